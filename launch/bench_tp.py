"""Tensor parallelism on the CPU: throughput and decode step at --tp-size 1 and 2, and what
the all-reduces of one step cost.

    python launch/bench_tp.py                                  # the generated model, ~5 minutes
    python launch/bench_tp.py --requests 32 --output-len 64 --out tp.json

For each tp size the real server runs (one torch thread per rank: on 2 cores, tp 2 uses both)
and gets `--requests` greedy requests at once (output tokens per second over the wall time),
then one streamed request alone (the median gap between its tokens is the decode step at
batch 1). The collectives of a decode step are then timed alone, between two gloo processes,
at the model's sizes: per step 2 all-reduces per layer (o and down) and one for the embedding
of [batch, hidden] floats, one all-gather of [batch, vocab / 2] logits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisgl_mp.bench.server_proc import launch_server  # noqa: E402
from minisgl_mp.client import AsyncClient, Client  # noqa: E402
from minisgl_mp.models.config import ModelConfig  # noqa: E402


async def _throughput(endpoint: str, prompts: list[list[int]], output_len: int) -> float:
    params = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    clients = [AsyncClient(endpoint) for _ in prompts]
    try:
        start = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(input_ids=p, sampling_params=params) for c, p in zip(clients, prompts)))
        elapsed = time.perf_counter() - start
    finally:
        for c in clients:
            c.close()
    return sum(len(o["token_ids"]) for o in outs) / elapsed


def _decode_step_ms(endpoint: str, prompt: list[int], tokens: int) -> float:
    stamps = []
    with Client(endpoint, timeout=600) as c:
        for _ in c.stream(input_ids=prompt, sampling_params={"max_tokens": tokens, "temperature": 0, "ignore_eos": True}):
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after the first decode
    return statistics.median(gaps) * 1000


def run_server(model: str, tp: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 7900) for _ in range(args.input_len)] for _ in range(args.requests)]
    srv_args = ["--tp-size", str(tp), "--num-threads", str(args.threads), "--num-pages", str(args.num_pages),
                "--no-enable-http"]
    with launch_server(model, srv_args, log_dir / f"tp{tp}.log") as srv:
        asyncio.run(_throughput(srv.zmq, prompts[:2], 4))  # warm-up
        tput = asyncio.run(_throughput(srv.zmq, prompts, args.output_len))
        step = _decode_step_ms(srv.zmq, prompts[0], args.decode_tokens)
    return {"tp_size": tp, "output_tokens_per_s": round(tput, 1), "decode_step_ms_batch1": round(step, 2)}


def _collectives(rank: int, port: int, sizes: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    result = {}
    for batch in sizes["batches"]:
        x = torch.randn(batch, sizes["hidden"])
        logits = torch.randn(batch, sizes["vocab"] // 2)
        parts = [torch.empty_like(logits) for _ in range(2)]
        ar, ag = [], []
        for _ in range(sizes["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ar.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather(parts, logits)
            ag.append(time.perf_counter() - t0)
        per_step = (2 * sizes["layers"] + 1) * statistics.median(ar) + statistics.median(ag)
        result[batch] = {"all_reduce_ms": statistics.median(ar) * 1000, "all_gather_logits_ms": statistics.median(ag) * 1000,
                         "collectives_per_decode_step_ms": per_step * 1000}
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def time_collectives(cfg: ModelConfig, batches: list[int], iters: int) -> dict[int, dict[str, float]]:
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sizes = {"hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "layers": cfg.num_layers, "batches": batches, "iters": iters}
    procs = [ctx.Process(target=_collectives, args=(r, port, sizes, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return {b: {k: round(v, 3) for k, v in r.items()} for b, r in result.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qwen3-tiny")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--num-pages", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=200, help="repeats of each timed collective")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_tp.json"))
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/minisgl_mp-bench-tp"))
    args = ap.parse_args()

    cfg = ModelConfig.from_file(Path(args.model) / "config.json")
    runs = [run_server(args.model, tp, args, args.log_dir) for tp in (1, 2)]
    coll = time_collectives(cfg, [1, args.requests], args.iters)
    one, two = runs
    report = {
        "model": args.model, "requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
        "threads_per_rank": args.threads, "runs": runs, "collectives": coll,
        "throughput_ratio_tp2_over_tp1": round(two["output_tokens_per_s"] / one["output_tokens_per_s"], 3),
        "decode_step_ratio_tp2_over_tp1": round(two["decode_step_ms_batch1"] / one["decode_step_ms_batch1"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for r in runs:
        print(f"tp {r['tp_size']}: {r['output_tokens_per_s']:.1f} output tok/s ({args.requests} requests), "
              f"decode step {r['decode_step_ms_batch1']:.2f} ms at batch 1")
    for b, c in coll.items():
        print(f"collectives of one decode step at batch {b}: {c['collectives_per_decode_step_ms']:.3f} ms "
              f"({2 * cfg.num_layers + 1} all-reduces of {c['all_reduce_ms']:.3f} ms, logits all-gather "
              f"{c['all_gather_logits_ms']:.3f} ms)")
    print(f"tp2 / tp1: throughput x{report['throughput_ratio_tp2_over_tp1']}, decode step "
          f"x{report['decode_step_ratio_tp2_over_tp1']}; JSON in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
