"""A live job on a window of ``bid_price``'s run, in a process of its own: the live
certificate (every ``prices.certify_period_s`` the server packs the last window,
``olproute.server.capture``, and a *certifier* solves its exact LP and returns the
figures: ``solvers.live.certify``) and the re-solve (every ``prices.resolve_period_s``, a
*resolver* solves the recent demand's LP for new prices: ``olproute.server.resolving``).
The CLI injects both, since the server may not import the solvers. The request path
never waits for them.

One worker process per job (``ProcessPoolExecutor(max_workers=1)``, spawned at start-up
and stopped with the server): a job still running when the next is due skips that
period; a job that raises, a worker that dies, or a job that runs past its deadline
(:func:`deadline_s`: 3 LP time limits and 30 s; its worker is terminated) is logged and
shown as the last job's error (a dead pool is replaced at the next job).

A worker dies with the server, however the server ends (SIGKILL included): its
initializer (:func:`die_with_parent`) asks Linux to kill it when its parent goes
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``), and, on any system, a thread of the worker polls
its parent's pid every ``ORPHAN_POLL_S`` and ends the worker once it is orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from olproute.routing.live_window import LiveWindow

LOG = logging.getLogger("olproute.server")

R = TypeVar("R")
Certifier = Callable[[LiveWindow], Mapping[str, Any]]

# what a job shows besides its own figures
OK, ERROR, EMPTY = "ok", "error", "empty"
IDLE_S = 1.0   # how often a job whose period is null looks at the config again
# a job still running after this many LP time limits plus STARTUP_S is stopped: the
# LP's own limit is checked between rounds, and what follows the solve comes after it
DEADLINE_LIMITS = 3.0
STARTUP_S = 30.0   # a fresh worker imports the solvers first
ORPHAN_POLL_S = 0.5   # how often a worker looks whether its server is still there
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """A worker's initializer: the worker ends when the process ``parent_pid`` that
    spawned it does (module docstring). The death signal is asked for first, then the
    parent checked, so a parent that died in between is seen."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="olproute-orphan-watch").start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)   # orphaned: adopted by another process; a running job goes with us


def deadline_s(time_limit_s: float) -> float:
    """How long a job whose LP has ``time_limit_s`` may run before it is stopped."""
    return DEADLINE_LIMITS * time_limit_s + STARTUP_S


def _figures(result: Any) -> Mapping[str, Any]:
    """A certifier's result is its figures already (a mapping)."""
    return dict(result)


def _ignore(doc: dict[str, Any], result: Any) -> None:
    return None


