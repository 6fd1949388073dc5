"""The price book: shadow prices p[g, k, r] >= 0 per instance g, future slot k and
resource r (batch slots, KV cache, compute), the free capacity, the rolling window of
recent requests and the arrival-rate estimate; it hands prices out on the request path
(O(1) per column from cumulative sums of p) and learns them off it, K projected mini-batch
steps per update (``olproute.pricing.step_ref``, the step and its rules;
``olproute.pricing.step_jax``, the jitted steps).

**Averaged prices.** A mini-batch step moves a few slots' prices by what a few random
samples happened to hit (a short prefill interval hits one slot in a hundred): the steps'
own prices are striped with noise. Decisions therefore read an exponential moving average
of them, half-life ``average_halflife_updates`` (Polyak-Ruppert averaging in its
tracking form). On the compute-bound scenario of ``solvers.compare`` (tuning seed 0) the
certificate D(p)/LP* - 1 of the prices decisions read goes from 12.0% (no averaging) to
7.4% (2 updates) and 6.2% (6, the default; 12: 6.2%).

Prices start from the last prices, shifted by the slots elapsed since; ``warm_start``
replaces them with an exact LP's duals on its absolute-slot grid (the first-order steps
then refine them between solves).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.config.schema import PriceConfig
from olproute.pricing.reward import (
    NUM_RESOURCES,
    RESOURCES,
    Columns,
    SampleExtent,
    capacities,
    column_price,
    pack_cumsums,
    price_cumsums,
    shift_columns,
    slots_since,
)
from olproute.pricing.step_jax import Backend, run_steps
from olproute.pricing.step_ref import BoolArray, FloatArray, IntArray, Samples, step_sizes
from olproute.types import Demand, InstanceSpec, PriceState, PriceView

SCALE_EVERY = 20   # updates between refreshes of the break-even price (adagrad's scale)
ARRIVALS_KEPT = 65_536   # arrival times kept for other replicas between two drains (latest)


def price_view(rows: Sequence[tuple[PriceBook, int]], state: PriceBook) -> PriceView:
    """The view of instances priced by several books: instance g is row ``rows[g][1]``
    of book ``rows[g][0]``; ``state`` gives the learning's state."""
    tops = {id(b): b.bottleneck() for b, _ in rows}
    return PriceView(
        slot_s=state.slot_s, horizon_slots=state.horizon, num_updates=state.num_updates,
        arrivals_in_horizon=state.arrivals_in_horizon, origin_s=state.origin_s,
        prices=np.stack([b.p[i] for b, i in rows]), free=np.stack([b.c[i] for b, i in rows]),
        bottleneck=tuple(tops[id(b)][i] for b, i in rows),
        compute_budget=np.array([b.compute_budget[i] for b, i in rows]))


