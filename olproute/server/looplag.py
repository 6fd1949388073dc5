"""How late the event loop runs: a task sleeps ``period_s`` and measures how much later
than asked it woke. A router whose loop lags answers late and sees its own health probes
time out; the lag tells an operator (``olproute_loop_lag_seconds``, ``GET
/debug/loop-lag``) and tells the health checks when a timeout is the router's fault
rather than the backend's.

The wake-up is timed with ``time.perf_counter``: uvloop's ``loop.time()`` counts whole
milliseconds, too coarse for a lag whose goal is under one. The period is a whole number
of milliseconds, as uvloop's timers are (another period would be rounded, and the
rounding read as lag or as waking early)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LagSummary:
    """The lag samples of a window: their number and quantiles in milliseconds."""

    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


class LoopLag:
    """Recent lag samples (s), kept for ``keep_s`` seconds of loop time."""

    def __init__(self, period_s: float = 0.01, keep_s: float = 60.0) -> None:
        self.period_s = period_s
        self.keep_s = keep_s
        self._samples: deque[tuple[float, float]] = deque()   # (loop time, lag s)

    async def run(self, observe: Callable[[float], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            lag = max(0.0, time.perf_counter() - t - self.period_s)
            self.add(loop.time(), lag)
            if observe is not None:
                observe(lag)

    def add(self, t: float, lag_s: float) -> None:
        self._samples.append((t, lag_s))
        while self._samples and self._samples[0][0] < t - self.keep_s:
            self._samples.popleft()

    def max_since(self, t: float) -> float:
        """The largest lag seen at or after loop time ``t`` (0 if none)."""
        return max((lag for when, lag in self._samples if when >= t), default=0.0)

    def summary(self, since: float) -> LagSummary:
        """The samples taken at or after loop time ``since`` (zeros when none)."""
        lags = np.array([lag for when, lag in self._samples if when >= since]) * 1e3
        if lags.size == 0:
            return LagSummary(0, 0.0, 0.0, 0.0)
        p50, p99 = np.percentile(lags, [50, 99])
        return LagSummary(int(lags.size), float(p50), float(p99), float(lags.max()))
