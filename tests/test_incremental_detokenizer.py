"""IncrementalDetokenizer: UTF-8-safe streaming, consistency with decode, stop strings."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from minisgl_mp.detokenizer import IncrementalDetokenizer
from minisgl_mp.detokenizer.byte_table import byte_table, byte_to_char

REPLACEMENT = "\ufffd"


class _WindowOnly:
    """The real tokenizer without its backend, so that no byte table is built for it and
    IncrementalDetokenizer decodes through it (the path of tokenizers that are not byte-level)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


@pytest.fixture(scope="module", params=["byte table", "decode window"])
def tokenizer(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Any:
    """Every test runs on both paths: the byte table the tiny model's tokenizer gets, and the
    decode window every other tokenizer gets."""
    real = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    if request.param == "byte table":
        assert byte_table(real) is not None
        return real
    assert byte_table(_WindowOnly(real)) is None
    return _WindowOnly(real)


@pytest.fixture(scope="module")
def byte_ids(tokenizer: Any) -> list[int]:
    """byte_ids[b] is the id of the token that is exactly byte b."""
    ids = tokenizer.convert_tokens_to_ids([byte_to_char()[b] for b in range(256)])
    assert None not in ids and tokenizer.unk_token_id not in ids, "not a byte-level BPE"
    return ids


def _decode(tokenizer: Any, ids: Sequence[int], skip: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """Push every chunk, then finish; return the deltas, checking text == their concatenation."""
    deltas = [detok.push(chunk) for chunk in chunks] + [detok.finish()]
    assert detok.text == "".join(deltas)
    return deltas


def _as_bytes(byte_ids: list[int], text: str) -> list[int]:
    return [byte_ids[b] for b in text.encode("utf-8")]


MULTIBYTE = "你好，世界！🙂 emoji 🎉👍🏽 and ünïcödé — 日本語のテキスト"


def test_multibyte_text_as_single_byte_tokens_never_shows_a_partial_character(tokenizer, byte_ids):
    ids = _as_bytes(byte_ids, MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer)
    seen = ""
    for token_id in ids:
        delta = detok.push([token_id])
        assert REPLACEMENT not in delta
        seen += delta
        assert MULTIBYTE.startswith(seen)
    seen += detok.finish()
    assert seen == detok.text == MULTIBYTE
    assert detok.num_tokens == len(ids)


def test_deltas_join_to_the_full_decode_for_normally_encoded_text(tokenizer):
    text = "Hello world! " + MULTIBYTE + " <|im_end|> tail"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        deltas = _stream(detok, [[i] for i in ids])
        assert "".join(deltas) == _decode(tokenizer, ids, skip)


def test_skip_special_tokens_both_ways(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi there<|im_end|><|endoftext|>", add_special_tokens=False)
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    _stream(shown, [[i] for i in ids])
    assert shown.text == "<|im_start|>hi there<|im_end|><|endoftext|>"
    hidden = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    _stream(hidden, [[i] for i in ids])
    assert hidden.text == "hi there"


def test_stop_string_spanning_tokens_is_trimmed_and_never_shown(tokenizer, byte_ids):
    # The stop string arrives one byte at a time, so every proper prefix of it is seen first.
    text = "The answer is 42. STOP-HERE and more text"
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP-HERE"])
    shown = ""
    for token_id in _as_bytes(byte_ids, text):
        delta = detok.push([token_id])
        shown += delta
        assert "The answer is 42. ".startswith(shown), f"shown {shown!r} then would retract"
    assert detok.matched_stop == "STOP-HERE"
    assert detok.push(tokenizer.encode(" more", add_special_tokens=False)) == ""
    shown += detok.finish()
    assert shown == detok.text == "The answer is 42. "
    assert detok.finish() == ""


def test_multibyte_stop_string_split_inside_a_character(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, stop=["世界"])
    _stream(detok, [[i] for i in _as_bytes(byte_ids, "你好世界再见")])
    assert (detok.text, detok.matched_stop) == ("你好", "世界")


def test_near_miss_of_a_stop_string_is_held_then_released_at_finish(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, stop=["</answer>"])
    deltas = _stream(detok, [[i] for i in _as_bytes(byte_ids, "x = 1 </answ")])
    assert "".join(deltas[:-1]) == "x = 1 "
    assert deltas[-1] == "</answ"
    assert detok.text == "x = 1 </answ" and detok.matched_stop is None
    assert detok.finish() == ""


def test_text_that_turns_away_from_a_stop_string_is_released_without_finish(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, stop=["</answer>"])
    for token_id in _as_bytes(byte_ids, "a </ans b"):
        detok.push([token_id])
    assert detok.text == "a </ans b"


def test_multiple_stop_strings_the_first_to_complete_wins(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, stop=["foo", "bar", "baz"])
    _stream(detok, [_as_bytes(byte_ids, "xx bar yy foo")])
    assert (detok.text, detok.matched_stop) == ("xx ", "bar")
    # Overlapping: "bc" completes before "abcd" does; on a tie the longer one wins.
    for stops, expected in ((["abcd", "bc"], ("za", "bc")), (["bc", "abc"], ("z", "abc"))):
        detok = IncrementalDetokenizer(tokenizer, stop=stops)
        _stream(detok, [[i] for i in _as_bytes(byte_ids, "zabcd")])
        assert (detok.text, detok.matched_stop) == expected


def test_stop_strings_completed_by_one_token_use_the_same_rule(tokenizer):
    """A multi-character token can complete two stop strings at once; the one that ends first
    in the text wins, as it would if the text came one character at a time."""
    word_id, word = next(
        (i, w)
        for i in range(len(tokenizer))
        if len(w := _decode(tokenizer, [i])) >= 3 and w.isascii() and w.isalpha() and w[0] != w[1]
    )
    detok = IncrementalDetokenizer(tokenizer, stop=[word, word[1]])
    _stream(detok, [[word_id]])
    assert (detok.text, detok.matched_stop) == (word[0], word[1])


def test_min_tokens_ignores_stop_strings_completed_before_it(tokenizer, byte_ids):
    ids = _as_bytes(byte_ids, "ab|ab|ab|")  # "|" completes at tokens 3, 6 and 9
    for min_tokens, expected in ((0, "ab"), (3, "ab"), (4, "ab|ab"), (9, "ab|ab|ab"), (10, None)):
        detok = IncrementalDetokenizer(tokenizer, stop=["|"], min_tokens=min_tokens)
        _stream(detok, [[i] for i in ids])
        if expected is None:
            assert (detok.text, detok.matched_stop) == ("ab|ab|ab|", None)
        else:
            assert (detok.text, detok.matched_stop) == (expected, "|")
    # A stop string may begin before min_tokens and end after it.
    detok = IncrementalDetokenizer(tokenizer, stop=["b|a"], min_tokens=4)
    _stream(detok, [[i] for i in ids])
    assert (detok.text, detok.matched_stop) == ("a", "b|a")


def test_invalid_arguments_are_rejected(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, stop=["ok", ""])
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, min_tokens=-1)
    detok = IncrementalDetokenizer(tokenizer, stop="single")
    _stream(detok, [tokenizer.encode("a single b", add_special_tokens=False)])
    assert (detok.text, detok.matched_stop) == ("a ", "single")
    with pytest.raises(RuntimeError):
        detok.push([1])


def test_prompt_context_is_never_emitted(tokenizer, byte_ids):
    chat = "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    output = _as_bytes(byte_ids, "🙂 ok") + tokenizer.encode(" done", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, prompt_ids=prompt)
        _stream(detok, [[i] for i in output])
        assert detok.text == _decode(tokenizer, output, skip) == "🙂 ok done"
    # A prompt cut inside a character must not leak U+FFFD or merge into the output.
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=_as_bytes(byte_ids, "你")[:2])
    _stream(detok, [[i] for i in _as_bytes(byte_ids, "ok")])
    assert detok.text == "ok"


class _CountingTokenizer:
    """Delegates to a real tokenizer; records how many ids each decode call received and fails
    at once past ``max_ids`` (a growing window would otherwise only show up as a slow test)."""

    def __init__(self, inner: Any, max_ids: int | None = None):
        self._inner = inner
        self._max_ids = max_ids
        self.all_special_ids = inner.all_special_ids
        self.decode_sizes: list[int] = []

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        self.decode_sizes.append(len(ids))
        if self._max_ids is not None and len(ids) > self._max_ids:
            raise AssertionError(f"decoded {len(ids)} ids at once; the window should stay small")
        return self._inner.decode(ids, **kwargs)


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("stray continuation bytes", [0x80]),
        ("invalid byte", [0xFF]),
        ("lead bytes that never complete", [0xE4]),
        ("real U+FFFD", [0xEF, 0xBF, 0xBD]),
        ("Chinese as single bytes", list("世界!".encode())),
    ],
)
def test_work_per_token_stays_bounded(tokenizer, byte_ids, name, pattern):
    n = 20_000
    ids = [byte_ids[pattern[i % len(pattern)]] for i in range(n)]
    counting = _CountingTokenizer(tokenizer, max_ids=32)
    detok = IncrementalDetokenizer(counting, stop=["never appears"])
    start = time.perf_counter()
    total = sum(len(detok.push([i])) for i in ids) + len(detok.finish())
    elapsed = time.perf_counter() - start
    # A window that grows would decode ~n/2 ids per call: quadratic, minutes instead of ~0.3 s.
    assert sum(counting.decode_sizes) <= 40 * n, name
    assert elapsed < 10.0, f"{name}: {elapsed:.1f}s for {n} tokens"
    assert detok.text == _decode(tokenizer, ids) and total == len(detok.text)


