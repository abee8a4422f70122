"""A reasoning model's grammar starts when its thinking ends.

A request with `require_reasoning` (SGLang's name: a chat request to a model that thinks, under
--reasoning-parser) opens inside its thinking. Its grammar constrains only what follows the
think-end sequence (`</think>`), as SGLang's ReasonerGrammarObject and vLLM's reasoning-aware
structured output do; otherwise a JSON answer would be written inside the thinking, where the
reasoning parser files it as reasoning. `thinking_token_budget` (vLLM's name) caps the thinking:
once that many tokens are thought, the think-end sequence is forced, token by token, so the
answer comes however long the model would have thought (max_tokens still counts both).

While a constrained request thinks, its stop tokens are masked: an output that ended inside
the thinking would have no answer at all. A request with a budget and no grammar keeps them.
"""

from __future__ import annotations

import torch

from minisgl_mp.constrained.matcher import GrammarMatcher, allow_all_but, allow_only

# Where thinking ends: the tag every --reasoning-parser here closes on (Qwen3's). The grammar
# backend tokenizes it, so it may be one token (Qwen3's vocabulary) or several.
THINK_END = "</think>"


class ReasoningMatcher(GrammarMatcher):
    """Free tokens (or, past the budget, the think-end sequence) until the thinking ends; then
    `grammar`'s (None: any token)."""

    def __init__(self, grammar: GrammarMatcher | None, think_end: tuple[int, ...], budget: int | None,
                 banned_while_thinking: frozenset[int] = frozenset()) -> None:
        if not think_end:
            raise ValueError("the think-end sequence is empty")
        self.grammar = grammar
        self.think_end = think_end
        self.budget = budget
        self.banned = banned_while_thinking
        self.thinking = True
        self.thought = 0  # tokens accepted while thinking, a partly matched think-end included
        self.matched = 0  # think_end[:matched] ends the output so far

    @property
    def forcing(self) -> bool:
        """The budget is spent: the next token is the think-end sequence's next."""
        # A partial think-end match is not counted against the budget, so a single-token
        # think-end (Qwen3's) comes after exactly `budget` thinking tokens.
        return self.thinking and self.budget is not None and self.thought - self.matched >= self.budget

    def accept_token(self, token: int) -> bool:
        if not self.thinking:
            return self.grammar is None or self.grammar.accept_token(token)
        if (self.forcing and token != self.think_end[self.matched]) or token in self.banned:
            return False
        self.thought += 1
        if token == self.think_end[self.matched]:
            self.matched += 1
        else:
            self.matched = 1 if token == self.think_end[0] else 0
        if self.matched == len(self.think_end):
            self.thinking = False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.forcing:
            allow_only(bitmask, row, self.think_end[self.matched])
        elif self.thinking:
            allow_all_but(bitmask, row, self.banned)
        elif self.grammar is None:
            allow_all_but(bitmask, row)
        else:
            self.grammar.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return not self.thinking and self.grammar is not None and self.grammar.is_terminated()
