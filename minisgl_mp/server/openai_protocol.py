"""OpenAI's /v1/completions and /v1/chat/completions requests: validated field by field, then
tokenized, length-checked and fanned out into one internal request per choice.

Everything is checked before anything starts, so a bad second prompt never leaves the first
running. Sampling fields keep SamplingParams' own error messages (they name the field and the
allowed range), so HTTP and the ZMQ endpoint reject the same request with the same words.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.server.chat_output import ChatOutputSpec
from minisgl_mp.server.chat_tools import model_thinks, tool_options
from minisgl_mp.server.fanout import Choice
from minisgl_mp.server.http_io import HttpError, opt_bool
from minisgl_mp.tokenizer.fields import check_extra_fields
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import GenerateRequest, RequestError, check_messages, check_template_kwargs

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "top_k", "min_p", "min_tokens", "repetition_penalty",
                   "ignore_eos", "stop_token_ids", "skip_special_tokens", "logit_bias", "include_stop_str_in_output",
                   "json_schema", "regex", "ebnf", "thinking_token_budget")
# Other engines' names for a sampling field: SGLang's no_stop_trim is vLLM's include_stop_str_in_output,
# SGLang's thinking_budget vLLM's thinking_token_budget.
FIELD_ALIASES = {"no_stop_trim": "include_stop_str_in_output", "thinking_budget": "thinking_token_budget"}
_COMMON_FIELDS = {"model", "n", "stream", "stream_options", "response_format", *SAMPLING_FIELDS, *FIELD_ALIASES}
# A raw prompt may open a thinking or not: the client says (SGLang's /generate field).
COMPLETION_FIELDS = frozenset(_COMMON_FIELDS | {"prompt", "logprobs", "echo", "require_reasoning"})
CHAT_FIELDS = frozenset(_COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                          "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
                                          "separate_reasoning", "stream_reasoning"})
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits
MAX_CHAT_TOP_LOGPROBS = 20
_SEED_MOD = 2**63


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated, tokenized completions (chat=False) or chat request."""

    chat: bool
    id: str
    created: int
    model: str
    n: int
    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: bool  # choices carry logprobs
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    # max_tokens 0 with echo: score the prompt only. One token is generated (the engine always
    # samples one) and left out of the response.
    prompt_only: bool = False
    output: ChatOutputSpec = ChatOutputSpec()  # chat: the parsers its choices' text goes through


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_model(body: dict[str, Any], model: str) -> None:
    name = body.get("model")
    if name is None:
        return  # optional here, unlike OpenAI: curl users need not repeat the only model's name
    if not isinstance(name, str):
        raise HttpError("model must be a string", param="model")
    if name != model:
        raise HttpError(f"the model {name!r} does not exist; this server serves {model!r}",
                        kind="not_found", param="model", code="model_not_found")


