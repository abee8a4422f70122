"""Weight formats on the CPU: how fast their products and a batch-1 decode step run, against the
memory's read rate measured in the same run.

    python -m minisgl_mp.bench weights --out bench_results/weights.json
    python -m minisgl_mp.bench weights --batch-sizes 1,4,8 --formats float32,int8 --no-engine   # products only

1. Products on the Qwen3-0.6B shapes (`--chain-layers` layers' qkv, o, gate_up and down, then
   the LM head: distinct tensors, far larger than the caches), per stored format and batch size:
   the C kernel, the register-tiled kernel over packed panels, oneDNN prepacked and `F.linear`
   (float32), the widened-tile path (16-bit and int8), on an AMX CPU the bfloat16 tiles and
   on an AVX512-BF16 one the dot-product panels (bf16dot), beside oneDNN's bfloat16 path, and
   what `Linear` picks. Weight GB/s =
   weight bytes / time; the kernel's crossover is the largest batch where it beats every other
   path.
2. The engine's batch-1 decode step per format (random weights, `--context` tokens cached)
   against its bandwidth floor: the bytes of every Linear weight over the read rate measured
   just before.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minisgl_mp.bench.cli import bench_parser
from minisgl_mp.bench.decode_floor import best_seconds, engine_decode_steps, measure_bandwidth, measure_matmul
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.layers.linear import Linear
from minisgl_mp.llm import LLM
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.source import resolve_model
from minisgl_mp.models.weight_format import quantize_int8

FORMATS = {"float32": ({}, torch.float32), "float16": ({"dtype": "float16"}, torch.float16),
           "bfloat16": ({"dtype": "bfloat16"}, torch.bfloat16), "int8": ({"quantization": "int8"}, torch.int8),
           # float32 without the C product kernel: the engine's path before it (engine step only)
           "float32-torch": ({"cpu_small_gemm": False}, torch.float32)}
ISA_FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx2", "fma", "f16c")


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in ISA_FLAGS if f in flags], "kernel_isa": cpu_kernels.kernel_isa(),
            "threads": torch.get_num_threads()}


def chain_linears(cfg: ModelConfig, layers: int, dtype: torch.dtype, seed: int) -> list[Linear]:
    """Linear modules of `layers` decoder layers (fused shapes, as the engine holds them) and
    the LM head, random weights stored in `dtype`, kernel-enabled as in the engine and prepacked
    for oneDNN as well (the engine makes that copy only with --cpu-prepack), to time it beside."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)] * layers
    gen = torch.Generator().manual_seed(seed)
    out = []
    for fan_in, fan_out in [*shapes, (h, cfg.vocab_size)]:
        lin = Linear(fan_in, fan_out)
        lin.weight.data.normal_(0, fan_in ** -0.5, generator=gen)
        if dtype == torch.int8:
            lin.store_weight(*quantize_int8(lin.weight.data))
        elif dtype != torch.float32:
            lin.store_weight(lin.weight.data.to(dtype))
        lin.prepack()
        lin.enable_cpu_gemm()
        out.append(lin)
    return out


def product_paths(lins: list[Linear], x: dict[int, torch.Tensor]) -> dict[str, Callable[[], None]]:
    stored = lins[0].weight.dtype != torch.float32
    paths: dict[str, Callable[[], None]] = {
        "kernel": lambda: [cpu_kernels.weight_gemm(x[m.in_features], m.weight, m.weight_scale) for m in lins],
        "linear": lambda: [m(x[m.in_features]) for m in lins],
    }
    if stored:
        paths["widened"] = lambda: [m._widened_linear(x[m.in_features]) for m in lins]
    else:
        paths["f_linear"] = lambda: [F.linear(x[m.in_features], m.weight) for m in lins]
        paths["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(x[m.in_features], m.packed_weight, None,
                                                                      "none", [], "") for m in lins]
        if all(m.panels is not None for m in lins):
            paths["panels"] = lambda: [m.panels.matmul(x[m.in_features]) for m in lins]
    packed16 = [m.amx or m.bf16dot for m in lins]
    if all(p is not None for p in packed16):
        # bfloat16 on an AMX or AVX512-BF16 CPU: the 16-bit kernel (what `linear` runs), and
        # oneDNN's own bfloat16 path on prepacked weights, with the casts the engine's float32
        # activations need.
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.data, 1) for m in lins]
        paths["amx" if lins[0].amx is not None else "bf16dot"] = lambda: [
            p.matmul(x[m.in_features]) for m, p in zip(lins, packed16)]
        paths["onednn_bf16"] = lambda: [torch.ops.mkldnn._linear_pointwise(
            x[m.in_features].to(torch.bfloat16), w, None, "none", [], "").float() for m, w in zip(lins, packed)]
    return paths


