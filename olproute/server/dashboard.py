"""``GET /dashboard``: a live page for operators (plain HTML and JavaScript in
``static/dashboard.html``, no build step, nothing fetched from outside the router), and
``GET /dashboard/data``: the JSON it polls every second — shadow prices per instance
(batch, KV and compute, binned over the horizon), decisions per second by action,
observed TTFT, and the last live certificate of the prices (``olproute.server.certify_live``).

Rates and recent TTFT come from the router's own Prometheus counters and histograms,
sampled when the page asks (at most every 0.25 s, kept for a minute): no background
task, and several open pages share one history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
from aiohttp import web

from olproute.pricing.reward import RESOURCES
from olproute.server import certify_live
from olproute.server.state import STATE, ServerState

ACTIONS = ("dispatch", "hold", "shed")
PRICE_BINS = 60          # columns of the price heatmaps
RATE_WINDOW_S = 5.0      # decisions per second and recent TTFT over about this long
KEEP_S = 60.0
MIN_SAMPLE_GAP_S = 0.25


@dataclass(frozen=True, slots=True)
class Sample:
    """Cumulative counters at one time (seconds since the server started)."""

    time_s: float
    decisions: dict[tuple[str, str], float]     # (action, instance) -> count
    ttft_le: tuple[float, ...]                  # histogram bucket bounds (+inf last)
    ttft_buckets: dict[str, np.ndarray]         # instance -> cumulative bucket counts
    ttft_sum: dict[str, float]


@dataclass(slots=True)
class History:
    samples: deque[Sample] = field(default_factory=deque)

    def add(self, sample: Sample) -> None:
        if (len(self.samples) > 1
                and sample.time_s - self.samples[-1].time_s < MIN_SAMPLE_GAP_S):
            self.samples[-1] = sample  # coalesce fast polls, but never drop the first
        else:
            self.samples.append(sample)
        while self.samples and sample.time_s - self.samples[0].time_s > KEEP_S:
            self.samples.popleft()

    def base(self, now_s: float) -> Sample | None:
        """The newest sample at least RATE_WINDOW_S old (else the oldest), not the last."""
        older = [s for s in list(self.samples)[:-1] if now_s - s.time_s >= RATE_WINDOW_S]
        if older:
            return older[-1]
        return self.samples[0] if len(self.samples) > 1 else None


HISTORY = web.AppKey("olproute_dashboard_history", History)


def add_routes(app: web.Application) -> None:
    """Register ``/dashboard`` and ``/dashboard/data`` (called by ``init_app``)."""
    # every counter is 0 when the server starts: the first rates are since then
    app[HISTORY] = History(deque([Sample(0.0, {}, (), {}, {})]))
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/data", data)


async def page(request: web.Request) -> web.Response:
    html = resources.files("olproute.server").joinpath("static/dashboard.html").read_text()
    return web.Response(text=html, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def data(request: web.Request) -> web.Response:
    st = request.app[STATE]
    history = request.app[HISTORY]
    now = st.now()
    sample = take_sample(st, now)
    history.add(sample)
    base = history.base(now)
    return web.json_response(dashboard_doc(st, now, sample, base),
                             headers={"Cache-Control": "no-store"})


# -- reading the router's metrics ------------------------------------------------------------
def take_sample(st: ServerState, now_s: float) -> Sample:
    decisions: dict[tuple[str, str], float] = {}
    for family in st.metrics.decisions.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                decisions[(s.labels["action"], s.labels["instance"])] = float(s.value)
    bounds: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for family in st.metrics.ttft_seconds.collect():
        for s in family.samples:
            inst = s.labels.get("instance", "")
            if s.name.endswith("_bucket"):
                bounds.setdefault(inst, {})[float(s.labels["le"])] = float(s.value)
            elif s.name.endswith("_sum"):
                sums[inst] = float(s.value)
    le = tuple(sorted(next(iter(bounds.values())).keys())) if bounds else ()
    buckets = {inst: np.array([b[x] for x in le]) for inst, b in bounds.items()}
    return Sample(now_s, decisions, le, buckets, sums)


def quantile(le: Sequence[float], cumulative: np.ndarray, q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket holding rank q; NaN when
    empty. A rank in the +inf bucket answers the largest finite bound."""
    total = float(cumulative[-1]) if len(cumulative) else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    i = int(np.searchsorted(cumulative, rank, side="left"))
    i = min(i, len(le) - 1)
    if math.isinf(le[i]):
        return float(le[i - 1]) if i > 0 else math.nan
    lo = 0.0 if i == 0 else float(le[i - 1])
    below = 0.0 if i == 0 else float(cumulative[i - 1])
    inside = float(cumulative[i]) - below
    return lo + (float(le[i]) - lo) * ((rank - below) / inside if inside > 0 else 1.0)


