"""Incremental, UTF-8-safe detokenization with stop strings.

The detokenizer process turns each request's new token ids into text deltas with this class, and
the scheduler process runs the same class over the same tokens to notice stop strings, so the
result must depend only on the token sequence and the settings (never on how tokens are grouped
into ``push`` calls): every push is processed one token at a time.

Two stages, each append-only:

1. ``_DecodeWindow`` turns tokens into *settled* text, the part of
   ``tokenizer.decode(all_tokens)`` that no later token can change. It decodes a short window of
   recent tokens per step and counts how many characters of that window's text are already out.
   A byte-level BPE tokenizer whose decode its byte table reproduces (``byte_table.py``) gets
   ``_ByteWindow`` instead: a table lookup and an incremental UTF-8 decoder per token.
2. ``IncrementalDetokenizer`` looks for stop strings in the settled text and holds back any
   suffix that could still grow into one, so nothing is ever streamed and then taken back.

Assumed of the tokenizer (true of byte-level BPE as in GPT-2, Llama 3 and Qwen, whose decode is
UTF-8 with one U+FFFD per maximal invalid byte run): appending tokens only ever changes a trailing
U+FFFD that stands for an unfinished character. Stray or invalid bytes give U+FFFD that later
bytes cannot change, so those are streamed like any other character once more text follows.
SentencePiece byte fallback (one U+FFFD per byte) is handled for one unfinished character at a
time; longer runs of byte tokens there are best effort.

No torch here: the detokenizer process runs without it.
"""

from __future__ import annotations

import codecs
from typing import Any, Sequence

from minisgl_mp.detokenizer.byte_table import ByteTable, byte_table

_REPLACEMENT = "\ufffd"
# An incomplete UTF-8 sequence is at most 3 bytes, i.e. at most 3 trailing U+FFFD (byte-level BPE
# gives 1, SentencePiece byte fallback 1 per byte). Any U+FFFD before those is final.
_MAX_HELD_REPLACEMENTS = 3
# The window keeps _KEEP_TOKENS tokens after a cut and is cut when it reaches _MAX_WINDOW_TOKENS,
# so each token costs O(_MAX_WINDOW_TOKENS) decode work. _KEEP_TOKENS must cover the unsettled
# tail (<= 3 replacement characters, <= 9 bytes, one byte or more per token) plus some context.
_KEEP_TOKENS = 12
_MAX_WINDOW_TOKENS = 24
# Prompt tokens used as decode context, for decoders whose output depends on what precedes.
PROMPT_TAIL_TOKENS = 6


def _trailing_replacements(text: str) -> int:
    count = 0
    while count < _MAX_HELD_REPLACEMENTS and count < len(text) and text[-1 - count] == _REPLACEMENT:
        count += 1
    return count


