"""Token id -> bytes, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen).

Their decode is ``bytes(concat(token bytes)).decode("utf-8", errors="replace")``: every token
stands for a fixed byte string (its vocabulary entry read through GPT-2's byte-to-character map,
or an added token's text as UTF-8), and the decoder joins them. So incremental decoding is a
table lookup and an incremental UTF-8 decoder, instead of decoding a window of tokens through
the tokenizer once per token.

The table is only used for a tokenizer whose backend decoder is byte-level and whose decode it
reproduces: built once per tokenizer and checked against ``tokenizer.decode`` on every single
token and on random sequences (``skip_special_tokens`` both ways); anything else, or any
mismatch, gets None and the caller decodes through the tokenizer.
"""

from __future__ import annotations

import logging
import random
import weakref
from typing import Any

logger = logging.getLogger(__name__)

# Random sequences the table is checked on, and their length: joins across tokens, special
# tokens among others, ids past the vocabulary.
CHECK_SEQUENCES = 64
CHECK_LEN = 24

_tables: weakref.WeakKeyDictionary[Any, ByteTable | None] = weakref.WeakKeyDictionary()


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the character that names it in the
    vocabulary. Printable Latin-1 bytes stand for themselves, the other 68 for the characters
    from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ByteTable:
    """`bytes_of[id]`: the bytes token `id` decodes to (b"" for ids the tokenizer has no token
    for, which its decode drops); `skipped`: the ids that ``skip_special_tokens`` drops."""

    def __init__(self, bytes_of: list[bytes], skipped: frozenset[int]) -> None:
        self.bytes_of = bytes_of
        self.skipped = skipped

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        n = len(self.bytes_of)
        data = b"".join(self.bytes_of[i] for i in ids
                        if 0 <= i < n and not (skip_special_tokens and i in self.skipped))
        return data.decode("utf-8", errors="replace")


def byte_table(tokenizer: Any) -> ByteTable | None:
    """The tokenizer's table, or None where decoding must go through the tokenizer."""
    try:
        return _tables[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: build it each time (never in the engine)
        return _build(tokenizer)
    table = _build(tokenizer)
    _tables[tokenizer] = table
    return table


def _build(tokenizer: Any) -> ByteTable | None:
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    to_byte = {c: b for b, c in byte_to_char().items()}
    bytes_of = []
    for token in tokens:
        if token is None:
            bytes_of.append(b"")
        elif all(c in to_byte for c in token):
            bytes_of.append(bytes(to_byte[c] for c in token))
        else:  # an added token's own text
            bytes_of.append(token.encode("utf-8"))
    special = [i for i in getattr(tokenizer, "all_special_ids", ()) or () if 0 <= i < size]
    skipped = frozenset(i for i in special if _decode(tokenizer, [i], True) == "")
    table = ByteTable(bytes_of, skipped)
    problem = _check(tokenizer, table, size, special)
    if problem is not None:
        logger.info("decoding through the tokenizer: its byte table %s", problem)
        return None
    return table


def _decode(tokenizer: Any, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _check(tokenizer: Any, table: ByteTable, size: int, special: list[int]) -> str | None:
    """None when the table decodes as the tokenizer does, else what differs."""
    # Every token alone through the backend (what tokenizer.decode calls; the tokenizer's own
    # loop over 150k tokens would take a second), then sequences through tokenizer.decode.
    singles = [[i] for i in range(size)]
    for skip in (False, True):
        want = tokenizer.backend_tokenizer.decode_batch(singles, skip_special_tokens=skip)
        bad = next((ids[0] for ids, w in zip(singles, want) if table.decode(ids, skip) != w), None)
        if bad is not None:
            return f"differs on token {bad}"
    rng = random.Random(0)

    def pick() -> int:  # a special token one time in eight; ids just past the vocabulary too
        return rng.choice(special) if special and rng.random() < 0.125 else rng.randrange(size + 2)

    seqs = [[pick() for _ in range(CHECK_LEN)] for _ in range(CHECK_SEQUENCES)]
    for skip in (False, True):
        for ids in seqs:
            if table.decode(ids, skip) != _decode(tokenizer, ids, skip):
                return f"differs on {ids} (skip_special_tokens={skip})"
    return None
