"""What a client-facing request may carry besides the fields we act on, as vLLM and SGLang treat it.

- A field we do not know is ignored and logged once per name (vLLM's behaviour): clients and
  routers add fields freely (sglang-router adds SGLang's extras to every request).
- A field we know but do not implement is accepted at the values that leave the result
  unchanged (its default, or any value where it has no effect here) and is a 400 that says so
  at any other value: silently ignoring it would change the answer behind the client's back.

Only the public endpoints are lenient; the schema between our own processes stays strict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from minisgl_mp.tokenizer.errors import RequestError

logger = logging.getLogger("minisgl_mp.tokenizer")

Check = Callable[[Any], bool]


def _unset(v: Any) -> bool:
    return v in (None, False, "", [], {})


def _any(_v: Any) -> bool:
    return True


def _one_of(*values: Any) -> Check:
    return lambda v: v is None or v in values


# name -> (values that leave the result unchanged, what to say when another value is sent)
INERT_FIELDS: dict[str, tuple[Check, str]] = {
    # Chat reads the tool and reasoning options; elsewhere they have nothing to act on. Qwen3
    # has no reasoning-effort levels (SGLang ignores reasoning_effort for it too).
    "separate_reasoning": (_any, ""),
    "stream_reasoning": (_any, ""),
    "reasoning_effort": (_any, ""),
    "parallel_tool_calls": (_any, ""),
    "tool_choice": (_one_of("none", "auto"), "tool calling is only supported on /v1/chat/completions"),
    "tools": (_unset, "tool calling is only supported on /v1/chat/completions"),
    "functions": (_unset, "function calling is not supported"),
    "function_call": (_one_of("none", "auto"), "function calling is not supported"),
    # Only fast tokenizers are loaded, which put no spaces between special tokens either way.
    "spaces_between_special_tokens": (_any, ""),
    "user": (_any, ""),
    "metadata": (_any, ""),
    "store": (_one_of(False), "stored completions are not supported"),
    "service_tier": (_any, ""),
    "log_metrics": (_any, ""),
    "rid": (_any, ""),
    "return_hidden_states": (_unset, "hidden states are not returned by this server"),
    "continue_final_message": (_unset, "continue_final_message is not supported"),
    "add_generation_prompt": (_one_of(True), "add_generation_prompt: false is not supported"),
    "lora_path": (_unset, "LoRA adapters are not supported"),
    "lora_id": (_unset, "LoRA adapters are not supported"),
    "image_data": (_unset, "this server serves a text-only model"),
    "audio_data": (_unset, "this server serves a text-only model"),
    "video_data": (_unset, "this server serves a text-only model"),
    "modalities": (_unset, "this server serves a text-only model"),
    "structural_tag": (_unset, "structural tags are not supported: use response_format, json_schema, regex or ebnf"),
    "custom_logit_processor": (_unset, "custom logit processors are not supported"),
    "custom_params": (_unset, "custom logit processors are not supported"),
    "session_params": (_unset, "sessions are not supported"),
    "token_ids_logprob": (_unset, "token_ids_logprob is not supported"),
    "return_text_in_logprobs": (_any, ""),
    "suffix": (_unset, "suffix (insertion) is not supported"),
    "echo": (_one_of(False), "echo is only supported on /v1/completions"),
    "prompt_logprobs": (_unset, "use echo with logprobs on /v1/completions, or /generate's logprob_start_len"),
    "guided_json": (_unset, "vLLM's guided decoding fields are not read here: use response_format, json_schema, regex or ebnf"),
    "guided_regex": (_unset, "vLLM's guided decoding fields are not read here: use response_format, json_schema, regex or ebnf"),
    "guided_choice": (_unset, "vLLM's guided decoding fields are not read here: use response_format, json_schema, regex or ebnf"),
    "guided_grammar": (_unset, "vLLM's guided decoding fields are not read here: use response_format, json_schema, regex or ebnf"),
    "use_beam_search": (_one_of(False), "beam search is not supported"),
    "truncate_prompt_tokens": (_unset, "prompt truncation is not supported"),
    "best_of": (_one_of(1), "best_of is not supported"),
    "stream_interval": (_any, ""),
    "n": (_one_of(1), "n > 1 is not supported on this endpoint"),
    "data_parallel_rank": (_any, ""),
}

_logged: set[str] = set()


def check_extra_fields(body: dict[str, Any], known: Iterable[str], where: str = "") -> None:
    """Refuse inert fields at a value that would matter; ignore (and log once) unknown ones."""
    known = set(known)
    for name, value in body.items():
        if name in known:
            continue
        inert = INERT_FIELDS.get(name)
        if inert is not None:
            ok, why = inert
            if not ok(value):
                raise RequestError(f"{where}{name}={value!r} is not supported: {why}", param=name)
            continue
        if name not in _logged:
            _logged.add(name)
            logger.warning("ignoring unknown request field %r (logged once per name)", f"{where}{name}")
