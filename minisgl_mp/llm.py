"""The offline engine: the scheduler in-process, no sockets. Tests and benchmarks drive it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Sequence

from minisgl_mp.detokenizer.incremental import PROMPT_TAIL_TOKENS, IncrementalDetokenizer, visible_ids
from minisgl_mp.engine.builder import build_scheduler
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.sampling_params import SamplingParams

# Text, token ids, or a tokenizer's output holding them under "input_ids".
Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.scheduler, self.tokenizer = build_scheduler(self.config, progress=False)
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, Mapping):  # a tokenizer's output, e.g. apply_chat_template(tokenize=True)
            prompt = prompt["input_ids"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)  # as the server does: the tokenizer's own special tokens
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[dict[str, Any]]:
        """One result per prompt: token_ids, text, logprobs, finish_reason, usage. A request that
        fails inside the engine (a failed step) has finish_reason "error" and the reason under
        "error"; the other requests of the call go on. A prompt that cannot run at all raises
        ValueError before anything runs."""
        if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")

        rids, detoks, results = [], {}, {}
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"offline-{next(self._ids)}"
                ids = self.encode(prompt)
                self.scheduler.add_request(rid, ids, p)
                rids.append(rid)
                if self.tokenizer is not None:
                    detoks[rid] = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens,
                                                         stop=p.stop, min_tokens=p.min_tokens, prompt_ids=ids[-PROMPT_TAIL_TOKENS:],
                                                         include_stop=p.include_stop_str_in_output)
                results[rid] = {"token_ids": [], "logprobs": [], "prompt_logprobs": []}
        except Exception:
            # One bad prompt fails the whole call: drop the requests already queued by it.
            for rid in rids:
                self.scheduler.abort(rid)
            raise

        while self.scheduler.has_work:
            for out in self.scheduler.step():
                res = results.get(out.rid)
                if res is None:  # the abort notice of a request from a call that failed
                    continue
                res["token_ids"].extend(out.new_token_ids)
                res["logprobs"].extend(out.logprobs)
                res["prompt_logprobs"].extend(out.prompt_logprobs)
                d = detoks.get(out.rid)
                if d is not None:
                    d.push(visible_ids(out.new_token_ids, out.finished, out.matched_stop, d.include_stop))
                if out.error is not None:  # this request failed; the others went on
                    res.update(finish_reason="error", error=out.error)
                elif out.finished:
                    res.update(finish_reason=out.finish_reason, matched_stop=out.matched_stop,
                               usage={"prompt_tokens": out.prompt_tokens,
                                      "completion_tokens": out.completion_tokens,
                                      "cached_tokens": out.cached_tokens})
                    if out.spec_verify_ct:
                        res["usage"].update(spec_verify_ct=out.spec_verify_ct,
                                            spec_accept_length=1 + out.spec_accepted_tokens / out.spec_verify_ct)
        for rid in rids:
            d = detoks.get(rid)
            if d is not None:
                d.finish()
            results[rid]["text"] = d.text if d is not None else None
        return [results[rid] for rid in rids]

    def shutdown(self) -> None:
        self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
