from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.kernels import int4


class Linear(nn.Module):
    """y = x W^T (+ b). Weights are allocated uninitialised: the loader fills them.

    The weight is stored in the model's dtype, or after `store_weight()` in a smaller format
    (float16 / bfloat16, int8 with a float32 scale per output channel, `weight_scale`, or int4
    blocks, kernels/int4.py: uint8 [out, in / 32 * 20]), while x and y keep the model's dtype:
    the product widens the weight on the fly.

    On the CPU, four paths, chosen by the number of rows (see docs/benchmarks.md):
    - `enable_cpu_gemm()`: for a stored format, the C kernel (kernels/csrc/weight_gemm.c)
      widens each weight in registers and reads it once for a few rows at a time, at the
      memory's rate; it runs every product of a stored format below DENSE_MIN_ROWS.
      For float32 weights it packs a copy into the column panels of the register-tiled
      kernel (kernels/csrc/packed_gemm.c), which then runs every float32 product: decode
      batches, where oneDNN falls short of the FMA rate (at one row it also read the weights
      faster than weight_gemm.c's row-at-a-time path), and prefill chunks, where its packed-x
      path ran above oneDNN's prepacked products (docs/benchmarks.md section 25).
    - `prepack()` (float32 weights): oneDNN's blocked layout, for the float32 batches past
      PANELS_MAX_ROWS rows, where the products are bound by arithmetic rather than by the weight
      bytes. The engine makes this copy only for weights without vector panels
      (`panels_take_every_batch()`), or everywhere with `--cpu-prepack`.
    - `F.linear`, after widening the stored weight to the activations' dtype a tile at a time:
      the fallback everywhere else (other devices, no C compiler), and for large batches of
      stored formats, which then run at the float32 matrix rate.
    - `enable_cpu_gemm()` on a CPU with AMX (Intel's matrix units), for bfloat16 weights: the
      tiles of kernels/csrc/amx_gemm.c run every product, x rounded to bfloat16 and float32
      accumulation and output, whatever the rows (one set of numerics for every batch);
      `amx=False` keeps the widening paths above.
    - `enable_cpu_gemm()` on a CPU with AVX512-BF16 but no AMX (AMD Zen 4 and 5, for one), for
      bfloat16 weights: the same numerics on the dot-product instruction, every product through
      kernels/csrc/bf16dot_gemm.c; `bf16_dot=False` keeps the widening paths.
    - `enable_cpu_gemm()` on a CPU with AVX512-VNNI, for int8 and int4 weights (inputs in whole
      blocks of 32): every product on its 16-bit integer dot products (kernels/csrc/vnni_gemm.c),
      x rounded to int16 per block of 32, whatever the rows; `vnni=False` keeps the widening
      paths.
    The plain weight stays the source of truth (tying, reloading, tests read it).
    """

    PACKED_MIN_ROWS = 4
    PANELS_MAX_ROWS = 256
    DENSE_MIN_ROWS = 256
    WIDEN_TILE = 4096  # output channels widened at once on the fallback path

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        self.weight_scale: torch.Tensor | None = None
        self.packed_weight: torch.Tensor | None = None
        self.panels: cpu_kernels.PackedWeight | None = None
        self.stored: cpu_kernels.StoredWeight | None = None
        self.amx: cpu_kernels.AmxWeight | None = None
        self.bf16dot: cpu_kernels.Bf16DotWeight | None = None
        self.vnni: cpu_kernels.VnniWeight | None = None
        self.cpu_gemm = False

    def store_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Keep `weight` ([out, in], any dtype the product accepts; int4 blocks [out, in / 32 * 20])
        in place of the current one; int8 comes with `scale` [out], float32."""
        shape = (self.out_features, int4.row_bytes(self.in_features) if weight.dtype == int4.STORAGE_DTYPE
                 else self.in_features)
        if weight.shape != shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != {shape}")
        if (scale is not None) != (weight.dtype == torch.int8):
            raise ValueError("an int8 weight needs its per-channel scale, and only it")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = None if scale is None else scale.float().contiguous()
        self.packed_weight = None
        self.panels = None
        self.stored = None
        self.amx = None
        self.bf16dot = None
        self.vnni = None
        self.cpu_gemm = False

    def prepack(self) -> bool:
        """Pack the weight for oneDNN; returns whether this build and dtype allow it."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not _onednn_available():
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.data, 1)
        return True

    def enable_cpu_gemm(self, amx: bool = True, bf16_dot: bool = True, vnni: bool = True) -> bool:
        """Use the C product kernels (and pack a float32 weight's panels, or a bfloat16 weight's
        AMX tiles where the CPU has them and `amx`, else its AVX512-BF16 panels where it has
        those and `bf16_dot`, or an int8 / int4 weight's AVX512-VNNI layout where it has that and
        `vnni`); returns whether the weight's device and dtype allow it."""
        self.cpu_gemm = (self.weight.device.type == "cpu" and self.weight.dtype in cpu_kernels.WEIGHT_FORMATS
                         and (self.bias is None or self.bias.dtype == torch.float32)
                         and cpu_kernels.load() is not None)
        bias = None if self.bias is None else self.bias.data
        self.panels = (cpu_kernels.PackedWeight(self.weight.data)
                       if self.cpu_gemm and self.weight.dtype == torch.float32 else None)
        self.stored = (cpu_kernels.StoredWeight(self.weight.data, self.weight_scale, bias)
                       if self.cpu_gemm and self.weight.dtype != torch.float32 else None)
        self.amx = (cpu_kernels.AmxWeight(self.weight.data, bias)
                    if amx and self.cpu_gemm and cpu_kernels.AmxWeight.fits(self.weight) and cpu_kernels.amx_ready()
                    else None)
        self.bf16dot = (cpu_kernels.Bf16DotWeight(self.weight.data, bias)
                        if self.amx is None and bf16_dot and self.cpu_gemm
                        and cpu_kernels.Bf16DotWeight.fits(self.weight) and cpu_kernels.bf16dot_ready() else None)
        self.vnni = (cpu_kernels.VnniWeight(self.weight.data, self.weight_scale, bias)
                     if vnni and self.cpu_gemm and cpu_kernels.VnniWeight.fits(self.weight) and cpu_kernels.vnni_ready()
                     else None)
        return self.cpu_gemm

    def panels_take_every_batch(self) -> bool:
        """Whether the float32 panels hold this weight in a vector build: they then run every
        batch as fast as oneDNN's copy would, so that copy is not needed."""
        return self.panels is not None and bool(cpu_kernels.kernel_isa(self.panels.isa))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.numel() // self.in_features
        if (self.panels is not None and x.dtype == torch.float32
                and (rows <= self.PANELS_MAX_ROWS or self.packed_weight is None)):
            y = self.panels.matmul(x.reshape(rows, shape[-1]), self.bias)
            return y.view(*shape[:-1], self.out_features)
        packed16 = self.amx or self.bf16dot or self.vnni
        if packed16 is not None and x.dtype == torch.float32:
            y = packed16.matmul(x.reshape(rows, shape[-1]))
            return y.view(*shape[:-1], self.out_features)
        stored = self.weight.dtype != x.dtype
        if self.cpu_gemm and stored and x.dtype == torch.float32 and rows < self.DENSE_MIN_ROWS:
            y = self.stored.matmul(x.reshape(rows, shape[-1]).contiguous())
            return y.view(*shape[:-1], self.out_features)
        if self.packed_weight is not None and rows >= self.PACKED_MIN_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(
                x.reshape(-1, shape[-1]), self.packed_weight, self.bias, "none", [], ""
            )
            return y.view(*shape[:-1], self.out_features)
        if stored:
            return self._widened_linear(x)
        return F.linear(x, self.weight, self.bias)

    def _widened_linear(self, x: torch.Tensor) -> torch.Tensor:
        """The product with the stored weight widened to x's dtype a tile of channels at a time,
        so no full-size widened copy is ever held. On the CPU in float32 the tiles go through
        oneDNN as they are (no prepacking: each is used once): F.linear takes torch's BLAS,
        which on AMD EPYCs ran these products at under half oneDNN's rate
        (docs/benchmarks.md section 23)."""
        onednn = x.device.type == "cpu" and x.dtype == torch.float32 and _onednn_available()
        rows = x.reshape(-1, self.in_features) if onednn else x
        tiles = []
        for start in range(0, self.out_features, self.WIDEN_TILE):
            w = self.weight[start:start + self.WIDEN_TILE]
            w = int4.dequantize(w).to(x.dtype) if w.dtype == int4.STORAGE_DTYPE else w.to(x.dtype)
            if self.weight_scale is not None:
                w = w * self.weight_scale[start:start + self.WIDEN_TILE, None].to(x.dtype)
            tiles.append(torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "") if onednn
                         else F.linear(x, w))
        if onednn:
            tiles = [t.view(*x.shape[:-1], t.shape[-1]) for t in tiles]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        fmt = "" if self.weight.dtype == torch.float32 else f", weight={str(self.weight.dtype).replace('torch.', '')}"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fmt}"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
