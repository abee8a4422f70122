"""Where the C paged kernel stops beating sdpa: one request's extend of N new tokens over a
cached prefix, one layer, through each backend (the cpu backend forced to take every length).

    python launch/bench_attention_crossover.py                    # Qwen3-0.6B heads: 16 q / 8 kv of 128
    python launch/bench_attention_crossover.py --prefix 0 --lens 64,128,256

Prints a table (median milliseconds per request and layer) and the longest query run where
the kernel is still faster: `attention/cpu.py`'s KERNEL_MAX_QUERY is set from it.
"""

from __future__ import annotations

import argparse

import torch

from minisgl_mp.attention.base import BatchLayout, ForwardMode
from minisgl_mp.attention.cpu import CpuBackend
from minisgl_mp.attention.sdpa import SdpaBackend
from minisgl_mp.bench.decode_floor import median_ms
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head_dim")
    p.add_argument("--prefix", type=int, default=1088, help="cached tokens before the new ones")
    p.add_argument("--lens", default="16,32,64,128,192,256,512", help="new tokens per extend")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    lens = [int(x) for x in args.lens.split(",")]
    total = args.prefix + max(lens)
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, total + 8, hkv, d, torch.float32, torch.device("cpu"), prefault=True)
    pool.k[0, :total] = torch.randn(total, hkv, d, generator=gen)
    pool.v[0, :total] = torch.randn(total, hkv, d, generator=gen)
    table = ReqTable(1, total, torch.device("cpu"))
    table.table[0] = torch.arange(total)
    kernel = CpuBackend(pool, table, hq, hkv, d, torch.float32, max_query=max(lens))
    sdpa = SdpaBackend(pool, table, hq, hkv, d, torch.float32)
    print(f"heads {hq}/{hkv}x{d}, prefix {args.prefix}, threads {torch.get_num_threads()}")
    print(f"{'new tokens':>10} {'kernel ms':>10} {'sdpa ms':>10}")
    crossover, still_faster = 0, True
    for n in lens:
        layout = BatchLayout(ForwardMode.EXTEND, torch.tensor([0]), (args.prefix,), (n,),
                             torch.arange(args.prefix, args.prefix + n))
        q = torch.randn(n, hq, d, generator=gen)
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        times = []
        for backend in (kernel, sdpa):
            meta = backend.prepare(layout)
            times.append(median_ms(lambda: backend.forward(q, k, v, 0, meta), args.reps, warmup=1))
        print(f"{n:>10} {times[0]:>10.2f} {times[1]:>10.2f}")
        still_faster = still_faster and times[0] < times[1]
        if still_faster:
            crossover = n
    print(f"the kernel is faster up to {crossover} new tokens (of those measured)")


if __name__ == "__main__":
    main()
