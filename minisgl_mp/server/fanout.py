"""Running the internal requests of one HTTP request (several prompts, n > 1) concurrently.

`run_choices` yields (choice index, output) in arrival order until every choice has finished.
If one fails, or the consumer stops early (a disconnect cancels it), every other choice is
cancelled, which closes its `manager.generate()` and so aborts it in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from minisgl_mp.message.messages import LogprobEntry, TextOut
from minisgl_mp.tokenizer.manager import TokenizerManager
from minisgl_mp.tokenizer.requests import GenerateRequest, RequestError

logger = logging.getLogger("minisgl_mp.server.http")


@dataclass(frozen=True)
class Choice:
    """One internal request: prompt `prompt_index`, sample `sample_index` of n."""

    index: int  # OpenAI's choice index: prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    request: GenerateRequest
    ids: list[int]  # the tokenized, length-checked prompt
    rid: str | None = None  # None: the manager picks one
    echo: str = ""  # completions' echo: the prompt text, put before the output


@dataclass
class ChoiceResult:
    """What one choice has produced so far; `last` is its latest output."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    last: TextOut | None = None

    def add(self, out: TextOut) -> None:
        self.text.append(out.text)
        self.ids.extend(out.new_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_logprobs.extend(out.prompt_logprobs or ())
        self.last = out


async def _pump(manager: TokenizerManager, choice: Choice,
                queue: asyncio.Queue[tuple[int, TextOut | RequestError]]) -> None:
    try:
        async with contextlib.aclosing(manager.generate(choice.request, ids=choice.ids, rid=choice.rid)) as outs:
            async for out in outs:
                queue.put_nowait((choice.index, out))
    except RequestError as e:
        queue.put_nowait((choice.index, e))
    except Exception:  # noqa: BLE001 - a bug here must reach the client as a 500, not hang it
        logger.exception("request for choice %d failed", choice.index)
        queue.put_nowait((choice.index, RequestError("internal error while generating", kind="internal")))


async def run_choices(manager: TokenizerManager, choices: list[Choice]) -> AsyncIterator[tuple[int, TextOut]]:
    """Raises the first choice's RequestError, after cancelling the others."""
    queue: asyncio.Queue[tuple[int, TextOut | RequestError]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(manager, c, queue)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, RequestError):
                raise item
            yield index, item
            if item.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
