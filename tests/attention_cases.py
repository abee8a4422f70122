"""Inputs shared by the tests of the CPU prompt-attention kernels (tests/test_amx_gemm.py,
tests/test_bf16dot_gemm.py)."""

from __future__ import annotations

import torch


def extend_case(hq: int, hkv: int, d: int, seed: int):
    """A ragged batch over scattered slots: fresh prompts, extends over a cached prefix longer
    than the run, a one-token run, lengths around the kernels' blocks of rows and keys."""
    gen = torch.Generator().manual_seed(seed)
    cached = [0, 0, 5, 300, 0, 47]
    q_lens = [17, 64, 100, 40, 1, 129]
    kv_lens = [c + n for c, n in zip(cached, q_lens)]
    slots = 1000
    k = torch.randn(slots, hkv, d, generator=gen)
    v = torch.randn(slots, hkv, d, generator=gen)
    stride = max(kv_lens) + 3
    kv_index = torch.stack([torch.randperm(slots, generator=gen)[:stride] for _ in q_lens])
    q_start = torch.tensor([0] + torch.tensor(q_lens).cumsum(0)[:-1].tolist())
    q = torch.randn(sum(q_lens), hq, d, generator=gen) * 2
    return q, k, v, kv_index, q_start, torch.tensor(q_lens), torch.tensor(kv_lens)
