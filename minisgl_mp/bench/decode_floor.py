"""How close one engine decode step comes to the cost of its matrix products.

Three figures per batch size B, all float32 on this machine, measured in the same run:
- the engine's decode step: `scheduler.step()` with exactly B requests decoding at a given
  context (checked on every timed step: B outputs of one token, B decode tokens, no prefill);
- a bare chain of the same products on the engine's own weights: per layer qkv, o, gate_up and
  down with the engine's fused shapes, then the LM head, on a [B, in] input, nothing else;
  once through the engine's Linear forward (prepacked oneDNN when on), once via F.linear;
- the raw floors: weight bytes / measured read bandwidth, and FLOPs / measured matmul FLOP/s.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.llm import LLM
from minisgl_mp.sampling_params import SamplingParams


def best_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure_bandwidth(mib: int = 512, reps: int = 5) -> dict[str, float]:
    """GB/s reading a tensor far larger than the caches (sum), and copying it (read + write)."""
    n = mib * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    read = min(best_seconds(lambda: x.sum(), reps))
    copy = min(best_seconds(lambda: y.copy_(x), reps))
    return {"tensor_mib": mib, "read_gbps": x.nbytes / read / 1e9, "copy_gbps": 2 * x.nbytes / copy / 1e9}


def measure_matmul(n: int = 2048, reps: int = 5) -> dict[str, float | None]:
    """GFLOP/s of an n x n float32 product, and the machine's FMA ceiling measured right after
    (kernels/csrc/fma_peak.c: register-only FMA chains on every thread; None without the C
    kernels): the product's share of it says how much faster any kernel could go."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = min(best_seconds(lambda: a @ b, reps))
    gflops = 2 * n**3 / t / 1e9
    peak = cpu_kernels.fma_peak_gflops()
    return {"matmul_n": n, "gflops": gflops, "fma_peak_gflops": peak,
            "matmul_share_of_peak": None if not peak else gflops / peak}


def chains(model: torch.nn.Module, batch: int) -> tuple[Callable[[], None], Callable[[], None] | None, int, int,
                                                        Callable[[], None] | None]:
    """(engine-Linear chain, F.linear chain, weight bytes, FLOPs, oneDNN chain) for one decode
    step's products: each Linear of each layer, then the LM head, on a batch of `batch` rows.
    The weight bytes are those stored (int8 with its scales, int4 blocks). The F.linear chain
    needs float32 weights (None for the stored formats); the oneDNN chain runs on its prepacked weights
    alone (None when the Linears hold no oneDNN copy): the path the engine took for decode
    batches before the packed-panel kernel."""
    linears = []
    for layer in model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    linears.append(model.lm_head)
    inputs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}  # x: [B, in]
    pairs = [(m, inputs[m.in_features]) for m in linears]

    @torch.inference_mode()
    def through_engine() -> None:
        for m, x in pairs:
            m(x)

    @torch.inference_mode()
    def through_f_linear() -> None:
        for m, x in pairs:
            F.linear(x, m.weight)

    @torch.inference_mode()
    def through_onednn() -> None:
        for m, x in pairs:
            torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, m.bias, "none", [], "")

    def stored_bytes(m: torch.nn.Module) -> int:
        scale = getattr(m, "weight_scale", None)
        return m.weight.numel() * m.weight.element_size() + (0 if scale is None else scale.numel() * 4)

    weight_bytes = sum(stored_bytes(m) for m in linears)
    flops = 2 * batch * sum(m.in_features * m.out_features for m in linears)
    f_linear = through_f_linear if all(m.weight.dtype == torch.float32 for m in linears) else None
    onednn = through_onednn if all(m.packed_weight is not None for m in linears) else None
    return through_engine, f_linear, weight_bytes, flops, onednn


