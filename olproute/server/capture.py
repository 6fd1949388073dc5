"""What the live certificate and the re-solves need of a running ``bid_price``, captured
on the event loop (``olproute.server.certify_live`` checks it,
``olproute.server.resolving`` re-solves it): per request, at its **first** decision, its
arrival, prompt, TTFT target and the per-instance figures bid_price decided with (the
decision's explanation, :data:`EXPLAINED`), then its outcome; per policy tick, the free
capacity and the prices after the tick's update.

Bounded: a ring of the most recent requests (preallocated arrays; a decision writes one
row) and the ticks of the last two windows (the longer of the two jobs'). ``pack``
selects the certificate's window and copies its requests into a
:class:`~olproute.routing.live_window.LiveWindow`, with the ticks' price updates and the
free capacity at its start (arrays no one writes again: shared, not copied);
``pack_recent`` the re-solve's, on the latest tick's free capacity.

**The window** (``window_bounds``) ends at the arrival of the first request still
running (its outcome unknown), or now; a request still running after a whole window is
left out of that rule (it would hold the window back for ever) and counts as not
finished. It starts ``certify_window_s`` earlier, but not before a request the ring has
evicted, nor before the oldest of the most recent ``certify_max_requests``; then it
moves up to the first tick at or after that time (the LP's initial occupancy is the free
capacity of the last tick at or before its start). A window that reaches back to the
server's start starts there (time 0): nothing ran before it, and the LP's initial
occupancy before the first tick is an empty cluster.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config.schema import PriceConfig, RewardConfig
from olproute.routing.live_window import LiveWindow, max_delay_slots
from olproute.types import Decision, Outcome, PriceView, Request

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# the per-instance tuples of bid_price's explanation the LP is built from
EXPLAINED = ("ttft_s", "tpot_s", "decode_tokens", "utility", "exec_ttft_s")


@dataclass(frozen=True, slots=True)
class Tick:
    """One policy tick: the prices after its update (slot i starts at ``origin_s + i *
    slot_s``; ``origin_s`` NaN before the first update), the free capacity, and the
    compute budget (prefill tokens per slot) per instance."""

    time_s: float
    origin_s: float
    num_updates: int
    prices: FloatArray
    free: FloatArray
    compute_budget: FloatArray


class LiveCapture:
    """The rings. Mutated on the event loop only; ``pack`` copies what it hands out."""

    def __init__(self, num_instances: int, capacity: int) -> None:
        self.num_instances = num_instances
        self.num_unexplained = 0     # first decisions whose explanation lacked EXPLAINED
        # the latest arrival the ring evicted (overwrote): a window starts after it
        self.evicted_s = -math.inf
        self.last_problem: str | None = None
        self.first_decided_s = math.inf   # the first request's first decision
        self.ticks: deque[Tick] = deque()
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        g = self.num_instances
        self.capacity = capacity
        self.request_id = np.full(capacity, -1, dtype=np.int64)
        self.seq = np.full(capacity, -1, dtype=np.int64)
        self.scalars = np.full((capacity, 4), np.nan)  # arrival, prompt, target, first seen
        self.per_instance = np.full((len(EXPLAINED), capacity, g), np.nan)
        self.instance = np.full(capacity, -1, dtype=np.int64)
        self.times = np.full((capacity, 2), np.nan)    # first token, finish
        self.done = np.zeros(capacity, dtype=bool)
        self._slot: dict[int, int] = {}
        self._next = 0

    @property
    def num_requests(self) -> int:
        return len(self._slot)

    # -- the request path: a few row writes ----------------------------------------------
    def decided(self, req: Request, decision: Decision, now_s: float) -> bool:
        """Record a request at its first decision (later ones are ignored); False when
        the explanation lacks one of :data:`EXPLAINED` (nothing is recorded then)."""
        rid = req.request_id
        if rid in self._slot:
            return True
        expl = decision.explanation
        missing = [k for k in EXPLAINED if len(expl.get(k, ())) != self.num_instances]
        if missing:
            self.num_unexplained += 1
            self.last_problem = (f"the policy's explanation has no per-instance "
                                 f"{', '.join(missing)}")
            return False
        i = self._next % self.capacity
        old = int(self.request_id[i])
        if old >= 0:
            del self._slot[old]
            self.evicted_s = max(self.evicted_s, float(self.scalars[i, 0]))
        self._slot[rid] = i
        self.first_decided_s = min(self.first_decided_s, now_s)
        self.request_id[i] = rid
        self.seq[i] = self._next
        self._next += 1
        self.scalars[i] = (req.arrival_s, req.prompt_tokens, req.ttft_target_s, now_s)
        for k, key in enumerate(EXPLAINED):
            self.per_instance[k, i] = expl[key]
        self.instance[i] = -1
        self.times[i] = np.nan
        self.done[i] = False
        return True

    def finished(self, outcome: Outcome) -> None:
        """A recorded request's outcome (served, failed or refused)."""
        i = self._slot.get(outcome.request_id)
        if i is None:
            return
        self.instance[i] = -1 if outcome.instance is None else outcome.instance
        self.times[i] = (np.nan if outcome.first_token_s is None else outcome.first_token_s,
                         np.nan if outcome.finish_s is None else outcome.finish_s)
        self.done[i] = True

    def dropped(self, request_id: int) -> None:
        """A recorded request that will have no outcome (its client left while it was
        held): not served."""
        i = self._slot.get(request_id)
        if i is not None:
            self.instance[i] = -1
            self.done[i] = True

    # -- off the request path ------------------------------------------------------------
    def ticked(self, now_s: float, view: PriceView, keep_s: float) -> None:
        """Record a tick (the view's arrays are copies already) and drop the ticks before
        the last one at or before ``now_s - keep_s``."""
        origin = np.nan if view.origin_s is None or view.num_updates == 0 else view.origin_s
        self.ticks.append(Tick(now_s, origin, view.num_updates, view.prices, view.free,
                               np.asarray(view.compute_budget, dtype=np.float64)))
        while len(self.ticks) > 1 and self.ticks[1].time_s <= now_s - keep_s:
            self.ticks.popleft()

    def why_empty(self) -> str:
        """Why a window packed nothing: the last recording problem when nothing was
        recorded, else no tick yet, else no request in the window."""
        if self.num_requests == 0 and self.last_problem:
            return self.last_problem
        return "no price tick yet" if not self.ticks else "no request arrived in the window"

    def resize(self, capacity: int) -> None:
        """Keep the most recent ``capacity`` requests in a ring of that size."""
        if capacity == self.capacity:
            return
        order = self.order()
        if len(order) > capacity:
            self.evicted_s = max(self.evicted_s, float(self.scalars[order[:-capacity], 0].max()))
            order = order[-capacity:]
        old = (self.request_id[order], self.scalars[order], self.per_instance[:, order],
               self.instance[order], self.times[order], self.done[order])
        self._alloc(capacity)
        n = len(order)
        (self.request_id[:n], self.scalars[:n], self.per_instance[:, :n], self.instance[:n],
         self.times[:n], self.done[:n]) = old
        self.seq[:n] = np.arange(n)
        self._next = n
        self._slot = {int(r): i for i, r in enumerate(self.request_id[:n].tolist())}

    def order(self) -> IntArray:
        """Occupied slots, oldest first."""
        used = np.nonzero(self.request_id >= 0)[0]
        result: IntArray = used[np.argsort(self.seq[used], kind="stable")]
        return result


