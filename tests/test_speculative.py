"""N-gram speculative decoding (`--speculative-algorithm NGRAM`), as a user would check it: on the
real model, a request that copies its prompt runs fewer steps and says exactly what it says
without speculation, greedy or seeded; stops, limits, logprobs, retraction, chunked prefill and
pages of 16 keep the answers, and so do bfloat16 weights 32 requests at once; requests with
penalties decode without drafts; the server reports the accepted length in usage, meta_info and
/metrics, and an aborted stream leaves no KV behind.
The verification's sampling keeps the model's distribution (a statistical test over seeds)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from hf_reference import torch_threads
from minisgl_mp import LLM, SamplingParams
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.scheduler.req import Req
from minisgl_mp.scheduler.sampler import Sampler
from minisgl_mp.speculative.speculator import NgramSpeculator
from minisgl_mp.client import Client
from server_utils import ServerProcess, launch_server, wait_idle_and_whole

TIMEOUT = 300  # the first test using a module fixture pays for loading the model
PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. "
           "Every night for ninety years its lamp had turned, warning ships away from the rocks below. "
           "The keeper, a quiet man named Thomas, climbed the one hundred and twelve steps at dusk.")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
COPY = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is a list in Python?"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from minisgl_mp.tools.fetch_model import DEFAULT_OUT, fetch

    return fetch(DEFAULT_OUT).parent


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "num_pages": 4096, "max_running_requests": 16}
    return LLM(str(model_dir), **(defaults | kwargs))


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def spec(model_dir: Path) -> LLM:
    return make_llm(model_dir, speculative_algorithm="NGRAM")


def chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [chat_ids(plain, user(COPY))] + [chat_ids(plain, user(q)) for q in QUESTIONS]


def assert_no_leak(llm: LLM) -> None:
    llm.scheduler.check_health()
    s = llm.scheduler.engine_stats()
    assert s["running"] == s["waiting"] == s["protected_tokens"] == 0, s
    assert s["free_tokens"] + s["evictable_tokens"] == s["total_tokens"], f"KV pages leaked: {s}"


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x["text"], x["token_ids"], x["finish_reason"]) == (y["text"], y["token_ids"], y["finish_reason"])


# ---- verification keeps the distribution ------------------------------------------------------

def _chi2_ok(counts: Counter, probs: list[float], n: int) -> bool:
    """Pearson's chi-square against `probs`, at p = 0.001 (a fixed seed set: the test is
    deterministic; the threshold keeps it meaningful)."""
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs) if p > 0)
    dof = sum(p > 0 for p in probs) - 1
    # Wilson-Hilferty: the chi-square quantile for p = 0.001
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


def test_verification_samples_as_plain_decoding_and_keeps_the_distribution() -> None:
    vocab, trials = 6, 4000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2],   # after the last token: p(draft 4) ~ 0.5
                           [0.0, 1.5, 0.3, 0.0, -1.0, 0.4],   # after draft 4: p(draft 1) ~ 0.4
                           [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]])   # after draft 1 (the bonus row)
    probs = torch.softmax(logits, dim=-1)
    draft = [4, 1]
    speculator = NgramSpeculator(2, 1, 4, 64)
    first, second, accepted = Counter(), Counter(), Counter()
    rng = random.Random(0)
    for _ in range(trials):
        sampler = Sampler(vocab, torch.device("cpu"), rows=1)
        req = Req("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=rng.getrandbits(62), max_tokens=8), 64,
                  frozenset())
        req.row = 0
        sampler.bind([req])
        (v,) = speculator.verify(logits, [(req, draft)], sampler)
        # The first token is the one plain decoding samples with this seed, whatever was drafted.
        assert v.tokens[0] == int(sampler.sample(logits[:1], [req]).token_ids[0])
        assert v.tokens[:v.accepted] == draft[:v.accepted] and len(v.tokens) == v.accepted + 1
        first[v.tokens[0]] += 1
        accepted[v.accepted] += 1
        if v.accepted >= 1:
            second[v.tokens[1]] += 1
    assert _chi2_ok(first, probs[0].tolist(), trials), first
    n2 = sum(second.values())
    assert _chi2_ok(second, probs[1].tolist(), n2), second
    p_accept_both = float(probs[0, 4] * probs[1, 1])
    assert abs(accepted[2] / trials - p_accept_both) < 4 * math.sqrt(p_accept_both / trials), accepted


# ---- the real model, offline --------------------------------------------------------------------

@pytest.mark.timeout(TIMEOUT)
def test_greedy_answers_are_unchanged_and_copying_is_drafted(plain: LLM, spec: LLM,
                                                             prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=64, temperature=0)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    same(got, want)
    assert want[0]["text"].startswith(PASSAGE[:40]), want[0]["text"]  # the model copies
    copy_usage = got[0]["usage"]
    assert copy_usage["spec_accept_length"] >= 2.0, copy_usage
    # Fewer steps than tokens: that is where the speed comes from.
    assert copy_usage["spec_verify_ct"] < copy_usage["completion_tokens"] / 2, copy_usage
    for one, ref in zip(prompts[1:], want[1:]):  # one at a time too (batch 1, where drafting pays)
        same(spec.generate(one, params), [ref])
    assert_no_leak(spec)


@pytest.mark.timeout(TIMEOUT)
def test_a_question_asked_again_drafts_from_the_first_answer(plain: LLM, spec: LLM) -> None:
    prompt = chat_ids(plain, user("Describe a walk through a forest in autumn."))
    params = SamplingParams(max_tokens=48, temperature=0)
    (want,) = plain.generate(prompt, params)
    first, second = spec.generate(prompt, params)[0], spec.generate(prompt, params)[0]
    same([first, second], [want, want])
    # The answer copies nothing from its prompt; the second time it copies the first answer.
    assert second["usage"]["spec_accept_length"] >= 3.0, (first["usage"], second["usage"])
    assert second["usage"]["spec_verify_ct"] < first["usage"].get("spec_verify_ct", 0) + 48
    # Flushing the cache forgets finished text too: the third time is the first again.
    spec.scheduler.flush_cache()
    third = spec.generate(prompt, params)[0]
    same([third], [want])
    assert third["usage"].get("spec_accept_length", 0) < second["usage"]["spec_accept_length"], third["usage"]


@pytest.mark.timeout(TIMEOUT)
def test_seeded_sampling_is_unchanged(plain: LLM, spec: LLM, prompts: list[list[int]]) -> None:
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=s) for s in range(4)]
    batch = [prompts[0]] * 2 + prompts[1:3]
    want = plain.generate(batch, params)
    got = spec.generate(batch, params)
    same(got, want)
    same(spec.generate(batch, params), got)
    assert got[0]["usage"].get("spec_verify_ct", 0) > 0


@pytest.mark.timeout(TIMEOUT)
def test_a_mixed_batch_keeps_every_answer_and_seeds_ignore_their_neighbours(plain: LLM, spec: LLM,
                                                                           prompts: list[list[int]]) -> None:
    """What a server's batch holds at once: greedy and seeded requests, top-p beside none, a stop
    string, a bias, log-probabilities and a grammar. Every answer is plain decoding's, and each
    seeded answer is the one its request gets alone: the rest of the batch changes no tokens."""
    copy_code = chat_ids(plain, user(f"Repeat the following text exactly, word for word:\n\n{CODE}"))
    summary = chat_ids(plain, user(f"Summarize:\n\n{CODE}"))
    the = plain.tokenizer.encode(" the", add_special_tokens=False)[-1]
    batch = [
        (prompts[0], SamplingParams(max_tokens=48, temperature=1.0, seed=11)),
        (copy_code, SamplingParams(max_tokens=64, temperature=1.3, seed=12)),
        (summary, SamplingParams(max_tokens=64, temperature=1.0, top_p=0.8, seed=13, logprobs=1)),
        (prompts[1], SamplingParams(max_tokens=48, temperature=1.0, seed=14)),
        (prompts[2], SamplingParams(max_tokens=32, temperature=0.5, top_k=40, seed=15)),
        (copy_code, SamplingParams(max_tokens=48, temperature=0, stop=["def mul"], logprobs=2)),
        (prompts[0], SamplingParams(max_tokens=40, temperature=0, min_tokens=10, logit_bias={the: -100.0})),
        (prompts[3], SamplingParams(max_tokens=32, temperature=0, regex=r"[A-Z][a-z ]{3,40}\.")),
    ]
    ids, params = [b[0] for b in batch], [b[1] for b in batch]
    want = plain.generate(ids, params)
    got = spec.generate(ids, params)
    same(got, want)
    assert got[1]["usage"].get("spec_verify_ct", 0) > 0, got[1]["usage"]
    for (one, p), ref in zip(batch, want):
        if p.seed is not None:
            same(plain.generate(one, p), [ref])
    assert_no_leak(spec)


@pytest.mark.timeout(TIMEOUT)
def test_stops_limits_and_logprobs_are_unchanged(plain: LLM, spec: LLM, prompts: list[list[int]]) -> None:
    copy = prompts[0]
    eos = plain.tokenizer.encode(" lamp", add_special_tokens=False)[-1]
    cases = [
        SamplingParams(max_tokens=64, temperature=0, stop=["ninety years"]),  # cut inside a draft
        SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[eos]),
        SamplingParams(max_tokens=7, temperature=0),  # the limit lands inside a draft
        SamplingParams(max_tokens=64, temperature=0, min_tokens=50, ignore_eos=False),
        SamplingParams(max_tokens=30, temperature=0, logprobs=3),
        SamplingParams(max_tokens=30, temperature=0, logit_bias={eos: -100.0}),
    ]
    for p in cases:
        (want,), (got,) = plain.generate(copy, p), spec.generate(copy, p)
        same([got], [want])
        assert got["matched_stop"] == want["matched_stop"], p
        assert len(got["token_ids"]) <= p.max_tokens
        if p.logprobs is not None:
            for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
                assert abs(a.token_logprob - b.token_logprob) < 1e-3
                assert a.top_ids == b.top_ids
    (stopped,) = spec.generate(copy, cases[0])
    assert stopped["finish_reason"] == "stop" and "ninety years" not in stopped["text"]
    assert_no_leak(spec)


@pytest.mark.timeout(TIMEOUT)
def test_requests_with_penalties_decode_without_drafts(plain: LLM, spec: LLM, prompts: list[list[int]]) -> None:
    p = SamplingParams(max_tokens=32, temperature=0, repetition_penalty=1.3)
    (want,), (got,) = plain.generate(prompts[0], p), spec.generate(prompts[0], p)
    same([got], [want])
    assert "spec_verify_ct" not in got["usage"], got["usage"]


@pytest.mark.timeout(TIMEOUT)
def test_retraction_chunked_prefill_and_pages_of_16_keep_answers(model_dir: Path, plain: LLM) -> None:
    questions = ["Repeat exactly: one two three four five six seven eight nine ten.", *QUESTIONS,
                 "Name three primary colors.", "Who wrote Romeo and Juliet?", "Explain gravity in one sentence."]
    batch = [chat_ids(plain, user(q)) for q in questions]
    params = SamplingParams(max_tokens=48, temperature=0)
    want = plain.generate(batch, params)
    retractions = 0
    # Pools of 112-128 tokens: one answer fits, eight at once do not, so decodes (and drafts) retract.
    for pages in (7, 8):
        small = make_llm(model_dir, speculative_algorithm="NGRAM", page_size=16, num_pages=pages,
                         max_prefill_tokens=16)
        same(small.generate(batch, params), want)
        stats = small.scheduler.engine_stats()
        assert stats["spec_accepted_tokens"] > 0, stats
        retractions += stats["retractions"]
        assert_no_leak(small)
        small.shutdown()
    assert retractions > 0, "no pool forced a retraction"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(not (cpu_kernels.amx_ready() or cpu_kernels.bf16dot_ready()),
                    reason="bfloat16 products take one set of numerics for every batch only on AMX tiles or "
                           "AVX512-BF16 dot products; the widening kernel elsewhere does not")
def test_bfloat16_weights_keep_answers_32_at_once(model_dir: Path) -> None:
    """`--dtype bfloat16` (products on AMX tiles or AVX512-BF16 dot products, x rounded to
    bfloat16): rounding magnifies a last-bit difference in the attention's output, and a
    verification step's query rows used to differ in those bits from the same rows decoded one
    at a time (the kernel scored an extend's last keys in another loop, and split a request's
    keys by its length), so one answer in 32 of `bench spec`'s copy-heavy batch changed. Now
    every row gives the same bits however it is batched, and the answers are the same, in the
    batch and alone."""
    from minisgl_mp.bench.spec import workload_prompts

    plain16 = make_llm(model_dir, dtype="bfloat16", max_running_requests=32)
    spec16 = make_llm(model_dir, dtype="bfloat16", max_running_requests=32, speculative_algorithm="NGRAM")
    batch = workload_prompts(plain16, "copy-batch", 0, 32)
    params = SamplingParams(max_tokens=160, temperature=0)
    want = plain16.generate(batch, params)
    same(spec16.generate(batch, params), want)
    assert spec16.scheduler.engine_stats()["spec_accepted_tokens"] > 0
    same([spec16.generate(batch[1], params)[0]], [want[1]])  # and one alone, with drafts or without
    same([plain16.generate(batch[2], params)[0]], [want[2]])
    assert_no_leak(spec16)
    plain16.shutdown()
    spec16.shutdown()


@pytest.mark.timeout(TIMEOUT)
def test_overlap_scheduling_keeps_answers_and_still_drafts(model_dir: Path, plain: LLM,
                                                           prompts: list[list[int]]) -> None:
    """With overlap scheduling (CUDA's default) a step that drafts waits for the tokens of the
    one before, and the others overlap: greedy and seeded answers are those without either, the
    copying request still drafts, and a pool small enough to retract leaks nothing."""
    greedy = SamplingParams(max_tokens=48, temperature=0)
    seeded = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=s) for s in range(len(prompts))]
    penalized = SamplingParams(max_tokens=24, temperature=0, frequency_penalty=0.5)
    llm = make_llm(model_dir, speculative_algorithm="NGRAM", disable_overlap_schedule=False)
    assert llm.scheduler.overlap
    got = llm.generate(prompts, greedy)
    same(got, plain.generate(prompts, greedy))
    assert got[0]["usage"]["spec_accept_length"] >= 2.0, got[0]["usage"]
    same(llm.generate(prompts, seeded), plain.generate(prompts, seeded))
    # No drafts (penalties): every step overlaps the one before.
    same(llm.generate(prompts[1], penalized), plain.generate(prompts[1], penalized))
    assert_no_leak(llm)
    llm.shutdown()

    # A pool of 128 tokens for eight short answers: decodes and drafts retract.
    questions = ["Repeat exactly: one two three four five six seven eight nine ten.", *QUESTIONS,
                 "Name three primary colors.", "Who wrote Romeo and Juliet?", "Explain gravity in one sentence."]
    batch = [chat_ids(plain, user(q)) for q in questions]
    small = make_llm(model_dir, speculative_algorithm="NGRAM", disable_overlap_schedule=False, page_size=16,
                     num_pages=8, max_prefill_tokens=16)
    same(small.generate(batch, greedy), plain.generate(batch, greedy))
    stats = small.scheduler.engine_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["retractions"] > 0, stats
    assert_no_leak(small)
    small.shutdown()


# ---- the server -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with launch_server(model_dir, "--device", "cpu", "--dtype", "float32", "--num-pages", "4096",
                       "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4") as s:
        yield s


@pytest.mark.timeout(TIMEOUT)
def test_server_reports_acceptance_and_an_aborted_stream_leaves_nothing(server: ServerProcess, plain: LLM,
                                                                        prompts: list[list[int]]) -> None:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    r = client.chat.completions.create(model=server.model, messages=user(COPY), temperature=0, max_tokens=64)
    (want,) = plain.generate(prompts[0], SamplingParams(max_tokens=64, temperature=0))
    assert r.choices[0].message.content == want["text"]
    usage = r.usage.model_dump()
    assert usage["spec_accept_length"] >= 2.0 and usage["spec_verify_ct"] > 0, usage
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=user(COPY), temperature=0, max_tokens=64, stream=True) if c.choices)
    assert streamed == want["text"]

    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as http:
        native = http.post("/generate", json={"input_ids": prompts[0],
                                              "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).json()
        assert native["meta_info"]["spec_verify_ct"] > 0 and native["meta_info"]["spec_accept_length"] > 1
        # An aborted stream: the client goes away after a few chunks.
        stream = client.chat.completions.create(model=server.model, messages=user(COPY), temperature=0,
                                                max_tokens=200, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        with Client(server.zmq, timeout=60) as c:
            wait_idle_and_whole(c)
        metrics = http.get("/metrics").text
    gauge = [line for line in metrics.splitlines() if line.startswith("sglang:spec_accept_length{")]
    assert gauge and float(gauge[0].rsplit(" ", 1)[1]) > 1.0, gauge
    assert "sglang:spec_accept_length_per_request_bucket" in metrics
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("sglang:spec_") and "_total{" in line}
    assert counts["sglang:spec_accepted_tokens_total"] > 0
    assert counts["sglang:spec_draft_tokens_total"] >= counts["sglang:spec_accepted_tokens_total"]


def test_an_unknown_algorithm_is_refused_with_a_reason() -> None:
    from minisgl_mp.engine_config import EngineConfig

    with pytest.raises(ValueError, match="NGRAM"):
        EngineConfig(model="unused", speculative_algorithm="EAGLE")
