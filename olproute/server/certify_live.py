"""The live certificate wired into the server: the background task that checks the last
window every ``prices.certify_period_s`` (``olproute.server.certify``), the tick hook
that records the prices, and the ``certificate`` of ``GET /prices`` and the dashboard.

The period and the window's bounds are read from the running config at each check, so
``POST /admin/reload`` changes them; the ring's size follows
``prices.certify_max_requests`` at the next check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from olproute.pricing.reward import capacities
from olproute.server.capture import pack
from olproute.server.state import ServerState
from olproute.types import PriceView

IDLE_S = 1.0   # how often a disabled certificate looks at the config again
# a check still running after this many LP time limits plus STARTUP_S is stopped: the
# LP's own limit is checked between rounds, and D(p) and its rescaling come after it
DEADLINE_LIMITS = 3.0
STARTUP_S = 30.0   # a fresh worker imports the solvers first


async def run(st: ServerState) -> None:
    """Check every period until cancelled (``init_app``'s lifecycle runs this)."""
    while True:
        period = st.loaded.config.prices.certify_period_s
        await asyncio.sleep(IDLE_S if period is None else period)
        if not st.certifying():
            continue
        try:
            check_now(st)
        except Exception as exc:  # the certificate must never stop: show it and go on
            assert st.live_cert is not None
            st.live_cert.failed(st.now(), exc)


def check_now(st: ServerState) -> None:
    """Pack the last window and submit it (or show why there is nothing to check)."""
    cert = st.live_cert
    assert cert is not None
    cfg = st.loaded.config
    cap = cert.capture
    cap.resize(cfg.prices.certify_max_requests)
    if cert.busy:
        deadline = DEADLINE_LIMITS * cfg.prices.certify_time_limit_s + STARTUP_S
        if not cert.overdue(deadline):
            cert.num_skipped += 1
            st.metrics.certificate_checks.labels("skipped").inc()
            return
        cert.abandon(st.now, deadline)
    now = st.now()
    batch_cap, kv_cap = capacities(st.loaded.specs)
    window = pack(cap, now, cfg.prices, cfg.reward, cfg.router.slot_ms / 1e3,
                  cfg.router.horizon_slots, batch_cap, kv_cap)
    if window is None:
        why = cap.last_problem if cap.num_requests == 0 and cap.last_problem else (
            "no price tick yet" if not cap.ticks else "no request arrived in the window")
        cert.empty(now, why)
        return
    cert.submit(window, now, st.now)


def ticked(st: ServerState, now_s: float, view: PriceView) -> None:
    """After a policy tick: record its prices and free capacity (``view``, taken after
    the tick in its thread)."""
    if st.live_cert is None or not st.certifying():
        return
    st.live_cert.capture.ticked(now_s, view, 2.0 * st.loaded.config.prices.certify_window_s)


def certificate_doc(st: ServerState) -> dict[str, Any]:
    """``certificate`` (the last check, or None) and ``certificate_message`` (why there is
    none) for ``GET /prices`` and the dashboard."""
    cfg = st.loaded.config.prices
    if st.router.policy_name != "bid_price" or st.router.pools.disaggregated:
        why = "the live certificate checks bid_price on mixed instances only"
    elif cfg.certify_period_s is None:
        why = "prices.certify_period_s is null: the live certificate is off"
    elif st.live_cert is None:
        why = "no certifier: the router was started without the LP (olproute serve has it)"
    elif st.live_cert.last is None:
        why = (f"no check yet (the first after {cfg.certify_period_s:g} s)")
    else:
        return {"certificate": st.live_cert.last, "certificate_message": None}
    return {"certificate": None, "certificate_message": why}
