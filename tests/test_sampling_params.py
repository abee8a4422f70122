"""SamplingParams: every invalid value is refused with a ValueError naming the field and what is
allowed; valid edge values, the accepted input forms and the dict round trip work."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from minisgl_mp.sampling_params import SamplingParams

# field -> (the allowed range as the error states it, invalid values)
INVALID: dict[str, tuple[str, list[Any]]] = {
    "max_tokens": ("an integer >= 1", [0, -1, 1.5, True, "3", None]),
    "min_tokens": ("an integer in [0, max_tokens=16]", [-1, 17, 1.0, None]),
    "temperature": ("a number >= 0 (0 means greedy)", [-0.1, float("nan"), float("inf"), "1", True, None]),
    "top_k": ("-1 (all tokens) or an integer >= 1", [0, -2, 1.5, False]),
    "top_p": ("a number in (0, 1]", [0, 0.0, 1.01, float("nan"), -0.5]),
    "min_p": ("a number in [0, 1]", [-0.01, 1.5, float("inf")]),
    "seed": ("null or an integer in [0, 2^63)", [-1, 2**63, 1.0, True, "7"]),
    "stop": ("a string or a list of non-empty strings", ["", [""], [1], ["ok", None], 5]),
    "stop_token_ids": ("a list of non-negative integers", [[-1], [1.0], [True], 3, ["1"]]),
    "ignore_eos": ("true or false", [1, "yes", None]),
    "skip_special_tokens": ("true or false", [0, "no"]),
    "include_stop_str_in_output": ("true or false", [1, "yes", None]),
    "presence_penalty": ("a number in [-2, 2]", [2.5, -2.01, float("nan"), None]),
    "frequency_penalty": ("a number in [-2, 2]", [-3, 2.0001, "0"]),
    "repetition_penalty": ("a number in (0, 2]", [0, -1, 2.1, float("inf")]),
    "logprobs": ("null or an integer in [0, 20]", [-1, 21, 1.0, True]),
    "logprob_start_len": ("null or an integer >= 0", [-1, 1.5, True]),
    "logit_bias": ("an object mapping token ids >= 0 to numbers in [-100, 100]",
                   [5, {"x": 1}, {"1": 101}, {"-1": 1}, {"1": "2"}, [[1, 2, 3]]]),
    "json_schema": ("a non-empty string", ["", 5, []]),
    "regex": ("a non-empty string", ["", 3]),
    "ebnf": ("a non-empty string", ["", True]),
    "require_reasoning": ("true or false", [1, "yes", None]),
    "thinking_token_budget": ("null or an integer >= 0", [-1, 1.5, True, "4"]),
}
CASES = [(name, value) for name, (_, values) in INVALID.items() for value in values]


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_invalid_value_names_field_and_range(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {INVALID[name][0]}, got ")):
        SamplingParams(**{name: value})


def test_every_field_is_validated() -> None:
    assert set(INVALID) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("kwargs, message", [
    ({"stop": [f"s{i}" for i in range(17)]}, "stop must have at most 16 strings, got 17"),
    ({"stop": "x" * 257}, "each stop string must be at most 256 characters"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids must have at most 64 entries"),
    ({"regex": "a", "ebnf": "root ::= \"a\""}, "json_schema, regex and ebnf are exclusive: give one, got regex, ebnf"),
    ({"json_schema": "{oops"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1]"}, "json_schema must be a JSON object (a schema), got list"),
    ({"thinking_token_budget": 4}, "thinking_token_budget caps the thinking the output opens with: it needs "
                                   "require_reasoning"),
])
def test_limits_on_stop_lists(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 1, "min_tokens": 1},
    {"max_tokens": 100_000, "min_tokens": 100_000},
    {"temperature": 0}, {"temperature": 0.0}, {"temperature": 100},
    {"top_k": -1}, {"top_k": 1}, {"top_k": 50_000},
    {"top_p": 1}, {"top_p": 1e-9},
    {"min_p": 0}, {"min_p": 1},
    {"seed": None}, {"seed": 0}, {"seed": 2**63 - 1},
    {"stop": [f"s{i}" for i in range(16)]}, {"stop": ["x" * 256]},
    {"stop_token_ids": list(range(64))}, {"stop_token_ids": [0]},
    {"presence_penalty": -2}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0},
    {"repetition_penalty": 2}, {"repetition_penalty": 1e-6},
    {"logprobs": None}, {"logprobs": 0}, {"logprobs": 20},
], ids=lambda kw: ",".join(f"{k}={str(v)[:16]}" for k, v in kw.items()))
def test_edge_values_are_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        got = getattr(p, name)
        assert got == (tuple(value) if isinstance(value, list) else value)


def test_input_forms_become_tuples() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_params_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, greedy", [
    ({}, False), ({"temperature": 0}, True), ({"top_k": 1}, True), ({"temperature": 0.7, "top_k": 2}, False),
])
def test_greedy(kwargs: dict[str, Any], greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_has_penalties() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_dict_round_trip() -> None:
    p = SamplingParams(max_tokens=7, min_tokens=2, temperature=0.5, top_k=5, top_p=0.9, min_p=0.1,
                       seed=11, stop=["x", "y"], stop_token_ids=[1, 2], ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                       skip_special_tokens=False, logprobs=3)
    d = p.to_dict()
    assert d["stop"] == ["x", "y"] and d["stop_token_ids"] == [1, 2]  # JSON- and msgpack-ready
    assert SamplingParams.from_dict(d) == p


def test_from_dict_names_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter\\(s\\): bogus, n"):
        SamplingParams.from_dict({"max_tokens": 3, "n": 2, "bogus": 1})


def test_from_dict_needs_an_object() -> None:
    with pytest.raises(ValueError, match="sampling_params must be an object, got list"):
        SamplingParams.from_dict([1, 2])  # type: ignore[arg-type]
