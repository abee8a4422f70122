from __future__ import annotations

import torch

from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.utils.memory import advise_huge_pages


class KVPool:
    """K and V of every layer for `num_slots` tokens, on one device.

    k, v: [num_layers, num_slots + 1, num_kv_heads, head_dim]. A slot is a token position in the
    pool; page p owns slots [p * page_size, (p + 1) * page_size). The extra slot `pad_slot` is
    never handed out: padded reads point there and are masked, and the padding rows of a CUDA
    graph's decode batch write there. It starts as zeros and only ever holds finite values. The rest is left uninitialised
    (allocating gigabytes stays instant), which is safe because attention reads only slots
    that were written, or the pad slot.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefault: bool = False,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            # Attention reads the pool a few KiB here and there: huge pages spare it the TLB
            # misses (random-slot decode measured 12 -> 9 ms per layer at batch 64).
            advise_huge_pages(self.k)
            advise_huge_pages(self.v)
        if prefault and device.type == "cpu":
            # A first write to a page faults it in (measured ~1.4 s per GiB here); left to the
            # decode steps, that cost landed in index_copy_ (0.76 ms a call at batch 64 instead
            # of 0.09 ms, ~14% of the step) until the pool had been touched once.
            self.k.zero_()
            self.v.zero_()
        else:
            self.k[:, num_slots].zero_()
            self.v[:, num_slots].zero_()
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # On the CPU a float32 model's K and V go in through one C call a layer (two
        # index_copy_, two casts and two views otherwise: a few hundred small dispatches a
        # decode step).
        self._kernel_store = (device.type == "cpu" and dtype in cpu_kernels.KV_DTYPES
                              and cpu_kernels.load() is not None)
        self._layer_bytes = self.k.stride(0) * self.k.element_size()

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T]; k, v: [T, Hkv, D], cast to the pool's dtype when it is not the model's
        # (round to nearest even for bfloat16)
        if self._kernel_store and loc.dtype == torch.int64 and loc.device.type == "cpu" and loc.is_contiguous():
            t, hkv, d = loc.numel(), self.num_kv_heads, self.head_dim
            k_stride, v_stride = cpu_kernels.kv_rows(k, t, hkv, d), cpu_kernels.kv_rows(v, t, hkv, d)
            if k_stride is not None and v_stride is not None:
                offset = layer_id * self._layer_bytes
                cpu_kernels.kv_store(k, k_stride, v, v_stride, loc, self.k.data_ptr() + offset,
                                     self.v.data_ptr() + offset, hkv * d, self.k.dtype == torch.bfloat16)
                return
        self.k[layer_id].index_copy_(0, loc, k.to(self.k.dtype))
        self.v[layer_id].index_copy_(0, loc, v.to(self.v.dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
