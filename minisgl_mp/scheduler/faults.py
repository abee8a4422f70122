"""Test-only fault injection, so that tests can drive the recovery paths of the real server.

`MINISGL_MP_FAULTS` lists faults as `where@step`, comma-separated:

    forward@5     the 5th model forward of this process raises InjectedFault
    forward@5+    every forward from the 5th on raises (a failure that repeats)
    sample@3      sampling in the 3rd forward's step raises
    hang@4        the 4th forward sleeps for an hour first (for the watchdog)

Steps count model forwards from 1. Unset (the normal case), nothing is ever injected.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FAULTS_ENV = "MINISGL_MP_FAULTS"
WHERE = ("forward", "sample", "hang")
HANG_SECONDS = 3600.0


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault."""


@dataclass(frozen=True)
class FaultPlan:
    # where -> (first step, repeats from there on)
    faults: tuple[tuple[str, int, bool], ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        faults = []
        for item in (spec or "").replace(" ", "").split(","):
            if not item:
                continue
            where, _, step = item.partition("@")
            repeat = step.endswith("+")
            step = step.rstrip("+")
            if where not in WHERE or not step.isdigit() or int(step) < 1:
                raise ValueError(f"{FAULTS_ENV}: {item!r} is not where@step (where: {', '.join(WHERE)}; "
                                 "step >= 1, optionally followed by +)")
            faults.append((where, int(step), repeat))
        return cls(tuple(faults))

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls.parse(os.environ.get(FAULTS_ENV))

    def _hit(self, where: str, step: int) -> str | None:
        """The fault (as written in the spec) that fires here, if any."""
        for w, s, repeat in self.faults:
            if w == where and (step == s or (repeat and step >= s)):
                return f"{w}@{s}{'+' if repeat else ''}"
        return None

    def before(self, where: str, step: int) -> None:
        if not self.faults:
            return
        if where == "forward" and self._hit("hang", step):
            time.sleep(HANG_SECONDS)
        fault = self._hit(where, step)
        if fault is not None:  # the same text each time a repeating fault fires
            raise InjectedFault(f"injected fault {fault} ({FAULTS_ENV})")
