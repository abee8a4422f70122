"""Smoke tests of the benchmark tools: each tool's tiniest run on the default model finishes
and writes a report whose numbers add up (what a user reading it relies on)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest
import torch

from minisgl_mp.kernels import cpu as cpu_kernels

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_SIZES = ["--input-len", "8,24", "--output-len", "2,5", "--no-progress"]


def load_tool(name: str) -> ModuleType:
    """The module of a `python -m minisgl_mp.bench` subcommand."""
    return importlib.import_module(f"minisgl_mp.bench.{name}")


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    # The tools set torch's thread count for the whole process (--num-threads).
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_offline_random_against_both_baselines(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    rc = load_tool("offline").main(["--model", str(tiny_model_dir), "--num-prompts", "3", *TINY_SIZES,
                                          "--hf-batch-sizes", "1,2", "--hf-max-requests", "2",
                                          "--num-threads", "1", "--out", str(out)])
    assert rc == 0
    report = read(out)
    res = report["results"]
    assert report["model"]["same_weights"] is True
    assert res["engine"]["requests"] == 3 and res["engine"]["output_tps"] > 0
    # Every prompt token was either computed or served from the cache, exactly once.
    stats = res["engine"]["engine_stats"]
    assert stats["prefill_tokens"] + stats["cached_prompt_tokens"] == res["engine"]["input_tokens"]
    assert [r["batch_size"] for r in res["hf_static"]] == [1, 2]
    for r in res["hf_static"]:
        assert "error" not in r, r
        assert r["requests"] == 2 and r["generated_incl_padding"] >= r["output_tokens"]
    # Continuous batching either ran or says why not.
    assert res["hf_cb"].get("output_tps", 0) > 0 or res["hf_cb"]["error"]
    assert report["ratios"]["engine_over_best_static_output_tps"] > 0
    assert report["machine"]["torch"] == torch.__version__


def test_offline_shared_prefix_and_multi_turn_reuse_the_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    tool = load_tool("offline")
    shared = tmp_path / "shared.json"
    # A small prefill budget: later prompts of a group are admitted after the first is cached.
    assert tool.main(["--model", str(tiny_model_dir), "--workload", "shared-prefix", "--num-groups", "2",
                      "--prompts-per-group", "3", "--system-len", "48", "--question-len", "4", "--output-len", "2",
                      "--max-prefill-tokens", "64", "--compare-naive", "--no-hf", "--no-progress",
                      "--out", str(shared)]) == 0
    report = read(shared)
    assert report["results"]["engine_naive"]["engine_stats"]["cached_prompt_tokens"] == 0
    assert report["ratios"]["naive_over_radix_prefill_tokens"] > 1.0

    multi = tmp_path / "multi.json"
    assert tool.main(["--model", str(tiny_model_dir), "--workload", "multi-turn", "--num-prompts", "2",
                      "--num-turns", "2", "--system-len", "8", *TINY_SIZES, "--no-hf", "--out", str(multi)]) == 0
    report = read(multi)
    engine = report["results"]["engine"]
    assert report["workload"]["rounds"] == 2 and engine["requests"] == 4
    assert engine["engine_stats"]["cached_prompt_tokens"] > 0  # turn 2 starts with turn 1's KV


def test_offline_decode_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    assert load_tool("floor").main([
        "--model", str(tiny_model_dir), "--decode-floor", "--batch-sizes", "1,3", "--context-len", "16",
        "--decode-steps", "2", "--warmup-steps", "1", "--chain-reps", "2", "--bandwidth-mib", "8",
        "--no-progress", "--out", str(out)]) == 0
    floor = read(out)["decode_floor"]
    assert [r["batch"] for r in floor["rows"]] == [1, 3]
    for row in floor["rows"]:
        assert row["step_ms"]["median"] > 0 and row["chain_engine_linear_ms"] > 0 and row["floor_ms"] > 0
        # oneDNN's chain needs the engine's oneDNN copy, which it makes only for weights
        # without vector panels (a build without the C kernels' vector paths)
        if cpu_kernels.kernel_isa():
            assert row["chain_onednn_ms"] is None
        else:
            assert row["chain_onednn_ms"] > 0
        assert row["flops"] == row["batch"] * floor["rows"][0]["flops"]
        assert all(v > 0 for v in row["ratios"].values())



@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_decode_floor_of_a_stored_format_counts_its_stored_bytes(tiny_model_dir: Path, tmp_path: Path,
                                                                 quantization: str) -> None:
    def rows(*extra: str) -> list[dict[str, Any]]:
        out = tmp_path / f"floor{len(extra)}.json"
        assert load_tool("floor").main([
            "--model", str(tiny_model_dir), "--batch-sizes", "1", "--context-len", "16", "--decode-steps", "2",
            "--warmup-steps", "1", "--chain-reps", "2", "--bandwidth-mib", "8", "--no-progress", "--out", str(out),
            *extra]) == 0
        return read(out)["decode_floor"]["rows"]

    full, stored = rows()[0], rows("--quantization", quantization)[0]
    assert stored["flops"] == full["flops"]  # the same products, on fewer bytes
    # int8: a byte a weight and a float32 scale a row; int4: 20 bytes a block of 32 weights
    share = {"int8": 1 / 4, "int4": 20 / 32 / 4}[quantization]
    assert share <= stored["weight_bytes"] / full["weight_bytes"] < share * 1.05
    assert stored["chain_f_linear_ms"] is None and stored["ratios"]["step_over_chain_f_linear"] is None
    assert stored["chain_engine_linear_ms"] > 0 and stored["ratios"]["step_over_floor_bandwidth"] > 0

def test_decode_steps_are_all_decodes_when_the_prompts_outgrow_a_prefill_chunk(tiny_model_dir: Path) -> None:
    """8 x 1,000 prompt tokens are four 2,048-token chunks: the timed steps must still each
    run every request (they all start decoding together)."""
    from minisgl_mp import LLM
    from minisgl_mp.bench.decode_floor import engine_decode_steps

    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=9000, max_prefill_tokens=2048)
    times = engine_decode_steps(llm, 8, 1000, steps=3, warmup=1, token_range=1000, seed=0, progress=False)
    assert len(times) == 3 and llm.scheduler.prefill_budget.max_tokens == 2048


def test_offline_prefill_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    assert load_tool("floor").main([
        "--model", str(tiny_model_dir), "--prefill-floor", "--prompt-len", "64", "--prefill-reps", "1",
        "--no-progress", "--out", str(out)]) == 0
    pf = read(out)["prefill_floor"]
    assert pf["prompt_len"] == 64 and pf["runs"] == 1 and pf["prefill_ms"]["median"] > 0
    # Causal attention over 64 tokens is 64*65/2 query-key pairs per head, QK^T and PV each.
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    heads, dim = cfg["num_attention_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert pf["flops"]["attention"] == cfg["num_hidden_layers"] * 4 * heads * dim * (64 * 65 // 2)
    assert pf["flops"]["lm_head"] == 2 * cfg["vocab_size"] * cfg["hidden_size"]
    assert all(v > 0 for v in pf["ratios"].values())
    # The dense FLOP model the peers benchmark uses (from config.json) counts the same work.
    from minisgl_mp.bench.decode_floor import workload_flops

    assert workload_flops(cfg, 1, 64, 1) == pf["flops"]
    # The FMA ceiling comes with the matmul rate; a product far above it would mean a broken probe.
    mm = pf["matmul"]
    if mm["fma_peak_gflops"] is not None:
        assert mm["fma_peak_gflops"] > 0 and 0 < mm["matmul_share_of_peak"] < 1.5
        assert 0 < pf["layer_products_share_of_fma_peak"] < 1.5


def test_weight_formats_bench(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "weights.json"
    assert load_tool("weights").main([
        "--model", str(tiny_model_dir), "--batch-sizes", "1,3", "--chain-layers", "1", "--reps", "1",
        "--formats", "float32,int8", "--context", "8", "--steps", "2", "--bandwidth-mib", "8", "--matmul-n", "128",
        "--out", str(out)]) == 0
    report = read(out)
    assert [(r["format"], r["batch"]) for r in report["products"]] == [
        ("float32", 1), ("float32", 3), ("int8", 1), ("int8", 3)]
    int8, f32 = report["products"][2], report["products"][0]
    assert 3.9 < f32["weight_bytes"] / int8["weight_bytes"] < 4  # a quarter, plus the scales
    assert all(v > 0 for r in report["products"] for v in r["weight_gbps"].values())
    assert "panels" in f32["ms"] and f32["panels_over_best_other"] > 0  # float32 only
    assert "panels" not in int8["ms"] and int8["panels_over_best_other"] is None
    assert [r["format"] for r in report["engine_batch1"]] == ["float32", "int8"]
    assert all(r["step_over_floor"] > 0 for r in report["engine_batch1"])


def test_serving_sweep_over_zmq_writes_report_and_plots(tiny_model_dir: Path, tmp_path: Path) -> None:
    plots = importlib.util.find_spec("matplotlib") is not None
    out = tmp_path / "serving.json"
    rc = load_tool("serving").main([
        "--launch", str(tiny_model_dir), "--num-prompts", "4", *TINY_SIZES, "--request-rates", "20,inf",
        "--warmup-requests", "1", "--server-log", str(tmp_path / "server.log"), "--plot-dir", str(tmp_path),
        "--out", str(out), *(() if plots else ("--no-plots",))])
    assert rc == 0
    report = read(out)
    assert [r["request_rate"] for r in report["runs"]] == [20.0, math.inf]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["outputs_of_wrong_length"]) == (4, 0, 0)
        assert 0 < m["ttft_ms"]["mean"] <= m["e2e_ms"]["mean"]
        assert m["output_tokens"] >= 4 * 2 and m["itl_ms"]["count"] > 0
        assert run["cache_flushed"] is True
        assert run["server_engine_stats"]["cached_prompt_tokens"] == 0  # flushed before each rate
        procs = run["process_cpu"]["processes"]  # where the CPU went, per process
        assert {"launcher", "scheduler", "tokenizer", "detokenizer", "benchmark client"} <= set(procs)
        assert procs["scheduler"]["cpu_seconds"] > 0 and all(p["cores"] >= 0 for p in procs.values())
        if Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
            assert procs["scheduler"]["sched"]["threads"] >= 1  # its OpenMP workers among them
    if plots:
        assert len(report["plots"]) == 2
        for p in report["plots"]:
            assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_offline_over_openai_http(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    rc = load_tool("serving").main([
        "--compare-offline", "--backend", "openai", "--launch", str(tiny_model_dir), "--max-concurrency", "4",
        "--num-prompts", "4", *TINY_SIZES, "--warmup-requests", "1", "--no-plots",
        "--server-log", str(tmp_path / "server.log"), "--out", str(out)])
    assert rc == 0
    report = read(out)
    run = report["runs"][0]["metrics"]
    assert run["completed"] == 4 and run["outputs_of_wrong_length"] == 0
    assert report["offline"]["output_tokens"] == run["output_tokens"]
    assert report["offline"]["max_running_requests"] == 4
    assert report["server_over_offline_output_tps"] > 0
    # The server runs with the offline engine's KV pool: a default pool is sized from the
    # memory free when it starts, which the offline run has just changed.
    pages = report["offline"]["kv_pages"]
    assert report["server_flags"][-2:] == ["--num-pages", str(pages)]
    assert f"KV pool: {pages} tokens" in (tmp_path / "server.log").read_text()


def test_py_spy_summary_and_process_discovery(tmp_path: Path) -> None:
    from minisgl_mp.bench import proc_profile

    log = tmp_path / "server.log"
    log.write_text("x INFO minisgl_mp.launch: detokenizer process ready (pid 11)\n"
                   "x INFO minisgl_mp.launch: scheduler process ready (pid 12)\n")
    assert proc_profile.server_processes(10, log) == {"launcher": 10, "detokenizer": 11, "scheduler": 12}
    assert proc_profile.cpu_seconds(os.getpid()) > 0
    raw = tmp_path / "scheduler.txt"
    raw.write_text("main (minisgl_mp/launch.py:10);step (/x/minisgl_mp/scheduler/scheduler.py:120) 30\n"
                   "main (minisgl_mp/launch.py:10);recv (zmq/sugar/socket.py:5) 10\n")
    summary = proc_profile.summarize(raw, possible_samples=100)
    assert summary["busy_share"] == 0.4
    assert summary["top_self"][0] == {"function": "step (scheduler/scheduler.py)", "share": 0.3}
    assert summary["top_self"][1]["function"] == "recv (sugar/socket.py)"


def test_decode_plan_bench(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert load_tool("decode_plan").main([
        "--model", str(tiny_model_dir), "--formats", "float32,int8", "--batch-sizes", "1,2", "--chunks", "0,24",
        "--context", "8", "--steps", "2", "--rounds", "2", "--out", str(out)]) == 0
    results = read(out)["results"]
    for fmt in ("float32", "int8"):
        rows = results[fmt]["rows"]
        assert [(r["batch"], r["chunk"]) for r in rows] == [(1, 0), (1, 24), (2, 0), (2, 24)]
        assert all(len(r["plan_ms"]) == len(r["modules_ms"]) == 2 and r["median_ratio"] > 0 for r in rows)
    # A step of no decodes and no chunk is no step: refused before loading anything.
    assert load_tool("decode_plan").main(["--batch-sizes", "0", "--chunks", "0", "--out", str(out)]) == 2


def test_decode_steps_beside_a_prompt_chunk(tiny_model_dir: Path) -> None:
    """Each timed step of `chunk` > 0 is the decodes plus one fresh prompt of that length."""
    from minisgl_mp import LLM
    from minisgl_mp.bench.decode_floor import engine_decode_steps

    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=1024)
    sched = llm.scheduler
    times = engine_decode_steps(llm, 3, 20, steps=4, warmup=1, token_range=1000, seed=0, progress=False, chunk=40)
    assert len(times) == 4 and not sched.has_work
    assert sched.stats.prefill_tokens == 3 * 20 + 5 * 40  # the decodes' prompts, then one chunk a step
    # No decodes: prefill-only steps of one chunk each.
    times = engine_decode_steps(llm, 0, 20, steps=2, warmup=1, token_range=1000, seed=0, progress=False, chunk=40)
    assert len(times) == 2 and sched.stats.prefill_tokens == 3 * 20 + 8 * 40
    llm.shutdown()


@pytest.mark.timeout(300)
def test_kernel_ab_prompt_attention(tmp_path: Path) -> None:
    """The A/B builds the kernel at a revision and from the working tree, checks their outputs
    against each other and reports a ratio per shape."""
    if cpu_kernels.load() is None or subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                                                   capture_output=True).returncode != 0:
        pytest.skip("needs a C compiler and the git history")
    out = tmp_path / "extend.json"
    subprocess.run([sys.executable, "-m", "minisgl_mp.bench", "kernels", "--kernel", "extend",
                    "--baseline-rev", "HEAD", "--layers", "1", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=280)
    rows = read(out)["rows"]
    assert [(r["prompts"], r["prompt_tokens"]) for r in rows] == [(8, 256), (1, 2048), (1, 512)]
    assert all(r["new_over_old"] > 0 for r in rows)


def test_thread_waits_sleeps_and_preemptions(tmp_path: Path) -> None:
    """The meter's scheduling figures: read per thread from /proc, summed over the threads alive
    at the end, a thread that started meanwhile counted whole."""
    from minisgl_mp.bench import proc_profile

    def write(tid: int, delay_ns: int, sleeps: int, preempted: int) -> None:
        task = tmp_path / "7" / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "schedstat").write_text(f"999 {delay_ns} 5\n")
        (task / "status").write_text(f"Name:\tx\nvoluntary_ctxt_switches:\t{sleeps}\n"
                                     f"nonvoluntary_ctxt_switches:\t{preempted}\n")

    write(7, 1_000_000, 10, 1)
    before = proc_profile.thread_sched(7, tmp_path)
    assert before == {7: (1_000_000, 10, 1)}
    write(7, 3_000_000, 25, 4)
    write(8, 500_000_000, 3, 2)  # an OpenMP worker started during the run
    after = proc_profile.thread_sched(7, tmp_path)
    assert proc_profile.sched_delta(before, after) == {
        "waiting_seconds": 0.502, "sleeps": 18, "preemptions": 5, "threads": 2}
    assert proc_profile.thread_sched(8, tmp_path) == {}  # no such process
    assert proc_profile.sched_delta(before, {}) is None

    meter = proc_profile.ProcessMeter({})
    meter.start()
    time.sleep(0.05)  # one sleep at least, on a kernel that exposes the counts
    used = meter.stop()["processes"]["benchmark client"]
    if "sched" in used:
        assert used["sched"]["sleeps"] >= 1 and used["sched"]["waiting_cores"] >= 0
        line = proc_profile.sched_line({"offline engine": used})
        assert line is not None and line.startswith("  waiting for a core: offline engine ")


def test_one_bench_command_lists_and_runs_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from minisgl_mp.bench.__main__ import SUBCOMMANDS

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    listing = subprocess.run([sys.executable, "-m", "minisgl_mp.bench", "--help"], capture_output=True, text=True,
                             env=env, timeout=60)
    assert listing.returncode == 0, listing.stderr
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in listing.stdout, name
    unknown = subprocess.run([sys.executable, "-m", "minisgl_mp.bench", "no-such-bench"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert unknown.returncode == 2 and "invalid choice: 'no-such-bench'" in unknown.stderr
    for name, sub in SUBCOMMANDS.items():  # each module's own flags, under the one command's name
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"minisgl_mp.bench.{sub.module}").main(["--help"])
        assert done.value.code == 0, name
        assert capsys.readouterr().out.startswith(f"usage: python -m minisgl_mp.bench {name} "), name


def test_spec_bench_answers_equal_plain_decoding(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    assert load_tool("spec").main(["--model", str(tiny_model_dir), "--workloads", "copy,copy-batch,free-batch",
                                   "--num-prompts", "2", "--concurrency", "2", "--max-tokens", "8", "--repeats", "2",
                                   "--no-hf", "--threads", "1", "--out", str(out)]) == 0
    report = read(out)
    for workload in ("copy", "copy-batch", "free-batch"):
        runs = report["results"][workload]
        assert set(runs) == {"plain", "ngram-k4"}
        for r in runs.values():
            assert r["identical"] == r["compared"] > 0 and r["output_tps"] > 0
            assert len(r["runs_output_tps"]) == 2 and r["output_tps"] in r["runs_output_tps"]
        assert report["speedups"][workload]["plain"] == 1.0
