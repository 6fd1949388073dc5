"""The router server's state, held in the aiohttp application under one typed key."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from olproute.config.loader import LoadedConfig
from olproute.estimate.calibration import Beta, OnlineCalibrator
from olproute.estimate.streamcal import StreamCalibrator
from olproute.routing.router import Router
from olproute.server.capture import LiveCapture
from olproute.server.certify import LiveCert
from olproute.server.holding import HoldQueue
from olproute.server.looplag import LoopLag
from olproute.server.metrics import ServerMetrics
from olproute.server.shared import SharedState
from olproute.server.tracker import Tracker
from olproute.types import (
    Decision,
    EngineSnapshot,
    InstanceSpec,
    Outcome,
    PriceView,
    Request,
)

if TYPE_CHECKING:
    from olproute.routing.live_window import Resolution
    from olproute.server.resolved import Handover

LOG = logging.getLogger("olproute.server")


@dataclass(slots=True)
class ServerState:
    """Everything the handlers and background tasks share. Mutated only on the event loop
    (the price update runs in a worker thread but only touches the policy's price book)."""

    loaded: LoadedConfig
    router: Router
    tracker: Tracker
    metrics: ServerMetrics
    session: aiohttp.ClientSession
    t0: float
    # health checks, scraping, batch records: a connection pool apart from the proxy's
    control: aiohttp.ClientSession
    calibrators: list[OnlineCalibrator] = field(default_factory=list)
    batches_supported: list[bool] = field(default_factory=list)
    # per backend: beta from its streams (a backend without batch records), and where
    # the beta the router uses came from: initial, batches or streams
    stream_calibrators: list[StreamCalibrator] = field(default_factory=list)
    beta_sources: list[str] = field(default_factory=list)
    # backends whose /metrics had none of vLLM's gauges, said once (olproute.server.app)
    gaugeless: set[int] = field(default_factory=set)
    # the embedded emulated instances (olproute.emulator.RunningEmulator), if any
    emulators: list[Any] = field(default_factory=list)
    holding: HoldQueue | None = None
    lag: LoopLag = field(default_factory=lambda: LoopLag())
    # what the live certificate and the re-solves run on (olproute.server.capture),
    # when the CLI gave a certifier or a resolver
    capture: LiveCapture | None = None
    # the live certificate (olproute.server.certify), when the CLI gave a certifier
    live_cert: LiveCert[Any] | None = None
    # the re-solves (olproute.server.resolving), when the CLI gave a resolver, and the
    # last one's duals waiting for the next tick
    live_resolve: LiveCert[Resolution] | None = None
    handover: Handover | None = None
    # per backend, the subscriber of its engine's KV events (olproute.server.kv_subscriber)
    # where its config names them; None elsewhere
    kv_subscribers: list[Any] = field(default_factory=list)
    # other router replicas' view on Redis (olproute.server.shared), when state.url is set
    shared: SharedState | None = None
    # held by the price tick's thread; the shared state's exchanges with the price books
    # take it only when free
    book_lock: threading.Lock = field(default_factory=threading.Lock)
    # per backend whose engine says it runs otherwise than its profile, the instance as
    # the engine says it is (olproute.server.engine_config): the router is built on these
    engine_specs: dict[int, InstanceSpec] = field(default_factory=dict)
    # set when engine_specs changed since the router was built (the scrape rebuilds it)
    rebuild_wanted: bool = False
    # held while a new router is built and swapped in (a reload, a rebuild on the
    # engines' word), so that one swap never undoes another
    swap_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # when the server started, Unix seconds: the ``created`` of GET /v1/models' entries
    started_unix_s: int = field(default_factory=lambda: int(time.time()))

    def modelled(self, loaded: LoadedConfig | None = None) -> LoadedConfig:
        """``loaded`` (the running config by default) with each backend as its engine says
        it is, where that differs from its profile: what the router is built on."""
        loaded = self.loaded if loaded is None else loaded
        if not self.engine_specs:
            return loaded
        return loaded.with_specs([self.engine_specs.get(g, s)
                                  for g, s in enumerate(loaded.specs)])

    def served_models(self) -> list[str]:
        """The model names the pool answers to: each backend's served name and its
        profile's model name, deduplicated, in backend order."""
        return list(dict.fromkeys(name for b in self.tracker.backends
                                  for name in (b.served_model, b.spec.model)))

    def model_exclude(self, model: str | None) -> frozenset[int] | None:
        """The backends a request for ``model`` may not go to: those not serving it (by
        its profile's model name or the name the backend answers to); none for no model,
        or for a name no backend serves when ``server.any_model`` routes any name to the
        whole pool. None: no backend serves ``model`` (a 404)."""
        if model is None:
            return frozenset()
        names = [(b.spec.model, b.served_model) for b in self.tracker.backends]
        if any(model in pair for pair in names):
            return frozenset(g for g, pair in enumerate(names) if model not in pair)
        return frozenset() if self.loaded.config.server.any_model else None

    def now(self) -> float:
        """Seconds since the server started (the policies' clock)."""
        return asyncio.get_running_loop().time() - self.t0

    def beta(self, g: int) -> Beta:
        """The batch-time coefficients backend ``g``'s replay runs with."""
        if self.beta_sources[g] == "streams":
            return self.stream_calibrators[g].beta
        return self.calibrators[g].beta

    def recalibrated(self) -> list[tuple[int, Beta]]:
        """(backend, beta) of every backend whose beta was refitted (a reloaded router
        starts from the initial calibration: it gets these)."""
        return [(g, self.beta(g)) for g, source in enumerate(self.beta_sources)
                if source != "initial"]

    @property
    def admin_token(self) -> str | None:
        server = self.loaded.config.server
        return os.environ.get(server.admin_token_env) or server.admin_token

    def snapshots(self, now_s: float) -> tuple[EngineSnapshot, ...] | None:
        return self.tracker.snapshots(now_s) if self.router.needs_snapshots else None

    def decide(self, request: Request, exclude: frozenset[int] = frozenset()) -> Decision:
        """One decision now, timed and counted; ``exclude`` marks backends as unhealthy
        for this decision only (a retry after a failure)."""
        now = self.now()
        t = time.perf_counter()
        d = self.router.decide(request, now, self.tracker.loads(now), self.snapshots(now),
                               _healthy_but(self.tracker.healthy(), exclude), self._inbound())
        self._counted(d, t)
        return d

    def decide_held(self, held: Sequence[tuple[Request, frozenset[int]]]
                    ) -> Iterator[Decision]:
        """One pass over held requests (``request``, ``exclude``) for a policy with
        ``joint_release``: decided together on one context, each counted; ``exclude``
        marks backends as unhealthy for that request only."""
        now = self.now()
        base = self.tracker.healthy()
        excludes = {r.request_id: ex for r, ex in held}
        t = time.perf_counter()
        for d in self.router.decide_held(
                [r for r, _ in held], now, self.tracker.loads(now), self.snapshots(now),
                lambda rid: _healthy_but(base, excludes.get(rid, frozenset())),
                self._inbound()):
            self._counted(d, t)
            yield d
            t = time.perf_counter()

    def _inbound(self) -> tuple[Any, ...] | None:
        return self.tracker.inbound_rows() if self.router.pools.disaggregated else None

    def _counted(self, d: Decision, t0: float) -> None:
        """A decision's time since ``t0`` (``perf_counter``: the loop's clock counts whole
        milliseconds under uvloop) and its action in the metrics."""
        name = "" if d.instance is None else self.loaded.specs[d.instance].name
        self.metrics.decided(d.action, name, time.perf_counter() - t0)

    def mark_failure(self, g: int) -> None:
        """Backend g failed (a request, a probe): the tracker marks it down, with backoff,
        and the router's prefix index forgets what it cached (it may have restarted)."""
        self.tracker.mark_failure(g, self.now())
        self.router.cache_lost(g)

    def certifying(self) -> bool:
        """Is the live certificate on: a certifier, a period, and this replica learns
        bid_price's prices on mixed instances (``learns_lp_prices``)?"""
        return (self.live_cert is not None
                and self.loaded.config.prices.certify_period_s is not None
                and self.learns_lp_prices())

    def resolving(self) -> bool:
        """Are the re-solves on: a resolver, a period, and this replica learns
        bid_price's prices on mixed instances (``learns_lp_prices``)?"""
        return (self.live_resolve is not None
                and self.loaded.config.prices.resolve_period_s is not None
                and self.learns_lp_prices())

    def learns_lp_prices(self) -> bool:
        """Does this replica learn the prices (the only one, or the leader of several)
        of bid_price on mixed instances (the exact LP's model)?"""
        return ((self.shared is None or self.shared.leading)
                and self.router.policy_name == "bid_price"
                and not self.router.pools.disaggregated)

    def capturing(self) -> bool:
        """Does the capture record: the certificate or the re-solves are on?"""
        return self.capture is not None and (self.certifying() or self.resolving())

    def first_decision(self, request: Request, decision: Decision) -> None:
        """A request's first decision on its way to a backend: the capture records it
        (a few row writes)."""
        if self.capture is not None and self.capturing():
            self.capture.decided(request, decision, self.now())

    def observe(self, outcome: Outcome) -> None:
        """A request's outcome, to the policy and the capture."""
        self.router.observe(outcome)
        if self.capture is not None:
            self.capture.finished(outcome)

    def forget(self, request_id: int) -> None:
        """A request whose decision will not be carried out (its client left while it
        was held): the policy drops it; the capture counts it not served."""
        self.router.forget(request_id)
        if self.capture is not None:
            self.capture.dropped(request_id)

    def ticked(self, now_s: float, view: PriceView) -> None:
        """After a policy tick: the capture records its prices and free capacity
        (``view``, taken after the tick in its thread), for two of the longer window."""
        if self.capture is None or not self.capturing():
            return
        cfg = self.loaded.config.prices
        window = max(cfg.certify_window_s if self.certifying() else 0.0,
                     cfg.resolve_window_s if self.resolving() else 0.0)
        self.capture.ticked(now_s, view, 2.0 * window)


def log_unpredicted(router: Router) -> None:
    """Log the pool's models the router's predictor was not trained for (their requests
    are predicted ``max_tokens``): once, when a router gets a predictor (at start-up, or a
    reload that names another)."""
    found = router.predictions
    if found is not None and found.unknown:
        LOG.warning("the predictor in %s was not trained for model(s) %s: their requests "
                    "are predicted max_tokens (it knows: %s)", found.predictor.directory,
                    ", ".join(found.unknown), ", ".join(found.predictor.models))


def prediction_status(st: ServerState) -> dict[str, Any]:
    """What ``/instances`` says of the predictions: ``prediction.serve``, the predictor
    (``shipped``, or ``prediction.model_dir`` as the config gives it; None without one),
    the pool's models it predicts and those predicted ``max_tokens``."""
    found = st.router.predictions
    if found is None:
        return {"serve": "max_tokens", "predictor": None, "models": [],
                "max_tokens_for": list(st.router.models)}
    return {"serve": "predictor",
            "predictor": st.loaded.config.prediction.model_dir or "shipped",
            "models": list(found.known), "max_tokens_for": list(found.unknown)}


def _healthy_but(healthy: Sequence[bool], exclude: frozenset[int]) -> list[bool]:
    """Per backend: healthy and not excluded for this request."""
    return [ok and g not in exclude for g, ok in enumerate(healthy)]


STATE = web.AppKey("olproute_state", ServerState)
