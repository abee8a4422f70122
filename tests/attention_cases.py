"""Inputs shared by the tests of the CPU attention kernels (tests/test_cpu_attention_kernel.py,
tests/test_amx_gemm.py, tests/test_bf16dot_gemm.py)."""

from __future__ import annotations

import torch


def ragged_batch(hq: int, hkv: int, d: int, q_lens: list[int], kv_lens: list[int], slots: int, seed: int,
                 q_scale: float, stride: int | None = None, kv_dtype: torch.dtype = torch.float32):
    """One layer's pool of `slots` random K/V rows, and a batch whose request b has q_lens[b]
    query tokens over kv_lens[b] keys at scattered slots (page-table rows `stride` wide, by
    default the longest context): (q, k, v, kv_index, q_start, q_len, kv_len)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    v = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    stride = stride or max(kv_lens)
    kv_index = torch.stack([torch.randperm(slots, generator=gen)[:stride] for _ in q_lens])
    q_start = torch.tensor([0] + torch.tensor(q_lens).cumsum(0)[:-1].tolist())
    q = torch.randn(sum(q_lens), hq, d, generator=gen) * q_scale
    return q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens)


def extend_case(hq: int, hkv: int, d: int, seed: int):
    """A ragged batch over scattered slots: fresh prompts, extends over a cached prefix longer
    than the run, a one-token run, lengths around the kernels' blocks of rows and keys."""
    cached = [0, 0, 5, 300, 0, 47]
    q_lens = [17, 64, 100, 40, 1, 129]
    kv_lens = [c + n for c, n in zip(cached, q_lens)]
    return ragged_batch(hq, hkv, d, q_lens, kv_lens, 1000, seed, 2.0, stride=max(kv_lens) + 3)
