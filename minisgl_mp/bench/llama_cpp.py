"""llama.cpp as a peer: its GGUF file for each weight type, llama-batched-bench for the fixed,
prefill and batched decode figures, llama-bench for batch 1 (the binaries that
`make bench-peers-setup` builds under .peers/llama-build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "peer_workers"  # run as scripts, in their own processes


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Runs cmd with its output in `log`; (exit status or None on timeout, the log's tail)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        try:
            rc: int | None = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                                            env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return rc, log.read_text(encoding="utf-8", errors="replace")[-1500:]


def gguf_type(file: Path) -> str:
    """A GGUF file's weight type as convert_hf_to_gguf names it (f32, q8_0, q4_1, ...)."""
    from gguf import GGUFReader, LlamaFileType

    ft = GGUFReader(str(file)).fields["general.file_type"].contents()
    return LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def gguf_file(model_dir: Path, gtype: str, peers: Path, timeout: float,
              source: Path | None = None) -> tuple[Path | None, str | None]:
    """The GGUF file llama.cpp runs: the model's own (`source`) when it is of that type, else
    one converted from the float32 checkpoint by llama.cpp's converter."""
    if source is not None and gguf_type(source) == gtype:
        return source, None
    if gtype.startswith("q4_"):
        return None, f"{gtype}: only the model's own GGUF file is run at that type (the converter writes none)"
    out = peers / "gguf" / f"{model_dir.name}-{gtype}.gguf"
    if out.exists():
        return out, None
    tmp = out.with_name(out.name + ".part")
    rc, tail = run_logged([sys.executable, str(WORKERS / "convert_gguf.py"), str(peers / "llama.cpp"),
                           str(model_dir), "--outtype", gtype, "--outfile", str(tmp)],
                          peers / "gguf" / f"{out.stem}.log", timeout)
    if rc != 0:
        return None, f"convert_hf_to_gguf ({'timed out' if rc is None else f'exit {rc}'}): ...{tail[-600:]}"
    os.replace(tmp, out)
    return out, None


def batched_bench(binary: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: list[int], log: Path,
                  timeout: float) -> list[dict[str, Any]]:
    cmd = [str(binary), "-m", str(gguf), "-c", str(max(npl) * (npp + ntg) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-t", str(threads),
           "-tb", str(threads), "--output-format", "jsonl"]
    rc, _ = run_logged(cmd, log, timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {'timed out' if rc is None else f'exit {rc}'}: ...{text[-600:]}")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"speed_tg"' in line]


def llama_bench(binary: Path, gguf: Path, threads: int, n_gen: int, depth: int, log: Path,
                timeout: float) -> dict[str, Any]:
    """llama-bench's batch-1 generation (tg) after `depth` cached tokens (the context the other
    systems' decode step is timed at, rather than llama-bench's default of an empty cache): its
    mean tokens per second over its repetitions."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", str(depth), "-t", str(threads), "-r", "3",
           "-o", "jsonl"]
    rc, _ = run_logged(cmd, log, timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {'timed out' if rc is None else f'exit {rc}'}: ...{text[-600:]}")
    row = next(json.loads(line) for line in text.splitlines() if line.startswith("{") and '"avg_ts"' in line)
    return {"n_gen": row["n_gen"], "tok_s": row["avg_ts"], "step_ms": 1e3 / row["avg_ts"], "llama_bench": row}


def llama_run(gtype: str, model_dir: Path, spec: dict[str, Any], measures: list[str], batches: list[int],
              peers: Path, work: Path, timeout: float, source: Path | None = None) -> dict[str, Any]:
    binary = peers / "llama-build/bin/llama-batched-bench"
    if not binary.exists():
        return {"error": f"{binary} missing: run `make bench-peers-setup` (or minisgl_mp/bench/peer_workers/setup_llama_cpp.sh)"}
    start = time.perf_counter()
    gguf, why = gguf_file(model_dir, gtype, peers, timeout, source)
    if gguf is None:
        return {"error": why}
    src = sorted(peers.glob("src/llama_cpp_python-*/"))
    result: dict[str, Any] = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                              "source": src[-1].name if src else None, "kv_cache": "f16 (llama.cpp default)"}
    n, inp, out, t = len(spec["requests"]), len(spec["requests"][0]), spec["output_len"], spec["threads"]
    try:
        if "fixed" in measures or "prefill" in measures:
            row = batched_bench(binary, gguf, t, inp, out, [n], work / f"llama-{gtype}-fixed.log", timeout)[0]
            if "fixed" in measures:
                result["fixed"] = {"seconds": row["t"], "output_tokens": n * out, "input_tokens": n * inp,
                                   "output_tps": n * out / row["t"], "batched_bench": row}
            if "prefill" in measures:
                result["prefill"] = {"seconds": row["t_pp"], "tokens": n * inp, "tps": row["speed_pp"]}
        if "decode" in measures:
            steps = spec["warmup_steps"] + spec["decode_steps"]
            rows = batched_bench(binary, gguf, t, spec["decode_context"], steps, batches,
                                 work / f"llama-{gtype}-decode.log", timeout)
            result["decode"] = [{"batch": r["pl"], "step_ms": 1e3 * r["t_tg"] / r["tg"], "steps": r["tg"],
                                 "batched_bench": r} for r in rows]
            bench = peers / "llama-build/bin/llama-bench"
            if 1 in batches and bench.exists():
                result["batch1_llama_bench"] = llama_bench(bench, gguf, t, 128, spec["decode_context"],
                                                           work / f"llama-{gtype}-bench.log", timeout)
    except (RuntimeError, IndexError, json.JSONDecodeError) as e:
        result["error"] = str(e)
    result["wall_s"] = time.perf_counter() - start
    return result
