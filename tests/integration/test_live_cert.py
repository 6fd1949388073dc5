"""The live certificate (issue 14 item 5): the worker pool that runs a certifier off the
event loop (``olproute.server.certify``), and a real router that checks bid_price's prices
against the exact LP while it serves (``GET /prices``, ``/metrics``, ``/dashboard/data``).
Waits poll with a timeout that only catches hangs."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.server.certify import Certifier, LiveCert
from olproute.server.metrics import ServerMetrics
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from solvers.live import certify
from tests.conftest import HANG_S
from tests.integration import certifiers
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_dashboard import _Cells, dump_dom
from tests.integration.test_server import CAL, _config, request
from tests.unit.test_live_certify import hand_window

PRICES = {"period_slots": 5, "window": 200, "minibatch": 32}


# -- the worker pool, without a server ---------------------------------------------------------
async def _check(live: LiveCert[Any], certifier: Certifier) -> dict[str, Any]:
    """Submit the hand-built window to ``certifier`` and wait for the check."""
    live.job = certifier
    before = live.num_checks
    assert live.submit(hand_window(), 0.0, lambda: 1.0)
    async with asyncio.timeout(HANG_S):
        while live.num_checks == before:
            await asyncio.sleep(0.02)
    assert live.last is not None
    return live.last


def test_a_failing_or_dying_certifier_is_the_checks_error_and_the_pool_recovers() -> None:
    metrics = ServerMetrics()
    live = LiveCert(certify, on_result=lambda doc, _: metrics.set_certificate(doc))

    async def run() -> list[dict[str, Any]]:
        try:
            return [await _check(live, c) for c in (certifiers.boom, certifiers.crash, certify)]
        finally:
            live.close()

    raised, died, ok = asyncio.run(run())
    assert raised["status"] == "error"
    assert raised["error"] == "ValueError: no LP today (4 requests)"
    assert raised["requests"] == 4 and raised["window_end_s"] == 0.6
    assert died["status"] == "error" and died["error"].startswith("BrokenProcessPool")
    assert ok["status"] == "ok" and ok["error"] is None and ok["time_s"] == 1.0
    assert ok["certificate"] >= -1e-6 and ok["lp_value"] > 0
    assert _metric(metrics.render().decode(), "olproute_price_certificate") == pytest.approx(
        ok["certificate"])
    assert _metric(metrics.render().decode(), "olproute_price_certificate_checks_total",
                   result="error") == 2


def test_a_running_check_skips_the_next_and_a_hung_one_is_stopped() -> None:
    live = LiveCert(certifiers.hang)

    async def run() -> dict[str, Any]:
        assert live.submit(hand_window(), 0.0, lambda: 1.0)
        assert live.busy and not live.overdue(HANG_S)
        assert not live.submit(hand_window(), 0.5, lambda: 1.5)   # still running: skipped
        assert live.last is None
        live.abandon(lambda: 2.0, 0.0)   # past its deadline: its worker is terminated
        assert not live.busy and live.last is not None
        stopped = dict(live.last)
        assert (await _check(live, certify))["status"] == "ok"   # a new worker
        return stopped

    stopped = asyncio.run(run())
    assert stopped["status"] == "error" and stopped["time_s"] == 2.0
    assert stopped["error"] == "TimeoutError: the check ran over 0 s and was stopped"
    assert live.num_checks == 2   # the abandoned check never reported again


def test_close_does_not_wait_for_a_running_check() -> None:
    live = LiveCert(certifiers.hang)

    async def run() -> None:
        assert live.submit(hand_window(), 0.0, lambda: 1.0)

    asyncio.run(run())
    closing = threading.Thread(target=live.close)
    closing.start()
    closing.join(HANG_S)
    assert not closing.is_alive()
    assert live.last is None   # the hung check never reported


# -- a router serving with the certificate ---------------------------------------------------
def _metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def _get(stack: Stack, path: str) -> Any:
    status, _, raw = request(stack.url, "GET", path)
    assert status == 200, raw
    return json.loads(raw) if path != "/metrics" else raw.decode()


def _serve(stack: Stack, n: int) -> None:
    for i in range(n):
        status, _, raw = request(stack.url, "POST", "/v1/completions",
                                 {"prompt": f"hello number {i}", "max_tokens": 3},
                                 headers={"x-slo-ttft-ms": "5000"})
        assert status == 200, raw


def _stack(tmp_path: Path, certifier: Certifier | None, num_fakes: int = 3,
           **extra: Any) -> Stack:
    loaded = load_config(_config(tmp_path, **extra))
    return Stack(loaded, num_fakes=num_fakes, certifier=certifier,
                 calibration=CalibrationSource(loaded, known=[CAL] * 3))


def _checked(stack: Stack, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first /prices certificate ``done`` accepts."""
    found: dict[str, Any] = {}

    def look() -> bool:
        cert = _get(stack, "/prices")["certificate"]
        if cert is not None and done(cert):
            found.update(cert)
            return True
        return False

    assert wait_until(look, timeout=2 * HANG_S), _get(stack, "/prices")["certificate"]
    return found


