"""The router server's state, held in the aiohttp application under one typed key."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from olproute.calibration import OnlineCalibrator
from olproute.config import LoadedConfig
from olproute.router import Router
from olproute.server.holding import HoldQueue
from olproute.server.looplag import LoopLag
from olproute.server.metrics import ServerMetrics
from olproute.server.tracker import Tracker
from olproute.types import Decision, EngineSnapshot, Request


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
    # the embedded emulated instances (olproute.emulator.RunningEmulator), if any
    emulators: list[Any] = field(default_factory=list)
    holding: HoldQueue | None = None
    lag: LoopLag = field(default_factory=lambda: LoopLag())

    def now(self) -> float:
        """Seconds since the server started (the policies' clock)."""
        return asyncio.get_running_loop().time() - self.t0

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
        healthy = [ok and g not in exclude for g, ok in enumerate(self.tracker.healthy())]
        t = asyncio.get_running_loop().time()
        inbound = self.tracker.inbound_rows() if self.router.pools.disaggregated else None
        d = self.router.decide(request, now, self.tracker.loads(now), self.snapshots(now),
                               healthy, inbound)
        self.metrics.decision_seconds.observe(asyncio.get_running_loop().time() - t)
        name = "" if d.instance is None else self.loaded.specs[d.instance].name
        self.metrics.decisions.labels(d.action, name).inc()
        return d


STATE = web.AppKey("olproute_state", ServerState)
