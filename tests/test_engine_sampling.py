"""What each sampling parameter does to the engine's output: seeds, top-k, temperature, stop
strings and stop tokens, EOS, min/max tokens, penalties and logprobs (float32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_reference import check_teacher_forced, hf_logits, load_hf_model, torch_threads
from minisgl_mp import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog"
OTHERS = ["Hello", "import os\nimport sys\n", "Once upon a time, in a land far away, there lived a"]
N = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_pages=2048, max_running_requests=16)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> dict[str, Any]:
    return llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0))[0]


def first_new_token_at(ids: list[int], start: int) -> int:
    """Index of the first token at or after `start` that did not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


# ---- randomness -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    # Hot enough that the noise decides most tokens (the model's logits are sharp).
    p = SamplingParams(max_tokens=N, temperature=3.0, seed=1234)
    alone = llm.generate(PROMPT, p)[0]["token_ids"]
    again = llm.generate(PROMPT, p)[0]["token_ids"]
    others = [SamplingParams(max_tokens=N + i, temperature=1.0, top_p=0.9) for i in range(len(OTHERS))]
    llm.scheduler.flush_cache()  # else the cached PROMPT is admitted first, as when alone
    batch = llm.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:], others[:2] + [p] + others[2:])
    assert alone == again
    assert batch[2]["token_ids"] == alone, "the same seed gave other tokens inside a batch"
    other_seed = llm.generate(PROMPT, dataclasses.replace(p, seed=1235))[0]["token_ids"]
    assert other_seed != alone


@pytest.mark.timeout(120)
def test_different_seeds_give_different_samples(llm: LLM, greedy: dict[str, Any]) -> None:
    samples = [tuple(llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=2.0, seed=s))[0]["token_ids"])
               for s in range(4)]
    assert len(set(samples)) == 4
    assert all(list(s) != greedy["token_ids"] for s in samples)


@pytest.mark.timeout(120)
def test_top_k_1_is_greedy(llm: LLM, greedy: dict[str, Any]) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=1.5, top_k=1, seed=5))[0]
    assert out["token_ids"] == greedy["token_ids"]


@pytest.mark.timeout(120)
def test_top_k_restricts_to_the_k_best(llm: LLM, tiny_model_dir: Path) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=5.0, top_k=3, seed=9))[0]
    prompt = llm.encode(PROMPT)
    logits = hf_logits(load_hf_model(tiny_model_dir), prompt + out["token_ids"][:-1])[len(prompt) - 1 :]
    ranks = [int((row > row[t]).sum()) for row, t in zip(logits, out["token_ids"])]
    assert max(ranks) < 3, f"ranks of the sampled tokens: {ranks}"
    assert max(ranks) > 0, "temperature 5 with top_k=3 never left the best token"


# ---- stopping ----------------------------------------------------------------------------------

def _stop_string_spanning_two_tokens(llm: LLM, ids: list[int], text: str) -> tuple[str, int, int]:
    """(stop string, its index in text, index of the token that completes it): the last two
    characters of one plain-ASCII token and the first two of the next, a few tokens in."""
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    offset = 0
    for k in range(len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        offset += len(a)
        plain = a.isascii() and b.isascii() and len(a) >= 2 and len(b) >= 2
        if k < 3 or not plain or not text[:offset].endswith(a):
            continue
        stop = a[-2:] + b[:2]
        if text.find(stop) == offset - 2 and stop.strip() == stop:
            return stop, offset - 2, k + 1
    raise AssertionError(f"no usable stop string in {pieces}")


@pytest.mark.timeout(120)
def test_stop_string_ends_generation_and_is_trimmed(llm: LLM, greedy: dict[str, Any]) -> None:
    stop, index, last = _stop_string_spanning_two_tokens(llm, greedy["token_ids"], greedy["text"])
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0, stop=["never appears", stop]))[0]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == stop
    assert out["text"] == greedy["text"][:index]
    assert out["token_ids"] == greedy["token_ids"][: last + 1]


