"""Notices a scheduler step that never ends (a hung kernel, a deadlock) and stops the server.

The loop marks the start and end of each step; a daemon thread checks the mark. A step longer
than the timeout dumps every thread's stack to the log (faulthandler: it works while the main
thread is stuck inside C code), reports the reason to the launcher and ends the process, which
makes the launcher stop the rest and exit non-zero.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger("minisgl_mp.scheduler")


class Watchdog:
    def __init__(self, timeout_s: float, on_expire: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_expire = on_expire
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._watch, name="scheduler-watchdog", daemon=True)
        if timeout_s > 0:
            self._thread.start()

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(period)
            started = self._step_started
            if started is None or time.monotonic() - started <= self.timeout_s:
                continue
            reason = (f"watchdog: a scheduler step has run for {time.monotonic() - started:.1f}s, over "
                      f"--watchdog-timeout {self.timeout_s:g}s; every thread's stack is dumped in the scheduler's log")
            logger.error("%s; dumping stacks", reason)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            self._on_expire(reason)
            os._exit(1)
