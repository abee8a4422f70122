"""How many KV pages fit: an explicit figure on the CPU, a memory fraction on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

DEFAULT_CPU_KV_GB = 4.0
GIB = 1 << 30


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int
    bytes_per_token: int
    reason: str

    def describe(self, page_size: int) -> str:
        tokens = self.num_pages * page_size
        gib = tokens * self.bytes_per_token / GIB
        return f"KV pool: {tokens} tokens ({self.num_pages} pages of {page_size}, {gib:.2f} GiB; {self.reason})"


def plan_pool(*, bytes_per_token: int, page_size: int, device: torch.device, num_pages: int | None,
              kv_cache_gb: float | None, mem_fraction_static: float, max_tokens_needed: int) -> PoolPlan:
    """`max_tokens_needed` (every running request at full context) caps the default size: more
    KV than that could never be used."""
    page_bytes = bytes_per_token * page_size
    if num_pages is not None:
        return PoolPlan(num_pages, bytes_per_token, "--num-pages")
    cap_pages = -(-max_tokens_needed // page_size)
    if kv_cache_gb is not None:
        return PoolPlan(max(1, int(kv_cache_gb * GIB // page_bytes)), bytes_per_token, "--kv-cache-gb")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * mem_fraction_static - (total - free)
        if budget < page_bytes:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB "
                f"after loading the model, --mem-fraction-static {mem_fraction_static}"
            )
        return PoolPlan(min(cap_pages, int(budget // page_bytes)), bytes_per_token,
                        f"--mem-fraction-static {mem_fraction_static}")
    default_gb = min(DEFAULT_CPU_KV_GB, psutil.virtual_memory().available / GIB / 4)
    pages = max(1, min(cap_pages, int(default_gb * GIB // page_bytes)))
    return PoolPlan(pages, bytes_per_token, f"default: min({DEFAULT_CPU_KV_GB} GiB, a quarter of free memory, what the batch can use)")
