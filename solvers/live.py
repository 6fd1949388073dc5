"""The live certificate's check: ``olproute serve`` captures a window of its running
``bid_price`` (``olproute.server.capture``) and runs :func:`certify` on it in a worker
process every ``prices.certify_period_s`` (the CLI injects this function: the server
may not import the solvers).

:func:`certify` turns the :class:`~olproute.routing.live_window.LiveWindow` into a
:class:`~solvers.record.WindowLog` (its price updates become the log's, the free
capacity at its start the log's one tick), builds the LP of [t0, t1) with
``build_window`` and checks it with ``check`` (``solvers.check``: D(p_online)/LP* - 1,
the online reward, binding rows) on one HiGHS thread within the window's time limit. It
returns plain numbers (JSON-able; non-finite floats the server shows as null).
"""

from __future__ import annotations

from typing import Any

from olproute.routing.live_window import LiveWindow
from solvers.certificate import PriceUpdate
from solvers.check import check
from solvers.record import WindowLog, build_window

# the worker shares the machine with the router it checks
LP_THREADS = 1


def to_log(w: LiveWindow) -> WindowLog:
    """The window as a WindowLog (its requests are all decided: first_seen is set)."""
    updates = tuple(PriceUpdate(float(t), float(o), p)
                    for t, o, p in zip(w.update_s, w.origin_s, w.prices, strict=True))
    return WindowLog(
        slot_s=w.slot_s, horizon=w.horizon, reward=w.reward, batch_cap=w.batch_cap,
        kv_cap=w.kv_cap, compute_cap=w.compute_cap, arrival_s=w.arrival_s,
        prompt_tokens=w.prompt_tokens, ttft_target_s=w.ttft_target_s,
        first_seen_s=w.first_seen_s, ttft_hat_s=w.ttft_hat_s, tpot_s=w.tpot_s,
        decode_tokens=w.decode_tokens, utility=w.utility, exec_ttft_s=w.exec_ttft_s,
        instance=w.instance, first_token_s=w.first_token_s, finish_s=w.finish_s,
        updates=updates, free=((w.free_s, w.free),))


def certify(window: LiveWindow) -> dict[str, Any]:
    """Solve the window's exact LP and certify bid_price's prices over it."""
    log = to_log(window)
    prob, ids = build_window(log, window.t0_s, window.t1_s,
                             max_delay=window.max_delay_slots)
    res, _, _ = check(log, ids, prob, window.gap_tol, time_limit_s=window.time_limit_s,
                      threads=LP_THREADS)
    return {
        "window_start_s": window.t0_s, "window_end_s": window.t1_s,
        "requests": res.num_requests, "instances": res.num_instances,
        "slots": res.num_slots, "max_delay_slots": res.max_delay,
        "price_updates": len(log.updates),
        "lp_value": res.lp_value, "lp_bound": res.lp_bound, "d_online": res.d_online,
        "certificate": res.certificate, "best_scale": res.best_scale,
        "certificate_scaled": res.certificate_scaled,
        "online_reward": res.online_reward, "online_served": res.online_served,
        "online_over_lp": res.online_reward / res.lp_value if res.lp_value > 0 else None,
        "rows": res.rows, "binding_rows": res.lp_binding,
        "binding_by_resource": dict(res.binding_by_resource),
        "lp_priced_rows": res.lp_priced, "online_priced_rows": res.online_priced,
        "lp_status": res.lp_status, "lp_method": res.lp_method, "lp_rounds": res.lp_rounds,
        "solve_s": res.lp_seconds,
    }