def interleaved_ms(paths: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median ms of each path, the paths taking turns (one untimed round first), so a host
    whose speed drifts during the run slows them all alike."""
    times: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(reps + 1):
        for k, fn in paths.items():
            t = best_seconds(fn, 1, warmup=0)[0]
            if rep:
                times[k].append(t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def weight_bytes(lins: list[Linear]) -> int:
    return sum(m.weight.nbytes + (0 if m.weight_scale is None else m.weight_scale.nbytes) for m in lins)


@torch.inference_mode()
def measure_products(cfg: ModelConfig, args: argparse.Namespace, read_gbps: float) -> list[dict[str, Any]]:
    rows = []
    for name in (f for f in args.formats if f != "float32-torch"):
        lins = chain_linears(cfg, args.chain_layers, FORMATS[name][1], args.seed)
        nbytes = weight_bytes(lins)
        for batch in args.batch_sizes:
            x = {k: torch.randn(batch, k) for k in {m.in_features for m in lins}}
            ms = interleaved_ms(product_paths(lins, x), args.reps)
            others = [v for k, v in ms.items() if k not in ("kernel", "linear", "panels", "amx", "bf16dot")]
            row = {"format": name, "batch": batch, "weight_bytes": nbytes, "ms": ms,
                   "weight_gbps": {k: nbytes / v / 1e6 for k, v in ms.items()},
                   "kernel_over_best_other": ms["kernel"] / min(others),
                   "panels_over_best_other": ms["panels"] / min(others) if "panels" in ms else None,
                   "amx_over_best_other": ms["amx"] / min(others) if "amx" in ms else None,
                   "bf16dot_over_best_other": ms["bf16dot"] / min(others) if "bf16dot" in ms else None,
                   "kernel_gbps_over_read": nbytes / ms["kernel"] / 1e6 / read_gbps}
            rows.append(row)
            print(f"{name:>8} B={batch:<3} " + " ".join(f"{k} {v:7.1f} ms ({row['weight_gbps'][k]:5.1f} GB/s)"
                                                       for k, v in ms.items()), flush=True)
        del lins
        gc.collect()
    return rows


def crossovers(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per format: the largest batch up to which the kernel beats every other path."""
    out = {}
    for name in dict.fromkeys(r["format"] for r in rows):
        best = 0
        for r in sorted((r for r in rows if r["format"] == name), key=lambda r: r["batch"]):
            if r["kernel_over_best_other"] >= 1:
                break
            best = r["batch"]
        out[name] = best
    return out


def measure_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name in args.formats:
        bw = measure_bandwidth(args.bandwidth_mib, reps=3)
        llm = LLM(args.model, load_format="dummy", device="cpu", seed=args.seed, num_pages=args.context + 64,
                  max_running_requests=2, cpu_prefault_kv=True, **FORMATS[name][0])
        try:
            model = llm.scheduler.runner.model
            nbytes = weight_bytes([m for m in model.modules() if isinstance(m, Linear)])
            steps = engine_decode_steps(llm, 1, args.context, args.steps, 3, model.config.vocab_size, args.seed,
                                        progress=False)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
        step_ms = 1e3 * statistics.median(steps)
        floor_ms = nbytes / bw["read_gbps"] / 1e6
        row = {"format": name, "weight_bytes": nbytes, "read_gbps": bw["read_gbps"], "step_ms_median": step_ms,
               "step_ms_min": 1e3 * min(steps), "floor_ms": floor_ms, "step_over_floor": step_ms / floor_ms}
        rows.append(row)
        print(f"{name:>8} batch-1 step {step_ms:6.1f} ms (min {row['step_ms_min']:.1f}), floor {floor_ms:.1f} ms "
              f"({nbytes / 1e9:.2f} GB at {bw['read_gbps']:.1f} GB/s): {row['step_over_floor']:.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("weights", __doc__)
    p.add_argument("--model", default="Qwen3-0.6B", help="config name or folder (random weights of its shape)")
    p.add_argument("--formats", default="float32,float16,bfloat16,int8",
                   help=f"stored weight formats, of {list(FORMATS)}")
    p.add_argument("--batch-sizes", default="1,2,4,8,12,16,32,64", help="rows per product")
    p.add_argument("--chain-layers", type=int, default=4, help="decoder layers' products in the chain, plus the LM head")
    p.add_argument("--reps", type=int, default=7, help="timed runs per product chain (median)")
    p.add_argument("--context", type=int, default=256, help="cached tokens of the decoding request")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (median)")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the float32 matrix product timed for reference")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-engine", dest="engine", action="store_false", help="only the products")
    p.add_argument("--no-products", dest="products", action="store_false", help="only the engine steps")
    p.add_argument("--out", type=Path, help="JSON report")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    if unknown := set(args.formats) - set(FORMATS):
        p.error(f"unknown formats {sorted(unknown)}; choose from {list(FORMATS)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_file(resolve_model(args.model, "dummy", allow_download=False).config_path)
    info = cpu_info()
    bw, mm = measure_bandwidth(args.bandwidth_mib), measure_matmul(args.matmul_n)
    print(f"{info['model']} {' '.join(info['flags'])}; kernel ISA {info['kernel_isa']}, {info['threads']} threads; "
          f"read {bw['read_gbps']:.1f} GB/s, matmul {mm['gflops']:.0f} GFLOP/s", flush=True)
    products = measure_products(cfg, args, bw["read_gbps"]) if args.products else []
    cross = crossovers(products)
    if products:
        print("kernel crossover (largest batch where it wins): " + ", ".join(f"{k} {v}" for k, v in cross.items()))
    engine = measure_engine(args) if args.engine else []
    report = {"command": "python -m minisgl_mp.bench weights", "args": {k: v for k, v in vars(args).items() if k != "out"},
              "cpu": info, "bandwidth": bw, "matmul": mm, "products": products, "kernel_crossover": cross,
              "engine_batch1": engine}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
