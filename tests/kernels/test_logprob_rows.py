"""logprob_rows (Triton, two launches) against the torch reference: token ids, ranks and top ids exact,
logprobs to float32 rounding; in the interpreter on the CPU, natively on the GPU."""
import pytest
import torch
from kernel_helpers import make_generator, randn
from torch import Tensor

from slora.kernels import reference
from slora.kernels.logprobs import MAX_TOP, SPLIT, logprob_rows


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple[Tensor, Tensor]:
    gen = make_generator(seed)
    logits = randn((rows, vocab), torch.float32, gen).mul_(4).to(dtype=dtype, device=device)
    tokens = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    return logits, tokens


def _assert_matches(actual: Tensor, expected: Tensor, logits: Tensor, top: int) -> None:
    """Token ids and ranks exact, logprobs to float32 rounding; the top ids by their logits (equal logits may
    come in any order from torch's topk), each row's ids distinct."""
    assert actual.dtype == torch.float64 and actual.shape == expected.shape
    assert torch.equal(actual[:, [0, 2]], expected[:, [0, 2]])
    values = [1, *range(3 + top, 3 + 2 * top)]
    torch.testing.assert_close(actual[:, values], expected[:, values], atol=2e-5, rtol=1e-5)
    ids, expected_ids = actual[:, 3:3 + top].long(), expected[:, 3:3 + top].long()
    assert torch.equal(logits.gather(1, ids), logits.gather(1, expected_ids))
    assert all(len(set(row)) == top for row in ids.tolist())


@pytest.mark.parametrize("vocab", [100, SPLIT, SPLIT + 7, 3 * SPLIT - 1])
@pytest.mark.parametrize("top", [0, 1, 5, MAX_TOP])
def test_logprob_rows_matches_the_reference(vocab, top):
    logits, tokens = _case(3, vocab, torch.float32, seed=vocab + top)
    _assert_matches(logprob_rows(logits, tokens, top), reference.logprob_rows(logits, tokens, top), logits, top)


def test_equal_logits_rank_strictly_above_and_list_the_lowest_id_first():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, 5.0]])
    out = logprob_rows(logits, torch.tensor([2]), 3)
    assert out[0, 0] == 2 and out[0, 2] == 1                  # nothing above 5.0: rank 1
    assert out[0, 3:6].tolist() == [1.0, 2.0, 4.0]
    out = logprob_rows(logits, torch.tensor([3]), 0)
    assert out[0, 2] == 4                                       # three fives above 1.0


def test_no_rows():
    logits, tokens = _case(0, 50, torch.float32, seed=0)
    assert logprob_rows(logits, tokens, 2).shape == (0, 7)


@pytest.mark.parametrize("change,match", [
    (lambda lg, tk, k: (lg[0], tk, k), "logits must be"),
    (lambda lg, tk, k: (lg.t(), tk, k), "logits must be"),
    (lambda lg, tk, k: (lg.double(), tk, k), "float32, float16 or bfloat16"),
    (lambda lg, tk, k: (lg, tk.int(), k), "tokens must be"),
    (lambda lg, tk, k: (lg, tk[:1], k), "tokens must be"),
    (lambda lg, tk, k: (lg, tk, MAX_TOP + 1), "top must be"),
])
def test_logprob_rows_rejects_bad_input(change, match):
    logits, tokens = _case(2, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match=match):
        logprob_rows(*change(logits, tokens, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top", [0, 5, MAX_TOP])
def test_logprob_rows_gpu(dtype, top):
    logits, tokens = _case(64, 128256, dtype, seed=top, device="cuda")
    _assert_matches(logprob_rows(logits, tokens, top), reference.logprob_rows(logits, tokens, top), logits, top)
