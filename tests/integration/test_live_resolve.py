"""Re-solved LP duals as the live server's prices (``prices.resolve_period_s``,
``olproute.server.resolving``): a real router re-solves the recent window in a worker
process, the next tick warm-starts bid_price's book with the duals, and ``GET /prices``
and ``/metrics`` show the last re-solve. Waits poll with a timeout that only catches
hangs; traffic goes on while they wait, so that a window always holds requests."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from olproute.config.loader import load_config
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from solvers.live import certify
from solvers.resolve import resolve_live
from tests.conftest import HANG_S
from tests.integration import certifiers
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_live_cert import PRICES, _get, _metric
from tests.integration.test_server import CAL, _config, request

# re-solves every 0.2 s of the last 0.5 s; no certificate (it would share the 2 cores)
RESOLVE = {**PRICES, "certify_period_s": None, "resolve_period_s": 0.2,
           "resolve_window_s": 0.5}
RESOURCES = ("batch", "kv", "compute")


def _stack(tmp_path: Path, resolver: Any, **prices: Any) -> Stack:
    loaded = load_config(_config(tmp_path, prices={**RESOLVE, **prices}))
    return Stack(loaded, num_fakes=3, certifier=certify, resolver=resolver,
                 calibration=CalibrationSource(loaded, known=[CAL] * 3))


def _resolved(stack: Stack, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first /prices re-solve ``done`` accepts, sending a request before each look."""
    found: dict[str, Any] = {}
    ids = itertools.count()

    def look() -> bool:
        status, _, raw = request(stack.url, "POST", "/v1/completions",
                                 {"prompt": f"hello number {next(ids)}", "max_tokens": 3},
                                 headers={"x-slo-ttft-ms": "5000"})
        assert status == 200, raw
        doc = _get(stack, "/prices")["resolve"]
        if doc is not None and done(doc):
            found.update(doc)
            return True
        return False

    assert wait_until(look, timeout=2 * HANG_S), _get(stack, "/prices")
    return found


def _prices(doc: dict[str, Any]) -> np.ndarray:
    """(G, H, 3) prices of a /prices document."""
    return np.array([[inst[r] for r in RESOURCES] for inst in doc["instances"]]
                    ).transpose(0, 2, 1)


def test_an_ok_resolve_becomes_the_books_prices(tmp_path: Path) -> None:
    # steps off: nothing but the re-solves moves the prices, so they must be the duals
    s = _stack(tmp_path, certifiers.fixed_duals, enabled=False)
    try:
        doc = _resolved(s, lambda d: d["outcome"] == "ok" and d["applied_s"] is not None)
        assert doc["error"] is None and doc["lp_value"] == 1.5 and doc["solve_s"] == 0.01
        assert doc["requests"] >= 1 and doc["t0_s"] <= doc["started_s"] <= doc["time_s"]
        assert doc["window_start_s"] < doc["window_end_s"] == doc["started_s"]
        assert doc["applied_s"] >= doc["time_s"]   # at the tick after it came back
        assert "p" not in doc
        prices = _get(s, "/prices")
        assert prices["resolve_message"] is None
        fixed = certifiers.fixed_p(3, 1)
        want = np.broadcast_to(fixed[:, :1, :], _prices(prices).shape)
        assert np.array_equal(_prices(prices), want)
        assert (_metric(_get(s, "/metrics"), "olproute_price_resolves_total", outcome="ok")
                or 0) >= 1
    finally:
        s.close()


def test_a_raising_or_slow_resolve_leaves_the_prices(tmp_path: Path) -> None:
    s = _stack(tmp_path, certifiers.no_resolve, enabled=False)
    try:
        raised = _resolved(s, lambda d: d["outcome"] == "error" and d["requests"] > 0)
        assert raised["error"].startswith("ValueError: no re-solve today")
        live = s.app[STATE].live_resolve
        assert live is not None
        s.call(lambda: setattr(live, "job", certifiers.too_slow))
        slow = _resolved(s, lambda d: d["outcome"] == "slow")
        assert slow["error"] == "HiGHS: Time limit reached" and slow["applied_s"] is None
        prices = _get(s, "/prices")
        assert not np.any(_prices(prices))   # steps off and no duals taken: still 0
        assert s.call(lambda: s.app[STATE].handover) is None
        text = _get(s, "/metrics")
        assert (_metric(text, "olproute_price_resolves_total", outcome="error") or 0) >= 1
        assert (_metric(text, "olproute_price_resolves_total", outcome="slow") or 0) >= 1
        assert _metric(text, "olproute_price_resolves_total", outcome="ok") is None
    finally:
        s.close()


def test_a_null_period_has_no_resolve(tmp_path: Path) -> None:
    s = _stack(tmp_path, resolve_live, resolve_period_s=None)
    try:
        request(s.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        doc = _get(s, "/prices")
        assert doc["resolve"] is None and "resolve_period_s" in doc["resolve_message"]
        live = s.app[STATE].live_resolve
        assert live is not None and s.call(lambda: (live.busy, live.num_checks)) == (False, 0)
        assert _metric(_get(s, "/metrics"), "olproute_price_resolves_total",
                       outcome="empty") is None
    finally:
        s.close()


def test_the_embedded_lp_resolves_and_warm_starts_live(tmp_path: Path) -> None:
    s = _stack(tmp_path, resolve_live)
    try:
        doc = _resolved(s, lambda d: d["outcome"] == "ok" and d["applied_s"] is not None)
        assert doc["lp_value"] > 0 and doc["requests"] >= 1 and doc["error"] is None
        assert 0 <= doc["solve_s"] <= doc["elapsed_s"]
    finally:
        s.close()
