"""The CPU products' weights (the C kernels of kernels/library.py): a weight in a stored format
for csrc/weight_gemm.c (`StoredWeight`: float32, float16, bfloat16, int8 with a scale per
output channel, int4 blocks, kernels/int4.py), float32 packed into csrc/packed_gemm.c's column
panels (`PackedWeight`), and bfloat16 packed for AMX tiles (`AmxWeight`, csrc/amx_gemm.c) or
AVX512-BF16's dot products (`Bf16DotWeight`, csrc/bf16dot_gemm.c). Each is checked and laid
out once at load; its `matmul` checks only x.
"""

from __future__ import annotations

import ctypes

import torch

from minisgl_mp.kernels import int4
from minisgl_mp.kernels.library import default_isa, fused_ok, load

# Stored weight dtypes the product kernel widens, and its format codes (csrc/weight_gemm.c):
# int4 is Q4_1 blocks, uint8 [N, K / 32 * 20] (kernels/int4.py).
WEIGHT_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, int4.STORAGE_DTYPE: 6}


def weight_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K]^T -> [M, N] float32, weight float32, float16, bfloat16,
    int8 (then times `scale` [N], its per-output-channel float32 scale) or int4 blocks (uint8
    [N, K / 32 * 20]), plus `bias` [N] float32. All contiguous, on the CPU. Bound by the weight
    bytes for small M; from a few rows the stored formats run at the float32 panels' rate."""
    return StoredWeight(weight, scale, bias, isa).matmul(x)


def _float32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x checked as float32 [M, k] on the CPU, with unit-stride rows (copied only if not)."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous() if x.stride(1) != 1 or x.stride(0) < k else x


class StoredWeight:
    """A weight in one of WEIGHT_FORMATS (with its int8 scale and its bias) checked once, for
    the product kernel of csrc/weight_gemm.c: `Linear` calls it a hundred times a decode step,
    so each call checks only x."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        self._lib = lib = load(isa)
        if lib is None:
            raise RuntimeError("the CPU product kernel is not available")
        fmt = WEIGHT_FORMATS.get(weight.dtype)
        if fmt is None or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
            raise ValueError(f"weight must be a contiguous 2-D CPU tensor in {list(WEIGHT_FORMATS)}, got {weight.dtype}")
        n = weight.shape[0]
        if (scale is not None) != (weight.dtype == torch.int8):
            raise ValueError("scale is given exactly when the weight is int8")
        if weight.dtype == int4.STORAGE_DTYPE and weight.shape[1] % int4.BLOCK_BYTES:
            raise ValueError(f"int4 weight rows must be whole {int4.BLOCK_BYTES}-byte blocks, got {weight.shape[1]} bytes")
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and (t.shape != (n,) or not fused_ok(t)):
                raise ValueError(f"{name} must be contiguous float32 [{n}]")
        self.weight, self.scale, self.bias, self.fmt = weight, scale, bias, fmt
        self.out_features, self.in_features = weight.shape
        if weight.dtype == int4.STORAGE_DTYPE:
            self.in_features = int4.in_features_of(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32, contiguous, on the CPU -> [M, N] float32."""
        n, k = self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or not fused_ok(x):
            raise ValueError(f"x must be contiguous float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
        y = x.new_empty((x.shape[0], n))
        scale, bias = self.scale, self.bias
        self._lib.weight_gemm(x.data_ptr(), x.shape[0], k, self.weight.data_ptr(), self.fmt,
                              None if scale is None else scale.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), n, n)
        return y


