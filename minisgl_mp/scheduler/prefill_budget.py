"""How many prompt tokens a step may prefill while other requests are decoding.

Every request that is decoding waits for the whole step, so a step that also prefills a long
prompt chunk is one long gap in each of their token streams. On a GPU a prefill chunk costs
about as much as the decode step it rides along with (the step is bound by reading weights);
on a CPU a prompt token costs about what a decode step's token costs, so a 512-token chunk
next to a batch of 20 decodes makes that step many times longer than the steps around it.

`MixedPrefillBudget` sizes the chunk from what the engine measures as it runs: a decode-only
step's time as a line in the batch size (fitted to the recent decode-only steps: a fixed part
and a part per decoding request), and what a prefill adds to a step as a line in its tokens
(fitted to the recent steps that prefill: the time beyond their decodes' share). The fixed part
matters: a step that carries a prompt runs the extend path, which costs something whatever the
chunk, and charging that to the chunk's tokens would make small chunks look dear and shrink
the chunk further. With decodes running, a step may prefill as many tokens as keep it within
`ratio` times a decode-only step of the same batch, and never fewer than `min_tokens`
(so a prompt always advances); with none running, the whole `--max-prefill-tokens` budget
applies (nobody waits on that step). The decode step is a line in the batch rather than one
average because under heavy load steps almost always carry a prefill: the decode-only steps
seen are the early, small ones, and the batch has grown since. A budget that adapts rather
than a fixed chunk size: the right chunk differs by model and machine by orders of magnitude.
"""

from __future__ import annotations

from collections import deque

# Prompt tokens a step may always prefill beside decodes, whatever the measured costs.
MIN_MIXED_PREFILL_TOKENS = 32
# The prompt tokens waiting (or part-prefilled) are let in within about this many steps, even
# past the time bound: when prompts arrive faster than the bound admits them, the queue would
# grow without limit (and each one's time to first token with it) while the decode batch,
# starved of new requests, shrinks. The rate a backlog sets holds until the backlog is gone:
# an eighth of what is left at each step would let a burst in geometrically, its last prompts
# in chunks at the floor for dozens of steps, each one's decode stream a step longer for it.
BACKLOG_STEPS = 8
# Steps each line is fitted to (the most recent ones of their kind).
SAMPLES = 64


class MixedPrefillBudget:
    def __init__(self, ratio: float | None, max_tokens: int, min_tokens: int = MIN_MIXED_PREFILL_TOKENS) -> None:
        """ratio None or <= 1: no bound beyond `max_tokens`."""
        self.ratio = ratio if ratio is not None and ratio > 1 else None
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self._decode: deque[tuple[int, float]] = deque(maxlen=SAMPLES)  # (batch, seconds)
        self._line: tuple[float, float] | None = None  # decode-only step = a + b * batch
        self._prefill: deque[tuple[int, float]] = deque(maxlen=SAMPLES)  # (tokens, seconds added)
        self._prefill_line: tuple[float, float] | None = None  # added = fixed + token_s * tokens
        self._drain = 0  # tokens a step lets in of the current backlog, whatever the time bound

    @property
    def token_s(self) -> float | None:
        """What one prefilled token adds to a step."""
        return None if self._prefill_line is None else self._prefill_line[1]

    @property
    def enabled(self) -> bool:
        return self.ratio is not None

    def decode_step_s(self, num_decodes: int) -> float | None:
        """The expected time of a decode-only step of `num_decodes` requests."""
        if self._line is None:
            return None
        a, b = self._line
        return max(a + b * num_decodes, 0.0) or None

    def tokens(self, num_decodes: int, backlog: int = 0) -> int:
        """The prefill budget of a step that runs `num_decodes` decodes, with `backlog` prompt
        tokens waiting to be prefilled. Called once per scheduled step: it keeps the backlog's
        rate from one step to the next."""
        # A larger backlog raises the rate; a shrinking one keeps it, so the backlog is in
        # within BACKLOG_STEPS steps of its peak; an empty one resets it.
        self._drain = max(self._drain, -(-backlog // BACKLOG_STEPS)) if backlog > 0 else 0
        return self._bounded(num_decodes, min(self._drain, backlog))

    def _bounded(self, num_decodes: int, drain: int) -> int:
        if not num_decodes or self.ratio is None or not self.token_s:
            return self.max_tokens
        step = self.decode_step_s(num_decodes)
        if step is None:
            return self.max_tokens
        fixed, token_s = self._prefill_line
        allowed = int(((self.ratio - 1.0) * step - fixed) / token_s)
        return max(self.min_tokens, min(self.max_tokens, max(allowed, drain)))

    def observe(self, seconds: float, num_decodes: int, prefill_tokens: int) -> None:
        """One step's time, with how many decodes and prefill tokens it ran."""
        if self.ratio is None or seconds <= 0:
            return
        if not prefill_tokens:
            if num_decodes:
                self._decode.append((num_decodes, seconds))
                self._line = _fit_line(self._decode)
            return
        # The decodes' share of a mixed step is a decode-only step's; before one was seen (the
        # first steps prefill alone), the whole step is the prompt's.
        base = (self.decode_step_s(num_decodes) or 0.0) if num_decodes else 0.0
        self._prefill.append((prefill_tokens, max(seconds - base, 0.0)))
        fixed, per_token = _fit_line(self._prefill)
        if per_token <= 0:
            # The chunks seen do not differ enough to tell a fixed part from a per-token one:
            # all of it per token (the cautious reading).
            fixed, per_token = 0.0, sum(y for _, y in self._prefill) / sum(x for x, _ in self._prefill)
        self._prefill_line = (max(fixed, 0.0), per_token) if per_token > 0 else None

    def to_dict(self) -> dict[str, float | int | None]:
        return {"ratio": self.ratio, "decode_line_s": self._line, "prefill_line_s": self._prefill_line,
                "tokens_with_one_decode": self._bounded(1, 0), "backlog_drain_tokens": self._drain}


def _fit_line(samples: deque[tuple[int, float]]) -> tuple[float, float]:
    """Least squares seconds = a + b * batch; a flat line (the mean) while the batches seen do
    not differ, and never a falling one (noise between close batch sizes)."""
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples)
    if var < 1e-9:
        return mean_y, 0.0
    b = max(sum((x - mean_x) * (y - mean_y) for x, y in samples) / var, 0.0)
    return mean_y - b * mean_x, b

