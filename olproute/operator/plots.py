"""The plots an operator looks at: shadow prices of batch, KV and compute over time
(instance x slot heatmaps), the bottleneck resource per instance over time, and tune's
Pareto fronts. Prices come from a simulation (``record_prices``: the policy's ``tick``
wrapped from outside, as ``EstimatorProbe`` wraps ``decide``) or from a live server
(``PriceTrace.from_polls`` on ``GET /prices`` answers). TTFT / EEL CDFs per policy:
``olproute.sim.plots.latency_cdfs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from olproute.config.loader import LoadedConfig
from olproute.policies import Policy
from olproute.pricing.reward import RESOURCES
from olproute.routing.assembly import CalibrationSource
from olproute.sim.cluster import SimResult
from olproute.sim.scenario import build_requests, make_cluster, make_policy
from olproute.types import Decision, EngineSnapshot, Outcome, Request, RoutingContext

if TYPE_CHECKING:
    from olproute.operator.tune import TuneResult

FloatArray = npt.NDArray[np.float64]
# one colour per resource in the bottleneck plot's lines and band
COLOURS = {"batch": "tab:blue", "kv": "tab:orange", "compute": "tab:green"}


@dataclass(frozen=True, slots=True)
class PriceTrace:
    """Prices p[t, g, k, r] sampled at times ``time_s`` (T,), for instances ``names``,
    slots of ``slot_s`` seconds; resources ``RESOURCES`` (batch, kv, compute)."""

    names: tuple[str, ...]
    slot_s: float
    time_s: FloatArray
    prices: FloatArray

    @staticmethod
    def from_polls(polls: Sequence[tuple[float, Mapping[str, Any]]]) -> PriceTrace:
        """From (time, ``GET /prices`` JSON) pairs of a live server: one price list per
        resource of ``RESOURCES`` per instance (a resource a document lacks, from a router
        that predates it, is priced 0)."""
        if not polls or not polls[0][1].get("instances"):
            raise ValueError("no prices in the polls (is the router's policy bid_price?)")
        first = polls[0][1]
        names = tuple(str(i["name"]) for i in first["instances"])
        arrays = []
        for _t, doc in polls:
            arrays.append(np.stack([_resource_rows(i) for i in doc["instances"]]))
        return PriceTrace(names, float(first["slot_s"]),
                          np.array([t for t, _ in polls], dtype=np.float64), np.stack(arrays))

    def totals(self) -> FloatArray:
        """(T, G, R): each resource's price summed over the horizon."""
        result: FloatArray = self.prices.sum(axis=2)
        return result

    def bottlenecks(self) -> npt.NDArray[np.int64]:
        """(T, G): index into RESOURCES of the dearest resource, -1 when all are free
        (``PriceBook.bottleneck`` at each sample)."""
        tot = self.totals()
        out: npt.NDArray[np.int64] = np.argmax(tot, axis=2).astype(np.int64)
        out[tot.max(axis=2) <= 0] = -1
        return out


def _resource_rows(inst: Mapping[str, Any]) -> FloatArray:
    """(H, R): one instance's prices from a ``GET /prices`` document, resources in the
    order of ``RESOURCES``; a resource it does not list is all zeros."""
    h = len(inst[RESOURCES[0]])
    rows: FloatArray = np.stack([np.asarray(inst.get(r, np.zeros(h)), dtype=np.float64)
                                 for r in RESOURCES], axis=-1)
    return rows


class PriceRecorder(Policy):
    """Wraps a policy with prices: decides, observes and ticks as it does, and keeps a copy
    of its prices (``price_view``) after every tick (float32, to halve the memory)."""

    def __init__(self, inner: Policy) -> None:
        if inner.price_view() is None:
            raise ValueError(f"policy {inner.name!r} has no shadow prices to record")
        self.name = inner.name
        self._inner = inner
        self.tick_s = inner.tick_s
        self.needs_snapshots = inner.needs_snapshots
        self.joint_release = inner.joint_release
        self.times: list[float] = []
        self.samples: list[npt.NDArray[np.float32]] = []

    def decide(self, ctx: RoutingContext) -> Decision:
        return self._inner.decide(ctx)

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        return self._inner.decide_held(requests, context)

    def observe(self, outcome: Outcome) -> None:
        self._inner.observe(outcome)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        self._inner.tick(now_s, snapshots)
        view = self._inner.price_view()
        assert view is not None
        self.times.append(now_s)
        self.samples.append(np.asarray(view.prices, dtype=np.float32))


