"""A/B of the C paged-attention kernel: the working tree's against the one at a git revision,
built with the same flags, timed interleaved in one process on the same inputs.

    .venv/bin/python launch/bench_kernel_ab.py --baseline-rev 350efe3 --out bench_results/kernel_ab.json

Shapes are Qwen3-0.6B's heads (16 query / 8 KV heads of 128): decodes at batch 1, 2 and 64
over 256-2048-token contexts, and a 64-token extend over a 1,088-token prefix. Prints new/old
per shape (below 1: the working tree's kernel is faster). With `--layers 28` each timed call
goes over 28 distinct layers of K/V, as a decode step does, so the cache is read from memory
rather than from the CPU's caches (the default, 1, reuses one layer).

The kernel's last argument is how a request is split over threads when requests are too few:
by kv-head chunks before commit 52f307c, by key ranges since; both builds get the count from the
same rule (double it while requests x count < 2 x threads).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minisgl_mp.kernels import cpu  # noqa: E402

KERNEL = "minisgl_mp/kernels/csrc/paged_attention.c"
SHAPES = ((1, 300, 1), (1, 2048, 1), (2, 2048, 1), (64, 256, 1), (64, 1024, 1), (4, 1088, 64))  # (requests, context, query tokens)
HQ, HKV, D = 16, 8, 128


def build(source: str, out: Path) -> ctypes._NamedFuncPointer:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", *cpu.CFLAGS, str(src), "-o", str(out), "-lm"], check=True)
    fn = ctypes.CDLL(str(out)).paged_attention_f32
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float, i64]
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-rev", required=True, help="git revision of the kernel to compare against")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=1, help="distinct layers of K/V each timed call goes over")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    old_src = subprocess.run(["git", "-C", str(REPO), "show", f"{args.baseline_rev}:{KERNEL}"],
                             capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        fns = {"old": build(old_src, Path(tmp) / "old.so"), "new": build((REPO / KERNEL).read_text(), Path(tmp) / "new.so")}
        rows = []
        for batch, ctx, nq in SHAPES:
            if args.layers * 2 * (batch * ctx + 16) * HKV * D * 4 > 8 << 30:
                print(f"{batch} x {ctx}: skipped (over 8 GiB of K/V with --layers {args.layers})")
                continue
            gen = torch.Generator().manual_seed(0)
            kv = [(torch.randn(batch * ctx + 16, HKV, D, generator=gen), torch.randn(batch * ctx + 16, HKV, D, generator=gen))
                  for _ in range(args.layers)]
            index = torch.arange(batch * ctx).view(batch, ctx).contiguous()
            q = torch.randn(batch * nq, HQ, D, generator=gen)
            out = torch.empty_like(q)
            q_start = torch.arange(batch, dtype=torch.int64) * nq
            q_len = torch.full((batch,), nq, dtype=torch.int64)
            kv_len = torch.full((batch,), ctx, dtype=torch.int64)
            chunks = 1
            while batch * chunks < 2 * torch.get_num_threads() and HKV % (chunks * 2) == 0:
                chunks *= 2
            calls = [(q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(), ctx, q_start.data_ptr(),
                      q_len.data_ptr(), kv_len.data_ptr(), out.data_ptr(), batch, HQ, HKV, D, D**-0.5, chunks)
                     for k, v in kv]
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    for call in calls:
                        if fn(*call) != 0:
                            raise RuntimeError(f"{name} kernel failed to allocate its scratch")
                    times[name].append((time.perf_counter() - t) / len(calls))
            old_ms, new_ms = (sorted(times[n])[len(times[n]) // 2] * 1e3 for n in ("old", "new"))
            rows.append({"requests": batch, "context": ctx, "query_tokens": nq, "old_ms": old_ms, "new_ms": new_ms,
                         "new_over_old": new_ms / old_ms})
            print(f"{batch:3d} requests x {ctx:5d} context, {nq:3d} query tokens: old {old_ms:8.2f} ms  "
                  f"new {new_ms:8.2f} ms  new/old {new_ms / old_ms:.3f}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"baseline_rev": args.baseline_rev, "threads": torch.get_num_threads(),
                                        "layers": args.layers,
                                        "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