@pytest.mark.timeout(120)
def test_min_tokens_ignores_an_early_stop_string(llm: LLM, greedy: dict[str, Any]) -> None:
    stop, index, last = _stop_string_spanning_two_tokens(llm, greedy["token_ids"], greedy["text"])
    if greedy["text"].count(stop) > 1:
        pytest.skip("the stop string occurs twice")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, min_tokens=last + 2, temperature=0, stop=stop))[0]
    assert out["finish_reason"] == "length" and out["matched_stop"] is None
    assert out["text"] == greedy["text"]


@pytest.mark.timeout(120)
def test_stop_token_id_ends_generation(llm: LLM, greedy: dict[str, Any]) -> None:
    ids = greedy["token_ids"]
    at = first_new_token_at(ids, 5)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[ids[at]]))[0]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == ids[at]
    assert out["token_ids"] == ids[: at + 1]
    assert out["usage"]["completion_tokens"] == at + 1


@pytest.mark.timeout(120)
def test_min_tokens_masks_stop_tokens(llm: LLM, greedy: dict[str, Any]) -> None:
    ids = greedy["token_ids"]
    at = first_new_token_at(ids, 3)
    p = SamplingParams(max_tokens=N, min_tokens=at + 4, temperature=0, stop_token_ids=[ids[at]])
    out = llm.generate(PROMPT, p)[0]["token_ids"]
    assert len(out) >= at + 4
    assert ids[at] not in out[: at + 4], "a stop token was generated before min_tokens"
    assert out[:at] == ids[:at]


@pytest.mark.timeout(120)
def test_max_tokens_ends_with_length(llm: LLM) -> None:
    for n in (1, 5):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0))[0]
        assert out["finish_reason"] == "length" and out["matched_stop"] is None
        assert len(out["token_ids"]) == out["usage"]["completion_tokens"] == n


@pytest.fixture(scope="module")
def eos_llm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            greedy: dict[str, Any]) -> tuple[LLM, int, int]:
    """The default model with one more EOS id: a token its greedy output for PROMPT produces.
    Returns (engine, that token, its first index in the greedy output)."""
    ids = greedy["token_ids"]
    at = first_new_token_at(ids, 4)
    model_dir = tmp_path_factory.mktemp("eos") / "model"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix == ".safetensors":
            (model_dir / f.name).symlink_to(f)
        else:
            shutil.copyfile(f, model_dir / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], ids[at]]
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = LLM(str(model_dir), device="cpu", dtype="float32", num_pages=512, max_running_requests=4)
    return engine, ids[at], at


@pytest.mark.timeout(120)
def test_eos_ends_generation(eos_llm: tuple[LLM, int, int], greedy: dict[str, Any]) -> None:
    engine, eos, at = eos_llm
    assert eos in engine.scheduler.eos_ids and 8002 in engine.scheduler.eos_ids
    out = engine.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0))[0]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == eos
    assert out["token_ids"] == greedy["token_ids"][: at + 1]


@pytest.mark.timeout(120)
def test_ignore_eos_runs_to_max_tokens(eos_llm: tuple[LLM, int, int], greedy: dict[str, Any]) -> None:
    engine, eos, _ = eos_llm
    out = engine.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))[0]
    assert out["finish_reason"] == "length"
    assert out["token_ids"] == greedy["token_ids"]


@pytest.mark.timeout(120)
def test_min_tokens_postpones_eos(eos_llm: tuple[LLM, int, int], greedy: dict[str, Any]) -> None:
    engine, eos, at = eos_llm
    out = engine.generate(PROMPT, SamplingParams(max_tokens=N, min_tokens=at + 3, temperature=0))[0]
    assert len(out["token_ids"]) >= at + 3
    assert eos not in out["token_ids"][: at + 3]


# ---- penalties ---------------------------------------------------------------------------------

