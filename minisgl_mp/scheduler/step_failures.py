"""A step that raises fails the requests it was running, not the scheduler: they end with an
error output, their KV is released and the page accounting is checked before the next step.
What cannot be recovered from (a broken page accounting, a device error, the same failure step
after step, any failure under tensor parallelism) is raised out of `step()` as
`FatalSchedulerError`."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from minisgl_mp.scheduler.req import FinishReason, Req

if TYPE_CHECKING:
    from minisgl_mp.scheduler.scheduler import LaunchedStep, Scheduler

logger = logging.getLogger(__name__)

# A step-level failure repeated this many steps in a row means the engine itself is broken.
MAX_REPEATED_FAILURES = 3


class FatalSchedulerError(RuntimeError):
    """The scheduler cannot go on serving; the process should exit with this message."""


def is_device_fatal(e: BaseException) -> bool:
    """Errors after which the device's state cannot be trusted (CUDA's sticky errors). Running
    out of memory is not one of them: the batch fails and memory comes back."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    text = f"{type(e).__name__}: {e}"
    return any(s in text for s in ("AcceleratorError", "CUDA error", "device-side assert", "illegal memory access"))


class StepFailureMixin:
    """The Scheduler's failure handling (its state lives on the Scheduler)."""

    def _fail_step(self: Scheduler, e: Exception, reqs: list[Req]) -> None:
        """Fail the step's requests: its batch, or (if scheduling itself raised) those it had
        touched so far."""
        what = f"{type(e).__name__}: {e}"
        if is_device_fatal(e):
            raise FatalSchedulerError(f"unrecoverable device error: {what}") from e
        if self.tp is not None:
            # A rank that failed alone (or a rank that is gone) has left the others inside a
            # collective of this step: there is no step boundary left to recover at.
            raise FatalSchedulerError(f"a step failed on tensor-parallel rank {self.tp.rank}: {what}") from e
        last, count = self._failure_streak
        count = count + 1 if what == last else 1
        self._failure_streak = (what, count)
        self.stats.failed_steps += 1
        victims = list(dict.fromkeys(r for r in reqs if not r.finished))
        logger.exception("a scheduler step failed; failing its %d request(s)", len(victims))
        if count >= MAX_REPEATED_FAILURES:
            raise FatalSchedulerError(f"the same failure in {count} steps in a row: {what}") from e
        for r in victims:
            self._fail(r, f"internal error while running the batch: {what}")

    def _fail(self: Scheduler, req: Req, message: str) -> None:
        """End `req` with an error: out of the queues, its KV released (nothing it computed goes
        into the prefix cache: this step's writes may be partial)."""
        self._failed_this_step = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.grammar_queue:
            self.grammar_queue.remove(req)
        try:
            self.kv.release(req, keep_in_cache=False)
        except Exception:  # noqa: BLE001 - the accounting check that follows names any leak
            logger.exception("releasing the KV of failed request %s", req.rid)
        req.finish_reason = FinishReason.ABORT
        self.reqs.pop(req.rid, None)
        self.stats.failed_requests += 1
        self._pending_outputs.append(replace(self._output(req, [], []), error=message))

    def _check_after_failure(self: Scheduler) -> None:
        try:
            self.check_health(full=True)
        except Exception as e:  # noqa: BLE001 - any inconsistency is fatal here
            raise FatalSchedulerError(f"KV accounting broken after a failed step: {e}") from e

    def _complete_or_fail(self: Scheduler, step: LaunchedStep) -> None:
        try:
            self._complete(step)
        except FatalSchedulerError:
            raise
        except Exception as e:  # noqa: BLE001 - as for a step that fails to run
            self._fail_step(e, step.batch.reqs)
