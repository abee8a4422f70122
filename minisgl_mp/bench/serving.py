"""Online serving benchmark: latency and throughput of a running server, streaming every request.

    python -m minisgl_mp.bench serving --quick                   # starts models/qwen3-tiny, sweeps 3 rates
    python -m minisgl_mp.bench serving --launch models/qwen3-tiny --request-rates 1,2,4,inf
    python -m minisgl_mp.bench serving --endpoint tcp://127.0.0.1:30001 --tokenizer models/qwen3-tiny
    python -m minisgl_mp.bench serving --backend openai --base-url http://127.0.0.1:8000/v1 \\
        --model-name Qwen/Qwen3-0.6B --tokenizer <its folder> --prompt-format text   # vLLM, SGLang
    python -m minisgl_mp.bench serving --compare-offline --launch models/qwen3-tiny \\
        --max-concurrency 64 --num-prompts 256               # process overhead: server vs offline

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped at
--max-concurrency in flight; all are greedy, ignore EOS and stream. Reported per rate: TTFT,
TPOT ((e2e - ttft) / (output tokens - 1) per request), ITL (every gap between streamed chunks)
and end-to-end latency (mean, median, p95, p99), request and token throughput, completed and
failed counts. The prefix cache is flushed before each rate (the same prompts are reused).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

from minisgl_mp.bench import plots
from minisgl_mp.bench.cli import add_workload_args, bench_parser, token_range_of, workload_from_args
from minisgl_mp.bench.proc_profile import ProcessMeter, PySpy, sched_line, server_processes
from minisgl_mp.bench.report import machine_info, ratio, table, write_json
from minisgl_mp.bench.server_proc import LaunchedServer, launch_server
from minisgl_mp.bench.serving_backends import Backend, OpenAIBackend, ZmqBackend
from minisgl_mp.bench.serving_run import run_requests, samples, summarize_run
from minisgl_mp.bench.workloads import Workload
from minisgl_mp.client import DEFAULT_ENDPOINT

QUICK_MODEL, QUICK_RATES = "models/qwen3-tiny", "4,16,inf"
STAT_KEYS = ("prefill_tokens", "cached_prompt_tokens", "decode_tokens", "steps", "retractions")


def rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers or inf separated by commas, got {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (or inf), got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("serving", __doc__)
    p.add_argument("--quick", action="store_true", help=f"small run; starts {QUICK_MODEL} unless a server is "
                   f"given, sweeps rates {QUICK_RATES}")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--out", type=Path, help="JSON report (default: bench_results/serving_<workload>.json)")
    p.add_argument("--plot-dir", type=Path, default=Path("bench_results/plots"), help="PNG plots go here")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    s = p.add_argument_group("server")
    s.add_argument("--backend", choices=("zmq", "openai"), default="zmq",
                   help="zmq: our client endpoint; openai: streaming /v1/completions (ours, vLLM, SGLang)")
    s.add_argument("--endpoint", help=f"ZMQ endpoint (default {DEFAULT_ENDPOINT})")
    s.add_argument("--base-url", help="OpenAI API base (default http://127.0.0.1:30000/v1)")
    s.add_argument("--model-name", help="the request's model field (openai; default: none, or the launched name)")
    s.add_argument("--api-key")
    s.add_argument("--tokenizer", help="tokenizer folder: prompt ids are drawn from its vocabulary, and "
                   "--prompt-format text decodes them")
    s.add_argument("--token-range", type=int, help="without a tokenizer: draw prompt ids below this")
    s.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="openai: send token ids (exact lengths) or text (any server; lengths change)")
    s.add_argument("--launch", metavar="MODEL", help="start our server on MODEL for the run, stop it after")
    s.add_argument("--launch-args", default="", help="more flags for the launched server (one string)")
    s.add_argument("--server-log", type=Path, default=Path("bench_results/bench_serving_server.log"))
    s.add_argument("--py-spy", type=Path, metavar="DIR",
                   help="with --launch: sample every server process with py-spy during each run (raw stacks "
                   "to DIR/rate_<r>/<process>.txt, a summary in the report); CPU seconds are always reported")
    s.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="flush the server's prefix cache before each rate (default: on)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    a.add_argument("--request-rates", type=rate_list, help="sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    a.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: unbounded)")
    a.add_argument("--warmup-requests", type=int, default=2, help="short untimed requests first")
    a.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    a.add_argument("--compare-offline", action="store_true", help="with --launch: the same requests through "
                   "the offline engine in-process, then the server (rate inf, with the offline engine's KV pool "
                   "unless --launch-args sizes it); reports server/offline tok/s")
    add_workload_args(p, ("random", "shared-prefix"))
    return p


def load_tokenizer_for(args: argparse.Namespace) -> Any | None:
    from minisgl_mp.engine.tokenizer import load_tokenizer
    from minisgl_mp.models.source import resolve_model

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.launch:
        # As the launched server resolves it: a named shape with `--load-format dummy` has no
        # checkpoint, only its config and tokenizer.
        from minisgl_mp.launch import parse_args

        engine, _ = parse_args(["--model", args.launch, *shlex.split(args.launch_args)])
        return load_tokenizer(resolve_model(args.launch, engine.load_format, allow_download=False).tokenizer_dir)
    return None


def make_backend(args: argparse.Namespace, server: LaunchedServer | None, tokenizer: Any | None) -> Backend:
    if args.backend == "zmq":
        return ZmqBackend(server.zmq if server else args.endpoint or DEFAULT_ENDPOINT, args.api_key)
    base = (server.http + "/v1") if server and server.http else args.base_url or "http://127.0.0.1:30000/v1"
    return OpenAIBackend(base, args.model_name or (server.model if server else None), tokenizer,
                         args.prompt_format, args.api_key, args.request_timeout)


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    if not before or not after or any(k not in before or k not in after for k in STAT_KEYS):
        return None
    return {k: int(after[k]) - int(before[k]) for k in STAT_KEYS}


async def warmup(backend: Backend, n: int, timeout_s: float) -> None:
    if n <= 0:
        return
    warm = [([1 + i, 2, 3, 4, 5, 6, 7, 8], 4) for i in range(n)]
    records, _ = await run_requests(backend, warm, math.inf, None, 0, timeout_s, False)
    if not any(r.ok for r in records):
        raise RuntimeError(f"warm-up requests failed ({records[0].error or 'no output'}): is the server up there?")


async def sweep(args: argparse.Namespace, backend: Backend, requests: list[tuple[list[int], int]],
                rates: list[float], max_concurrency: int | None,
                server_pids: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """One timed run per rate. With `server_pids` (a launched server), each run also reports
    the CPU time of every process, and with --py-spy a sampling profile of each."""
    await warmup(backend, args.warmup_requests, min(args.request_timeout, 120.0))
    runs = []
    for i, rate in enumerate(rates):
        label = "inf" if math.isinf(rate) else f"{rate:g}"
        flushed = await backend.flush_cache() if args.flush_cache else None
        before = await backend.engine_stats()
        meter = ProcessMeter(server_pids) if server_pids else None
        spy = PySpy(server_pids, args.py_spy / f"rate_{label}") if server_pids and args.py_spy else None
        if spy is not None and not spy.available:
            print("--py-spy: py-spy is not installed (pip install py-spy); CPU seconds only", file=sys.stderr)
            spy = None
        for probe in (spy, meter):
            if probe is not None:
                probe.start()
        records, duration = await run_requests(backend, requests, rate, max_concurrency, args.seed + i,
                                               args.request_timeout, args.progress)
        cpu = meter.stop() if meter else None
        profile = spy.stop() if spy else None
        metrics = summarize_run(records, duration)
        runs.append({"label": label, "request_rate": rate,
                     "max_concurrency": max_concurrency, "cache_flushed": flushed, "metrics": metrics,
                     "server_engine_stats": stats_delta(before, await backend.engine_stats()),
                     "process_cpu": cpu, "py_spy": profile, "samples": samples(records)})
        print(f"rate {label}: {metrics['completed']} done, {metrics['failed']} failed, "
              f"{metrics['output_tps']:.1f} out tok/s, TTFT mean {metrics['ttft_ms']['mean'] or 0:.0f} ms", flush=True)
        if cpu:
            print("  CPU cores busy: " + ", ".join(f"{n} {p['cores']:.2f}" for n, p in cpu["processes"].items()),
                  flush=True)
            if (line := sched_line(cpu["processes"])) is not None:
                print(line, flush=True)
        for name, prof in (profile or {}).items():
            if "error" in prof:
                print(f"  py-spy {name}: {prof['error']}", flush=True)
                continue
            tops = "; ".join(f"{t['function']} {t['share']:.0%}" for t in prof["top_self"][:4])
            print(f"  py-spy {name}: on CPU {prof['busy_share']:.0%} of the run; top: {tops}", flush=True)
    return runs


def print_runs(runs: list[dict[str, Any]]) -> None:
    def ms(m: dict[str, Any], key: str) -> list[Any]:
        return [m[key]["mean"], m[key]["median"], m[key]["p99"]]

    rows = [[r["label"], r["metrics"]["completed"], r["metrics"]["failed"], r["metrics"]["duration_s"],
             r["metrics"]["request_throughput"], r["metrics"]["output_tps"], r["metrics"]["total_tps"],
             *ms(r["metrics"], "ttft_ms"), *ms(r["metrics"], "tpot_ms"), *ms(r["metrics"], "itl_ms"),
             *ms(r["metrics"], "e2e_ms")] for r in runs]
    lat = [f"{k} {s}" for k in ("TTFT", "TPOT", "ITL", "E2E") for s in ("mean", "p50", "p99")]
    print(table(["rate", "done", "failed", "seconds", "req/s", "out tok/s", "total tok/s", *lat], rows))
    print("latencies in ms")


def server_flags(args: argparse.Namespace) -> list[str]:
    """--launch-args, plus --cpu-prefault-kv unless they say otherwise: a benchmark times a
    server whose KV pool has been touched, as one that has run a while has."""
    flags = shlex.split(args.launch_args)
    if not {"--cpu-prefault-kv", "--no-cpu-prefault-kv"} & set(flags):
        flags.append("--cpu-prefault-kv")
    return flags


def offline_run(args: argparse.Namespace, requests_of: Callable[[int], Workload],
                max_concurrency: int) -> tuple[dict[str, Any], Workload]:
    """The launched server's engine, in-process, on the same requests: (result, workload).
    Its running requests are capped at the server run's concurrency, so the two differ only by
    the processes, sockets, tokenizer and detokenizer between client and scheduler. The
    engine is freed and its heap handed back before returning: the server starts in the
    memory this process leaves, and sizes its KV pool from it by default."""
    import gc

    from minisgl_mp.bench.runs import run_engine
    from minisgl_mp.launch import parse_args
    from minisgl_mp.llm import LLM
    from minisgl_mp.utils.memory import release_freed_memory

    engine, _ = parse_args(["--model", args.launch, *server_flags(args)])
    engine = dataclasses.replace(engine, max_running_requests=min(engine.max_running_requests, max_concurrency))
    llm = LLM(**dataclasses.asdict(engine))
    token_range = token_range_of(llm.tokenizer, llm.scheduler.runner.model_config.vocab_size)
    workload = requests_of(token_range)
    print(f"offline engine: {workload.num_requests} requests in-process", flush=True)
    meter = ProcessMeter({})
    meter.start()
    result = run_engine(llm, workload, token_range, "offline engine", args.progress).to_dict()
    used = meter.stop()["processes"]["benchmark client"]
    cores = used["cores"]
    print(f"  CPU cores busy: offline engine {cores:.2f}", flush=True)
    if (line := sched_line({"offline engine": used})) is not None:
        print(line, flush=True)
    kv_pages = llm.scheduler.runner.num_pages
    llm.shutdown()
    del llm
    gc.collect()
    release_freed_memory()
    import torch

    if torch.cuda.is_available():  # the server sizes its KV pool in the memory left on the device
        torch.cuda.empty_cache()
    return {**result, "max_running_requests": engine.max_running_requests, "cpu_cores_busy": cores,
            "sched": used.get("sched"), "kv_pages": kv_pages}, workload


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    if args.quick and not (args.launch or args.endpoint or args.base_url):
        args = argparse.Namespace(**{**vars(args), "launch": QUICK_MODEL})
    if args.compare_offline and not args.launch:
        print("bench serving: --compare-offline needs --launch MODEL (the offline engine runs that model)", file=sys.stderr)
        return 2
    rates = ([math.inf] if args.compare_offline else args.request_rates
             or (rate_list(QUICK_RATES) if args.quick and args.request_rate == math.inf else [args.request_rate]))
    max_concurrency = args.max_concurrency or (64 if args.compare_offline else None)
    report: dict[str, Any] = {"mode": "compare_offline" if args.compare_offline else "serving",
                              "argv": sys.argv[1:] if argv is None else argv, "backend": args.backend,
                              "launched": args.launch, "launch_args": args.launch_args, "machine": machine_info()}
    server = None
    try:
        tokenizer = load_tokenizer_for(args)
        if tokenizer is None and not args.token_range:
            raise ValueError("pass --tokenizer (or --launch) so prompt ids come from a vocabulary, or --token-range N")
        def make_workload(token_range: int) -> Workload:
            return workload_from_args(args, token_range)

        if args.compare_offline:
            report["offline"], workload = offline_run(args, make_workload, max_concurrency)
            # This process only runs clients from here on: shrink torch's thread pool so no
            # idle OpenMP worker of the offline run holds a core the server needs.
            import torch

            torch.set_num_threads(1)
        else:
            workload = make_workload(token_range_of(tokenizer, 2**31) if tokenizer else args.token_range)
        report["workload"] = {"name": workload.name, **workload.params, "requests": workload.num_requests}
        if args.launch:
            print(f"starting the server on {args.launch} (log: {args.server_log})", flush=True)
            flags = server_flags(args)
            if args.compare_offline and not {"--num-pages", "--kv-cache-gb"} & set(flags):
                # The same KV pool as the offline engine's: a default pool is sized from the
                # memory free at start, which differs between the two, and a smaller pool
                # runs fewer requests at once.
                flags += ["--num-pages", str(report["offline"]["kv_pages"])]
            report["server_flags"] = flags
            server = launch_server(args.launch, flags, args.server_log)
        backend = make_backend(args, server, tokenizer)

        async def go() -> list[dict[str, Any]]:
            try:
                pids = server_processes(server.proc.pid, server.log_path) if server else None
                return await sweep(args, backend, workload.single_turn_requests(), rates, max_concurrency, pids)
            finally:
                await backend.close()

        runs = asyncio.run(go())
    except (ValueError, RuntimeError) as e:
        print(f"bench serving: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print_runs(runs)
    report["runs"] = runs
    if args.compare_offline:
        off, srv = report["offline"]["output_tps"], runs[0]["metrics"]["output_tps"]
        report["server_over_offline_output_tps"] = ratio(srv, off)
        print(f"offline engine {off:.1f} out tok/s, server ({max_concurrency} concurrent streams) {srv:.1f} "
              f"out tok/s: server/offline = {report['server_over_offline_output_tps']:.3f}")
    name = report["mode"] if args.compare_offline else f"serving_{workload.name.replace('-', '_')}"
    if args.plots and any(r["samples"]["ttft_ms"] for r in runs):
        title = f"{args.launch or args.backend} · {workload.name} · {workload.num_requests} requests"
        report["plots"] = [str(plots.latency_distributions(runs, args.plot_dir / f"{name}_latency.png", title))]
        if len(runs) > 1:
            report["plots"].append(str(plots.rate_sweep(runs, args.plot_dir / f"{name}_sweep.png", title)))
        print("plots: " + ", ".join(report["plots"]))
    report["wall_seconds"] = time.perf_counter() - start
    out = write_json(args.out or Path(f"bench_results/{name}.json"), report)
    print(f"wrote {out} ({report['wall_seconds']:.0f}s)")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
