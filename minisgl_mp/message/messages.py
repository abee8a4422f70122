"""The messages between the three processes, grouped by who receives them.

    tokenizer --SCHEDULER_CHANNEL--> scheduler --DETOKENIZER_CHANNEL--> detokenizer
        ^                                                                   |
        +------------------------TOKENIZER_CHANNEL-------------------------+

With --dp-size N there are N schedulers, each with its own SCHEDULER_CHANNEL inbox; all push to
the one detokenizer. The scheduler's errors and admin replies travel through the detokenizer too, so that everything
about a request reaches the tokenizer process in the order it happened.
"""

from __future__ import annotations

from typing import Any

from minisgl_mp.message.codec import Channel, TokenIds, message

# Bound on one internal message. A batch of outputs for max_running_requests requests, or a
# prompt of a million token ids, fits well inside it.
INTERNAL_MAX_BYTES = 64 << 20


# ---- to the scheduler ---------------------------------------------------------------------------
@message("generate")
class GenerateReq:
    rid: str
    input_ids: TokenIds
    sampling_params: dict[str, Any]


@message("abort")
class AbortReq:
    rid: str


@message("admin")
class AdminReq:
    rid: str
    command: str  # "ping", "stats", "flush_cache", "check_health"


@message("check_grammar")
class CheckGrammarReq:
    """Is this request's grammar valid? Answered at once with an AdminReply (ok, or
    {"error": ...}) and its compile started, so that a bad one is a 400 before any response
    begins (a stream's status line included)."""

    rid: str
    sampling_params: dict[str, Any]


@message("shutdown")
class ShutdownReq:
    reason: str


# ---- to the detokenizer (and passed on to the tokenizer process) ---------------------------------
@message("detok_params")
class DetokParams:
    """Sent once, with a request's first output, so the detokenizer can decode it."""

    skip_special_tokens: bool
    stop: list[str]
    min_tokens: int
    prompt_tail: TokenIds
    include_stop: bool = False  # keep the matched stop string / stop token's text


@message("logprob")
class LogprobEntry:
    logprob: float
    top_ids: TokenIds
    top_logprobs: list[float]


@message("token_out")
class TokenOut:
    rid: str
    new_ids: TokenIds
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[LogprobEntry]
    detok: DetokParams | None = None
    # With a request's first output, when it asked for prompt log-probabilities.
    prompt_logprobs: list[LogprobEntry] | None = None
    # Speculative decoding, so far: verification steps and the drafts they accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0


@message("batch_token_out")
class BatchTokenOut:
    outputs: list[TokenOut]


@message("req_error")
class ReqError:
    rid: str
    message: str
    kind: str  # "invalid_request", "internal"


@message("admin_reply")
class AdminReply:
    rid: str
    ok: bool
    result: dict[str, Any]


# ---- to the tokenizer process ---------------------------------------------------------------------
@message("text_out")
class TextOut:
    rid: str
    text: str  # new text since the last output
    new_ids: TokenIds
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[LogprobEntry]
    prompt_logprobs: list[LogprobEntry] | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_accept_length(self) -> float:
        """Tokens per verification step (SGLang's spec_accept_length); 0 before any."""
        return 1 + self.spec_accepted_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0


@message("batch_text_out")
class BatchTextOut:
    outputs: list[TextOut]


SCHEDULER_CHANNEL = Channel("scheduler", GenerateReq, AbortReq, AdminReq, CheckGrammarReq, ShutdownReq,
                            max_bytes=INTERNAL_MAX_BYTES)
DETOKENIZER_CHANNEL = Channel("detokenizer", BatchTokenOut, ReqError, AdminReply, ShutdownReq,
                              max_bytes=INTERNAL_MAX_BYTES)
TOKENIZER_CHANNEL = Channel("tokenizer", BatchTextOut, ReqError, AdminReply,
                            max_bytes=INTERNAL_MAX_BYTES)
