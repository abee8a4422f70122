"""The default model, SmolLM2-135M-Instruct (a real trained model: Q4_1 GGUF dequantized to
float32), as a user meets it. Its greedy chat answers and logprobs are transformers' on the same
file; the facts come out right; retraction, chunked prefill, pages of 16, the radix cache and
streaming leave the answers unchanged; seeded n=4 sampling repeats; a JSON schema answer
validates and says something; stop strings cut where they should.

One offline engine, one transformers model and one server serve the whole module (each takes
15-30 s to load on 2 cores).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from hf_reference import hf_logits, torch_threads
from minisgl_mp import LLM, SamplingParams
from server_utils import ServerProcess, launch_server

TIMEOUT = 300  # pytest-timeout counts the module fixtures' loading in the first test that uses them
MAX_TOKENS = 24
TOL = 1e-3  # logprobs against transformers' (measured: ~2e-5)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.",
    "What is a list in Python?",
    "Explain gravity in one sentence.",
]
# (question, a word its answer must contain)
FACTS = [("What is the capital of France?", "Paris"), ("Who wrote Romeo and Juliet?", "Shakespeare"),
         ("What is 2 + 2?", "4")]
Messages = list[dict[str, str]]
Outputs = list[dict[str, Any]]  # what LLM.generate returns


def user(question: str) -> Messages:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="session")
def model_file() -> Path:
    """The GGUF file, fetched once (`make model` does the same) while a lock keeps concurrent
    pytest runs from fetching it twice; fetch() renames into place, so no reader sees half a file."""
    from filelock import FileLock

    from minisgl_mp.tools.fetch_model import DEFAULT_OUT, fetch

    DEFAULT_OUT.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DEFAULT_OUT.parent / f".{DEFAULT_OUT.name}.lock")):
        return fetch(DEFAULT_OUT)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def make_llm(model_file: Path, **kwargs: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "num_pages": 4096, "max_running_requests": 16}
    return LLM(str(model_file.parent), **(defaults | kwargs))


@pytest.fixture(scope="module")
def llm(model_file: Path) -> LLM:
    return make_llm(model_file)


@pytest.fixture(scope="module")
def hf(model_file: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                dtype=torch.float32).eval()


def chat_ids(llm: LLM, messages: Messages) -> list[int]:
    """The prompt as the server builds it: the model's chat template, then its tokenizer."""
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [chat_ids(llm, user(q)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy(llm: LLM, prompts: list[list[int]]) -> Outputs:
    """The engine's greedy answers to QUESTIONS, run as one batch, with the top-5 logprobs."""
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=5))


def answer(greedy: Outputs, question: str) -> str:
    return greedy[QUESTIONS.index(question)]["text"]


def assert_no_leak(llm: LLM) -> None:
    llm.scheduler.check_health()
    s = llm.scheduler.engine_stats()
    assert s["running"] == s["waiting"] == s["protected_tokens"] == 0, s
    assert s["free_tokens"] + s["evictable_tokens"] == s["total_tokens"], f"KV pages leaked: {s}"


# ---- the offline engine against transformers -----------------------------------------------------

