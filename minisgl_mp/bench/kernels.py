"""A/B of the C paged-attention kernel: the working tree's against the one at a git revision,
built with the same flags, timed interleaved in one process on the same inputs, beside a loop
that only reads the same K/V rows (the memory's ceiling for this access pattern).

    .venv/bin/python -m minisgl_mp.bench kernels --baseline-rev 4fb117d --layers 28 --out bench_results/kernel_ab.json

Shapes are Qwen3-0.6B's heads (16 query / 8 KV heads of 128): decodes at batch 1, 2, 16 and 64
over 256-2048-token contexts, and 16-token extends over 1,088-token prefixes (the longest query
run the cpu backend gives this kernel). A request's
slots are pages of `--page-size` slots in a shuffled order over the pool, as a pool hands them
out after a while, and the pool is advised onto huge pages as the engine's is. Prints new/old
per shape (below 1: the working tree's kernel is faster) and each one's GB/s of K/V. With
`--layers 28` each timed call goes over 28 distinct layers of K/V, as a decode step does, so
the cache is read from memory rather than from the CPU's caches (the default, 1, reuses one).

Both builds get the same key-split count (`kernels.cpu.default_key_splits`); each takes the
headers of its own revision.

`--kernel panels` (csrc/packed_gemm.c, float32) or `--kernel bf16dot` (csrc/bf16dot_gemm.c, on
CPUs with AVX512-BF16) A/Bs a product kernel instead: each build packs the Qwen3-0.6B products
of `--layers` layers (qkv, o, gate_up, down) and the LM head, and a timed call is that chain
on `--rows` rows of x, as a decode step's products are:

    .venv/bin/python -m minisgl_mp.bench kernels --kernel panels --baseline-rev 4fb117d --layers 28 --rows 1,8,12,16,32,64

`--kernel extend` A/Bs prompt attention (csrc/extend_attention.c) on `--layers` layers of K/V:
eight 256-token prompts in one chunk, one 2,048-token prompt, 512 tokens over a 1,536-token
prefix, the two builds' outputs checked against each other (`--kernel extend-bf16dot`: the
bfloat16 dot-product kernel, csrc/bf16dot_attention.c, on CPUs with AVX512-BF16):

    .venv/bin/python -m minisgl_mp.bench kernels --kernel extend --baseline-rev HEAD --layers 4

With `--onednn` (float32) oneDNN's prepacked products of the same weights are timed as well, in
the same rounds; `--no-lm-head` leaves the LM head out of the chain, as in a prefill chunk
(whose logits are only its last tokens'):

    .venv/bin/python -m minisgl_mp.bench kernels --kernel panels --baseline-rev HEAD --layers 4 --no-lm-head --onednn --rows 128,256,512,2048
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

from minisgl_mp.bench.cli import bench_parser
from minisgl_mp.kernels import cpu
from minisgl_mp.utils.memory import advise_huge_pages

REPO = Path(__file__).resolve().parents[2]  # the git checkout whose revisions are compared

CSRC = "minisgl_mp/kernels/csrc"
KERNEL = f"{CSRC}/paged_attention.c"
SHAPES = ((1, 300, 1), (1, 2048, 1), (2, 2048, 1), (16, 256, 1), (64, 256, 1), (64, 1024, 1),
          (4, 1088, 16))  # (requests, context, query tokens)
HQ, HKV, D = 16, 8, 128
# (out, in) of a Qwen3-0.6B layer's products (fused qkv and gate/up), and of its LM head
LAYER_PRODUCTS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
LM_HEAD = (151936, 1024)
PRODUCT_KERNELS = {"panels": ("packed_gemm.c", "packed_gemm_pack", "packed_gemm_f32", torch.float32),
                   "bf16dot": ("bf16dot_gemm.c", "bf16dot_gemm_pack", "bf16dot_gemm_bf16", torch.bfloat16)}

# Every K and V row of each request's keys summed, request by request over the threads, the
# next rows prefetched as the kernel does: what reading those bytes alone costs.
READER = r"""
#include <stdint.h>
float read_rows(const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                const int64_t *kv_len, int64_t batch, int64_t row) {
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
    typedef float vf __attribute__((vector_size(VW * 4)));
    float total = 0.0f;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
    for (int64_t b = 0; b < batch; ++b) {
        vf a = {0};
        const int64_t *s = kv_index + b * stride;
        for (int64_t t = 0; t < kv_len[b]; ++t) {
            if (t + 8 < kv_len[b])
                for (int64_t o = 0; o < row; o += 16) {
                    __builtin_prefetch(k + s[t + 8] * row + o, 0, 2);
                    __builtin_prefetch(v + s[t + 8] * row + o, 0, 2);
                }
            for (int64_t j = 0; j < row; j += VW) {
                vf x, y;
                __builtin_memcpy(&x, k + s[t] * row + j, sizeof x);
                __builtin_memcpy(&y, v + s[t] * row + j, sizeof y);
                a += x + y;
            }
        }
        for (int i = 0; i < VW; ++i) total += a[i];
    }
    return total;
}
"""


def _sources(rev: str | None, dest: Path, kernel: str = KERNEL) -> Path:
    """The kernel and the csrc headers at `rev` (None: the working tree), written into dest."""
    dest.mkdir(parents=True)
    names = [kernel] + [f"{CSRC}/{p.name}" for p in (REPO / CSRC).glob("*.h")]
    for name in names:
        if rev is None:
            text = (REPO / name).read_text()
        else:
            got = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{name}"], capture_output=True, text=True)
            if got.returncode != 0:
                continue  # a header the revision did not have
            text = got.stdout
        (dest / Path(name).name).write_text(text)
    return dest / Path(kernel).name


def _build(src: Path, out: Path, isa: str) -> ctypes.CDLL:
    flags = [*cpu.CFLAGS, *cpu.ISA_FLAGS[isa], f"-I{src.parent}"]
    subprocess.run(["cc", *flags, str(src), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def _paged_batch(layers: int, batch: int, ctx: int, nq: int, page: int) -> tuple[torch.Tensor, ...]:
    """`batch` requests of `ctx` keys each (their last `nq` the query tokens) over `layers`
    layers of K/V, a request's slots in pages of `page` shuffled over the pool as a pool hands
    them out after a while, the pool on huge pages as the engine's is: (k, v, kv_index, q, out,
    q_start, q_len, kv_len)."""
    gen = torch.Generator().manual_seed(0)
    pages = -(-ctx // page)
    slots = batch * pages * page + 1
    k = torch.empty(layers, slots, HKV, D)
    v = torch.empty_like(k)
    advise_huge_pages(k)
    advise_huge_pages(v)
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    order = torch.randperm(batch * pages, generator=gen)
    index = (order.view(batch, pages, 1) * page + torch.arange(page)).view(batch, pages * page).contiguous()
    q = torch.randn(batch * nq, HQ, D, generator=gen)
    q_start = torch.arange(batch, dtype=torch.int64) * nq
    q_len = torch.full((batch,), nq, dtype=torch.int64)
    kv_len = torch.full((batch,), ctx, dtype=torch.int64)
    return k, v, index, q, torch.empty_like(q), q_start, q_len, kv_len


def products_ab(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """The product chain of `args.layers` layers and the LM head, old build against new."""
    source, pack_name, gemm_name, wdtype = PRODUCT_KERNELS[args.kernel]
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    shapes = [*LAYER_PRODUCTS * args.layers, *([] if args.no_lm_head else [LM_HEAD])]
    gen = torch.Generator().manual_seed(0)
    weights = {shape: (torch.randn(shape, generator=gen) * 0.05).to(wdtype) for shape in set(shapes)}
    chains = {}
    for name, rev in (("old", args.baseline_rev), ("new", None)):
        src = _sources(rev, tmp / name, f"{CSRC}/{source}")
        lib = _build(src, tmp / f"{name}.so", args.isa)
        pack, gemm = getattr(lib, pack_name), getattr(lib, gemm_name)
        pack.argtypes, gemm.argtypes = [vp, i64, i64, vp], [vp, i64, i64, i64, vp, i64, vp, vp, i64]
        pack.restype = gemm.restype = None if args.kernel == "panels" else ctypes.c_int
        packed = []
        for n, k in shapes:
            buf = torch.empty(-(-n // 48) * 48 * k, dtype=wdtype)  # room for either kernel's padding
            advise_huge_pages(buf)
            w = weights[(n, k)]
            if pack(w.data_ptr(), n, k, buf.data_ptr()) not in (None, 0):
                raise RuntimeError(f"{name} {pack_name} refused a {n} x {k} weight")
            packed.append((buf, n, k))
        chains[name] = (gemm, packed)
    # oneDNN's prepacked products of the same weights (what Linear runs past PANELS_MAX_ROWS
    # rows when it holds that copy), each on a contiguous x of its own width
    onednn = ([(torch.ops.mkldnn._reorder_linear_weight(weights[(n, k)], 1), n, k) for n, k in shapes]
              if args.onednn else [])
    rows = []
    for m in args.rows:
        x = torch.randn(m, max(k for _, k in shapes), generator=gen)
        y = torch.empty(m, max(n for n, _ in shapes))
        xs = {k: x[:, :k].contiguous() for _, k in shapes} if onednn else {}
        times: dict[str, list[float]] = {"old": [], "new": [], **({"onednn": []} if onednn else {})}
        for _ in range(args.repeats):
            for name, (gemm, packed) in chains.items():
                t = time.perf_counter()
                for buf, n, k in packed:
                    gemm(x.data_ptr(), m, k, x.shape[1], buf.data_ptr(), n, None, y.data_ptr(), y.shape[1])
                times[name].append(time.perf_counter() - t)
            if onednn:
                t = time.perf_counter()
                for w, n, k in onednn:
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                times["onednn"].append(time.perf_counter() - t)
        med = {n: sorted(ts)[len(ts) // 2] * 1e3 for n, ts in times.items()}
        wbytes = sum(n * k for n, k in shapes) * weights[shapes[-1]].element_size()
        gbps = {n: wbytes / (ms / 1e3) / 1e9 for n, ms in med.items()}
        gflops = {n: 2 * m * sum(n_ * k for n_, k in shapes) / (ms / 1e3) / 1e9 for n, ms in med.items()}
        row = {"rows": m, "old_ms": med["old"], "new_ms": med["new"], "new_over_old": med["new"] / med["old"],
               "weight_gbps": gbps, "gflops": gflops}
        line = (f"{m:4d} rows: old {med['old']:8.2f} ms  new {med['new']:8.2f} ms  new/old {med['new'] / med['old']:.3f}  "
                f"(weight GB/s: old {gbps['old']:.1f}, new {gbps['new']:.1f}; GFLOP/s new {gflops['new']:.0f})")
        if onednn:
            row.update(onednn_ms=med["onednn"], new_over_onednn=med["new"] / med["onednn"])
            line += f"  oneDNN {med['onednn']:8.2f} ms, new/oneDNN {med['new'] / med['onednn']:.3f}"
        rows.append(row)
        print(line, flush=True)
    return rows


# (prompts, cached prefix, prompt tokens) for --kernel extend: the fixed workload's 2,048-token
# chunk of eight 256-token prompts, one 2,048-token prompt, and a 512-token chunk over a prefix
EXTEND_SHAPES = ((8, 0, 256), (1, 0, 2048), (1, 1536, 512))
# prompt-attention kernels: float32, and AVX512-BF16's dot products (bfloat16 weights' path)
EXTEND_KERNELS = {"extend": ("extend_attention.c", "extend_attention_f32"),
                  "extend-bf16dot": ("bf16dot_attention.c", "extend_attention_bf16dot")}


def extend_ab(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Prompt attention (csrc/extend_attention.c, or bf16dot_attention.c for extend-bf16dot) of
    `args.layers` layers a call, old build against new; GFLOP/s counts the causal half of each prompt's square (plus its
    prefix), the work the mask leaves."""
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    source, symbol = EXTEND_KERNELS[args.kernel]
    fns = {}
    for name, rev in (("old", args.baseline_rev), ("new", None)):
        fn = getattr(_build(_sources(rev, tmp / name, f"{CSRC}/{source}"), tmp / f"{name}.so", args.isa), symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float]
        fns[name] = fn
    rows = []
    for batch, cached, nq in EXTEND_SHAPES:
        k, v, index, q, out, q_start, q_len, kv_len = _paged_batch(args.layers, batch, cached + nq, nq, args.page_size)
        calls = [(q.data_ptr(), k[i].data_ptr(), v[i].data_ptr(), index.data_ptr(), index.shape[1],
                  q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), out.data_ptr(), batch, HQ, HKV, D,
                  D**-0.5) for i in range(args.layers)]
        outs = {}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                for call in calls:
                    if fn(*call) != 0:
                        raise RuntimeError(f"{name} kernel failed (or, -2, does not run on this CPU)")
                times[name].append((time.perf_counter() - t) / len(calls))
                outs[name] = out.clone()
        tol = 1e-4 if args.kernel == "extend" else 2e-2  # bfloat16 products: the same roundings, other sums
        torch.testing.assert_close(outs["new"], outs["old"], atol=tol, rtol=tol)
        med = {n: sorted(ts)[len(ts) // 2] * 1e3 for n, ts in times.items()}
        flops = 4 * batch * HQ * D * (nq * cached + nq * (nq + 1) / 2)  # QK^T and PV, causal
        gflops = {n: flops / (ms / 1e3) / 1e9 for n, ms in med.items()}
        rows.append({"prompts": batch, "cached": cached, "prompt_tokens": nq, "old_ms": med["old"],
                     "new_ms": med["new"], "new_over_old": med["new"] / med["old"], "gflops": gflops})
        print(f"{batch} x {nq:4d} tokens over {cached:4d} cached: old {med['old']:7.2f} ms  new {med['new']:7.2f} ms"
              f"  new/old {med['new'] / med['old']:.3f}  (GFLOP/s of the causal work: old {gflops['old']:.0f}, "
              f"new {gflops['new']:.0f})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("kernels", __doc__)
    ap.add_argument("--baseline-rev", required=True, help="git revision of the kernel to compare against")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=1, help="distinct layers of K/V each timed call goes over")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="threads for the kernels (default: torch's)")
    ap.add_argument("--isa", choices=sorted(cpu.ISA_FLAGS), default="native",
                    help="build both kernels for this vector ISA (avx2: the path of CPUs without AVX-512)")
    ap.add_argument("--kernel", choices=["attention", *EXTEND_KERNELS, *PRODUCT_KERNELS], default="attention",
                    help="attention: decode (paged_attention.c); extend: prompt attention (extend_attention.c; "
                         "extend-bf16dot: bf16dot_attention.c); or a product kernel")
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 16, 32, 64],
                    help="rows of x for a product kernel")
    ap.add_argument("--onednn", action="store_true",
                    help="--kernel panels: time oneDNN's prepacked products of the same weights as well")
    ap.add_argument("--no-lm-head", action="store_true",
                    help="a product kernel's chain without the LM head (as a prefill chunk's, whose logits are "
                         "only its last tokens')")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.onednn and args.kernel != "panels":
        ap.error("--onednn goes with --kernel panels (float32)")
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP runtime
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    if args.kernel != "attention":
        with tempfile.TemporaryDirectory() as tmp:
            rows = extend_ab(args, Path(tmp)) if args.kernel in EXTEND_KERNELS else products_ab(args, Path(tmp))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"kernel": args.kernel, "baseline_rev": args.baseline_rev, "isa": args.isa,
                                            "threads": torch.get_num_threads(), "layers": args.layers, "rows": rows},
                                           indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fns = {}
        for name, rev in (("old", args.baseline_rev), ("new", None)):
            fn = _build(_sources(rev, Path(tmp) / name), Path(tmp) / f"{name}.so", args.isa).paged_attention_f32
            fn.restype = ctypes.c_int
            fn.argtypes = [vp, vp, vp, vp, i64, vp, vp, vp, vp, i64, i64, i64, i64, ctypes.c_float, i64]
            fns[name] = fn
        (Path(tmp) / "read.c").write_text(READER)
        reader = _build(Path(tmp) / "read.c", Path(tmp) / "read.so", args.isa).read_rows
        reader.restype = ctypes.c_float
        reader.argtypes = [vp, vp, vp, i64, vp, i64, i64]
        rows = []
        for batch, ctx, nq in SHAPES:
            page = args.page_size
            pages = -(-ctx // page)
            slots = batch * pages * page + 1
            if args.layers * 2 * slots * HKV * D * 4 > 8 << 30:
                print(f"{batch} x {ctx}: skipped (over 8 GiB of K/V with --layers {args.layers})")
                continue
            k, v, index, q, out, q_start, q_len, kv_len = _paged_batch(args.layers, batch, ctx, nq, page)
            splits = cpu.default_key_splits(batch)
            calls = [(q.data_ptr(), k[i].data_ptr(), v[i].data_ptr(), index.data_ptr(), index.shape[1],
                      q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), out.data_ptr(), batch, HQ, HKV, D,
                      D**-0.5, splits) for i in range(args.layers)]
            reads = [(k[i].data_ptr(), v[i].data_ptr(), index.data_ptr(), index.shape[1], kv_len.data_ptr(), batch,
                      HKV * D) for i in range(args.layers)]
            times: dict[str, list[float]] = {"old": [], "new": [], "read": []}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    for call in calls:
                        if fn(*call) != 0:
                            raise RuntimeError(f"{name} kernel failed to allocate its scratch")
                    times[name].append((time.perf_counter() - t) / len(calls))
                t = time.perf_counter()
                for call in reads:
                    reader(*call)
                times["read"].append((time.perf_counter() - t) / len(reads))
            med = {n: sorted(ts)[len(ts) // 2] * 1e3 for n, ts in times.items()}
            gbps = {n: 2 * batch * ctx * HKV * D * 4 / (ms / 1e3) / 1e9 for n, ms in med.items()}
            rows.append({"requests": batch, "context": ctx, "query_tokens": nq, "old_ms": med["old"],
                         "new_ms": med["new"], "read_ms": med["read"], "new_over_old": med["new"] / med["old"],
                         "gbps": gbps})
            print(f"{batch:3d} requests x {ctx:5d} context, {nq:3d} query tokens: old {med['old']:8.2f} ms  "
                  f"new {med['new']:8.2f} ms  new/old {med['new'] / med['old']:.3f}  "
                  f"(GB/s: old {gbps['old']:.1f}, new {gbps['new']:.1f}, read only {gbps['read']:.1f})", flush=True)
            del k, v
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"baseline_rev": args.baseline_rev, "isa": args.isa,
                                        "threads": torch.get_num_threads(),
                                        "layers": args.layers, "page_size": args.page_size, "rows": rows},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