def engine_decode_steps(llm: LLM, batch: int, context: int, steps: int, warmup: int,
                        token_range: int, seed: int, progress: bool = True, chunk: int = 0) -> list[float]:
    """Seconds of each of `steps` scheduler steps with exactly `batch` requests decoding.
    `chunk` > 0: each timed (and warm-up) step also prefills a fresh `chunk`-token prompt of one
    output token beside them, a mixed step as a serving engine runs when a request arrives."""
    sched = llm.scheduler
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rids = [f"floor-{batch}-{i}" for i in range(batch)]
    for rid in rids:
        sched.add_request(rid, torch.randint(token_range, (context,), generator=gen).tolist(), params)
    # The prompts go in together, in as few steps as memory allows, not at the pace the
    # mixed-step budget or the prefill chunk sets beside decodes: requests that start decoding
    # steps apart would finish steps apart, and the timed steps would not all be `batch` decodes.
    budget = sched.prefill_budget
    ratio, budget.ratio = budget.ratio, None
    max_tokens, budget.max_tokens = budget.max_tokens, max(budget.max_tokens, batch * context, chunk)
    arrivals = iter(range(warmup + steps))

    def arrive() -> None:
        if chunk:
            sched.add_request(f"floor-chunk-{batch}-{next(arrivals)}",
                              torch.randint(token_range, (chunk,), generator=gen).tolist(), once)

    try:
        while sched.waiting or any(not r.is_decoding for r in sched.running):
            sched.step()
        for _ in range(warmup):
            arrive()
            sched.step()
        times = []
        what = f"engine {'mixed' if chunk else 'decode'} B={batch}" + (f" + {chunk}" if chunk else "")
        for _ in tqdm(range(steps), desc=what, disable=not progress, leave=False):
            arrive()
            before = sched.stats.decode_tokens, sched.stats.prefill_tokens
            start = time.perf_counter()
            outs = sched.step()
            times.append(time.perf_counter() - start)
            decoded, prefilled = sched.stats.decode_tokens - before[0], sched.stats.prefill_tokens - before[1]
            if (len(outs) != batch + bool(chunk) or decoded != batch or prefilled != chunk
                    or any(len(o.new_token_ids) != 1 for o in outs)):
                raise RuntimeError(
                    f"a timed step was not {batch} decodes beside {chunk} prompt tokens: {len(outs)} outputs, "
                    f"{decoded} decode and {prefilled} prefill tokens (retracted? give the KV pool more pages)")
        return times
    finally:
        budget.ratio, budget.max_tokens = ratio, max_tokens
        for rid in rids:
            sched.abort(rid)
        while sched.has_work:
            sched.step()
        sched.flush_cache()


def measure(llm: LLM, batch_sizes: list[int], context: int, steps: int, warmup: int, chain_reps: int,
            token_range: int, seed: int, bandwidth: dict[str, float], matmul: dict[str, float],
            progress: bool = True) -> list[dict[str, Any]]:
    model = llm.scheduler.runner.model
    rows = []
    for b in batch_sizes:
        step = engine_decode_steps(llm, b, context, steps, warmup, token_range, seed, progress)
        via_engine, via_f, weight_bytes, flops, via_onednn = chains(model, b)
        chain_engine = best_seconds(via_engine, chain_reps)
        chain_f = best_seconds(via_f, chain_reps) if via_f is not None else None
        chain_onednn = best_seconds(via_onednn, chain_reps) if via_onednn is not None else None
        bw_floor = weight_bytes / (bandwidth["read_gbps"] * 1e9)
        flop_floor = flops / (matmul["gflops"] * 1e9)
        step_s = statistics.median(step)
        row = {
            "batch": b, "context_start": context + 1 + warmup, "context_end": context + warmup + steps,
            "step_ms": {"median": step_s * 1e3, "mean": statistics.fmean(step) * 1e3, "min": min(step) * 1e3},
            "chain_engine_linear_ms": statistics.median(chain_engine) * 1e3,
            "chain_f_linear_ms": statistics.median(chain_f) * 1e3 if chain_f else None,
            "chain_onednn_ms": statistics.median(chain_onednn) * 1e3 if chain_onednn else None,
            "weight_bytes": weight_bytes, "flops": flops,
            "floor_bandwidth_ms": bw_floor * 1e3, "floor_flops_ms": flop_floor * 1e3,
            "floor_ms": max(bw_floor, flop_floor) * 1e3,
            "decode_tps": b / step_s,
        }
        row["ratios"] = {
            "step_over_chain_engine_linear": step_s * 1e3 / row["chain_engine_linear_ms"],
            "step_over_chain_f_linear": step_s * 1e3 / row["chain_f_linear_ms"] if chain_f else None,
            "step_over_floor_bandwidth": step_s / bw_floor,
            "step_over_floor_flops": step_s / flop_floor,
            "step_over_floor": step_s * 1e3 / row["floor_ms"],
        }
        rows.append(row)
    return rows