def window_bounds(arrival_s: FloatArray, done: BoolArray, tick_s: FloatArray, now_s: float,
                  window_s: float, max_requests: int, evicted_s: float = -math.inf
                  ) -> tuple[float, float]:
    """(t0, t1) of the window to check (module docstring); arrivals in any order, all
    those after ``evicted_s`` (the latest arrival no longer among them)."""
    running = arrival_s[~done & (arrival_s >= now_s - window_s)]
    t1 = min(now_s, float(running.min())) if running.size else now_s
    lo = max(t1 - window_s, float(np.nextafter(evicted_s, np.inf)))
    inside = np.sort(arrival_s[(arrival_s >= lo) & (arrival_s < t1)])
    if inside.size > max_requests:
        lo = float(inside[-max_requests])
    return (0.0 if lo <= 0.0 else _tick_at_or_after(tick_s, lo, t1)), t1


def _tick_at_or_after(tick_s: FloatArray, t: float, before: float) -> float:
    """The first tick time in [t, before), else t."""
    later = tick_s[(tick_s >= t) & (tick_s < before)]
    return float(later.min()) if later.size else t


def pack(cap: LiveCapture, now_s: float, cfg: PriceConfig, reward: RewardConfig,
         slot_s: float, horizon: int, batch_cap: FloatArray, kv_cap: FloatArray
         ) -> LiveWindow | None:
    """The window to check now, copied out of the rings; None when no request or no tick
    falls in it."""
    if not cap.ticks:
        return None
    order = cap.order()
    ticks = list(cap.ticks)
    tick_s = np.array([t.time_s for t in ticks])
    arrival = cap.scalars[order, 0]
    t0, t1 = window_bounds(arrival, cap.done[order], tick_s, now_s, cfg.certify_window_s,
                           cfg.certify_max_requests, cap.evicted_s)
    rows = order[(arrival >= t0) & (arrival < t1)]
    rows = rows[np.argsort(cap.scalars[rows, 0], kind="stable")]
    if rows.size == 0:
        return None
    first = np.nonzero(tick_s <= t0)[0]
    ticks = ticks[int(first[-1]) if first.size else 0:]
    # a tick's arrays are its own (the price view's copies), never written after: shared
    updates = [t for t in ticks if t.num_updates > 0 and np.isfinite(t.origin_s)]
    return _window(cap, rows, t0, t1, reward, slot_s, horizon, batch_cap, kv_cap,
                   compute_cap=ticks[-1].compute_budget, updates=updates, free=ticks[0],
                   gap_tol=cfg.certify_gap_tol, time_limit_s=cfg.certify_time_limit_s,
                   max_delay_slots=None)


