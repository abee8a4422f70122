"""SGLang's and vLLM's helper endpoints, which routers, benchmark scripts and lm-eval call:

    GET  /get_model_info (/model_info)     model path, tokenizer, is_generation (the router reads it)
    GET  /get_server_info (/server_info)   the server's settings and live state
    GET  /get_load                         [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]
    GET  /version                          {"version"}
    POST /abort_request                    {"rid"} or {"abort_all": true}
    POST /tokenize, /detokenize            vLLM's (and SGLang's) shapes; GET /tokenizer_info (vLLM's)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from minisgl_mp import __version__
from minisgl_mp.server.http_io import HttpError, read_json
from minisgl_mp.server.openai_protocol import check_model
from minisgl_mp.server_config import ServerConfig
from minisgl_mp.tokenizer.fields import check_extra_fields
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import (GenerateRequest, check_input_ids, check_messages, check_template_kwargs,
                                           check_tools, make_params)

TOKENIZE_FIELDS = ("model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
                   "chat_template_kwargs", "return_token_strs")


def _architecture(config_path: str) -> tuple[str | None, list[str]]:
    try:
        cfg = json.loads((Path(config_path) / "config.json").read_text() if Path(config_path).is_dir()
                         else Path(config_path).read_text())
    except (OSError, ValueError):
        return None, []
    return cfg.get("model_type"), list(cfg.get("architectures") or [])


def add_sglang_routes(api: APIRouter, config: ServerConfig, manager: TokenizerManager) -> None:
    model, server, engine = config.model, config.server, config.engine
    model_type, architectures = _architecture(model.config_path)

    def model_info() -> dict[str, Any]:
        return {"model_path": model.name, "tokenizer_path": model.tokenizer_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": model_type, "architectures": architectures}

    @api.get("/get_model_info")
    @api.get("/model_info")
    async def get_model_info() -> Response:
        return JSONResponse(model_info())

    @api.get("/get_server_info")
    @api.get("/server_info")
    async def get_server_info() -> Response:
        stats = (await manager.admin("stats")).result
        return JSONResponse({
            "version": __version__, "model_path": model.name, "served_model_name": model.name,
            "tokenizer_path": model.tokenizer_dir, "context_length": model.context_len,
            "tp_size": 1, "dp_size": server.dp_size, "page_size": engine.page_size,
            "max_running_requests": engine.max_running_requests,
            "chunked_prefill_size": stats.get("dp_ranks", [stats])[0].get("max_prefill_tokens"),  # (per replica) "schedule_policy": engine.schedule_policy,
            "disable_radix_cache": engine.cache_type != "radix", "host": server.host, "port": server.port,
            "tool_call_parser": server.tool_call_parser, "reasoning_parser": server.reasoning_parser,
            "max_total_num_tokens": stats.get("total_tokens"),
            "internal_states": [{"num_running_reqs": s.get("running"), "num_queue_reqs": s.get("waiting")}
                                for s in _per_rank(stats)],
        })

    @api.get("/get_load")
    async def get_load() -> Response:
        stats = (await manager.admin("stats")).result
        return JSONResponse([{"dp_rank": rank, "num_reqs": s.get("running", 0) + s.get("waiting", 0),
                              "num_waiting_reqs": s.get("waiting", 0),
                              "num_tokens": s.get("total_tokens", 0) - s.get("free_tokens", 0) - s.get("evictable_tokens", 0)}
                             for rank, s in enumerate(_per_rank(stats))])

    @api.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @api.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request, server.max_payload_bytes)
        check_extra_fields(body, ("rid", "abort_all", "finished_reason", "abort_message"))
        if body.get("abort_all") is True:
            rids = list(manager.states)
        elif isinstance(body.get("rid"), str):
            rid = body["rid"]  # a /generate with n > 1 runs rid-0, rid-1, ...
            rids = [r for r in manager.states if r == rid or r.startswith(f"{rid}-")]
        else:
            raise HttpError("give a rid (string) or abort_all: true", param="rid")
        for rid in rids:
            await manager.abort(rid)
        return JSONResponse({"aborted": rids})

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_json(request, server.max_payload_bytes)
        check_extra_fields(body, TOKENIZE_FIELDS)
        check_model(body, model.name)
        ids = await _tokenize(body, manager)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": model.context_len, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = manager.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_json(request, server.max_payload_bytes)
        check_extra_fields(body, ("model", "tokens", "skip_special_tokens"))
        check_model(body, model.name)
        ids = check_input_ids(body.get("tokens"), param="tokens")
        bad = next((t for t in ids if not 0 <= t < manager.vocab_size), None)
        if bad is not None:
            raise HttpError(f"token id {bad} is outside the vocabulary [0, {manager.vocab_size})", param="tokens")
        text = manager.tokenizer.decode(ids, skip_special_tokens=bool(body.get("skip_special_tokens", False)))
        return JSONResponse({"prompt": text, "text": text})  # vLLM's key and SGLang's

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        tok = manager.tokenizer
        return JSONResponse({"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                             "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                             "chat_template": getattr(tok, "chat_template", None),
                             "model_max_length": model.context_len})


async def _tokenize(body: dict[str, Any], manager: TokenizerManager) -> list[int]:
    """A prompt (add_special_tokens, default true) or chat messages and tools (through the
    template, as a chat request renders them: vLLM's shape)."""
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise HttpError("give exactly one of 'prompt' and 'messages'")
    if body.get("messages") is not None:
        kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
        if body.get("add_generation_prompt") is False:
            raise HttpError("add_generation_prompt: false is not supported", param="add_generation_prompt")
        req = GenerateRequest(rid=None, params=make_params({"max_tokens": 1}),
                              messages=check_messages(body["messages"]), chat_template_kwargs=kwargs,
                              tools=check_tools(body.get("tools")))
        return await manager.prompt_ids(req)
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise HttpError("prompt must be a string", param="prompt")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise HttpError("add_special_tokens must be true or false", param="add_special_tokens")
    return manager.tokenizer.encode(prompt, add_special_tokens=add_special)


def _per_rank(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each scheduler replica's stats (a merged answer carries them under "dp_ranks")."""
    return stats.get("dp_ranks") or [stats]
