"""launch/gpu_check.py's CPU smoke run: every check that is not CUDA-only runs at toy sizes and
the JSON report says each passed (the CUDA-only parts, graph capture and replay, need a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_run_writes_a_passing_report(tiny_model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (the script's main), not a subprocess: the imports are already paid for.
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "launch/gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gpu_check.json"
    rc = script.main(["--device", "cpu", "--quick", "--small-model", str(tiny_model_dir),
                      "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert {"greedy_vs_hf_small", "backends_vs_sdpa", "long_context", "throughput_eager",
            "decode_steps_eager", "hf_generate_baseline", "overlap_agrees", "hidden_syncs", "kernels_per_step",
            "served", "speculative"} <= set(checks)
    assert all(c["ok"] for c in checks.values())
    assert checks["overlap_agrees"]["identical"] == checks["overlap_agrees"]["requests"]
    assert checks["speculative"]["identical"] == checks["speculative"]["requests"]
    assert checks["greedy_vs_hf_small"]["max_logit_gap"] <= checks["greedy_vs_hf_small"]["tolerance"]
    assert "cpu" in checks["backends_vs_sdpa"]["backends"] or "sdpa" in checks["backends_vs_sdpa"]["backends"]
    assert checks["throughput_eager"]["output_tokens"] > 0
    # The launched server gave the offline engine's greedy outputs on both frontends.
    served = checks["served"]
    assert served["zmq_same_tokens"] == served["openai_same_text"] == served["prompts"] > 0
    assert served["zmq"]["completed"] == served["openai"]["completed"] == served["requests"]

