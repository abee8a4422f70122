"""The int8 / int4 products on AVX512-VNNI (kernels/csrc/vnni_gemm.c) against the arithmetic
they state, computed here in float64: x rounded to int16 per block of 32 inputs, exact integer
dot products with the stored weights, each block's sum scaled. Skipped where the CPU (or the
build) has no AVX512-VNNI."""

from __future__ import annotations

import pytest
import torch

from minisgl_mp.kernels import int4
from minisgl_mp.kernels.weights import VnniWeight, vnni_ready

pytestmark = pytest.mark.skipif(not vnni_ready(), reason="no AVX512-VNNI on this CPU or build")


def _int8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen)
    scale = (w.abs().amax(dim=1) / 127).float().contiguous()
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _x_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K / 32, 32] as float64, block scales [M, K / 32, 1] float64), rounded
    as the kernel rounds: float32 scale amax / 32767, x * (32767 / amax) to the nearest even."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    xq = torch.round(b * inv).clamp(-32768, 32767)
    return xq.double(), (amax / 32767.0).double()


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None):
    xq, sx = _x_blocks(x)
    m, blocks = xq.shape[0], xq.shape[1]
    if weight.dtype == torch.int8:
        w = weight.double().reshape(weight.shape[0], blocks, 32)
        y = torch.einsum("mbi,nbi,mb->mn", xq, w, sx[..., 0]) * scale.double()
    else:
        b = weight.reshape(weight.shape[0], blocks, 20)
        d = b[..., 0:2].contiguous().view(torch.float16).double()[..., 0]
        mn = b[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
        qs = b[..., 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).double()
        xs = x.double().reshape(m, blocks, 32).sum(-1)
        y = torch.einsum("mbi,nbi,mb,nb->mn", xq, q, sx[..., 0], d) + torch.einsum("mb,nb->mn", xs, mn)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(576, 576), (37, 64), (200, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64, 150])
def test_product_is_the_stated_integer_arithmetic(fmt: str, n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k + rows)
    if fmt == "int8":
        weight, scale = _int8_weight(n, k, gen)
    else:
        weight, scale = int4.quantize(torch.randn(n, k, generator=gen)), None
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :32] = 0.0  # a block of zeros has scale 0
    y = VnniWeight(weight, scale, bias).matmul(x)
    ref = _reference(x, weight, scale, bias)
    assert y.shape == (rows, n)
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_strided_rows_and_a_narrow_last_unit() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, scale = _int8_weight(21, 96, gen)
    wide = torch.randn(5, 200, generator=gen)
    x = wide[:, 10:106]  # rows 200 apart
    y = VnniWeight(weight, scale).matmul(x)
    assert torch.allclose(y.double(), _reference(x.contiguous(), weight, scale, None), rtol=1e-4, atol=1e-3)


def test_refuses_what_it_cannot_take() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, scale = _int8_weight(8, 48, gen)
    assert not VnniWeight.fits(weight)  # 48 inputs: not whole blocks of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        VnniWeight(weight, scale)
    weight, scale = _int8_weight(8, 64, gen)
    with pytest.raises(ValueError, match="scale"):
        VnniWeight(weight, None)
    with pytest.raises(ValueError, match="float32"):
        VnniWeight(weight, scale).matmul(torch.randn(2, 64, dtype=torch.float64))
    assert not VnniWeight.fits(torch.randn(8, 64))