def record_prices(loaded: LoadedConfig, policy: str = "bid_price",
                  requests: Sequence[Request] | None = None,
                  calibration: CalibrationSource | None = None) -> tuple[SimResult, PriceTrace]:
    """Simulate ``policy`` (one with a price book) and keep its prices after every tick;
    the run is the one ``simulate`` does on the same config and seed."""
    cfg = loaded.config
    if not cfg.prices.enabled:
        raise ValueError("prices.enabled is false: the policy learns no prices to record")
    reqs = list(requests) if requests is not None else build_requests(loaded)
    probe = PriceRecorder(make_policy(loaded, policy, calibration=calibration))
    res = make_cluster(loaded, probe).run(reqs)
    if not probe.samples:
        raise ValueError("the policy never updated its prices")
    return res, PriceTrace(tuple(s.name for s in loaded.specs), cfg.router.slot_ms / 1e3,
                           np.array(probe.times), np.stack(probe.samples).astype(np.float64))


# -- drawing --------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def price_heatmap(trace: PriceTrace, path: Path, title: str = "") -> None:
    """One row per instance, one column per resource (batch, KV and compute): the price
    of each future slot k (vertical, seconds ahead) over time (horizontal). Each column
    shares a colour scale clipped at its 99th percentile, so a few spikes do not wash out
    the rest."""
    plt = _pyplot()
    g_count = len(trace.names)
    h = trace.prices.shape[2]
    fig, axes = plt.subplots(g_count, len(RESOURCES), figsize=(5.5 * len(RESOURCES),
                             1.5 + 1.6 * g_count), squeeze=False, sharex=True, sharey=True,
                             constrained_layout=True)
    t0, t1 = float(trace.time_s[0]), float(trace.time_s[-1])
    if t1 <= t0:
        t1 = t0 + trace.slot_s
    extent = (t0, t1, 0.0, h * trace.slot_s)
    for r, resource in enumerate(RESOURCES):
        vals = trace.prices[..., r]
        vmax = float(np.percentile(vals, 99)) if vals.size else 0.0
        vmax = vmax if vmax > 0 else max(float(vals.max(initial=0.0)), 1e-9)
        for g, name in enumerate(trace.names):
            ax = axes[g, r]
            im = ax.imshow(vals[:, g, :].T, origin="lower", aspect="auto", extent=extent,
                           cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest")
            ax.set_title(f"{name}: {resource}", fontsize=9)
            if r == 0:
                ax.set_ylabel("slot ahead (s)")
            if g == g_count - 1:
                ax.set_xlabel("time (s)")
        fig.colorbar(im, ax=axes[:, r], shrink=0.8, label=f"{resource} price per slot")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bottleneck_plot(trace: PriceTrace, path: Path, title: str = "") -> None:
    """Per instance, the horizon-summed batch, KV and compute prices over time, with the
    dearest resource (the bottleneck) as a coloured band underneath."""
    plt = _pyplot()
    g_count = len(trace.names)
    tot = trace.totals()
    which = trace.bottlenecks()
    fig, axes = plt.subplots(g_count, 1, figsize=(11, 1.2 + 1.5 * g_count), squeeze=False,
                             sharex=True, constrained_layout=True)
    t = trace.time_s
    for g, name in enumerate(trace.names):
        ax = axes[g, 0]
        for r, resource in enumerate(RESOURCES):
            ax.plot(t, tot[:, g, r], color=COLOURS[resource], lw=1.0,
                    label=f"{resource} (sum)")
        top = float(tot[:, g].max(initial=0.0)) or 1.0  # never priced: a unit axis
        for r, resource in enumerate(RESOURCES):
            on = which[:, g] == r
            ax.fill_between(t, 0, -0.06 * top, where=on, step="post",
                            color=COLOURS[resource], alpha=0.8, lw=0)
        ax.set_ylim(-0.08 * top, top * 1.05)
        ax.set_ylabel(name, fontsize=8)
        ax.grid(True, alpha=0.3)
        shares = ", ".join(f"{resource} {(which[:, g] == r).mean():.0%}"
                           for r, resource in enumerate(RESOURCES))
        ax.text(0.995, 0.92, f"bottleneck: {shares}, none (free) "
                             f"{(which[:, g] == -1).mean():.0%} of the time",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
    axes[0, 0].legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(title or "shadow price summed over the horizon; band: the bottleneck")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pareto_plot(tune: TuneResult, path: Path, title: str = "") -> None:
    """Two panels: P99 TTFT vs tokens/s, and mean TTFT vs OnTimeUtility (or mean EEL);
    every point in grey, each front as a line with its points numbered, the selected
    point starred; a box gives the weights of the labelled points. Points whose runs
    came out identical are drawn and listed once, under the lowest number."""
    from olproute.operator.tune import identical_groups, point_label, varied_keys

    plt = _pyplot()
    rows = [r.summary.as_dict() for r in tune.results]
    groups = identical_groups(tune.results)
    head = {m: i for i, members in groups.items() for m in members}
    second = tune.second_metric
    panels = (
        ("throughput_tokens_per_s", "ttft_p99_s", tune.front_throughput,
         "throughput over the arrival window (tokens/s)", "P99 TTFT, served (ms)", 1.0, 1e3),
        ("ttft_mean_s", second, tune.front_second, "mean TTFT (ms)",
         "OnTimeUtility" if second == "on_time_utility" else "mean EEL (s)", 1e3, 1.0),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), constrained_layout=True,
                             gridspec_kw={"width_ratios": [1, 1, 0.8]})
    sel = head[tune.selected]
    labelled: set[int] = {sel}
    for ax, (xk, yk, front, xl, yl, xscale, yscale) in zip(axes[:2], panels, strict=True):
        xs = np.array([float(r[xk]) for r in rows]) * xscale
        ys = np.array([float(r[yk]) for r in rows]) * yscale
        ax.scatter(xs, ys, s=14, color="0.7", label="all points", zorder=1)
        on = np.array([i for i in groups if front[i]], dtype=np.int64)
        order = on[np.argsort(xs[on])] if on.size else on
        ax.plot(xs[order], ys[order], "-o", color="tab:blue", ms=5, label="Pareto front",
                zorder=2)
        for i in order:
            labelled.add(int(i))
            ax.annotate(f"#{tune.results[i].index}", (xs[i], ys[i]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color="tab:blue")
        ax.scatter([xs[sel]], [ys[sel]], marker="*", s=180, color="tab:red", zorder=3,
                   label=f"selected #{tune.results[sel].index}")
        if "TTFT" in xl:
            ax.set_xscale("log")
        if "TTFT" in yl:
            ax.set_yscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    keys = varied_keys(tune.results)
    lines = []
    for i in sorted(labelled)[:20]:
        same = len(groups[i]) - 1
        lines.append(f"#{tune.results[i].index}{' *' if i == sel else ''}"
                     f"{f' (+{same} identical)' if same else ''}:")
        lines.append(f"  {point_label(tune.results[i].point, keys)}")
    rule = tune.selection.describe() + ("" if tune.feasible else " (none met; closest)")
    ax = axes[2]
    ax.axis("off")
    ax.text(0.0, 1.0, "labelled points\n\n" + "\n".join(lines) + f"\n\n* selected: {rule}",
            va="top", ha="left", fontsize=7.5, family="monospace", wrap=True,
            transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