@dataclass(slots=True)
class LiveCert(Generic[R]):
    """The worker pool of one job, and the last job's document (JSON-able, None before
    the first): when and what it ran on, its ``status_key`` (ok, error, empty), its
    error, and the figures ``summary`` takes from its result. ``on_result`` is called on
    the event loop with each finished job's document and its result (None when it
    raised, or when no job ran); ``num_skipped`` counts the periods skipped because a
    job was still running. ``name`` names the job in the log."""

    job: Callable[[LiveWindow], R]
    summary: Callable[[R], Mapping[str, Any]] = _figures
    on_result: Callable[[dict[str, Any], R | None], None] = _ignore
    name: str = "the live certificate"
    status_key: str = "status"
    last: dict[str, Any] | None = None
    num_checks: int = 0
    num_skipped: int = 0
    _pool: ProcessPoolExecutor | None = field(default=None, init=False, repr=False)
    _running: Future[R] | None = field(default=None, init=False, repr=False)
    _meta: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _wall: float = field(default=0.0, init=False, repr=False)   # perf_counter at submit
    _closed: bool = field(default=False, init=False)

    def start(self) -> None:
        """Create the pool and spawn its worker now: the spawn takes ~4 ms of the calling
        thread, which at start-up is no request's."""
        if self._pool is None and not self._closed:
            self._pool = ProcessPoolExecutor(max_workers=1,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=die_with_parent,
                                             initargs=(os.getpid(),))
            self._pool.submit(int)   # a process pool spawns its worker at the first call

    @property
    def busy(self) -> bool:
        """Is a job still running?"""
        return self._running is not None and not self._running.done()

    def make_room(self, limit_s: float, clock: Callable[[], float]) -> bool:
        """May a job start now? Not while one runs (the period is skipped and counted),
        unless it has run past ``limit_s`` (:func:`deadline_s`): then it is abandoned."""
        if not self.busy:
            return True
        if not self.overdue(limit_s):
            self.num_skipped += 1
            return False
        self.abandon(clock, limit_s)
        return True

    def submit(self, window: LiveWindow, now_s: float, clock: Callable[[], float]) -> bool:
        """Start the job on ``window`` (packed at ``now_s``, server clock ``clock``) unless
        one is still running (False: this period is skipped). Call on the event loop."""
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
            fut = self._pool.submit(self.job, window)
        except RuntimeError as exc:   # a broken pool refuses work: replace it next time
            self._drop_pool()
            self._finish(meta, wall, clock, None, exc)
            return True
        self._running, self._meta, self._wall = fut, meta, wall

        def done(f: Future[R]) -> None:   # in the pool's thread
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
                loop.call_soon_threadsafe(self._collect, f, meta, wall, clock)

        fut.add_done_callback(done)
        return True

    def overdue(self, limit_s: float) -> bool:
        """Has the running job run longer than ``limit_s`` (wall seconds)?"""
        return self.busy and time.perf_counter() - self._wall > limit_s

    def abandon(self, clock: Callable[[], float], limit_s: float) -> None:
        """Stop the running job (its worker is terminated; a new one starts with the
        next job) and show it as timed out: a hung worker must not skip every
        period from now on."""
        self._running = None
        self._drop_pool()
        self._finish(self._meta, self._wall, clock, None, TimeoutError(
            f"the check ran over {limit_s:g} s and was stopped"))

    def empty(self, now_s: float, why: str) -> None:
        """A period with nothing to run on: shown as the last job."""
        self._show({"time_s": now_s, "started_s": now_s, self.status_key: EMPTY,
                    "error": why, "window_start_s": None, "window_end_s": None,
                    "requests": 0}, None)

    def failed(self, now_s: float, exc: Exception) -> None:
        """A period whose window could not be packed: shown as the last job's error."""
        LOG.error("%s could not pack its window: %r", self.name, exc)
        self._show({"time_s": now_s, "started_s": now_s, self.status_key: ERROR,
                    "error": f"packing the window: {type(exc).__name__}: {exc}",
                    "window_start_s": None, "window_end_s": None, "requests": 0}, None)

    def _show(self, doc: dict[str, Any], result: R | None) -> None:
        self.num_checks += 1
        self.last = doc
        self.on_result(doc, result)

    def _collect(self, fut: Future[R], meta: dict[str, Any], wall: float,
                 clock: Callable[[], float]) -> None:
        if self._closed or fut is not self._running or fut.cancelled():
            return   # the server stopped, or this job was abandoned
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            self._drop_pool()
        self._finish(meta, wall, clock, None if exc is not None else fut.result(), exc)

    def _finish(self, meta: dict[str, Any], wall: float, clock: Callable[[], float],
                result: R | None, exc: BaseException | None) -> None:
        figures: Mapping[str, Any] = {}
        if result is not None:
            try:
                figures = self.summary(result)
            except Exception as bad:  # a result the server cannot read is the job's error
                result, exc = None, bad
        doc: dict[str, Any] = {**meta, "time_s": clock(),
                               "elapsed_s": time.perf_counter() - wall,
                               self.status_key: OK if exc is None else ERROR,
                               "error": None if exc is None else f"{type(exc).__name__}: {exc}",
                               **{k: _jsonable(v) for k, v in figures.items()}}
        if exc is not None:
            LOG.error("%s failed: %s", self.name, doc["error"])
        self._show(doc, result)

    def _drop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool)

    def close(self) -> None:
        """Stop the worker, a job it is running too (its result is dropped)."""
        self._closed = True
        self._drop_pool()


async def run_every(period_s: Callable[[], float | None], active: Callable[[], bool],
                    job: Callable[[], None], failed: Callable[[Exception], None]) -> None:
    """Every ``period_s()`` seconds (read again each time: a reload may change it; null:
    look again after ``IDLE_S``) run ``job`` if ``active()``, until cancelled; a job
    that raises is handed to ``failed`` and the next period comes all the same."""
    while True:
        period = period_s()
        await asyncio.sleep(IDLE_S if period is None else period)
        if not active():
            continue
        try:
            job()
        except Exception as exc:  # a live job must never stop: show it and go on
            failed(exc)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting for a running job: its process is
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