def prefill_flops(model: torch.nn.Module, prompt_len: int) -> dict[str, int]:
    """Matrix-product FLOPs of prefilling one `prompt_len`-token prompt: every layer's products
    on all its tokens, causal attention (QK^T and PV over the lower triangle), and the LM head
    on the last token only (the one sampled)."""
    per_token = sum(m.weight.numel() for layer in model.layers
                    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                              layer.mlp.gate_up_proj, layer.mlp.down_proj))
    attn = model.layers[0].self_attn
    heads, head_dim = attn.num_heads, attn.head_dim
    pairs = prompt_len * (prompt_len + 1) // 2  # (query, key) pairs under the causal mask
    return {"linear": 2 * prompt_len * per_token,
            "attention": len(model.layers) * 2 * 2 * heads * head_dim * pairs,
            "lm_head": 2 * model.lm_head.weight.numel()}


def workload_flops(config: dict[str, Any], prompts: int, input_len: int, output_len: int) -> dict[str, int] | None:
    """Matrix-product FLOPs of `prompts` requests of `input_len` prompt tokens and `output_len`
    generated tokens on a dense decoder described by its Hugging Face config: every layer's
    products on every token (the last output token is never fed back), causal attention (QK^T
    and PV over the keys each query sees) and the LM head once per output token. The same
    work for every engine, whatever its kernels: over a machine's FMA ceiling it is the time
    no engine can beat. None for configs it does not describe (mixtures of experts)."""
    try:
        hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
        heads, vocab = config["num_attention_heads"], config["vocab_size"]
    except KeyError:
        return None
    if config.get("num_experts") or config.get("num_local_experts"):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token = layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    fed = input_len + output_len - 1  # tokens that go through the layers, per request
    # Query at position i (0-based) sees i + 1 keys: sum over the fed positions.
    pairs = fed * (fed + 1) // 2
    return {"linear": 2 * prompts * fed * per_token,
            "attention": prompts * layers * 2 * 2 * heads * head_dim * pairs,
            "lm_head": 2 * prompts * output_len * vocab * hidden}


def engine_prefill(llm: LLM, prompt_len: int, reps: int, token_range: int, seed: int) -> list[float]:
    """Seconds the scheduler takes to prefill one `prompt_len`-token prompt from nothing (one
    step: the prefill budget must hold the prompt) and sample its first token; the prefix
    cache is flushed between runs so nothing is reused."""
    sched = llm.scheduler
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(reps + 1):  # the first run is untimed: first-touch costs
        sched.add_request(f"prefill-{i}", torch.randint(token_range, (prompt_len,), generator=gen).tolist(), params)
        start = time.perf_counter()
        steps = 0
        while sched.has_work:
            sched.step()
            steps += 1
        elapsed = time.perf_counter() - start
        if sched.stats.prefill_tokens == 0 or steps != 1:
            raise RuntimeError(f"the {prompt_len}-token prefill took {steps} steps: raise --max-prefill-tokens")
        sched.flush_cache()
        if i:
            times.append(elapsed)
    return times


def measure_prefill(llm: LLM, prompt_len: int, reps: int, token_range: int, seed: int,
                    matmul: dict[str, float]) -> dict[str, Any]:
    """A long prompt's prefill against its FLOPs at the machine's measured matmul rate, and
    against the bare chain of its products on [prompt_len, in] inputs."""
    model = llm.scheduler.runner.model
    times = engine_prefill(llm, prompt_len, reps, token_range, seed)
    flops = prefill_flops(model, prompt_len)
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    inputs = {m.in_features: torch.randn(prompt_len, m.in_features) for m in linears}

    @torch.inference_mode()
    def layer_products() -> None:  # the prefill's products alone, through the engine's Linear
        for m in linears:
            m(inputs[m.in_features])

    chain_s = statistics.median(best_seconds(layer_products, max(2, reps), warmup=1))
    total = sum(flops.values())
    step_s = statistics.median(times)
    floor_s = total / (matmul["gflops"] * 1e9)
    peak = matmul.get("fma_peak_gflops")
    return {
        "prompt_len": prompt_len, "runs": len(times),
        "prefill_ms": {"median": step_s * 1e3, "min": min(times) * 1e3},
        "prefill_tps": prompt_len / step_s,
        "flops": flops, "gflops_achieved": total / step_s / 1e9,
        "floor_flops_ms": floor_s * 1e3,
        "chain_layer_products_ms": chain_s * 1e3,
        "attention_share_of_flops": flops["attention"] / total,
        # The products' GFLOP/s over the FMA ceiling: how much a faster kernel could still win.
        "layer_products_share_of_fma_peak": (flops["linear"] / chain_s / 1e9 / peak) if peak else None,
        "ratios": {"prefill_over_floor_flops": step_s / floor_s,
                   "layer_products_over_their_floor": chain_s / (flops["linear"] / (matmul["gflops"] * 1e9)),
                   "prefill_over_layer_products": step_s / chain_s},
    }
