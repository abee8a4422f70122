"""The xgrammar backend: JSON schema, regex and EBNF grammars on CPU and GPU."""

from __future__ import annotations

import re
from typing import Any

import torch
import xgrammar as xgr

from minisgl_mp.constrained.base import GrammarBackend, GrammarKey, GrammarMatcher
from minisgl_mp.constrained.reasoning import THINK_END

# xgrammar's messages start with "[time] /path/file.cc:line: " and sometimes a failed check.
_NOISE = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def _clean(e: Exception) -> str:
    return " ".join(_NOISE.sub("", str(e)).split()) or type(e).__name__


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 any_whitespace: bool = False) -> None:
        super().__init__(think_end_ids=tuple(tokenizer.encode(THINK_END, add_special_tokens=False)),
                         stop_token_ids=stop_token_ids)
        # The mask spans the larger of the model's rows and the tokenizer's ids; ids the
        # tokenizer lacks (the model's padding rows) are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        # Our cache (base.py) dedups and bounds compiled grammars; xgrammar's own is off.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.any_whitespace = any_whitespace

    def _grammar(self, key: GrammarKey) -> xgr.Grammar:
        try:
            if key.kind == "json_schema":
                return xgr.Grammar.from_json_schema(key.spec, any_whitespace=self.any_whitespace)
            if key.kind == "regex":
                return xgr.Grammar.from_regex(key.spec)
            return xgr.Grammar.from_ebnf(key.spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every bad input
            raise ValueError(f"{key.kind} is invalid: {_clean(e)}") from None

    def validate(self, key: GrammarKey) -> None:
        self._grammar(key)

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        grammar = self._grammar(key)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - reported to the request, never a failed step
            raise ValueError(f"{key.kind} cannot be compiled: {_clean(e)}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # logits: [B, V_model]; bitmask: [B, ceil(vocab_size / 32)], filled on the CPU.
        bitmask = bitmask.to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
