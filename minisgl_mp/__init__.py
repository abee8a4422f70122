"""minisgl_mp: a multi-process LLM serving engine (tokenizer, scheduler, detokenizer over ZMQ)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl_mp.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl_mp.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; the tokenizer and detokenizer processes import this package without it.
    if name == "LLM":
        from minisgl_mp.llm import LLM

        return LLM
    raise AttributeError(name)
