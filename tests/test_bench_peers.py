"""`bench peers` without the peers: an engine option the engine lacks is a skipped variant, a
peer that is not installed is a failed system, and neither sinks the report's other figures."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_tools import load_tool


def test_rejected_engine_option_is_reported_as_skipped(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    peers = load_tool("peers")
    monkeypatch.setitem(peers.ENGINE_VARIANTS, "future", {"dtype": "float32", "no_such_option": "int8"})
    spec = {"model": str(tiny_model_dir), "threads": 1, "seed": 0, "token_range": 100, "requests": [[1, 2, 3]],
            "output_len": 2, "prefill_requests": [[4, 5, 6]], "decode_context": 4, "decode_steps": 1,
            "warmup_steps": 1, "max_num_seqs": 1, "max_model_len": 64, "kv_cache_gib": 1}
    r = peers.engine_run("future", spec, ["decode"], [1], tmp_path, timeout=300)
    assert "error" not in r, r
    assert "no_such_option" in r["skipped"]


def test_report_keeps_figures_when_peers_are_missing(tmp_path: Path, capsys) -> None:
    peers = load_tool("peers")
    spec = {"requests": [[1] * 8] * 2, "output_len": 4, "threads": 2, "decode_context": 8, "decode_steps": 2,
            "warmup_steps": 1}
    results = {
        "engine": {"fixed": {"output_tps": 20.0}, "prefill": {"tps": 100.0},
                   "decode": [{"batch": 1, "step_ms": 50.0}, {"batch": 16, "step_ms": 400.0}]},
        "vllm": peers.vllm_run(spec, ["fixed"], [1], tmp_path / "nowhere", tmp_path, 10),
        "llama-f32": peers.llama_run("f32", tmp_path, spec, ["decode"], [1], tmp_path / "nowhere", tmp_path, 10),
        "llama-f16": {"decode": [{"batch": 1, "step_ms": 25.0}]},
    }
    assert "make bench-peers-setup" in results["vllm"]["error"]
    assert "make bench-peers-setup" in results["llama-f32"]["error"]
    summary = peers.summarize(results, [1, 16])
    assert summary["ratio_to_engine"]["llama-f16"]["decode_b1_ms"] == 0.5
    assert summary["ratio_to_engine"]["llama-f16"]["fixed_output_tps"] is None
    assert summary["ratio_to_engine"]["engine"]["decode_b16_ms"] == 1.0
    peers.print_table(summary, results)
    out = capsys.readouterr().out
    assert "vllm: failed" in out and "25.00 (0.50x)" in out
    json.dumps(summary)  # the report is written as JSON


def test_fma_ceiling_puts_each_system_against_the_workloads_flop_floor(capsys) -> None:
    """Each system's fixed and prefill time over the FLOPs of the work at the FMA ceiling
    measured before it, and what 1.2x vLLM's fixed workload would ask of the engine."""
    peers = load_tool("peers")
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}
    args = peers.build_parser().parse_args(["--num-prompts", "2", "--input-len", "8", "--output-len", "4"])
    fixed = peers.decode_floor.workload_flops(cfg, 2, 8, 4)
    total = sum(fixed.values())
    results = {"engine": {"fixed": {"seconds": 2 * total / 1e9}, "fma_peak_gflops": 1.0},
               "vllm": {"fixed": {"seconds": 3 * total / 1e9}, "prefill": {"seconds": 1.0}, "fma_peak_gflops": 1.0},
               "llama-f32": {"fixed": {"seconds": 1.0}}}  # no ceiling measured (reused from an old report)
    ceiling = peers.fma_ceiling(cfg, args, results)
    assert ceiling["systems"]["engine"]["fixed_over_floor"] == 2.0
    assert ceiling["systems"]["engine"]["prefill_over_floor"] is None
    assert ceiling["systems"]["vllm"]["fixed_over_floor"] == 3.0 and "llama-f32" not in ceiling["systems"]
    assert abs(ceiling["fixed_1_2x_vllm_needs_engine_over_floor"] - 2.5) < 1e-9
    summary = peers.summarize(results, [], ceiling)
    peers.print_table(summary, results)
    assert "1.2x vLLM's fixed workload needs the engine at 2.50x its FLOP floor" in capsys.readouterr().out
    # A mixture of experts is not described by the dense FLOP model: no ceiling, no failure.
    assert peers.fma_ceiling({**cfg, "num_experts": 8}, args, results) is None
    json.dumps(summary)
