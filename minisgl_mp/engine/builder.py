"""Builds a ready Scheduler from an EngineConfig: model source, device, dtype, model, pool."""

from __future__ import annotations

import json
import logging
from functools import partial
from dataclasses import dataclass
from typing import Any

import torch

from minisgl_mp.constrained.base import create_grammar_backend
from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.detokenizer.byte_table import byte_table
from minisgl_mp.detokenizer.incremental import PROMPT_TAIL_TOKENS, IncrementalDetokenizer
from minisgl_mp.engine.model_runner import ModelRunner
from minisgl_mp.engine.tokenizer import load_tokenizer
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.source import ModelSource, resolve_model
from minisgl_mp.scheduler.faults import FaultPlan
from minisgl_mp.scheduler.req import Req
from minisgl_mp.scheduler.scheduler import Scheduler
from minisgl_mp.utils.device import resolve_device, resolve_weight_dtypes
from minisgl_mp.utils.memory import keep_freed_memory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    source: ModelSource
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # what the model computes in
    weight_dtype: torch.dtype  # what its linear and embedding weights are stored in
    context_len: int
    eos_ids: frozenset[int]


def resolve_engine(config: EngineConfig) -> tuple[EngineParts, Any | None]:
    """Everything decided before any weight is loaded, and the tokenizer (None when the model
    has none, e.g. dummy weights without the default model's tokenizer at hand)."""
    source = resolve_model(config.model, config.load_format, config.tokenizer)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    model_config = ModelConfig.from_file(source.config_path)
    device = resolve_device(config.device)
    dtype, weight_dtype = resolve_weight_dtypes(config.dtype, config.quantization, device, model_config.hf_dtype)
    parts = EngineParts(source, model_config, device, dtype, weight_dtype, model_config.context_len(config.context_length),
                        eos_token_ids(source, model_config, tokenizer))
    return parts, tokenizer


def eos_token_ids(source: ModelSource, model_config: ModelConfig, tokenizer: Any | None) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids = set(model_config.eos_token_ids)
    gen = source.config_path.parent / "generation_config.json"
    if source.weights is not None and gen.exists():
        with open(gen, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in ids)


def build_scheduler(config: EngineConfig, progress: bool = True, faults: FaultPlan | None = None,
                    tp: TPGroup | None = None) -> tuple[Scheduler, Any | None]:
    """The scheduler with its model loaded, and the tokenizer. `faults`: test-only injected
    failures (scheduler/faults.py). `tp`: this rank's group when config.tp_size > 1 (the
    server's scheduler processes join it; the offline engine runs one process)."""
    if (tp.size if tp is not None else 1) != config.tp_size:
        raise ValueError(f"tp_size {config.tp_size} needs one scheduler process per rank: serve it with "
                         f"python -m minisgl_mp.launch --tp-size {config.tp_size}")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    parts, tokenizer = resolve_engine(config)
    logger.info("model %s on %s in %s (weights %s), context length %d", parts.source.name, parts.device,
                parts.dtype, parts.weight_dtype, parts.context_len)
    if parts.device.type == "cpu" and config.cpu_keep_freed_memory and not keep_freed_memory():
        logger.info("malloc settings not changed (not glibc): large tensors may page-fault in each step")
    runner = ModelRunner(config, parts.source, parts.model_config, parts.device, parts.dtype,
                         parts.context_len, progress=progress, weight_dtype=parts.weight_dtype, tp=tp)
    make_checker = None if tokenizer is None else partial(stop_checker, tokenizer)
    if tokenizer is not None:
        byte_table(tokenizer)  # built now, not at the first request with a stop string
    grammar = create_grammar_backend(config.grammar_backend, tokenizer, parts.model_config.vocab_size, parts.eos_ids,
                                     config.constrained_json_any_whitespace)
    return Scheduler(config, runner, parts.eos_ids, make_checker, faults, grammar, tp), tokenizer


def stop_checker(tokenizer: Any, req: Req) -> IncrementalDetokenizer:
    """The scheduler's view of a request's text, to notice its stop strings. Built exactly as
    the detokenizer builds its own (same settings, same prompt tail), so both stop at the
    same token."""
    p = req.params
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                                  min_tokens=p.min_tokens, prompt_ids=req.token_ids[-PROMPT_TAIL_TOKENS:])
