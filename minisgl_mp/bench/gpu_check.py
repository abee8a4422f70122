"""The checks of launch/gpu_check.py: the CUDA path, run whenever a GPU is at hand.

Each check returns a JSON-able dict with `ok`; one that raises is recorded with its error and
the others still run. `Sizes` holds the full run's settings (one GPU, under 6 minutes) and a
quick one that runs on the CPU in seconds, so CI exercises every line that is not CUDA-only.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import torch

from minisgl_mp.attention import registry
from minisgl_mp.attention.base import BatchLayout, ForwardMode
from minisgl_mp.bench import decode_floor
from minisgl_mp.bench.checkpoints import BenchModel
from minisgl_mp.bench.hf_baselines import HFStatic, load_hf_model
from minisgl_mp.bench.runs import run_engine, run_workload
from minisgl_mp.bench.workloads import LengthRange, random_workload
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.llm import LLM
from minisgl_mp.sampling_params import SamplingParams


@dataclass(frozen=True)
class Sizes:
    greedy_prompts: int
    greedy_tokens: int
    long_prompt: int  # tokens of the long-context prompt, alone and among short ones
    skew_short: int  # short requests beside it
    throughput_requests: int
    throughput_lens: tuple[int, int]  # input and output lengths drawn from U(lo, hi)
    decode_batches: tuple[int, ...]
    decode_context: int
    hf_requests: int  # the transformers baseline runs the first N requests of the workload


# nano-vllm's published setting: 256 sequences, input and output lengths U(100, 1024).
FULL = Sizes(4, 32, 32768, 255, 256, (100, 1024), (1, 64, 256), 256, 64)
QUICK = Sizes(2, 4, 256, 7, 6, (8, 24), (1, 2), 32, 3)


def engine_kwargs(device: str, dtype: torch.dtype, max_running: int, attention_backend: str = "auto") -> dict[str, Any]:
    """LLM(...) settings; on the CPU a small pool (a GPU sizes its own from free memory)."""
    kwargs: dict[str, Any] = {"device": device, "dtype": str(dtype).split(".")[-1],
                              "max_running_requests": max_running, "attention_backend": attention_backend}
    if device == "cpu":
        kwargs["kv_cache_gb"] = 0.25
    return kwargs


def run_check(name: str, fn: Callable[[], dict[str, Any]], results: dict[str, Any], log: Callable[[str], None]) -> None:
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # a failed check is a result, not the end of the run
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    out["seconds"] = round(time.perf_counter() - start, 2)
    results[name] = out
    log(f"{name}: {'ok' if out.get('ok') else 'FAILED'} ({out['seconds']} s)"
        + ("" if out.get("ok") else f" {out.get('error', '')}"))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy_vs_hf(model: BenchModel, device: str, dtype: torch.dtype, sizes: Sizes, tol: float,
                 seed: int, attention_backend: str = "auto", cuda_fused_ops: bool = True) -> dict[str, Any]:
    """The engine's greedy tokens judged by transformers in float32 on the same weights, teacher
    forced: at each step, how far the chosen token's logit is below the best one (its gap).

    In float32 every gap must be within `tol`. In a 16-bit dtype rounding alone moves logits by
    whole units on random weights (their logits reach ~30, where a bfloat16 step is 0.125 and 28
    layers add up), so the bar is transformers' own run in that dtype on the same tokens: the
    engine's largest gap within 1.5x of its largest (or `tol`), and its mean within 1.5x of its
    mean plus 0.05. A wrong kernel picks tokens many logits below the best and fails both."""
    llm = LLM(model.engine_model, load_format=model.engine_load_format, cuda_fused_ops=cuda_fused_ops,
              **engine_kwargs(device, dtype, 16, attention_backend))
    vocab = llm.scheduler.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (5, 40, 130, 300)[: sizes.greedy_prompts]]
    outs = [o["token_ids"] for o in llm.generate(prompts, _greedy(sizes.greedy_tokens))]
    del llm
    hf = load_hf_model(model, seed, device, progress=False)  # float32: the reference
    seqs = [torch.tensor([p + o[:-1]], device=device) for p, o in zip(prompts, outs)]

    def logits_of(m: Any) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [m(x).logits[0, len(p) - 1 :].float() for x, p in zip(seqs, prompts)]

    ref = logits_of(hf)
    chosen = [torch.tensor(o, device=device) for o in outs]
    gaps = torch.cat([r.max(1).values - r.gather(1, c[:, None])[:, 0] for r, c in zip(ref, chosen)])
    result: dict[str, Any] = {
        "prompt_lens": [len(p) for p in prompts], "tokens_each": sizes.greedy_tokens, "dtype": str(dtype),
        "max_logit_gap": float(gaps.max()), "mean_logit_gap": float(gaps.mean()),
        "top1_agreement": float((gaps == 0).float().mean()),
        "per_prompt_gap": [float(g.max()) for g in gaps.split(sizes.greedy_tokens)],
    }
    if dtype == torch.float32:
        return {"ok": result["max_logit_gap"] <= tol, "tolerance": tol, **result}
    low = logits_of(hf.to(dtype))
    hf_gaps = torch.cat([r.max(1).values - r.gather(1, lo.argmax(1, keepdim=True))[:, 0] for r, lo in zip(ref, low)])
    max_tol = max(tol, 1.5 * float(hf_gaps.max()))
    mean_tol = 1.5 * float(hf_gaps.mean()) + 0.05
    return {"ok": result["max_logit_gap"] <= max_tol and result["mean_logit_gap"] <= mean_tol,
            "tolerance": {"max": max_tol, "mean": mean_tol}, **result,
            "hf_same_dtype": {"max_logit_gap": float(hf_gaps.max()), "mean_logit_gap": float(hf_gaps.mean()),
                              "top1_agreement": float((hf_gaps == 0).float().mean())}}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def backends_vs_sdpa(device: torch.device, dtype: torch.dtype, seed: int, quick: bool = False) -> dict[str, Any]:
    """Every backend that runs here against sdpa on one ragged batch: decodes, a fresh prompt,
    an extend over a prefix; page size 16, Qwen3-0.6B heads (16 q / 8 kv of 128; quick: a
    smaller batch of 4 q / 2 kv heads of 32, for Triton's CPU interpreter)."""
    hq, hkv, d, page = (4, 2, 32, 16) if quick else (16, 8, 128, 16)
    cached, extend = ((40, 0, 9), (1, 20, 5)) if quick else ((300, 0, 77, 1000, 5), (1, 60, 19, 1, 1))
    seq = [c + e for c, e in zip(cached, extend)]
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq]
    pool = KVPool(1, (sum(pages) + 1) * page, hkv, d, dtype, device)
    table = ReqTable(len(seq), max(seq), device)
    order = torch.randperm(sum(pages) + 1, generator=gen).tolist()
    for r, (n, np_) in enumerate(zip(seq, pages)):
        mine, order = order[:np_], order[np_:]
        table.table[r, :n] = torch.cat([torch.arange(p * page, (p + 1) * page) for p in mine])[:n].to(device)
    pool.k.normal_(generator=None)
    pool.v.normal_(generator=None)
    out_loc = torch.cat([table.table[r, c : c + e] for r, (c, e) in enumerate(zip(cached, extend))])
    layout = BatchLayout(ForwardMode.EXTEND, torch.arange(len(seq), device=device), cached, extend, out_loc)
    t = sum(extend)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    outs, errors = {}, {}
    for name in ("sdpa", *[b for b in registry.BACKENDS if b != "sdpa"]):
        if not registry.is_available(name, device, dtype, dtype):
            continue
        backend = registry.create_backend(name, pool, table, hq, hkv, d, dtype)
        outs[name] = backend.forward(q, k, v, 0, backend.prepare(layout)).float()
        if name != "sdpa":
            errors[name] = float((outs[name] - outs["sdpa"]).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return {"ok": all(e <= tol for e in errors.values()), "max_abs_error_vs_sdpa": errors, "tolerance": tol,
            "backends": list(outs)}


def long_context(llm: LLM, sizes: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    """One long prompt alone, then the same among many short ones: both must finish."""
    gen = torch.Generator().manual_seed(seed)
    long = torch.randint(vocab, (sizes.long_prompt,), generator=gen).tolist()
    short = [torch.randint(vocab, (64,), generator=gen).tolist() for _ in range(sizes.skew_short)]
    cuda = torch.cuda.is_available() and llm.scheduler.runner.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    alone = llm.generate([long], _greedy(4))
    alone_s = time.perf_counter() - start
    start = time.perf_counter()
    skewed = llm.generate([long, *short], _greedy(8))
    skewed_s = time.perf_counter() - start
    done = all(len(o["token_ids"]) == 4 for o in alone) and all(len(o["token_ids"]) == 8 for o in skewed)
    return {"ok": done, "prompt_tokens": sizes.long_prompt, "short_requests": sizes.skew_short,
            "alone_s": alone_s, "skewed_batch_s": skewed_s,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def hidden_syncs(llm: LLM, vocab: int, seed: int, steps: int = 10) -> dict[str, Any]:
    """Decode steps that wait for the device only where they mean to: with overlap scheduling the
    one wait a step is for the previous step's tokens (an event, which this does not count).
    Anything else that synchronises (a pageable copy, `.item()`, a boolean mask) would wait for
    the forward in flight and undo the overlap. Counted with PyTorch's sync debug mode over
    `steps` steps of 16 decodes, for greedy, seeded top-p and penalized sampling, and greedy with
    a new 64-token prompt admitted every step (the steps a server runs while requests arrive:
    admission, page-table writes and a prompt chunk beside the decodes, eagerly); a sync in
    every step fails, a one-off (a lazy initialisation) does not. On the CPU nothing is counted."""
    cuda = llm.scheduler.runner.device.type == "cuda"
    configs = {
        "greedy": SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True),
        "top_p_seeded": SamplingParams(max_tokens=steps + 16, temperature=0.8, top_p=0.9, top_k=50, seed=seed,
                                       ignore_eos=True),
        "penalized": SamplingParams(max_tokens=steps + 16, temperature=0.7, frequency_penalty=0.5,
                                    presence_penalty=0.3, repetition_penalty=1.1, min_tokens=steps + 8,
                                    logit_bias=((5, 1.0),), ignore_eos=True),
        "prompt_each_step": SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True),
    }
    arrival = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    sched, gen, counts = llm.scheduler, torch.Generator().manual_seed(seed), {}
    for name, params in configs.items():
        for i in range(16):
            sched.add_request(f"sync-{name}-{i}", torch.randint(vocab, (100,), generator=gen).tolist(), params)
        while sched.waiting or any(not r.is_decoding for r in sched.running):
            sched.step()
        for _ in range(3):
            sched.step()
        where: list[str] = []

        def seen(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
            # Where in the engine: the innermost frame of ours, not torch's own.
            if "synchroniz" in str(message):
                ours = [f for f in traceback.extract_stack()[:-1]
                        if "minisgl_mp" in f.filename and not f.filename.endswith("bench/gpu_check.py")]
                where.append(f"{ours[-1].filename.split('minisgl_mp/')[-1]}:{ours[-1].lineno}" if ours
                             else f"{filename}:{lineno}")

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for k in range(steps):
                    if name == "prompt_each_step":
                        sched.add_request(f"sync-arrival-{k}", torch.randint(vocab, (64,), generator=gen).tolist(),
                                          arrival)
                    sched.step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        counts[name] = {"syncs": len(where), "where": sorted(set(where))}
        while sched.has_work:
            sched.step()
    return {"ok": all(c["syncs"] < steps / 2 for c in counts.values()), "steps_each": steps, "counted": cuda,
            **counts}


def kernels_per_step(model: BenchModel, device: str, dtype: torch.dtype, vocab: int, seed: int, steps: int = 5,
                     attention_backend: str = "auto") -> dict[str, Any]:
    """What one batch-1 decode step launches on the device, with and without `--cuda-fused-ops`:
    kernels (and copies) a step and their summed device time, counted by torch.profiler on the
    eager engine (no CUDA graph, no overlap) so that each launch shows. The launch count is what
    a step costs the host when it is not captured; the device time is what the fused kernels
    save inside a captured graph. On the CPU the fused kernels do not exist: only the plain
    engine's operators are counted (a smoke run of the code)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    rows: dict[str, Any] = {}
    for fused in ((False, True) if cuda else (False,)):
        llm = LLM(model.engine_model, load_format=model.engine_load_format, cuda_fused_ops=fused,
                  disable_cuda_graph=True, disable_overlap_schedule=True,
                  **engine_kwargs(device, dtype, 4, attention_backend))
        sched, gen = llm.scheduler, torch.Generator().manual_seed(seed)
        sched.add_request("kernels", torch.randint(vocab, (100,), generator=gen).tolist(),
                          SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
        while sched.waiting or any(not r.is_decoding for r in sched.running):
            sched.step()
        sched.step()
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                sched.step()
            if cuda:
                torch.cuda.synchronize()
        def counted(e: Any) -> bool:  # kernels and copies on a GPU (not the runtime's calls); operators on the CPU
            if cuda:
                return e.device_type.name == "CUDA" and not e.name.startswith("cuda")
            return e.device_type.name == "CPU" and e.name.startswith("aten::")

        on_device = [e for e in prof.events() if counted(e)]
        by_name: dict[str, int] = {}
        for e in on_device:
            by_name[e.name] = by_name.get(e.name, 0) + 1
        device_us = sum(e.time_range.elapsed_us() for e in on_device) if cuda else 0.0
        rows["fused" if fused else "plain"] = {
            "launches_per_step": len(on_device) / steps, "device_ms_per_step": device_us / steps / 1e3,
            "top": sorted(((n, c / steps) for n, c in by_name.items()), key=lambda t: -t[1])[:12]}
        while sched.has_work:
            sched.step()
        del llm, sched
        gc.collect()
    ok = all(r["launches_per_step"] > 0 for r in rows.values())
    if "fused" in rows:  # the fused kernels replace launches; more would mean they are not taken
        ok = ok and rows["fused"]["launches_per_step"] < rows["plain"]["launches_per_step"]
    return {"ok": ok, "steps": steps, "counted": "device kernels" if cuda else "aten operators", **rows}


def served(model: BenchModel, device: str, dtype: torch.dtype, sizes: Sizes, vocab: int, seed: int,
           attention_backend: str, log_path: Path, streams: int = 64) -> dict[str, Any]:
    """The server users start (`python -m minisgl_mp.launch`: the tokenizer, scheduler and
    detokenizer processes) on this device. Greedy outputs of a few prompts, each sent alone,
    must equal the offline engine's for the same prompt alone (the same kernels on the same
    batch, so the same tokens in any dtype), through the ZMQ client (token ids) and the OpenAI
    API (text). Then out tok/s with `streams` streaming clients on each frontend, beside the
    offline engine on the same requests at most `streams` at a time; and nothing in the
    server's log says a process died or a request raised."""
    from minisgl_mp.bench.runs import EngineRunner
    from minisgl_mp.bench.server_proc import launch_server
    from minisgl_mp.bench.serving_backends import OpenAIBackend, ZmqBackend
    from minisgl_mp.bench.serving_run import run_requests, summarize_run
    from minisgl_mp.client import Client

    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (sizes.greedy_prompts,), generator=gen)]
    lens = LengthRange(*sizes.throughput_lens)
    workload = random_workload(sizes.throughput_requests // 2, lens, lens, vocab, seed)
    kwargs = engine_kwargs(device, dtype, streams, attention_backend)
    llm = LLM(model.engine_model, load_format=model.engine_load_format, **kwargs)
    ref = [llm.generate(p, _greedy(sizes.greedy_tokens))[0] for p in prompts]
    runner = EngineRunner(llm, progress=False)
    runner.warmup(vocab)
    offline = run_workload("offline engine", workload, runner.generate).to_dict()
    pages = llm.scheduler.runner.num_pages
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():  # the server sizes its pool in what this process leaves
        torch.cuda.empty_cache()

    flags = ["--load-format", model.engine_load_format, "--device", device, "--dtype", kwargs["dtype"],
             "--attention-backend", attention_backend, "--num-pages", str(pages),
             "--max-running-requests", str(streams)]
    params = {"max_tokens": sizes.greedy_tokens, "temperature": 0.0, "ignore_eos": True}
    out: dict[str, Any] = {"prompts": len(prompts), "tokens_each": sizes.greedy_tokens, "streams": streams,
                           "requests": workload.num_requests, "offline_output_tps": offline["output_tps"]}
    with launch_server(model.engine_model, flags, log_path) as server:
        with Client(server.zmq, timeout=300) as c:
            zmq_same = [c.generate(input_ids=p, sampling_params=params)["token_ids"] == r["token_ids"]
                        for p, r in zip(prompts, ref)]
            # The same prompts again: from the prefix cache they would run another kernel (an
            # extend over cached keys), whose rounding in 16 bits may tip a near-tie.
            c.admin("flush_cache")
        http_same = []
        for p, r in zip(prompts, ref):
            reply = httpx.post(f"{server.http}/v1/completions", json={"prompt": p, **params}, timeout=300)
            reply.raise_for_status()
            http_same.append(reply.json()["choices"][0]["text"] == r["text"])
        out["zmq_same_tokens"], out["openai_same_text"] = sum(zmq_same), sum(http_same)
        for backend in (ZmqBackend(server.zmq), OpenAIBackend(f"{server.http}/v1", None)):
            async def go(b: Any = backend) -> tuple[list[Any], float]:
                try:
                    return await run_requests(b, workload.single_turn_requests(), math.inf, streams, seed, 600.0,
                                              progress=False)
                finally:
                    await b.close()

            metrics = summarize_run(*asyncio.run(go()))
            out[backend.name] = {k: metrics[k] for k in ("completed", "failed", "output_tps", "ttft_ms", "itl_ms")}
            out[backend.name]["server_over_offline"] = metrics["output_tps"] / offline["output_tps"]
    log = log_path.read_text(encoding="utf-8", errors="replace")
    out["log_clean"] = "Traceback" not in log and "died" not in log
    out["ok"] = (out["zmq_same_tokens"] == out["openai_same_text"] == len(prompts) and out["log_clean"]
                 and all(out[b]["completed"] == workload.num_requests for b in ("zmq", "openai")))
    return out


def overlap_agrees(model: BenchModel, device: str, dtype: torch.dtype, seed: int,
                   attention_backend: str = "auto") -> dict[str, Any]:
    """Greedy, seeded and penalized outputs with overlap scheduling equal those without."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, frequency_penalty=1.0, ignore_eos=True)] * 4
    outs = {}
    for disable in (True, False):
        llm = LLM(model.engine_model, load_format=model.engine_load_format, device=device,
                  dtype=str(dtype).replace("torch.", ""), disable_overlap_schedule=disable, num_pages=4096,
                  attention_backend=attention_backend)
        vocab = llm.scheduler.runner.model_config.vocab_size
        prompts = [torch.randint(vocab, (8 + 5 * i,), generator=torch.Generator().manual_seed(seed + i)).tolist()
                   for i in range(len(params))]
        outs[disable] = [o["token_ids"] for o in llm.generate(prompts, params)]
        del llm
    same = sum(a == b for a, b in zip(outs[True], outs[False]))
    return {"ok": same == len(params), "requests": len(params), "identical": same}


def throughput(llm: LLM, sizes: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    lens = LengthRange(*sizes.throughput_lens)
    workload = random_workload(sizes.throughput_requests, lens, lens, vocab, seed)
    result = run_engine(llm, workload, vocab, progress=False).to_dict()
    return {"ok": True, **result}


def decode_steps(llm: LLM, sizes: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    rows = {}
    for b in sizes.decode_batches:
        times = decode_floor.engine_decode_steps(llm, b, sizes.decode_context, steps=10, warmup=3,
                                                 token_range=vocab, seed=seed, progress=False)
        rows[str(b)] = {"median_ms": 1e3 * sorted(times)[len(times) // 2], "min_ms": 1e3 * min(times)}
    return {"ok": True, "context": sizes.decode_context, "step_ms": rows}


def hf_baseline(model: BenchModel, device: str, dtype: torch.dtype, sizes: Sizes, vocab: int,
                seed: int) -> dict[str, Any]:
    """transformers `generate` on static batches over the first requests of the same workload."""
    lens = LengthRange(*sizes.throughput_lens)
    workload = random_workload(sizes.throughput_requests, lens, lens, vocab, seed).head(sizes.hf_requests)
    hf = load_hf_model(model, seed, device, progress=False).to(dtype)
    static = HFStatic(hf, batch_size=sizes.hf_requests, progress=False)
    return {"ok": True, **run_workload("hf_static", workload, static.generate).to_dict()}


def speculative(model: str, device: str, quick: bool, attention_backend: str = "auto") -> dict[str, Any]:
    """N-gram speculation on the device's defaults (CUDA graphs for decode and verify steps,
    overlap scheduling): greedy answers identical to plain decoding, copy-heavy requests one at a
    time and 16 at once plus free text; seeded sampling identical; out tok/s one request at a
    time with and without it (the real model, so that drafts are accepted as in use). In
    float32: with the triton backend a verify row's attention is a decode row's bit for bit,
    but the matrix products (cuBLAS) and flashinfer's prefill wrapper are not batch-invariant,
    and in 16-bit their roundings could part near-tied greedy choices, which says nothing of
    the verification."""
    from minisgl_mp.bench.spec import timed_generate, workload_prompts

    tokens = 16 if quick else 128
    greedy = SamplingParams(max_tokens=tokens, temperature=0)
    seeded = SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, seed=7)
    out: dict[str, Any] = {"model": model, "max_tokens": tokens}
    answers: dict[bool, dict[str, list[list[int]]]] = {}
    for spec in (False, True):
        kwargs = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4} if spec else {}
        llm = LLM(model, device=device, dtype="float32", max_running_requests=32,
                  attention_backend=attention_backend, **({"kv_cache_gb": 0.25} if device == "cpu" else {}),
                  **kwargs)
        runner = llm.scheduler.runner
        replays = {"verify_graph": 0}
        if runner.verify_graphs is not None:
            replay = runner.verify_graphs.replay

            def counted(*a: Any, _replay: Any = replay) -> torch.Tensor:
                replays["verify_graph"] += 1
                return _replay(*a)
            runner.verify_graphs.replay = counted  # type: ignore[method-assign]
        copy = workload_prompts(llm, "copy", 2 if quick else 8, 1)
        free = workload_prompts(llm, "free", 2 if quick else 8, 1)
        batch = workload_prompts(llm, "copy-batch", 0, 4 if quick else 16)
        one = timed_generate(llm, copy, False, greedy)
        answers[spec] = {
            "copy": one["token_ids"],
            "free": [o["token_ids"] for o in llm.generate(free, greedy)],
            "copy_batch": [o["token_ids"] for o in llm.generate(batch, greedy)],
            "seeded": [o["token_ids"] for o in llm.generate(copy + free, seeded)],
        }
        out["ngram" if spec else "plain"] = {
            "copy_one_at_a_time_out_tps": one["output_tps"], "spec_accept_length": one["spec_accept_length"],
            "overlap": llm.scheduler.overlap, "attention_backend": runner.attention_backend,
            "verify_graph_sizes": list(runner.verify_graphs.sizes) if runner.verify_graphs is not None else [],
            "verify_graph_replays": replays["verify_graph"],
        }
        llm.shutdown()
        del llm
        gc.collect()
    identical = {k: sum(a == b for a, b in zip(answers[False][k], answers[True][k])) for k in answers[False]}
    out["identical"] = identical
    out["requests"] = {k: len(v) for k, v in answers[False].items()}
    out["copy_speedup"] = out["ngram"]["copy_one_at_a_time_out_tps"] / out["plain"]["copy_one_at_a_time_out_tps"]
    graphs_ran = device == "cpu" or out["ngram"]["verify_graph_replays"] > 0
    out["ok"] = identical == out["requests"] and graphs_ran
    return out