class PriceBook:
    """Owns the prices, the free capacity, the rolling window of recent requests and the
    arrival-rate estimate; hands out prices (``price``) on the request path and learns
    them (``update``) off it. Times in seconds; prices per capacity fraction per slot.
    ``compute_budget`` (G,) is each instance's prefill tokens per slot (what its compute
    row's fractions are of), reported in the view."""

    def __init__(self, specs: Sequence[InstanceSpec], slot_s: float, horizon: int,
                 cfg: PriceConfig, rng: np.random.Generator, backend: Backend = "jax",
                 compute_budget: FloatArray | None = None) -> None:
        self.num_instances = len(specs)
        self.slot_s = slot_s
        self.horizon = horizon
        self.cfg = cfg
        self._rng = rng
        self._backend = backend
        g, w = self.num_instances, cfg.window
        self.compute_budget = (np.full(g, np.inf) if compute_budget is None
                               else np.asarray(compute_budget, dtype=np.float64).copy())
        self.p = np.zeros((g, horizon, NUM_RESOURCES))         # handed out: the average
        self._iterate = np.zeros((g, horizon, NUM_RESOURCES))  # the steps' own prices
        self.c = np.ones((g, horizon, NUM_RESOURCES))
        self._acc = np.zeros((g, horizon, NUM_RESOURCES))
        self.set_cumsums()
        self.samples = Samples.empty(w, g, cfg.sample_delays_slots)
        batch_cap, _ = capacities(specs)
        self.samples.batch_a[:] = 1.0 / batch_cap
        self.num_samples = 0
        self._next = 0
        self.num_steps = 0
        self.num_updates = 0
        self.last_price_scale = 0.0
        self._scale_samples = 0
        self._origin_s: float | None = None   # time of price slot 0
        self._decayed_arrivals = 0.0
        self._first_arrival_s: float | None = None
        self._last_arrival_s: float | None = None
        self._n_h = 0.0
        self._schedule: tuple[float, FloatArray] | None = None
        # several router replicas (olproute.server.shared): a follower's book gathers
        # and shares demand but reads its prices from the leader's (``leading`` False:
        # ``update`` learns nothing); the demand kept for ``drain_demand`` when shared
        self.leading = True
        self._outbox: list[tuple[npt.NDArray[Any], ...]] | None = None
        self._outbox_arrivals: deque[float] = deque(maxlen=ARRIVALS_KEPT)

    @property
    def delays(self) -> IntArray:
        """The delays (slots) each sample's reward is given for, the first 0."""
        return self.samples.delays

    # -- request path ----------------------------------------------------------------
    def price(self, cols: Columns, now_s: float) -> FloatArray:
        """a_jg . p_g for every instance, O(1) each: the columns (slots from now) moved by
        the slots elapsed since the book's slot 0 (its last update), cut at the horizon."""
        shift = 0 if self._origin_s is None else slots_since(now_s, self._origin_s,
                                                             self.slot_s)
        return column_price(shift_columns(cols, shift, self.horizon), self._p0, self._p1)

    def cumsums(self, now_s: float) -> tuple[FloatArray, int]:
        """What the compiled decision kernel prices from: the prices' cumulative sums packed
        (``reward.pack_cumsums``) and the slots elapsed from their slot 0 to now."""
        shift = 0 if self._origin_s is None else slots_since(now_s, self._origin_s,
                                                             self.slot_s)
        return self._packed, shift

    def set_cumsums(self) -> None:
        """The cumulative sums of ``p`` that ``price`` and ``cumsums`` read, after a change of
        ``p`` (each update does this itself)."""
        p0, p1 = price_cumsums(self.p)
        self._p0, self._p1, self._packed = p0, p1, pack_cumsums(p0, p1)

    def observe_arrival(self, now_s: float) -> None:
        """Count an arrival for the rate estimate behind N_H (exponential decay)."""
        self._count_arrival(now_s)
        if self._outbox is not None:
            self._outbox_arrivals.append(now_s)

    def _count_arrival(self, t_s: float) -> None:
        """One arrival at ``t_s`` in the decayed count; one earlier than the last counted
        (another replica's, learned late) counts decayed by its age then."""
        if self._first_arrival_s is None or t_s < self._first_arrival_s:
            self._first_arrival_s = t_s
        last = self._last_arrival_s
        if last is None or t_s >= last:
            self._decayed_arrivals = self._decayed_at(t_s) + 1.0
            self._last_arrival_s = t_s
        else:
            self._decayed_arrivals += math.exp(-(last - t_s) * math.log(2)
                                               / self.cfg.arrival_rate_halflife_s)

    def _decayed_at(self, now_s: float) -> float:
        """The decayed arrival count as of ``now_s`` (no decay for out-of-order times)."""
        if self._last_arrival_s is None:
            return 0.0
        gap = max(now_s - self._last_arrival_s, 0.0)
        return self._decayed_arrivals * math.exp(-gap * math.log(2)
                                                 / self.cfg.arrival_rate_halflife_s)

    def arrival_rate_per_s(self, now_s: float) -> float:
        """Arrivals per second as of ``now_s``: the decayed count over the decayed length
        of time observed, ``halflife / ln 2 * (1 - 2^(-elapsed / halflife))``. Dividing by
        the time observed rather than by its limit removes the start-up bias (the bare
        decayed count needs several half-lives to reach the rate: 74% of it after 20 s
        at a 10 s half-life), and a pause in arrivals lowers the rate as it lasts. The
        time observed counts as at least half a half-life, so that the first arrivals do
        not read as a burst (the rate is then under-estimated for those first seconds)."""
        if self._first_arrival_s is None:
            return 0.0
        hl = self.cfg.arrival_rate_halflife_s
        # at least half a half-life: one arrival in the first slot is not 20 a second
        elapsed = max(now_s - self._first_arrival_s, hl / 2)
        seen = hl / math.log(2) * -math.expm1(-elapsed * math.log(2) / hl)
        return self._decayed_at(now_s) / seen

    def add_sample(self, reward: FloatArray, cols: Columns, extent: SampleExtent) -> None:
        """Remember one request's reward, (G,) for a start now or (G, L) for each of
        ``delays``, its columns (relative to its decision time) and their extent
        (``Samples.put``)."""
        self.samples.put(self._next, reward, cols, extent)
        self._kept(self._ring(1))
        self._filled(1)

    def add_samples(self, reward: FloatArray, cols: Columns, extent: SampleExtent) -> None:
        """``add_sample`` for K requests in order: rewards (K, G, L), columns and extents
        (K, G); K at most the window."""
        k = reward.shape[0]
        if k > self.cfg.window:
            raise ValueError(f"{k} samples at once; the window holds {self.cfg.window}")
        rows = self._ring(k)
        self.samples.put_many(rows, reward, cols, extent)
        self._kept(rows)
        self._filled(k)

    def _ring(self, k: int) -> IntArray:
        """The window's rows the next ``k`` samples go to (the oldest overwritten)."""
        return (self._next + np.arange(k)) % self.cfg.window

    def _filled(self, k: int) -> None:
        """``k`` samples were written at ``_ring(k)``."""
        self._next = (self._next + k) % self.cfg.window
        self.num_samples = min(self.num_samples + k, self.cfg.window)

    def _kept(self, rows: IntArray) -> None:
        """New samples in ``rows``: kept for other replicas too when demand is shared
        (at most a window's worth waits: older ones would be overwritten there too)."""
        if self._outbox is None:
            return
        self._outbox.append(self.samples.take_rows(rows))
        while sum(len(r[0]) for r in self._outbox) - len(self._outbox[0][0]) >= \
                self.cfg.window:
            self._outbox.pop(0)

    # -- several replicas ----------------------------------------------------------------
    def share_demand(self, on: bool = True) -> None:
        """Keep the demand gathered from now on for ``drain_demand`` (or stop)."""
        self._outbox = [] if on else None
        self._outbox_arrivals.clear()

    def drain_demand(self) -> Demand | None:
        """The samples and arrivals gathered since the last call (at most a window of
        samples and ``ARRIVALS_KEPT`` arrivals, the latest; None when there are none, or
        demand is not shared)."""
        if self._outbox is None or not (self._outbox or self._outbox_arrivals):
            return None
        if self._outbox:
            rows = tuple(np.concatenate(parts)[-self.cfg.window:]
                         for parts in zip(*self._outbox, strict=True))
        else:
            rows = tuple(a[:0].copy() for a in self.samples.arrays)
        demand = Demand(rows, np.array(self._outbox_arrivals, dtype=np.float64))
        self._outbox = []
        self._outbox_arrivals.clear()
        return demand

    def add_demand(self, demand: Demand, shift_s: float = 0.0) -> None:
        """Another replica's demand into this book's window and arrival rate, its times
        moved by ``shift_s`` into this book's clock. Not shared on: it is that replica's
        to share."""
        k = min(demand.num_samples, self.cfg.window)
        if k:
            self.samples.put_rows(self._ring(k), [a[-k:] for a in demand.rows])
            self._filled(k)
        for t in np.sort(demand.arrivals_s):
            self._count_arrival(float(t) + shift_s)

    def state(self) -> PriceState:
        """Copies of what the learning leaves (``PriceState``)."""
        return PriceState(self.p.copy(), self._iterate.copy(), self._acc.copy(),
                          self._origin_s, self._n_h, self.num_updates, self.num_steps,
                          self.last_price_scale)

    def adopt(self, state: PriceState, shift_s: float = 0.0) -> None:
        """Take another book's learned prices (its times moved by ``shift_s`` into this
        book's clock): a follower prices with them, and a new leader learns on from
        them. A state that is not this book's shape, or holds a NaN, an infinity or a
        negative price, is refused (ValueError) and the book keeps its own."""
        check_state(state, self.p.shape)
        self.p, self._iterate, self._acc = (state.p.copy(), state.iterate.copy(),
                                            state.acc.copy())
        self._origin_s = None if state.origin_s is None else state.origin_s + shift_s
        self._n_h = state.arrivals_in_horizon
        self.num_updates, self.num_steps = state.num_updates, state.num_steps
        self.last_price_scale = state.price_scale
        self._scale_samples = self.num_samples
        self.set_cumsums()

    @property
    def arrivals_in_horizon(self) -> float:
        """N_H at the last update: expected arrivals within the horizon, rate x H x Delta."""
        return self._n_h

    @property
    def origin_s(self) -> float | None:
        """The time of price slot 0 (None before the first update)."""
        return self._origin_s

    def view(self) -> PriceView:
        """This book's prices, one row per instance."""
        return price_view([(self, g) for g in range(self.num_instances)], self)

    def bottleneck(self) -> list[str]:
        """Per instance, the resource with the highest total price ('none' when free)."""
        totals = self.p.sum(axis=1)
        return ["none" if t.max() <= 0 else RESOURCES[int(np.argmax(t))] for t in totals]

    # -- off the request path ------------------------------------------------------------
    def set_free_capacity(self, c: FloatArray) -> None:
        if c.shape != self.c.shape:
            raise ValueError(f"free capacity must have shape {self.c.shape}, got {c.shape}")
        self.c = c

    def advance(self, now_s: float) -> int:
        """Roll the prices forward to now: slot 0 becomes the current slot; returns the
        slots shifted. The newly exposed tail takes each (instance, resource)'s mean price
        over the old horizon: the last slot alone is the least learned (few samples reach
        it), and repeating it over a long gap would inflate every price. The step rule's
        accumulator rolls with the prices."""
        if self._origin_s is None:
            self._origin_s = now_s
            return 0
        shift = slots_since(now_s, self._origin_s, self.slot_s)
        if shift <= 0:
            return 0
        self._origin_s += shift * self.slot_s
        for arr in (self.p, self._iterate, self._acc):
            roll_tail(arr, shift)
        self.set_cumsums()
        return shift

    def warm_start(self, t0_s: float, p_abs: FloatArray, now_s: float | None = None) -> None:
        """Take an LP's duals ``p_abs`` (G, K, 3), slot k starting at ``t0_s + k * slot_s``,
        as both the handed-out and the steps' prices, from the book's slot 0 on: the LP
        slots before it are dropped, book slots before the LP's grid (started before its
        window) take its first slot, and those past its grid price 0. Not
        the duals' last slot: the LP sees no demand arriving after its window, so its
        last slots carry the end of its grid rather than a price for later, and one
        value repeated over the rest of the horizon would inflate every long column's
        price; 0 prices nothing the LP did not, and the steps raise it from the window's
        samples. A book with no origin yet takes the whole slot at or before ``now_s``
        (``t0_s`` without it) as its slot 0. The step rule's accumulator and scale stay
        as they are: they are about the samples, not the prices."""
        p_abs = np.asarray(p_abs, dtype=np.float64)
        shape = (self.num_instances, NUM_RESOURCES)
        if p_abs.ndim != 3 or (p_abs.shape[0], p_abs.shape[2]) != shape:
            raise ValueError(f"p_abs must be (G={self.num_instances}, K, {NUM_RESOURCES}), "
                             f"got {p_abs.shape}")
        if not math.isfinite(t0_s):
            raise ValueError(f"t0_s must be finite, got {t0_s}")
        if not np.all(np.isfinite(p_abs)):
            raise ValueError("p_abs has NaN or infinite prices")
        if np.any(p_abs < 0):
            raise ValueError(f"p_abs has negative prices (min {float(p_abs.min()):g})")
        if self._origin_s is None:
            start = t0_s if now_s is None else now_s
            self._origin_s = t0_s + slots_since(start, t0_s, self.slot_s) * self.slot_s
        first = round((self._origin_s - t0_s) / self.slot_s)
        # book slots that started before the LP's window (the current slot, when the
        # solve began in its second half or the book had not rolled since) are now: the
        # LP's first slot prices them
        ks = np.maximum(first + np.arange(self.horizon), 0)
        inside = ks < p_abs.shape[1]
        self.p = np.zeros_like(self.p)
        self.p[:, inside] = p_abs[:, ks[inside]]
        self._iterate = self.p.copy()
        self.set_cumsums()

    def _minibatches(self) -> tuple[IntArray, BoolArray, IntArray]:
        k, s = self.cfg.steps_per_period, self.cfg.minibatch
        idx = self._rng.integers(0, self.num_samples, size=(k, s))
        mask = np.ones((k, s), dtype=bool)
        if self.num_samples < s:  # fewer samples than the padded batch: use each once
            idx[:, :] = np.arange(s) % self.num_samples
            mask[:, self.num_samples:] = False
        offset = self._rng.integers(0, self.horizon, size=(k, s))
        return idx, mask, offset

    def step_scale(self) -> float:
        """eta0 in price units: adagrad multiplies it by the window's break-even price,
        refreshed every ``SCALE_EVERY`` updates (a median over the window: it moves
        slowly, and costs a quarter of an update) and whenever the window has grown by a
        quarter since (a scale from the first few requests would hold for 10 s)."""
        if self.cfg.schedule != "adagrad":
            return self.cfg.step_size
        if (self.num_updates % SCALE_EVERY == 0 or self.last_price_scale <= 0
                or self.num_samples > 1.25 * self._scale_samples):  # the window fills
            self.last_price_scale = self.samples.price_scale(self.num_samples)
            self._scale_samples = self.num_samples
        return self.cfg.step_size * self.last_price_scale

    def set_schedule(self, t0_s: float, prices: FloatArray) -> None:
        """Replay fixed prices instead of learning them: ``prices`` (G, K, R) are absolute,
        slot k starting at t0_s + k * slot_s (an oracle's, e.g. the duals of a run's
        hindsight LP); each update then reads the horizon from now, 0 past the end."""
        if prices.shape[0] != self.num_instances or prices.shape[2] != NUM_RESOURCES:
            raise ValueError(f"scheduled prices must be (G={self.num_instances}, K, "
                             f"{NUM_RESOURCES}), got {prices.shape}")
        self._schedule = (t0_s, np.asarray(prices, dtype=np.float64))

    def _replay(self, now_s: float) -> None:
        """Prices from the fixed schedule for the horizon starting at price slot 0."""
        assert self._schedule is not None
        t0_s, sched = self._schedule
        first = round(((self._origin_s or now_s) - t0_s) / self.slot_s)
        ks = first + np.arange(self.horizon)
        inside = (ks >= 0) & (ks < sched.shape[1])
        self.p = np.zeros_like(self.p)
        self.p[:, inside] = sched[:, ks[inside]]
        self._iterate = self.p.copy()
        self.num_updates += 1
        self.set_cumsums()

    def update(self, now_s: float) -> None:
        """Shift to now, then K projected mini-batch steps on the window (or, with a
        fixed schedule, read its prices); nothing when not ``leading``."""
        if not self.leading:
            return
        self.advance(now_s)
        if self._schedule is not None:
            self._replay(now_s)
            return
        if self.num_samples == 0:
            return
        k = self.cfg.steps_per_period
        self._n_h = self.arrival_rate_per_s(now_s) * self.horizon * self.slot_s
        idx, mask, offset = self._minibatches()
        etas = step_sizes(self.step_scale(), self.cfg.schedule, self.num_steps, k)
        self._iterate, self._acc = run_steps(
            self._iterate, self._acc, self.c, self.samples, idx, mask, offset, self._n_h,
            etas, self.cfg.schedule, adagrad_decay(self.cfg), self._backend)
        keep = average_weight(self.cfg)
        self.p = keep * self.p + (1.0 - keep) * self._iterate
        self.num_steps += k
        self.num_updates += 1
        self.set_cumsums()