class _DecodeWindow:
    """Settled text of a growing token sequence, with bounded decode work per token.

    Invariant: ``decode(window)[:sent]`` is text already accounted for (returned, or prompt
    context), and for any tokens appended later, ``decode(window + later)[sent:]`` equals what
    ``decode(all_tokens + later)`` adds beyond the text returned so far.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, context_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._skipped_cache: dict[int, bool] = {}
        context = [int(i) for i in context_ids]
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character; decoding the output on its own matches
            # decode(output) exactly, which is what the stream promises.
            context, context_text = [], ""
        self._window = context
        self._sent = len(context_text)
        self._cut_at = max(len(self._window), _KEEP_TOKENS) + (_MAX_WINDOW_TOKENS - _KEEP_TOKENS)

    def append(self, token_id: int) -> str:
        """Add one token; return the text it settled (often "", e.g. mid-character)."""
        if self._is_skipped(token_id):
            return ""
        self._window.append(token_id)
        text = self._decode(self._window)
        settled = len(text) - _trailing_replacements(text)
        delta = text[self._sent : settled]
        self._sent = max(self._sent, settled)
        if len(self._window) >= self._cut_at:
            self._cut(text)
        return delta

    def flush(self) -> str:
        """No more tokens: the held tail (e.g. U+FFFD of a cut-off character) is final."""
        text = self._decode(self._window)
        delta = text[self._sent :]
        self._sent = max(self._sent, len(text))
        return delta

    def _cut(self, text: str) -> None:
        """Drop old tokens from the window, keeping the invariant.

        Cutting at a token boundary inside a character is fine once that character is settled
        and returned: the kept tokens then decode to some stray-byte U+FFFD (already counted as
        sent) followed by exactly the text the full decode has from the next character on.
        ``head`` ends with that character (as U+FFFD if cut inside it), so the condition is
        ``len(head) <= sent``; the length difference of the two decodes re-bases ``sent``.
        """
        keep_from = len(self._window) - _KEEP_TOKENS
        head = self._decode(self._window[:keep_from])
        if len(head) <= self._sent and text.startswith(head[:-1]):
            rest = self._decode(self._window[keep_from:])
            new_sent = self._sent + len(rest) - len(text)
            if 0 <= new_sent <= len(rest) and rest[new_sent:] == text[self._sent :]:
                del self._window[:keep_from]
                self._sent = new_sent
                self._cut_at = _MAX_WINDOW_TOKENS
                return
        # Not safe yet (e.g. tokens that decode to nothing); try again a few tokens later.
        self._cut_at = len(self._window) + _KEEP_TOKENS

    def _is_skipped(self, token_id: int) -> bool:
        """True for tokens that decode drops regardless of context (skipped special tokens);
        keeping them out of the window keeps it bounded when a model emits many of them."""
        if not self._skip_special_tokens or token_id not in self._special_ids:
            return False
        skipped = self._skipped_cache.get(token_id)
        if skipped is None:
            skipped = self._decode([token_id]) == ""
            self._skipped_cache[token_id] = skipped
        return skipped

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )


class _ByteWindow:
    """What _DecodeWindow computes, for a tokenizer with a byte table (byte_table.py): each
    token's bytes go through an incremental UTF-8 decoder, which holds back only an unfinished
    character. The prompt is no context here: a byte-level decode of later tokens does not
    depend on earlier whole characters, and a prompt that ends inside one is dropped as
    _DecodeWindow drops it. A byte that can never start or continue a character shows as
    U+FFFD at once (the window waits for more text), which the full decode has as well."""

    def __init__(self, table: ByteTable, skip_special_tokens: bool) -> None:
        self._bytes_of = table.bytes_of
        self._skipped = table.skipped if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def append(self, token_id: int) -> str:
        if token_id in self._skipped or not 0 <= token_id < len(self._bytes_of):
            return ""
        return self._utf8.decode(self._bytes_of[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class IncrementalDetokenizer:
    """Streams one request's output text: UTF-8 safe, consistent with ``tokenizer.decode``,
    and cut right before the first stop string.

    Guarantees, for the generated tokens pushed so far (``full = tokenizer.decode(tokens, ...)``):

    * ``text`` is a prefix of ``full``; the difference is held-back text: an unfinished
      character, a few trailing U+FFFD, or a suffix that could still become a stop string.
    * After ``finish()`` with no stop string matched, ``text == full``.
    * With a match, ``text`` is ``full`` up to (not including) the stop string, and nothing that
      was returned is ever taken back. With ``include_stop`` the stop string is included.

    Stop-string rule: the stop string that *completes* first wins (smallest end position; on a
    tie the longer one, which starts earlier). This is what char-by-char streaming would see, so
    it does not depend on how text is split into tokens. ``min_tokens``: text settled while
    processing the i-th generated token (1-based) may end a stop string only if
    ``i >= min_tokens``; text released by ``finish()`` counts if ``num_tokens >= min_tokens``.
    A stop string may start in earlier text. Empty stop strings are rejected (ValueError); a
    single ``str`` is taken as one stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        prompt_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._stops = tuple(dict.fromkeys(stops))
        # Chars before new text that a stop string ending in the new text can reach back into.
        self._lookback = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        table = byte_table(tokenizer)
        self._window: _DecodeWindow | _ByteWindow = (
            _ByteWindow(table, skip_special_tokens) if table is not None
            else _DecodeWindow(tokenizer, skip_special_tokens, prompt_ids[-PROMPT_TAIL_TOKENS:]))
        self._pending = ""  # settled text held back because it could still become a stop string
        self._tail = ""  # last self._lookback chars of returned text
        self._parts: list[str] = []
        self._num_tokens = 0
        self._matched_stop: str | None = None
        self._finished = False
        # vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the matched stop string, and
        # a stop token's text, stay in the output.
        self.include_stop = include_stop

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far, including any pushed after a stop string matched."""
        return self._num_tokens

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated token ids; return the text that is now safe to show."""
        if self._finished:
            raise RuntimeError("push() called after finish()")
        released: list[str] = []
        for token_id in token_ids:
            self._num_tokens += 1
            if self._matched_stop is not None:
                continue
            settled = self._window.append(int(token_id))
            if settled:
                released.append(self._release(settled, self._num_tokens >= self._min_tokens))
        return self._emit("".join(released))

    def finish(self) -> str:
        """The request ended: return whatever was held back. Later calls return ""."""
        if self._finished:
            return ""
        self._finished = True
        if self._matched_stop is not None:
            return ""
        out = ""
        settled = self._window.flush()
        if settled:
            out = self._release(settled, self._num_tokens >= self._min_tokens)
        if self._matched_stop is None:
            out += self._pending
            self._pending = ""
        return self._emit(out)

    def _release(self, new: str, stops_active: bool) -> str:
        """Run newly settled text through the stop-string check; return what may be shown."""
        buffered = self._pending + new
        if not self._stops:
            return buffered
        # region: [returned tail | pending | new]; a stop string found now must end inside new.
        region = self._tail + buffered
        if stops_active:
            found = self._first_completed_stop(region, len(region) - len(new))
            if found is not None:
                start, stop = found
                self._matched_stop = stop
                self._pending = ""
                # start >= len(self._tail): every proper stop prefix was held back in pending.
                return region[len(self._tail) : start + (len(stop) if self.include_stop else 0)]
        hold = self._held_suffix_len(region, len(buffered))
        self._pending = buffered[len(buffered) - hold :]
        return buffered[: len(buffered) - hold]

    def _first_completed_stop(self, region: str, searched: int) -> tuple[int, str] | None:
        """(start, stop) of the occurrence ending after region[:searched] that ends first."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = region.find(stop, max(0, searched - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_suffix_len(self, region: str, limit: int) -> int:
        """Length of the longest suffix of region (at most limit) that is a proper prefix of a
        stop string, i.e. text that must not be shown yet."""
        held = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, limit), held, -1):
                if region.endswith(stop[:length]):
                    held = length
                    break
        return held

    def _emit(self, out: str) -> str:
        if out:
            self._parts.append(out)
            if self._lookback:
                self._tail = (self._tail + out)[-self._lookback :]
        return out


def visible_ids(new_ids: Sequence[int], finished: bool, matched_stop: int | str | None,
                include_stop: bool) -> Sequence[int]:
    """The ids of one output whose text the user sees: a request that ended on a stop token
    (a stop_token_id, or EOS) does not show that token's text, as in vLLM and SGLang, unless
    the request keeps its stop (include_stop_str_in_output / no_stop_trim). The token still
    counts in completion_tokens and output ids."""
    if finished and isinstance(matched_stop, int) and not include_stop and len(new_ids):
        return new_ids[:-1]
    return new_ids