class PackedWeight:
    """A float32 weight [N, K] packed into the column panels of csrc/packed_gemm.c, for the
    library of one ISA (the layout follows its vector width)."""

    PANEL = 16

    def __init__(self, weight: torch.Tensor, isa: str | None = None) -> None:
        self.isa = isa or default_isa()
        self._lib = lib = load(self.isa)
        if lib is None:
            raise RuntimeError("the CPU product kernel is not available")
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"weight must be a 2-D float32 CPU tensor, got {weight.dtype} {tuple(weight.shape)}")
        weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        padded = -(-self.out_features // self.PANEL) * self.PANEL
        self.panels = torch.empty(padded * self.in_features, dtype=torch.float32)
        lib.packed_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32, plus `bias` [N]
        float32."""
        n, k = self.out_features, self.in_features
        x = _float32_rows(x, k)
        if bias is not None and (bias.shape != (n,) or not fused_ok(bias)):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        y = x.new_empty((x.shape[0], n))
        self._lib.packed_gemm_f32(x.data_ptr(), x.shape[0], k, x.stride(0), self.panels.data_ptr(), n,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        return y


def amx_ready(isa: str | None = None) -> bool:
    """Whether bfloat16 products can run on AMX here: a build with it (an AMX CPU, `native`)
    and the kernel's permission to use the tile registers."""
    lib = load(isa)
    return lib is not None and bool(lib.amx_gemm_ready())


def bf16dot_ready(isa: str | None = None) -> bool:
    """Whether bfloat16 products can run on AVX512-BF16's dot products here (a build with it:
    `native` on such a CPU)."""
    lib = load(isa)
    return lib is not None and bool(lib.bf16dot_gemm_ready())


class _Bf16Packed:
    """A bfloat16 weight [N, K] packed once for one of the kernels that round x to bfloat16
    and multiply on 16-bit units, float32 accumulation and output: y = x W^T (+ bias)."""

    KIND = ""
    REQUIRES = ""

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        raise NotImplementedError

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        raise NotImplementedError

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
                and cls._shape_ok(*weight.shape))

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None) -> None:
        self._lib = lib = load(isa)
        if lib is None or not self._ready(lib):
            raise RuntimeError(f"{self.KIND} products are not available on this CPU or build")
        if not self.fits(weight):
            raise ValueError(f"weight must be a 2-D bfloat16 CPU tensor with {self.REQUIRES}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and (bias.shape != (self.out_features,) or not fused_ok(bias)):
            raise ValueError(f"bias must be contiguous float32 [{self.out_features}]")
        self.bias = bias
        self.packed = self._pack(lib, weight.contiguous())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gemm(self, *args: int | None) -> int:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32."""
        n, k = self.out_features, self.in_features
        x = _float32_rows(x, k)
        y = x.new_empty((x.shape[0], n))
        if x.shape[0] == 0:
            return y
        rc = self._gemm(x.data_ptr(), x.shape[0], k, x.stride(0), self.packed.data_ptr(), n,
                        None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), n, n)
        if rc != 0:
            raise MemoryError(f"the {self.KIND} product could not allocate its bfloat16 copy of x")
        return y


class AmxWeight(_Bf16Packed):
    """A bfloat16 weight [N, K] (N and K multiples of 32) packed into AMX tiles for
    csrc/amx_gemm.c: y = x W^T with x rounded to bfloat16, float32 accumulation and output."""

    KIND = "AMX"
    REQUIRES = "both sides multiples of 32"
    BLOCK = 32

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        return n % cls.BLOCK == 0 and k % cls.BLOCK == 0

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        return bool(lib.amx_gemm_ready())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        tiles = torch.empty(weight.numel(), dtype=torch.bfloat16)
        lib.amx_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, tiles.data_ptr())
        return tiles

    def _gemm(self, *args: int | None) -> int:
        return self._lib.amx_gemm_bf16(*args)


class Bf16DotWeight(_Bf16Packed):
    """A bfloat16 weight [N, K] (K even) packed into the pair panels of csrc/bf16dot_gemm.c,
    for CPUs with AVX512-BF16 and no AMX: y = x W^T with x rounded to bfloat16, float32
    accumulation and output (the numerics of AmxWeight)."""

    KIND = "AVX512-BF16"
    REQUIRES = "an even number of inputs"
    PANEL = 16

    @classmethod
    def _shape_ok(cls, n: int, k: int) -> bool:
        return n > 0 and k > 0 and k % 2 == 0

    @classmethod
    def _ready(cls, lib: ctypes.CDLL) -> bool:
        return bool(lib.bf16dot_gemm_ready())

    def _pack(self, lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        padded = -(-self.out_features // self.PANEL) * self.PANEL
        panels = torch.empty(padded * self.in_features, dtype=torch.bfloat16)
        lib.bf16dot_gemm_pack(weight.data_ptr(), self.out_features, self.in_features, panels.data_ptr())
        return panels

    def _gemm(self, *args: int | None) -> int:
        return self._lib.bf16dot_gemm_bf16(*args)


def vnni_ready(isa: str | None = None) -> bool:
    """Whether int8 and int4 products can run on AVX512-VNNI's dot products here (a build with
    it: `native` on such a CPU)."""
    lib = load(isa)
    return lib is not None and bool(lib.vnni_gemm_ready())


class VnniWeight:
    """An int8 (with its per-channel scale) or int4 weight [N, K], K a multiple of 32, packed
    for csrc/vnni_gemm.c: y = x W^T (+ bias) with x rounded to int16 per block of 32 inputs and
    exact integer dot products (llama.cpp rounds x to int8 instead), at every row
    count. Where the arithmetic bounds a product this runs several times the float32 panels'
    rate, which widening the weights is held to."""

    FORMATS = {torch.int8: 0, int4.STORAGE_DTYPE: 1}
    GROUP = 32

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        if weight.dtype not in cls.FORMATS or weight.dim() != 2 or weight.device.type != "cpu":
            return False
        k = int4.in_features_of(weight) if weight.dtype == int4.STORAGE_DTYPE else weight.shape[1]
        return weight.shape[0] > 0 and k > 0 and k % cls.GROUP == 0

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        self._lib = lib = load(isa)
        if lib is None or not lib.vnni_gemm_ready():
            raise RuntimeError("AVX512-VNNI products are not available on this CPU or build")
        if not self.fits(weight):
            raise ValueError(f"weight must be a 2-D int8 or int4 CPU tensor with a multiple of {self.GROUP} "
                             f"inputs, got {weight.dtype} {tuple(weight.shape)}")
        self.fmt = self.FORMATS[weight.dtype]
        self.out_features = n = weight.shape[0]
        self.in_features = k = int4.in_features_of(weight) if self.fmt else weight.shape[1]
        if (scale is not None) != (self.fmt == 0):
            raise ValueError("scale is given exactly when the weight is int8")
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and (t.shape != (n,) or not fused_ok(t)):
                raise ValueError(f"{name} must be contiguous float32 [{n}]")
        self.scale, self.bias = scale, bias
        weight = weight.contiguous()
        self.packed = torch.empty(int(lib.vnni_gemm_packed_bytes(self.fmt, n, k)), dtype=torch.uint8)
        pack = lib.vnni_gemm_pack_q4 if self.fmt else lib.vnni_gemm_pack_i8
        if pack(weight.data_ptr(), n, k, self.packed.data_ptr()) != 0:
            raise ValueError(f"could not pack a weight of shape {tuple(weight.shape)}")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32."""
        n, k = self.out_features, self.in_features
        x = _float32_rows(x, k)
        y = x.new_empty((x.shape[0], n))
        rc = self._lib.vnni_gemm(x.data_ptr(), x.shape[0], k, x.stride(0), self.fmt, self.packed.data_ptr(),
                                 None if self.scale is None else self.scale.data_ptr(),
                                 None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), n, n)
        if rc != 0:
            raise MemoryError("the AVX512-VNNI product could not allocate its int16 copy of x")
        return y


def packed_gemm_tile(isa: str | None = None) -> tuple[int, int] | None:
    """(channels per unit, rows per tile) of the packed product in this build (None: no kernels)."""
    lib = load(isa)
    return None if lib is None else (int(lib.packed_gemm_unit()), int(lib.packed_gemm_rows()))



def kernel_isa(isa: str | None = None) -> int | None:
    """512, 256 or 0: the vector width the product kernel was built with (None: no kernels)."""
    lib = load(isa)
    return None if lib is None else int(lib.weight_gemm_isa())
