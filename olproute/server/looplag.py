"""How late the event loop runs: a task sleeps ``period_s`` and measures how much later
than asked it woke. A router whose loop lags answers late and sees its own health probes
time out; the lag tells an operator (``olproute_loop_lag_seconds``) and tells the health
checks when a timeout is the router's fault rather than the backend's."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class LoopLag:
    """Recent lag samples (s), kept for ``keep_s`` seconds of loop time."""

    def __init__(self, period_s: float = 0.05, keep_s: float = 60.0) -> None:
        self.period_s = period_s
        self.keep_s = keep_s
        self._samples: deque[tuple[float, float]] = deque()   # (loop time, lag s)

    async def run(self, observe: Callable[[float], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period_s)
            now = loop.time()
            self.add(now, max(0.0, now - t - self.period_s))
            if observe is not None:
                observe(self._samples[-1][1])

    def add(self, t: float, lag_s: float) -> None:
        self._samples.append((t, lag_s))
        while self._samples and self._samples[0][0] < t - self.keep_s:
            self._samples.popleft()

    def max_since(self, t: float) -> float:
        """The largest lag seen at or after loop time ``t`` (0 if none)."""
        return max((lag for when, lag in self._samples if when >= t), default=0.0)
