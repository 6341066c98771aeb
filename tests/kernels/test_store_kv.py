"""store_kv (Triton) against the torch reference."""
import pytest
import torch
from kernel_helpers import make_generator, randn
from slora.kernels import reference
from slora.kernels.store_kv import store_kv


def _case(tokens: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
          dtype: torch.dtype, pool_dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = make_generator(seed)
    # key/value as column slices of one wider projection output, like the engine's fused qkv.
    kv = randn((tokens, 2 * num_kv_heads * head_dim + 8), dtype, gen, device)
    key = kv[:, :num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    pool = randn((num_pages, 2 * page_size * num_kv_heads * head_dim), pool_dtype, gen, device)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1           # padding tokens are skipped
    return key, value, pool, slots.to(torch.int32).to(device)


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                              (torch.float32, torch.float16)])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 32), (3, 16)])
def test_store_kv_matches_reference(dtype, pool_dtype, page_size, num_kv_heads, head_dim):
    key, value, pool, slots = _case(13, 5, page_size, num_kv_heads, head_dim, dtype, pool_dtype, seed=page_size)
    expected = pool.clone()
    reference.store_kv(key, value, expected, slots, page_size)
    store_kv(key, value, pool, slots, page_size)
    assert torch.equal(pool, expected)


def test_store_kv_int64_slots_and_no_tokens():
    key, value, pool, slots = _case(7, 3, 16, 2, 16, torch.float32, torch.float32, seed=1)
    expected = pool.clone()
    reference.store_kv(key, value, expected, slots.long(), 16)
    store_kv(key, value, pool, slots.long(), 16)
    assert torch.equal(pool, expected)
    store_kv(key[:0], value[:0], pool, slots[:0], 16)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("change,match", [
    (lambda k, v, p, s: (k, v[:, :1], p, s), "value shape"),
    (lambda k, v, p, s: (k, v, p[:, :-2], s), "page_elems"),
    (lambda k, v, p, s: (k, v, p, s[:-1]), "slot_mapping must be"),
    (lambda k, v, p, s: (k, v, p, s.float()), "int32 or int64"),
    (lambda k, v, p, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, p, s), "stride 1"),
    (lambda k, v, p, s: (k[0], v, p, s), "key must be"),
])
def test_store_kv_rejects_bad_input(change, match):
    key, value, pool, slots = _case(4, 2, 8, 2, 16, torch.float32, torch.float32, seed=2)
    with pytest.raises(ValueError, match=match):
        store_kv(*change(key, value, pool, slots), 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 128])
def test_store_kv_gpu(dtype, page_size):
    key, value, pool, slots = _case(3000, 4096 * 2 // page_size, page_size, 8, 128, dtype, dtype, seed=3,
                                    device="cuda")
    expected = pool.clone()
    reference.store_kv(key, value, expected, slots, page_size)
    store_kv(key, value, pool, slots, page_size)
    assert torch.equal(pool, expected)
