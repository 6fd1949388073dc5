"""What the router knows of each engine: fresh snapshots, or stale ones (BEAR paper's
staleness study: 0, 25, 100, 400, 1000 ms).

With ``age_s > 0`` each engine publishes a snapshot whenever it starts a batch or falls
idle; the router at time t sees, per engine, the latest one published at or before
t - age_s, plus the requests it dispatched there that the snapshot does not hold and
that have not finished (the router tracks its own dispatches and finishes at once).

With ``view="router"`` each snapshot is reduced to what a router tracking its own traffic
rebuilds of it (``olproute.routing.tracked.router_view``: dispatch order, no batch in flight,
nothing computed of a queued prefill, preempted requests still running), as
``olproute serve`` sees real backends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from olproute.routing.tracked import router_view
from olproute.sim.engine import SimEngine
from olproute.types import EngineSnapshot

FloatArray = npt.NDArray[np.float64]


class SnapshotFeed:
    def __init__(self, engines: Sequence[SimEngine], age_s: float,
                 view: Literal["engine", "router"] = "engine") -> None:
        if age_s < 0:
            raise ValueError("snapshot age must be >= 0")
        self.engines = list(engines)
        self.age_s = age_s
        self.view_of = view
        # per engine, for the router view: request_id -> dispatch time, unfinished, and
        # the prompt tokens the router expected cached (when some)
        self._dispatch_s: list[dict[int, float]] = [{} for _ in engines]
        self._cached: list[dict[int, int]] = [{} for _ in engines]
        self._published: list[deque[EngineSnapshot]] = [deque() for _ in engines]
        # per engine: request_id -> (dispatch time, prompt, predicted decode, prompt tokens
        # the router expected cached there), unfinished
        self._dispatched: list[dict[int, tuple[float, int, int, int]]] = [
            {} for _ in engines]

    def publish(self, g: int, now_s: float) -> None:
        if self.age_s > 0:
            self._published[g].append(self.engines[g].snapshot(now_s))

    def dispatched(self, g: int, now_s: float, request_id: int, prompt: int,
                   predicted: int, cached: int = 0) -> None:
        if self.age_s > 0:
            self._dispatched[g][request_id] = (now_s, prompt, predicted, cached)
        if self.view_of == "router":
            self._dispatch_s[g][request_id] = now_s
            if cached:
                self._cached[g][request_id] = cached

    def finished(self, g: int, request_id: int) -> None:
        if self.age_s > 0:
            self._dispatched[g].pop(request_id, None)
        if self.view_of == "router":
            self._dispatch_s[g].pop(request_id, None)
            self._cached[g].pop(request_id, None)

    def _seen(self, g: int, snap: EngineSnapshot) -> EngineSnapshot:
        if self.view_of == "engine":
            return snap
        return router_view(snap, self._dispatch_s[g], self.engines[g].spec, self._cached[g])

    def view(self, now_s: float) -> tuple[tuple[EngineSnapshot, ...],
                                         tuple[FloatArray | None, ...] | None]:
        """(snapshots, pending) as the router sees them at now_s; a pending row has a
        fourth column, its cached prompt tokens, when one of them has some."""
        if self.age_s == 0:
            return tuple(self._seen(g, e.snapshot(now_s))
                         for g, e in enumerate(self.engines)), None
        horizon = now_s - self.age_s
        snaps: list[EngineSnapshot] = []
        pending: list[FloatArray | None] = []
        for g, q in enumerate(self._published):
            # keep the newest snapshot at or before the horizon; older ones are never
            # needed again because simulated time only moves forward
            while len(q) > 1 and q[1].time_s <= horizon:
                q.popleft()
            snap = q[0] if q and q[0].time_s <= horizon else self._empty(g, horizon)
            snaps.append(self._seen(g, snap))
            known = set(snap.request_ids.tolist())
            # dicts keep insertion order, which is dispatch order
            rows = [(p, d, t, c) for rid, (t, p, d, c) in self._dispatched[g].items()
                    if rid not in known]
            table = np.array(rows, dtype=np.float64).reshape(len(rows), 4)
            pending.append(None if not rows else table if table[:, 3].any()
                           else np.ascontiguousarray(table[:, :3]))
        return tuple(snaps), tuple(pending)

    def _empty(self, g: int, time_s: float) -> EngineSnapshot:
        """Before an engine's first publication: it was idle and empty."""
        spec = self.engines[g].spec
        return EngineSnapshot(
            time_s=time_s, table=np.zeros((0, 5), dtype=np.int64), num_running=0,
            num_free_blocks=spec.num_kv_blocks, inflight=np.zeros((0, 2), dtype=np.int64),
            inflight_start_s=time_s, request_ids=np.zeros(0, dtype=np.int64))
