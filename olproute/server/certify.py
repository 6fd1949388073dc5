"""The live certificate of ``bid_price``'s prices: every ``prices.certify_period_s`` the
server packs the last window (``olproute.server.capture``) and hands it to a
*certifier* in a process of its own, which solves the window's exact LP and returns
the figures (``solvers.live.certify``; the CLI injects it, since the server may not
import the solvers). The request path never waits for it.

One worker process (``ProcessPoolExecutor(max_workers=1)``, spawned at start-up and
stopped with the server): a check still running when the next is due
skips that period; a check that raises, a worker that dies, or a check that runs past
its deadline (``olproute.server.certify_live``: 3 LP time limits and 30 s; its worker is
terminated) is logged and shown as the last check's error (a dead pool is replaced at
the next check).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from olproute.routing.live_window import LiveWindow
from olproute.server.capture import LiveCapture

LOG = logging.getLogger("olproute.server")

Certifier = Callable[[LiveWindow], Mapping[str, Any]]

# what a check shows besides the certifier's own figures
OK, ERROR, EMPTY = "ok", "error", "empty"


@dataclass(slots=True)
class LiveCert:
    """The capture, the worker pool, and the last check (a JSON-able dict, None before
    the first). ``on_result`` is called on the event loop with each finished check;
    ``num_skipped`` counts the periods skipped because a check was still running."""

    certifier: Certifier
    capture: LiveCapture
    on_result: Callable[[dict[str, Any]], None] = lambda doc: None
    last: dict[str, Any] | None = None
    num_checks: int = 0
    num_skipped: int = 0
    _pool: ProcessPoolExecutor | None = field(default=None, init=False, repr=False)
    _running: Future[Mapping[str, Any]] | None = field(default=None, init=False, repr=False)
    _meta: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _wall: float = field(default=0.0, init=False, repr=False)   # perf_counter at submit
    _closed: bool = field(default=False, init=False)

    def start(self) -> None:
        """Create the pool and spawn its worker now: the spawn takes ~4 ms of the calling
        thread, which at start-up is no request's."""
        if self._pool is None and not self._closed:
            self._pool = ProcessPoolExecutor(max_workers=1,
                                             mp_context=multiprocessing.get_context("spawn"))
            self._pool.submit(int)   # a process pool spawns its worker at the first call

    @property
    def busy(self) -> bool:
        """Is a check still running?"""
        return self._running is not None and not self._running.done()

    def submit(self, window: LiveWindow, now_s: float, clock: Callable[[], float]) -> bool:
        """Start checking ``window`` (packed at ``now_s``, server clock ``clock``) unless a
        check is still running (False: this period is skipped). Call on the event loop."""
        if self.busy or self._closed:
            return False
        loop = asyncio.get_running_loop()
        if self._pool is None:   # a pool dropped after a failure: 4 ms of the loop
            self.start()
        assert self._pool is not None
        meta = {"started_s": now_s, "window_start_s": window.t0_s,
                "window_end_s": window.t1_s, "requests": window.num_requests}
        wall = time.perf_counter()
        try:
            fut = self._pool.submit(self.certifier, window)
        except RuntimeError as exc:   # a broken pool refuses work: replace it next time
            self._drop_pool()
            self._finish(meta, wall, clock, None, exc)
            return True
        self._running, self._meta, self._wall = fut, meta, wall

        def done(f: Future[Mapping[str, Any]]) -> None:   # in the pool's thread
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
                loop.call_soon_threadsafe(self._collect, f, meta, wall, clock)

        fut.add_done_callback(done)
        return True

    def overdue(self, limit_s: float) -> bool:
        """Has the running check run longer than ``limit_s`` (wall seconds)?"""
        return self.busy and time.perf_counter() - self._wall > limit_s

    def abandon(self, clock: Callable[[], float], limit_s: float) -> None:
        """Stop the running check (its worker is terminated; a new one starts with the
        next check) and show it as timed out: a hung worker must not skip every
        period from now on."""
        self._running = None
        self._drop_pool()
        self._finish(self._meta, self._wall, clock, None, TimeoutError(
            f"the check ran over {limit_s:g} s and was stopped"))

    def empty(self, now_s: float, why: str) -> None:
        """A period with nothing to check: shown as the last check."""
        self._show({"time_s": now_s, "started_s": now_s, "status": EMPTY, "error": why,
                    "window_start_s": None, "window_end_s": None, "requests": 0})

    def failed(self, now_s: float, exc: Exception) -> None:
        """A period whose window could not be packed: shown as the last check's error."""
        LOG.error("the live certificate could not pack its window: %r", exc)
        self._show({"time_s": now_s, "started_s": now_s, "status": ERROR,
                    "error": f"packing the window: {type(exc).__name__}: {exc}",
                    "window_start_s": None, "window_end_s": None, "requests": 0})

    def _show(self, doc: dict[str, Any]) -> None:
        self.num_checks += 1
        self.last = doc
        self.on_result(doc)

    def _collect(self, fut: Future[Mapping[str, Any]], meta: dict[str, Any], wall: float,
                 clock: Callable[[], float]) -> None:
        if self._closed or fut is not self._running or fut.cancelled():
            return   # the server stopped, or this check was abandoned
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            self._drop_pool()
        self._finish(meta, wall, clock, None if exc is not None else fut.result(), exc)

    def _finish(self, meta: dict[str, Any], wall: float, clock: Callable[[], float],
                result: Mapping[str, Any] | None, exc: BaseException | None) -> None:
        doc: dict[str, Any] = {**meta, **{k: _jsonable(v) for k, v in (result or {}).items()},
                               "time_s": clock(), "elapsed_s": time.perf_counter() - wall,
                               "status": OK if exc is None else ERROR,
                               "error": None if exc is None else f"{type(exc).__name__}: {exc}"}
        if exc is not None:
            LOG.error("the live certificate's check failed: %s", doc["error"])
        self._show(doc)

    def _drop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool)

    def close(self) -> None:
        """Stop the worker, a check it is running too (its result is dropped)."""
        self._closed = True
        self._drop_pool()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting for a running check: its process is
    terminated (Python 3.14's ``terminate_workers``; before it, only the pool's own
    table of processes names them)."""
    workers = list(pool._processes.values())
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        if w.is_alive():
            w.terminate()


def _jsonable(x: Any) -> Any:
    """Numbers as JSON takes them: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