def test_the_embedded_default_certifies_bid_prices_prices_live(tmp_path: Path) -> None:
    s = _stack(tmp_path, certify, num_fakes=0,
               prices={**PRICES, "certify_period_s": 0.5, "certify_window_s": 30.0},
               server={"emulator_time_scale": 0.2, "health_period_s": 0.2})
    try:
        _serve(s, 12)
        cert = _checked(s, lambda c: c["status"] == "ok")
        assert cert["certificate"] >= -1e-6          # weak duality: D(p_online) >= LP*
        assert cert["lp_value"] > 0 and cert["d_online"] >= cert["lp_value"] * (1 - 1e-6)
        assert 1 <= cert["requests"] <= 12 and cert["error"] is None
        assert cert["window_start_s"] < cert["window_end_s"] <= cert["time_s"]
        assert cert["online_over_lp"] == pytest.approx(cert["online_reward"] / cert["lp_value"])
        assert 0 <= cert["binding_rows"] <= cert["rows"] and cert["solve_s"] >= 0
        text = _get(s, "/metrics")
        assert wait_until(lambda: _metric(_get(s, "/metrics"),
                                          "olproute_price_certificate") is not None)
        assert _metric(text, "olproute_price_certificate_solve_seconds") is not None
        board = _get(s, "/dashboard/data")
        assert board["certificate"]["status"] == "ok"   # the window still holds them all
        assert board["certificate_message"] is None
        page = _Cells()
        page.feed(dump_dom(s.url + "/dashboard", tmp_path))
        line = page.ids["certificate"]
        assert re.match(r"[+-]\d+\.\d\d % · online/LP\* \d+\.\d{3} · LP\* ", line), line
        # bounded: the ring holds the requests once each, at their first decision
        cap = s.app[STATE].capture
        assert cap is not None and s.call(lambda: cap.num_requests) == 12
    finally:
        s.close()


def test_a_raising_certifier_shows_as_the_error_and_serving_goes_on(tmp_path: Path) -> None:
    s = _stack(tmp_path, certifiers.boom, prices={**PRICES, "certify_period_s": 0.3})
    try:
        _serve(s, 3)
        cert = _checked(s, lambda c: c["status"] == "error" and c["requests"] > 0)
        assert cert["error"].startswith("ValueError: no LP today")
        live = s.app[STATE].live_cert
        assert live is not None
        s.call(lambda: setattr(live, "job", certifiers.crash))
        _serve(s, 2)
        _checked(s, lambda c: (c["error"] or "").startswith("BrokenProcessPool"))
        _serve(s, 2)   # still serving
        text = _get(s, "/metrics")
        assert _metric(text, "olproute_price_certificate") is None   # never a good check
        assert (_metric(text, "olproute_price_certificate_checks_total", result="error")
                or 0) >= 2
    finally:
        s.close()


def test_a_null_period_captures_nothing_and_shows_no_certificate(tmp_path: Path) -> None:
    s = _stack(tmp_path, certify, prices={**PRICES, "certify_period_s": None})
    try:
        _serve(s, 3)
        doc = _get(s, "/prices")
        assert doc["certificate"] is None and "certify_period_s" in doc["certificate_message"]
        assert _metric(_get(s, "/metrics"), "olproute_price_certificate") is None
        live, cap = s.app[STATE].live_cert, s.app[STATE].capture
        assert live is not None and cap is not None
        assert s.call(lambda: (cap.num_requests, len(cap.ticks), live.busy)) == (0, 0, False)
    finally:
        s.close()


def test_another_policy_has_no_certificate(tmp_path: Path) -> None:
    s = _stack(tmp_path, certify, router={"policy": "round_robin", "slot_ms": 20},
               prices={**PRICES, "certify_period_s": 0.2})
    try:
        _serve(s, 3)
        doc = _get(s, "/prices")
        assert doc["instances"] == [] and doc["certificate"] is None
        assert "bid_price" in doc["certificate_message"]
        cap = s.app[STATE].capture
        assert cap is not None and s.call(lambda: cap.num_requests) == 0
    finally:
        s.close()
