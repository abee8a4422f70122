"""Seeded benchmark workloads, all as conversations of turns.

A single-turn workload (random, shared-prefix) is a list of one-turn conversations. A turn's
prompt is the whole conversation so far: every earlier turn's user tokens and output tokens,
then this turn's user tokens. Prompts are random token ids below `token_range` (ordinary
tokens of the tokenizer, so they also decode to text), drawn with numpy's PCG64 from `seed`:
the same arguments give the same workload on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

WORKLOADS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class LengthRange:
    """Lengths drawn uniformly from [lo, hi], both included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"a length range needs 1 <= min <= max, got {self.lo}..{self.hi}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'128' (fixed) or '64,512' (uniform, inclusive)."""
        parts = [p.strip() for p in text.split(",")]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"a length is N or MIN,MAX, got {text!r}") from None
        if len(values) == 1:
            return cls(values[0], values[0])
        if len(values) == 2:
            return cls(values[0], values[1])
        raise ValueError(f"a length is N or MIN,MAX, got {text!r}")

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.lo, self.hi + 1, size=n)]

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo},{self.hi}"


@dataclass(frozen=True)
class Turn:
    user_ids: tuple[int, ...]  # appended to the conversation before this turn is sent
    output_len: int  # tokens generated (ignore_eos: exactly this many)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    group: int = 0  # shared-prefix: the system prompt it shares; else the conversation index


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]
    params: dict[str, Any] = field(default_factory=dict)  # what generated it, for reports

    @property
    def num_rounds(self) -> int:
        return max((len(c.turns) for c in self.conversations), default=0)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def head(self, n: int) -> Workload:
        """The first n conversations (a capped baseline runs these)."""
        return Workload(self.name, self.conversations[:n], {**self.params, "capped_to_conversations": n})

    def single_turn_requests(self) -> list[tuple[list[int], int]]:
        """(prompt ids, output length) of each request; only for one-turn workloads."""
        if self.num_rounds > 1:
            raise ValueError(f"the {self.name} workload has several turns per conversation")
        return [(list(c.turns[0].user_ids), c.turns[0].output_len) for c in self.conversations]


def _ids(rng: np.random.Generator, n: int, token_range: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, token_range, size=n))


def random_workload(num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                    token_range: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    ins, outs = input_len.draw(rng, num_prompts), output_len.draw(rng, num_prompts)
    convs = tuple(Conversation((Turn(_ids(rng, i, token_range), o),), group=k)
                  for k, (i, o) in enumerate(zip(ins, outs)))
    return Workload("random", convs, {"num_prompts": num_prompts, "input_len": str(input_len),
                                      "output_len": str(output_len), "seed": seed})


def shared_prefix_workload(num_groups: int, prompts_per_group: int, system_len: LengthRange,
                           question_len: LengthRange, output_len: LengthRange, token_range: int,
                           seed: int) -> Workload:
    """As SGLang's generated-shared-prefix: each group's prompts start with the group's random
    system prompt and end with their own random question. Groups are interleaved (a seeded
    shuffle), so a scheduler must find the sharing rather than get it in order."""
    rng = np.random.default_rng(seed)
    convs = []
    for g in range(num_groups):
        system = _ids(rng, system_len.draw(rng, 1)[0], token_range)
        for q, o in zip(question_len.draw(rng, prompts_per_group), output_len.draw(rng, prompts_per_group)):
            convs.append(Conversation((Turn(system + _ids(rng, q, token_range), o),), group=g))
    order = rng.permutation(len(convs))
    return Workload("shared-prefix", tuple(convs[i] for i in order), {
        "num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_len": str(system_len),
        "question_len": str(question_len), "output_len": str(output_len), "seed": seed})


def multi_turn_workload(num_conversations: int, num_turns: int, system_len: LengthRange | None,
                        turn_len: LengthRange, output_len: LengthRange, token_range: int,
                        seed: int) -> Workload:
    """Conversations of `num_turns` turns; the first turn starts with its own system prompt
    (when `system_len` is given). Each later turn's prompt holds every earlier turn's output."""
    rng = np.random.default_rng(seed)
    convs = []
    for c in range(num_conversations):
        system = _ids(rng, system_len.draw(rng, 1)[0], token_range) if system_len else ()
        turns = []
        for t, (u, o) in enumerate(zip(turn_len.draw(rng, num_turns), output_len.draw(rng, num_turns))):
            turns.append(Turn((system if t == 0 else ()) + _ids(rng, u, token_range), o))
        convs.append(Conversation(tuple(turns), group=c))
    return Workload("multi-turn", tuple(convs), {
        "num_conversations": num_conversations, "num_turns": num_turns,
        "system_len": str(system_len) if system_len else None, "turn_len": str(turn_len),
        "output_len": str(output_len), "seed": seed})


def round_prompts(workload: Workload, k: int, history: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]], list[int]]:
    """Round k: (indices of conversations that have a turn k, their prompts, output lengths).
    `history[i]` is conversation i so far (its prompts and outputs)."""
    idx = [i for i, c in enumerate(workload.conversations) if k < len(c.turns)]
    prompts = [list(history[i]) + list(workload.conversations[i].turns[k].user_ids) for i in idx]
    return idx, prompts, [workload.conversations[i].turns[k].output_len for i in idx]