def pack_recent(cap: LiveCapture, now_s: float, cfg: PriceConfig, reward: RewardConfig,
                slot_s: float, horizon: int, batch_cap: FloatArray, kv_cap: FloatArray
                ) -> LiveWindow | None:
    """The window to re-solve now (``solvers.resolve.resolve_live``), copied out of the
    rings: the requests that arrived in [now - ``resolve_window_s``, now) (all decided:
    the ring holds a request from its first decision; none before one it evicted), as
    the simulator's re-solves take them, on the free capacity of the latest tick (its
    ``free_s``), each start at most the steps' largest sample delay late
    (``live_window.max_delay_slots``). None when no request or no tick falls in it."""
    if not cap.ticks:
        return None
    t0 = max(now_s - cfg.resolve_window_s, float(np.nextafter(cap.evicted_s, np.inf)))
    order = cap.order()
    arrival = cap.scalars[order, 0]
    rows = order[(arrival >= t0) & (arrival < now_s)]
    if rows.size == 0:
        return None
    rows = rows[np.argsort(cap.scalars[rows, 0], kind="stable")]
    latest = cap.ticks[-1]
    return _window(cap, rows, t0, now_s, reward, slot_s, horizon, batch_cap, kv_cap,
                   compute_cap=latest.compute_budget, updates=[], free=latest,
                   gap_tol=0.0, time_limit_s=cfg.resolve_time_limit_s,
                   max_delay_slots=max_delay_slots(cfg))


def _window(cap: LiveCapture, rows: IntArray, t0: float, t1: float, reward: RewardConfig,
            slot_s: float, horizon: int, batch_cap: FloatArray, kv_cap: FloatArray, *,
            compute_cap: FloatArray, updates: list[Tick], free: Tick, gap_tol: float,
            time_limit_s: float, max_delay_slots: int | None) -> LiveWindow:
    """The rows' requests (copied: fancy indexing), with ``updates``' prices and
    ``free``'s free capacity."""
    return LiveWindow(
        t0_s=t0, t1_s=t1, slot_s=slot_s, horizon=horizon, reward=reward,
        batch_cap=np.asarray(batch_cap, dtype=np.float64).copy(),
        kv_cap=np.asarray(kv_cap, dtype=np.float64).copy(),
        compute_cap=compute_cap.copy(),
        arrival_s=cap.scalars[rows, 0], prompt_tokens=cap.scalars[rows, 1],
        ttft_target_s=cap.scalars[rows, 2], first_seen_s=cap.scalars[rows, 3],
        ttft_hat_s=cap.per_instance[0, rows], tpot_s=cap.per_instance[1, rows],
        decode_tokens=cap.per_instance[2, rows], utility=cap.per_instance[3, rows],
        exec_ttft_s=cap.per_instance[4, rows], instance=cap.instance[rows],
        first_token_s=cap.times[rows, 0], finish_s=cap.times[rows, 1],
        update_s=np.array([t.time_s for t in updates]),
        origin_s=np.array([t.origin_s for t in updates]),
        prices=tuple(t.prices for t in updates), free_s=free.time_s, free=free.free,
        gap_tol=gap_tol, time_limit_s=time_limit_s, max_delay_slots=max_delay_slots)