def _penalized(p: SamplingParams, prompt_len: int):
    """The penalties as documented (OpenAI/vLLM): repetition over prompt and output, frequency
    and presence over the output only."""
    def adjust(row: torch.Tensor, before: list[int]) -> torch.Tensor:
        seen = torch.tensor(sorted(set(before)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        output = torch.tensor(before[prompt_len:], dtype=torch.int64)
        counts = torch.bincount(output, minlength=row.numel()).to(row.dtype)
        return row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    return adjust


REPEATS = "import os\nimport sys\n"  # its greedy output repeats a token; every penalty below changes it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -2.0},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "presence_penalty": 1.0},
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_penalties_follow_their_definition(llm: LLM, tiny_model_dir: Path, penalties: dict[str, float]) -> None:
    p = SamplingParams(max_tokens=N, temperature=0, **penalties)
    prompt = llm.encode(REPEATS)
    out = llm.generate(REPEATS, p)[0]["token_ids"]
    plain = llm.generate(REPEATS, SamplingParams(max_tokens=N, temperature=0))[0]["token_ids"]
    assert out != plain, "the penalty changed nothing"
    check_teacher_forced(load_hf_model(tiny_model_dir), prompt, out, adjust=_penalized(p, len(prompt)))


@pytest.mark.timeout(120)
def test_frequency_and_presence_penalties_count_only_generated_tokens(llm: LLM) -> None:
    plain = llm.generate(REPEATS, SamplingParams(max_tokens=N, temperature=0))[0]["token_ids"]
    j = next(j for j, t in enumerate(plain) if t in plain[:j])  # the first repeat
    i = plain.index(plain[j])
    # With plain[:i + 1] moved into the prompt, plain[j] repeats a prompt token, not an output
    # token, and plain[i + 1 : j + 1] are all new: the penalties must not touch this path.
    context = llm.encode(REPEATS) + plain[: i + 1]
    p = SamplingParams(max_tokens=j - i, temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    assert llm.generate([context], p)[0]["token_ids"] == plain[i + 1 : j + 1]


@pytest.mark.timeout(120)
def test_huge_repetition_penalty_prevents_repeats(llm: LLM) -> None:
    plain = llm.generate(REPEATS, SamplingParams(max_tokens=N, temperature=0))[0]["token_ids"]
    assert len(set(plain)) < len(plain), "pick a prompt whose greedy output repeats"
    out = llm.generate(REPEATS, SamplingParams(max_tokens=N, temperature=0, repetition_penalty=2.0))[0]
    ids, prompt = out["token_ids"], llm.encode(REPEATS)
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt), f"repeats in {ids}"


# ---- logprobs -------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=N, temperature=0, logprobs=5),
    SamplingParams(max_tokens=N, temperature=1.0, seed=3, logprobs=3),
    SamplingParams(max_tokens=8, temperature=0, logprobs=0),
], ids=["greedy-top5", "sampled-top3", "no-top"])
def test_logprobs_match_transformers(llm: LLM, tiny_model_dir: Path, params: SamplingParams) -> None:
    out = llm.generate(PROMPT, params)[0]
    prompt, ids = llm.encode(PROMPT), out["token_ids"]
    logits = hf_logits(load_hf_model(tiny_model_dir), prompt + ids[:-1])[len(prompt) - 1 :]
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out["logprobs"]) == len(ids)
    for t, (lp, token) in enumerate(zip(out["logprobs"], ids)):
        assert abs(lp.token_logprob - float(ref[t, token])) < 1e-4, f"step {t}"
        assert len(lp.top_ids) == len(lp.top_logprobs) == params.logprobs
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        if params.logprobs:
            hf_top = ref[t].topk(params.logprobs).values
            assert torch.allclose(torch.tensor(lp.top_logprobs), hf_top, atol=1e-4), f"step {t}"
            assert lp.top_ids[0] == int(ref[t].argmax()) or float(ref[t].max() - ref[t, lp.top_ids[0]]) < 1e-4
            if params.greedy:
                assert lp.top_ids[0] == token


@pytest.mark.timeout(60)
def test_no_logprobs_unless_asked(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert out["logprobs"] == []
