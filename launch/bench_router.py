"""Data parallelism, measured: sglang-router's cost in front of one replica, and --dp-size 2
against 1.

Three phases, each with its own servers (started and stopped here):
  1. one replica, requests sent to it directly;
  2. the same replica behind `python -m sglang_router.launch_router --policy cache_aware`
     (one worker, so the difference is the router's hop, not routing);
  3. one server with --dp-size 2 (and again --dp-size 1) measured directly.
Each phase runs `--sequential` requests one at a time (latency per request) and then
`--requests` requests `--concurrency` at a time (throughput). Prompts share ten prefixes.

    python launch/bench_router.py --model models/qwen3-tiny --out /tmp/bench_router.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from minisgl_mp.bench.server_proc import launch_server

TOPICS = ["apples", "rivers", "engines", "violins", "glaciers", "lanterns", "comets", "harbors", "orchids", "quarries"]


def prompts(n: int) -> list[str]:
    return [f"Notes on {TOPICS[i % 10]}: one fact per line, plain words. " * 3 + f"Q{i}:" for i in range(n)]


def _post(url: str, model: str, prompt: str, max_tokens: int) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t


def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    _post(url, model, "warm up", args.max_tokens)
    lat = [_post(url, model, p, args.max_tokens) for p in prompts(args.sequential)]
    batch = prompts(args.requests)
    t = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(lambda p: _post(url, model, p, args.max_tokens), batch))
    elapsed = time.perf_counter() - t
    return {"latency_median_ms": 1000 * statistics.median(lat), "latency_mean_ms": 1000 * statistics.mean(lat),
            "requests_per_s": len(batch) / elapsed, "output_tokens_per_s": len(batch) * args.max_tokens / elapsed}


@contextlib.contextmanager
def server(model: str, extra: list[str], log_dir: Path, name: str) -> Iterator[Any]:
    s = launch_server(model, ["--port", "0", "--zmq-port", "0", *extra], log_dir / f"{name}.log")
    try:
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def router(worker_urls: list[str], log_path: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--worker-urls", *worker_urls, "--policy", "cache_aware"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sglang-router did not start; see " + str(log_path))
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/qwen3-tiny")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sequential", type=int, default=30)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="--num-threads of each scheduler replica")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = ["--num-threads", str(args.threads), "--num-pages", "8192"]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_router-"))
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(),
                               "loadavg_before": os.getloadavg()}
    with server(args.model, base, log_dir, "direct") as s:
        results["direct"] = measure(s.http, s.model, args)
        with router([s.http], log_dir / "router.log") as url:
            results["router"] = measure(url, s.model, args)
    for dp in (1, 2):
        with server(args.model, [*base, "--dp-size", str(dp)], log_dir, f"dp{dp}") as s:
            results[f"dp{dp}"] = measure(s.http, s.model, args)
    results["loadavg_after"] = os.getloadavg()
    d, r = results["direct"], results["router"]
    results["router_latency_ratio"] = r["latency_median_ms"] / d["latency_median_ms"]
    results["router_throughput_ratio"] = r["requests_per_s"] / d["requests_per_s"]
    results["dp2_over_dp1_throughput"] = results["dp2"]["requests_per_s"] / results["dp1"]["requests_per_s"]
    print(json.dumps(results, indent=2))
    print(f"router/direct: latency x{results['router_latency_ratio']:.2f} "
          f"(+{r['latency_median_ms'] - d['latency_median_ms']:.1f} ms median), "
          f"throughput x{results['router_throughput_ratio']:.2f}; "
          f"dp2/dp1 throughput x{results['dp2_over_dp1_throughput']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
