"""Per-request sampling parameters. Pure Python: the tokenizer process validates with it too."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit
LOGIT_BIAS_RANGE = 100.0
LOGIT_BIAS_ALLOWED = f"an object mapping token ids >= 0 to numbers in [{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)

@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Keep the matched stop string, or the stop token's text, in the output (vLLM's name;
    # SGLang calls it no_stop_trim).
    include_stop_str_in_output: bool = False
    # Number of top log-probabilities to return per generated token (None: none).
    logprobs: int | None = None
    # Return the prompt's log-probabilities from this position on (None: none); the top-k of
    # each is `logprobs` (which must be set). Position 0 has no log-probability.
    logprob_start_len: int | None = None
    # Added to the logits before sampling: ((token id, bias), ...); a dict of them is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output (SGLang's names; at most one): the output must match a JSON schema
    # (JSON text; an object is serialized), a regex, or an EBNF grammar. The grammar's end is
    # the request's end (finish_reason "stop").
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # The output opens inside the model's thinking (SGLang's name; the chat endpoint sets it
    # under --reasoning-parser unless enable_thinking is false): the grammar constrains only
    # what follows the think-end token (constrained/reasoning.py).
    require_reasoning: bool = False
    # With require_reasoning: after this many thinking tokens the think-end token is forced, so
    # the answer always comes (vLLM's name; None: no cap). max_tokens counts both.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (JSON, msgpack) and a single stop string; store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "-1 (all tokens) or an integer >= 1")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "null or an integer in [0, 2^63)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "require_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not _is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "a number in (0, 2]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]")
        if self.logprob_start_len is not None:
            if not _is_int(self.logprob_start_len) or self.logprob_start_len < 0:
                raise bad("logprob_start_len", "null or an integer >= 0")
            if self.logprobs is None:
                raise ValueError("logprob_start_len needs logprobs (the top-k count, 0 for none)")
        if self.thinking_token_budget is not None and (not _is_int(self.thinking_token_budget)
                                                       or self.thinking_token_budget < 0):
            raise bad("thinking_token_budget", "null or an integer >= 0")
        if self.thinking_token_budget is not None and not self.require_reasoning:
            raise ValueError("thinking_token_budget caps the thinking the output opens with: it needs "
                             "require_reasoning (set by the chat endpoint when the model thinks)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not _is_num(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias must be {LOGIT_BIAS_ALLOWED}, got {token!r}: {bias!r}")
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        """Shape only; the grammar engine checks the grammar itself (a 400 that names it)."""
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        for name in given:
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if len(given) > 1:
            raise ValueError(f"json_schema, regex and ebnf are exclusive: give one, got {', '.join(given)}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Strict: unknown keys are an error that names them."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)


def _logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} (JSON keys are strings) or [[id, bias], ...] (our wire
    form) as sorted (id, bias) pairs; raises ValueError naming logit_bias."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
        items = [tuple(p) for p in bias]
    else:
        raise ValueError(f"logit_bias must be {LOGIT_BIAS_ALLOWED}, got {bias!r}")
    pairs = []
    for token, value in items:
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)
        if not _is_int(token):
            raise ValueError(f"logit_bias must be {LOGIT_BIAS_ALLOWED}, got {token!r}: {value!r}")
        if _is_int(value):
            value = float(value)
        pairs.append((token, value))
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id more than once")
    return tuple(sorted(pairs))