def check_state(state: PriceState, shape: tuple[int, ...]) -> None:
    """ValueError unless ``state`` fits a book of prices ``shape``: its three arrays of
    that shape, finite and >= 0, its time, N_H and scale finite (N_H and scale >= 0)."""
    for name, a in (("prices", state.p), ("iterate", state.iterate), ("acc", state.acc)):
        if a.shape != shape:
            raise ValueError(f"{name} of shape {a.shape} for a book of {shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} hold NaN or infinite values")
        if a.size and float(a.min()) < 0:
            raise ValueError(f"{name} hold negative values (min {float(a.min()):g})")
    if state.origin_s is not None and not math.isfinite(state.origin_s):
        raise ValueError(f"price slot 0 at {state.origin_s}")
    for name, x in (("N_H", state.arrivals_in_horizon), ("price scale", state.price_scale)):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{name} {x}")


def roll_tail(arr: FloatArray, shift: int) -> None:
    """Move (G, H, R) ``shift`` slots towards slot 0 in place; the tail takes the mean."""
    h = arr.shape[1]
    fill = arr.mean(axis=1, keepdims=True)
    if shift >= h:
        arr[:] = fill
    else:
        arr[:, :h - shift] = arr[:, shift:]
        arr[:, h - shift:] = fill


def average_weight(cfg: PriceConfig) -> float:
    """The weight of the last handed-out prices in their moving average with the steps'
    latest (its half-life in updates; 0 with no averaging)."""
    hl = cfg.average_halflife_updates
    return float(0.5 ** (1.0 / hl)) if hl > 0 else 0.0


def adagrad_decay(cfg: PriceConfig) -> float:
    """Per-step factor on the adagrad accumulator (its half-life in steps)."""
    return float(0.5 ** (1.0 / cfg.adagrad_halflife_steps))


