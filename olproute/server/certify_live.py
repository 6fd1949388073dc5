"""The live certificate wired into the server: the background task that checks the last
window every ``prices.certify_period_s`` (``olproute.server.certify``), and the
``certificate`` of ``GET /prices`` and the dashboard.

The period and the window's bounds are read from the running config at each check, so
``POST /admin/reload`` changes them; the ring's size follows
``prices.certify_max_requests`` at the next check.
"""

from __future__ import annotations

from typing import Any

from olproute.pricing.reward import capacities
from olproute.server.capture import pack
from olproute.server.certify import deadline_s, run_every
from olproute.server.state import ServerState


async def run(st: ServerState) -> None:
    """Check every period until cancelled (``init_app``'s lifecycle runs this)."""
    cert = st.live_cert
    assert cert is not None
    await run_every(lambda: st.loaded.config.prices.certify_period_s, st.certifying,
                    lambda: check_now(st), lambda exc: cert.failed(st.now(), exc))


def check_now(st: ServerState) -> None:
    """Pack the last window and submit it (or show why there is nothing to check)."""
    cert, cap = st.live_cert, st.capture
    assert cert is not None and cap is not None
    cfg = st.loaded.config
    cap.resize(cfg.prices.certify_max_requests)
    if not cert.make_room(deadline_s(cfg.prices.certify_time_limit_s), st.now):
        st.metrics.certificate_checks.labels("skipped").inc()
        return
    now = st.now()
    batch_cap, kv_cap = capacities(st.router.specs)
    window = pack(cap, now, cfg.prices, cfg.reward, cfg.router.slot_ms / 1e3,
                  cfg.router.horizon_slots, batch_cap, kv_cap)
    if window is None:
        cert.empty(now, cap.why_empty())
        return
    cert.submit(window, now, st.now)


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
