"""skinny_linear (Triton) against the torch reference."""
import pytest
import torch
from kernel_helpers import make_generator, randn
from slora.kernels import reference
from slora.kernels.skinny_linear import MAX_ROWS, skinny_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 64, 128), (5, 96, 384), (16, 40, 200)])
@pytest.mark.parametrize("split_k", [None, 1, 3])
def test_skinny_linear_matches_reference(dtype, rows, out_features, in_features, split_k):
    gen = make_generator(rows * out_features + (split_k or 0))
    x = randn((rows, in_features + 8), dtype, gen)[:, :in_features]       # strided rows
    weight = randn((out_features, in_features), dtype, gen)
    got = skinny_linear(x, weight, block_n=32, block_k=64, split_k=split_k)
    want = reference.linear(x.float(), weight.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * in_features ** 0.5, rtol=tol)
    assert got.dtype == dtype and got.shape == (rows, out_features)


def test_skinny_linear_no_rows():
    weight = torch.randn(32, 64)
    assert skinny_linear(torch.randn(0, 64), weight).shape == (0, 32)


@pytest.mark.parametrize("x_shape,w_shape,dtypes,match", [
    ((4, 64), (32, 48), (torch.float32, torch.float32), "features"),
    ((MAX_ROWS + 1, 64), (32, 64), (torch.float32, torch.float32), "at most"),
    ((4, 64), (32, 64), (torch.float32, torch.float16), "dtype"),
    ((4, 64, 1), (32, 64), (torch.float32, torch.float32), "must be"),
])
def test_skinny_linear_rejects_bad_input(x_shape, w_shape, dtypes, match):
    with pytest.raises(ValueError, match=match):
        skinny_linear(torch.randn(x_shape).to(dtypes[0]), torch.randn(w_shape).to(dtypes[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336)])
def test_skinny_linear_gpu(dtype, rows, out_features, in_features):
    gen = make_generator(rows)
    x = randn((rows, in_features), dtype, gen, "cuda")
    weight = randn((out_features, in_features), dtype, gen, "cuda") / in_features ** 0.5
    want = reference.linear(x.float(), weight.float())
    torch.testing.assert_close(skinny_linear(x, weight).float(), want, atol=3e-2, rtol=2e-2)