def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise HttpError(f"{name} must be null or an integer in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _n(body: dict[str, Any], max_n: int) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= max_n:
        raise HttpError(f"n must be an integer in [1, {max_n}] (--max-n), got {n!r}", param="n")
    return n


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise HttpError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(opts, dict):
        raise HttpError("stream_options must be an object", param="stream_options")
    check_extra_fields(opts, ("include_usage", "continuous_usage_stats"), where="stream_options.")
    return opt_bool(opts, "include_usage"), opt_bool(opts, "continuous_usage_stats")




def with_aliases(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with other engines' field names (FIELD_ALIASES) under ours; both at once is an error."""
    out = dict(body)
    for alias, name in FIELD_ALIASES.items():
        if out.get(alias) is not None:
            if out.get(name) is not None and out[name] != out[alias]:
                raise HttpError(f"{alias} and {name} are the same setting; give one", param=alias)
            out[name] = out.pop(alias)
    return out


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def response_format_schema(body: dict[str, Any]) -> str | None:
    """OpenAI's response_format as the JSON schema (text) it constrains the output to, or None
    for free text. json_object is any JSON object (SGLang's reading); json_schema's `strict` is
    accepted either way: the grammar always holds the output to the schema."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMAT_TYPES:
        raise HttpError(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                        f"got {rf!r}", param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return '{"type": "object"}'
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise HttpError("response_format.json_schema must be an object: {name, schema, strict}",
                        param="response_format")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise HttpError(f"response_format.json_schema.schema must be an object, got {schema!r}",
                        param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise HttpError("response_format.json_schema.strict must be true or false", param="response_format")
    return json.dumps(schema)


def _grammar_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The constraint of an OpenAI request: response_format, or SGLang's json_schema / regex /
    ebnf (at most one of them all)."""
    schema = response_format_schema(body)
    if schema is None:
        return {}
    given = [n for n in ("json_schema", "regex", "ebnf") if body.get(n) is not None]
    if given:
        raise HttpError(f"response_format and {given[0]} both constrain the output; give one",
                        param="response_format")
    return {"json_schema": schema}


def sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from the non-null `fields`; its messages start with the field's name."""
    try:
        return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None})
    except (ValueError, TypeError) as e:
        message = str(e)
        first = message.split(" ", 1)[0]
        known = first in SAMPLING_FIELDS or first in ("logprobs", "logprob_start_len")
        raise HttpError(message, param=first if known else None) from None


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts (text or token ids)."""
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise HttpError(f"prompt must be {shapes} (non-empty)", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise HttpError(f"prompt must be {shapes}", param="prompt")


async def _tokenize(manager: TokenizerManager, req: GenerateRequest) -> list[int]:
    try:
        return await manager.prompt_ids(req)
    except RequestError as e:
        if e.param == "input_ids":
            e.param = "prompt"
        raise


def _fan_out(prompts: list[tuple[GenerateRequest, list[int], str]], n: int) -> list[Choice]:
    """n choices per prompt, prompt-major. With a seed, sample j uses seed + j, so the choices
    differ from each other while the same request still gives the same texts."""
    choices = []
    for p, (req, ids, echo) in enumerate(prompts):
        for j in range(n):
            seed = req.params.seed
            r = req if j == 0 or seed is None else dataclasses.replace(
                req, params=dataclasses.replace(req.params, seed=(seed + j) % _SEED_MOD))
            choices.append(Choice(index=p * n + j, prompt_index=p, sample_index=j, request=r, ids=ids, echo=echo))
    return choices


def _new_request(chat: bool, model: str, n: int, choices: list[Choice], stream: bool,
                 usage_opts: tuple[bool, bool], logprobs: bool, prompt_only: bool = False,
                 output: ChatOutputSpec = ChatOutputSpec()) -> OpenAIRequest:
    prefix = "chatcmpl" if chat else "cmpl"
    return OpenAIRequest(chat=chat, id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model, n=n,
                         choices=choices, stream=stream, include_usage=usage_opts[0], logprobs=logprobs,
                         continuous_usage=usage_opts[1], prompt_only=prompt_only, output=output)


async def parse_completion(body: dict[str, Any], manager: TokenizerManager) -> OpenAIRequest:
    server, model = manager.config.server, manager.config.model.name
    check_extra_fields(body, COMPLETION_FIELDS)
    body = with_aliases(body)
    check_model(body, model)
    if "prompt" not in body:
        raise HttpError("prompt is required", param="prompt")
    prompts = _prompts(body["prompt"])
    n = _n(body, server.max_n)
    stream = opt_bool(body, "stream")
    usage_opts = _stream_options(body, stream)
    echo = opt_bool(body, "echo")
    top = _opt_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    fields = {**{k: body.get(k) for k in SAMPLING_FIELDS}, "logprobs": top, **_grammar_fields(body),
              "require_reasoning": body.get("require_reasoning")}
    # vLLM's way to score a prompt: max_tokens 0 with echo (lm-eval's loglikelihood sends 1).
    prompt_only = body.get("max_tokens") == 0 and _is_int(body["max_tokens"])
    if prompt_only:
        if not echo:
            raise HttpError("max_tokens 0 is only allowed with echo: true (it scores the prompt)", param="max_tokens")
        fields.update(max_tokens=1, min_tokens=None)
    if echo and top is not None:
        fields["logprob_start_len"] = 0  # the echoed prompt gets its log-probabilities too
    params = sampling_params(fields)
    manager.admit_check(len(prompts) * n)  # fail fast, before tokenizing anything
    tokenized = []
    for prompt in prompts:
        req = (GenerateRequest(rid=None, params=params, stream=stream, text=prompt) if isinstance(prompt, str)
               else GenerateRequest(rid=None, params=params, stream=stream, input_ids=prompt))
        ids = await _tokenize(manager, req)
        echoed = "" if not echo else prompt if isinstance(prompt, str) else manager.tokenizer.decode(ids)
        tokenized.append((req, ids, echoed))
    choices = _fan_out(tokenized, n)
    manager.admit_check(len(choices))
    return _new_request(False, model, n, choices, stream, usage_opts, top is not None, prompt_only)


async def parse_chat(body: dict[str, Any], manager: TokenizerManager) -> OpenAIRequest:
    server, model, context_len = manager.config.server, manager.config.model.name, manager.context_len
    check_extra_fields(body, CHAT_FIELDS)
    body = with_aliases(body)
    check_model(body, model)
    if "messages" not in body:
        raise HttpError("messages is required", param="messages")
    messages = check_messages(body["messages"])
    template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    tools, schema, output = tool_options(body, manager, template_kwargs)
    thinks = model_thinks(manager, template_kwargs)
    budget = body.get("thinking_token_budget")
    if budget is not None:  # checked here too: with thinking off it is dropped, never a sampling field
        if server.reasoning_parser is None:
            raise HttpError("thinking_token_budget needs a server started with --reasoning-parser (it says where "
                            "the model's thinking ends)", param="thinking_token_budget")
        if not _is_int(budget) or budget < 0:
            raise HttpError(f"thinking_token_budget must be null or an integer >= 0, got {budget!r}",
                            param="thinking_token_budget")
    n = _n(body, server.max_n)
    stream = opt_bool(body, "stream")
    usage_opts = _stream_options(body, stream)
    want_logprobs = opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise HttpError("top_logprobs requires logprobs: true", param="top_logprobs")
    fields = {**{k: body.get(k) for k in SAMPLING_FIELDS}, **_grammar_fields(body)}
    fields["logprobs"] = (top or 0) if want_logprobs else None
    # A thinking model's grammar (and budget) waits for its thinking to end; with thinking off
    # the grammar starts at once and there is no thinking to cap.
    fields["require_reasoning"] = thinks
    if not thinks:
        fields["thinking_token_budget"] = None
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name wins
        if not _is_int(body["max_completion_tokens"]) or body["max_completion_tokens"] < 1:
            raise HttpError(f"max_completion_tokens must be an integer >= 1, got {body['max_completion_tokens']!r}",
                            param="max_completion_tokens")
        fields["max_tokens"] = body["max_completion_tokens"]
    if schema is not None:  # tool_choice "required" or a named function: the calls' schema
        if any(fields.get(n) is not None for n in ("json_schema", "regex", "ebnf")):
            raise HttpError("tool_choice 'required' or a named function constrains the output itself; "
                            "it cannot be combined with response_format or json_schema / regex / ebnf",
                            param="tool_choice")
        fields["json_schema"] = schema
    # Without a limit a chat reply may use the rest of the context (OpenAI's default); the
    # placeholder validates the other fields until the prompt's length is known.
    unlimited = fields["max_tokens"] is None
    if unlimited:
        fields["max_tokens"] = context_len
    params = sampling_params(fields)
    manager.admit_check(n)
    probe = dataclasses.replace(params, max_tokens=1, min_tokens=0) if unlimited else params
    ids = await _tokenize(manager, GenerateRequest(rid=None, params=probe, stream=stream, messages=messages,
                                                   chat_template_kwargs=template_kwargs, tools=tools))
    if unlimited:
        try:
            params = dataclasses.replace(params, max_tokens=context_len - len(ids))
        except ValueError as e:  # min_tokens over what the context leaves
            raise HttpError(str(e), param="min_tokens") from None
    req = GenerateRequest(rid=None, params=params, stream=stream, messages=messages,
                          chat_template_kwargs=template_kwargs, tools=tools)
    choices = _fan_out([(req, ids, "")], n)
    manager.admit_check(len(choices))
    return _new_request(True, model, n, choices, stream, usage_opts, want_logprobs, output=output)