class _NoSpecialIdsTokenizer:
    """A tokenizer whose ``all_special_ids`` misses the tokens that decode skips, so skipped
    tokens do enter the decode window."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.all_special_ids: list[int] = []

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return self._inner.decode(ids, **kwargs)


@pytest.mark.parametrize("hide_special_ids", [False, True])
def test_tokens_that_decode_to_nothing_inside_a_character(tokenizer, byte_ids, hide_special_ids):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    lead, *rest = _as_bytes(byte_ids, "你")
    ids = _as_bytes(byte_ids, "ab") + [lead] + [im_end] * 300 + rest + _as_bytes(byte_ids, "好")
    if hide_special_ids:
        # The window must grow here (a cut would lose the lead byte), but the text stays right.
        detok = IncrementalDetokenizer(_NoSpecialIdsTokenizer(tokenizer))
    else:
        detok = IncrementalDetokenizer(_CountingTokenizer(tokenizer, max_ids=32))
    deltas = _stream(detok, [[i] for i in ids])
    assert REPLACEMENT not in "".join(deltas)
    assert detok.text == _decode(tokenizer, ids) == "ab你好"


def _reference_stop(full: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut full text before the stop string that completes first (ties: the longer one)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best[:2]):
            best = (start + len(stop), -len(stop), stop)
    if best is None:
        return full, None
    return full[: best[0] + best[1]], best[2]


def _random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4)
        chunks.append(ids[i : i + size])
        i += size
    return chunks


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_token_sequences_match_decode(tokenizer, byte_ids, data):
    pieces = st.one_of(
        st.integers(0, len(tokenizer) - 1).map(lambda i: [i]),
        st.sampled_from(range(0x80, 0x100)).map(lambda b: [byte_ids[b]]),
        st.sampled_from(MULTIBYTE).map(lambda ch: _as_bytes(byte_ids, ch)),
        st.sampled_from(tokenizer.encode(MULTIBYTE + "<|im_end|>", add_special_tokens=False)).map(
            lambda i: [i]
        ),
    )
    ids = [i for piece in data.draw(st.lists(pieces, max_size=40), label="pieces") for i in piece]
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    full = _decode(tokenizer, ids, skip)
    # Stop strings: pieces of the output (so they often match) and a few fixed ones.
    piece = st.builds(lambda i, n: full[i : i + n], st.integers(0, len(full)), st.integers(1, 3))
    fixed = st.sampled_from(["ab", "好", "🙂", REPLACEMENT, "<|im_end|>"])
    stops = data.draw(st.lists((piece | fixed).filter(bool), max_size=3), label="stops")
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))

    by_token = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, stop=stops)
    shown = ""
    for n, token_id in enumerate(ids, start=1):
        shown += by_token.push([token_id])
        assert _decode(tokenizer, ids[:n], skip).startswith(shown)
        assert full.startswith(shown), "text shown earlier was taken back"
    shown += by_token.finish()
    expected_text, expected_stop = _reference_stop(full, stops)
    assert (shown, by_token.matched_stop) == (expected_text, expected_stop)

    # The scheduler and the detokenizer may see the same tokens in different chunks.
    chunked = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, stop=stops)
    _stream(chunked, _random_chunks(rng, ids))
    assert (chunked.text, chunked.matched_stop) == (expected_text, expected_stop)


def test_the_byte_table_is_only_used_where_it_decodes_as_the_tokenizer(tiny_model_dir: Path) -> None:
    """A tokenizer that looks byte-level but decodes otherwise (here: a decode that changes
    its text) gets no table, so its text comes from its own decode."""
    real = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    class Shouting(_WindowOnly):
        backend_tokenizer = real.backend_tokenizer

        def decode(self, ids: Any, **kwargs: Any) -> str:
            return self._inner.decode(ids, **kwargs).upper()

    shouting = Shouting(real)
    assert byte_table(shouting) is None
    ids = real.encode("quiet words", add_special_tokens=False)
    detok = IncrementalDetokenizer(shouting)
    _stream(detok, [[i] for i in ids])
    assert detok.text == "QUIET WORDS"
    table = byte_table(real)
    assert table is not None and byte_table(real) is table  # built once per tokenizer
    assert table.skipped == frozenset(real.all_special_ids)
