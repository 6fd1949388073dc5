"""The router's central buffer on the server: requests the policy holds wait here and are
decided again every slot, within bounds that keep the event loop responsive.

- At most ``admission.max_held`` requests wait at once; a request the policy would hold
  past that is refused at once (``full``).
- One task re-scores the buffer each slot, oldest first from a rotating start, and stops
  when the slot's budget (``server.hold_budget_ms`` of loop time) is spent: the rest wait
  for the next slot. A request whose patience has run out is always decided (the policy
  then sheds or defers it), so nothing outstays its patience by more than a slot or two.
- A request whose client has gone is dropped at once, unscored, and the policy forgets it.
- A policy that decides its held requests together (``joint_release``) gets them all in
  one call per slot (``DecideHeld``: the expired first, then the others from the cursor);
  the call is not cut by the budget (its cost per buffer size is measured in
  ``bench/bench_prices.py``) and the buffer is capped by ``max_held``.

The simulator re-scores every held request every slot (decisions take no simulated time);
here a decision costs loop time, so the budget is what bounds the loop's lag.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from olproute.types import Decision, Request

Decide = Callable[[Request, frozenset[int]], Decision]
DecideHeld = Callable[[Sequence[tuple[Request, frozenset[int]]]], Iterator[Decision]]


@dataclass(slots=True)
class _Held:
    request: Request
    exclude: frozenset[int]
    deadline_s: float                  # server clock: when its patience runs out
    future: asyncio.Future[Decision | None]
    client_gone: Callable[[], bool]


@dataclass(slots=True)
class HoldStats:
    """Counters since start: re-scores done, re-scores deferred to a later slot by the
    budget, requests dropped unscored because their client left."""

    rescored: int = 0
    deferred: int = 0
    dropped: int = 0
    slot_seconds: list[float] = field(default_factory=list)


class HoldQueue:
    def __init__(self, max_held: int, slot_s: float, budget_s: float,
                 now: Callable[[], float],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``now``: the server's clock (arrivals, patience); ``clock``: what the budget
        is measured with (loop time spent deciding)."""
        self.max_held = max_held
        self.slot_s = slot_s
        self.budget_s = budget_s
        self._now = now
        self._clock = clock
        self._held: dict[int, _Held] = {}
        self._cursor = 0
        self._task: asyncio.Task[None] | None = None
        self.stats = HoldStats()

    def __len__(self) -> int:
        return len(self._held)

    def full(self) -> bool:
        return len(self._held) >= self.max_held

    async def wait(self, request: Request, exclude: frozenset[int], patience_s: float,
                   decide: Decide, client_gone: Callable[[], bool],
                   decide_held: DecideHeld | None = None) -> Decision | None:
        """Hold ``request`` until the policy dispatches or sheds it (its decision), or its
        client leaves (None). The caller checks ``full()`` first. ``decide_held``: for a
        policy that decides the held requests together (else one by one, ``decide``)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Decision | None] = loop.create_future()
        rid = request.request_id
        deadline = request.arrival_s + patience_s
        self._held[rid] = _Held(request, exclude, deadline, fut, client_gone)
        self._ensure_running(decide, decide_held)
        try:
            return await fut
        finally:
            self._held.pop(rid, None)

    def _ensure_running(self, decide: Decide, decide_held: DecideHeld | None) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(decide, decide_held))

    async def _run(self, decide: Decide, decide_held: DecideHeld | None) -> None:
        """Re-score every slot while anything is held; end when the buffer empties."""
        while self._held:
            await asyncio.sleep(self.slot_s)
            if decide_held is None:
                await self.rescore(decide)
            else:
                await self.rescore_together(decide_held)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for h in list(self._held.values()):
            if not h.future.done():
                h.future.set_result(None)

    async def rescore(self, decide: Decide) -> None:
        """One slot's pass over the buffer: drop the abandoned, decide the expired, then
        the others from the cursor on until the budget is spent. After each dispatch the
        loop runs the request's handler up to its first wait, so the tracker counts the
        dispatch before the next held request is decided."""
        t0 = self._clock()
        entries = list(self._held.values())
        if not entries:
            return
        now = self._now()
        start = self._cursor % len(entries)
        order = entries[start:] + entries[:start]
        expired = [h for h in order if h.deadline_s <= now]
        waiting = [h for h in order if h.deadline_s > now]
        done_waiting = 0
        for h in expired:
            if self._one(h, decide):
                await asyncio.sleep(0)
        for h in waiting:
            if self._clock() - t0 >= self.budget_s and (done_waiting or expired):
                break
            if self._one(h, decide):
                await asyncio.sleep(0)
            done_waiting += 1
        self.stats.deferred += len(waiting) - done_waiting
        self._cursor = start + done_waiting
        self._slot_took(t0)

    async def rescore_together(self, decide_held: DecideHeld) -> None:
        """One slot's pass for a policy that decides the held requests together: drop
        the abandoned, then one ``decide_held`` call over the rest (the expired first);
        after each dispatch the loop runs the request's handler up to its first wait."""
        t0 = self._clock()
        now = self._now()
        waiting = [h for h in list(self._held.values()) if not self._gone(h)]
        if not waiting:
            return
        waiting.sort(key=lambda h: h.deadline_s > now)   # stable: the expired first
        by_id = {h.request.request_id: h for h in waiting}
        for d in decide_held([(h.request, h.exclude) for h in waiting]):
            self.stats.rescored += 1
            h = by_id[d.request_id]
            if h.future.done():   # its client left while the pass ran
                continue
            if d.action != "hold":
                h.future.set_result(d)
            if d.action == "dispatch":
                await asyncio.sleep(0)
        self._slot_took(t0)

    def _slot_took(self, t0: float) -> None:
        """Record a slot's pass: its loop time since ``t0`` (the last 256 kept)."""
        self.stats.slot_seconds.append(self._clock() - t0)
        del self.stats.slot_seconds[:-256]

    def _gone(self, h: _Held) -> bool:
        """Is the request already decided, or has its client left (then it is dropped,
        unscored)?"""
        if h.future.done():
            return True
        if h.client_gone():
            self.stats.dropped += 1
            h.future.set_result(None)
            return True
        return False

    def _one(self, h: _Held, decide: Decide) -> bool:
        """Decide one held request; True if it was dispatched."""
        if self._gone(h):
            return False
        self.stats.rescored += 1
        d = decide(h.request, h.exclude)
        if d.action != "hold":
            h.future.set_result(d)
        return d.action == "dispatch"