@pytest.mark.timeout(TIMEOUT)
def test_greedy_chat_answers_equal_transformers(hf: torch.nn.Module, prompts: list[list[int]],
                                                greedy: Outputs, llm: LLM) -> None:
    # Some answers end at <|im_end|> within MAX_TOKENS, some run to the limit: both ends are covered.
    assert {o["finish_reason"] for o in greedy} == {"stop", "length"}
    for question, prompt, out in zip(QUESTIONS, prompts, greedy):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert out["token_ids"] == ref, (
            f"{question!r}: engine said {out['text']!r}, transformers "
            f"{llm.tokenizer.decode(ref, skip_special_tokens=True)!r}")
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
        assert out["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("question", "word"), FACTS, ids=[w for _, w in FACTS])
def test_factual_answer_names_the_fact(greedy: Outputs, question: str, word: str) -> None:
    assert word in answer(greedy, question)


@pytest.mark.timeout(TIMEOUT)
def test_logprobs_equal_transformers(hf: torch.nn.Module, prompts: list[list[int]], greedy: Outputs) -> None:
    for question, prompt, out in zip(QUESTIONS, prompts, greedy):
        ids = out["token_ids"]
        # Teacher-forced: transformers' log-softmax at each step the engine sampled.
        ref = torch.log_softmax(hf_logits(hf, prompt + ids[:-1])[len(prompt) - 1:], dim=-1)
        assert len(out["logprobs"]) == len(ids)
        for t, (lp, token) in enumerate(zip(out["logprobs"], ids)):
            where = f"{question!r} step {t}"
            assert abs(lp.token_logprob - float(ref[t, token])) < TOL, where
            hf_top = ref[t].topk(5)
            assert torch.allclose(torch.tensor(lp.top_logprobs), hf_top.values, atol=TOL), where
            assert lp.top_ids[0] == token, where  # greedy: the sampled token is the best one
            for i, tid in enumerate(lp.top_ids):  # the same ids, up to order within near-ties
                assert float(ref[t, tid]) == pytest.approx(float(hf_top.values[i]), abs=TOL), where


@pytest.mark.timeout(TIMEOUT)
def test_retraction_chunked_prefill_and_pages_of_16_keep_answers(model_file: Path, prompts: list[list[int]],
                                                                 greedy: Outputs) -> None:
    page_size = 16
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_pages = -(-longest // page_size) + 2  # the longest request fits, with little room beside it
    small = make_llm(model_file, page_size=page_size, num_pages=num_pages, max_prefill_tokens=16)
    outs = small.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    stats = small.scheduler.engine_stats()
    assert stats["retractions"] > 0, f"a {num_pages * page_size}-token pool did not force retraction: {stats}"
    # Every prompt (35-39 tokens, ~20 of them the shared system prompt) went in 16-token chunks.
    assert stats["max_prefill_tokens"] == 16 and stats["prefill_tokens"] > 16 * len(prompts), stats
    for question, out, ref in zip(QUESTIONS, outs, greedy):
        assert (out["text"], out["token_ids"]) == (ref["text"], ref["token_ids"]), question
        assert out["finish_reason"] == ref["finish_reason"]
    assert_no_leak(small)


# (stop strings, the one that matches first) for "The primary colors are: Red, Blue, and Yellow."
STOPS = [
    (("Blue",), "Blue"),  # a whole word
    (("ellow",), "ellow"),  # inside a token
    ((", and",), ", and"),  # across tokens
    (("Yellow", "Red"), "Red"),  # the earlier of two wins, whatever their order in the list
]


@pytest.mark.timeout(TIMEOUT)
def test_stop_strings_cut_right_before_the_stop(llm: LLM, greedy: Outputs) -> None:
    question = "Name three primary colors."
    full = answer(greedy, question)
    assert greedy[QUESTIONS.index(question)]["finish_reason"] == "stop"  # unstopped, it ends at <|im_end|>
    prompt = chat_ids(llm, user(question))
    for stop, matched in STOPS:
        assert matched in full, f"{matched!r} is not in the unstopped answer {full!r}"
        out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=stop))[0]
        assert out["finish_reason"] == "stop" and out["matched_stop"] == matched, (stop, out)
        assert out["text"] == full[:full.index(matched)], stop


# ---- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_file: Path) -> Iterator[ServerProcess]:
    # On the CPU in float32 like the offline engine, whose answers it must give.
    with launch_server(model_file.parent, "--device", "cpu", "--dtype", "float32", "--num-pages", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def chat(client: openai.OpenAI, server: ServerProcess, messages: Messages, **kwargs: Any) -> Any:
    """A chat completion, greedy and MAX_TOKENS long unless `kwargs` say otherwise."""
    params = {"temperature": 0, "max_tokens": MAX_TOKENS} | kwargs
    return client.chat.completions.create(model=server.model, messages=messages, **params)


@pytest.mark.timeout(TIMEOUT)
def test_server_stream_equals_non_stream_and_the_offline_answer(client: openai.OpenAI, server: ServerProcess,
                                                                greedy: Outputs) -> None:
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        whole = chat(client, server, user(question)).choices[0]
        chunks = list(chat(client, server, user(question), stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.message.content == answer(greedy, question)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [whole.finish_reason]


@pytest.mark.timeout(TIMEOUT)
def test_second_turn_hits_the_cache_and_answers_as_cold(client: openai.OpenAI, server: ServerProcess) -> None:
    first_turn = user("What is a list in Python?")
    first = chat(client, server, first_turn)
    second_turn = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "And a tuple?"}]
    warm = chat(client, server, second_turn)
    assert warm.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens, warm.usage

    with httpx.Client(base_url=server.http, timeout=TIMEOUT) as http:
        deadline = time.monotonic() + 30
        while (r := http.post("/flush_cache")).status_code != 200:  # refused while a request still runs
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
    cold = chat(client, server, second_turn)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, cold.usage
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert "tuple" in cold.choices[0].message.content.lower()


@pytest.mark.timeout(TIMEOUT)
def test_seeded_n4_sampling_repeats(client: openai.OpenAI, server: ServerProcess) -> None:
    def sample() -> list[str]:
        r = chat(client, server, user("Tell me a short story about a cat."), temperature=0.8, seed=1234, n=4,
                 max_tokens=16)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        return [c.message.content for c in r.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1, f"4 samples at temperature 0.8, all the same: {first}"
    assert all(text.strip() for text in first)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.mark.timeout(TIMEOUT)
def test_json_schema_answer_validates_and_says_something(client: openai.OpenAI, server: ServerProcess) -> None:
    r = chat(client, server, user("What is the capital of France? Answer in JSON with the keys city and country."),
             max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, SCHEMA)
    assert all(v.strip() for v in value.values()), value
    assert value["city"] == "Paris", value