def ttft_summary(le: Sequence[float], cumulative: np.ndarray, total_s: float) -> dict[str, Any]:
    count = float(cumulative[-1]) if len(cumulative) else 0.0
    return {"count": round(count),
            "mean_s": _num(total_s / count) if count > 0 else None,
            "p50_s": _num(quantile(le, cumulative, 0.5)),
            "p99_s": _num(quantile(le, cumulative, 0.99))}


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _summed(buckets: Iterable[np.ndarray], size: int) -> np.ndarray:
    out = np.zeros(size)
    for b in buckets:
        out = out + b
    return out


def binned(values: Sequence[float], bins: int = PRICE_BINS) -> list[float]:
    """Mean over ``bins`` equal stretches of the horizon (fewer when it is shorter)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return []
    parts = np.array_split(x, min(bins, x.size))
    return [round(float(p.mean()), 6) for p in parts]


def dashboard_doc(st: ServerState, now_s: float, sample: Sample,
                  base: Sample | None) -> dict[str, Any]:
    names = [s.name for s in st.loaded.specs]
    prices = st.router.prices()
    by_name = {i["name"]: i for i in prices["instances"]} if prices else {}
    since_s = now_s - base.time_s if base is not None else max(now_s, 1e-9)

    def delta(key: tuple[str, str]) -> float:
        old = base.decisions.get(key, 0.0) if base is not None else 0.0
        return sample.decisions.get(key, 0.0) - old

    per_action = {a: sum(delta(k) for k in sample.decisions if k[0] == a) / since_s
                  for a in ACTIONS}
    totals = {a: int(sum(v for k, v in sample.decisions.items() if k[0] == a))
              for a in ACTIONS}
    n = len(sample.ttft_le)
    now_all = _summed(sample.ttft_buckets.values(), n)
    base_all = (_summed(base.ttft_buckets.values(), n) if base is not None
                and base.ttft_le == sample.ttft_le else np.zeros(n))
    base_sum = sum(base.ttft_sum.values()) if base is not None else 0.0
    loads = st.tracker.loads(now_s)
    healthy = st.tracker.healthy()
    instances = []
    for g, name in enumerate(names):
        p = by_name.get(name)
        buckets = sample.ttft_buckets.get(name)
        count = float(buckets[-1]) if buckets is not None and len(buckets) else 0.0
        instances.append({
            "name": name, "healthy": bool(healthy[g]), "in_flight": loads[g].num_outstanding,
            "dispatch_per_s": delta(("dispatch", name)) / since_s,
            "ttft_mean_s": (sample.ttft_sum.get(name, 0.0) / count) if count else None,
            "bottleneck": p["bottleneck"] if p else "none",
            "price_sum": {r: float(sum(p[r])) if p else 0.0 for r in RESOURCES},
            **{r: binned(p[r]) if p else [] for r in RESOURCES}})
    return {
        **certify_live.certificate_doc(st),
        "policy": st.router.policy_name, "uptime_s": now_s,
        "has_prices": prices is not None,
        "price_updates": prices["updates"] if prices else 0,
        "horizon_s": (prices["slot_s"] * prices["horizon_slots"]) if prices else 0.0,
        "instances": instances,
        "decisions": {"window_s": since_s, "per_s": per_action, "total": totals},
        "ttft": {"all": ttft_summary(sample.ttft_le, now_all, sum(sample.ttft_sum.values())),
                 "recent": ttft_summary(sample.ttft_le, now_all - base_all,
                                        sum(sample.ttft_sum.values()) - base_sum),
                 "window_s": since_s},
    }
