"""Re-solved LP duals as bid_price's prices in the server (``prices.resolve_period_s``):
every period the requests of the last ``prices.resolve_window_s`` are packed
(``capture.pack_recent``) and a *resolver* solves their exact LP, moved forward to the
latest tick, in a worker process of its own (``olproute.server.certify.LiveCert``; the
CLI injects ``solvers.resolve.resolve_live``: the server does not import the solvers).

A re-solve that comes back ``ok`` hands its duals over to the book: the next tick takes
them (``PriceBook.warm_start``) in its thread, under the book's lock, after its own
update (as the simulator's re-solves follow the tick's update), so the loop neither
waits for the lock nor writes the prices; the steps refine them from the tick after
on. A slow, failed or empty re-solve, or one that raised, leaves the prices as they are;
so does a reload meanwhile (the duals were the old router's). ``resolve`` in ``GET
/prices`` shows the last re-solve without its duals; ``olproute_price_resolves_total`` counts
them by outcome.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from olproute.pricing.book import PriceBook
from olproute.pricing.reward import capacities
from olproute.routing.live_window import OK, Resolution
from olproute.routing.router import Router
from olproute.server.capture import pack_recent
from olproute.server.certify import LiveCert, deadline_s, run_every
from olproute.server.resolved import OUTCOME, Handover, Resolver
from olproute.server.state import ServerState


def worker(st: ServerState, resolver: Resolver) -> LiveCert[Resolution]:
    """The re-solves' worker pool, reporting to ``st``."""
    return LiveCert(resolver, summary=summary,
                    on_result=lambda doc, res: collected(st, doc, res),
                    name="the re-solve", status_key=OUTCOME)


async def run(st: ServerState) -> None:
    """Re-solve every period until cancelled (``init_app``'s lifecycle runs this)."""
    live = st.live_resolve
    assert live is not None
    await run_every(lambda: st.loaded.config.prices.resolve_period_s, st.resolving,
                    lambda: resolve_now(st), lambda exc: live.failed(st.now(), exc))


def resolve_now(st: ServerState) -> None:
    """Pack the recent window and submit it (or show why there is nothing to solve)."""
    live, cap = st.live_resolve, st.capture
    assert live is not None and cap is not None
    cfg = st.loaded.config
    if not live.make_room(deadline_s(cfg.prices.resolve_time_limit_s), st.now):
        st.metrics.resolved("skipped")
        return
    now = st.now()
    batch_cap, kv_cap = capacities(st.router.specs)
    window = pack_recent(cap, now, cfg.prices, cfg.reward, cfg.router.slot_ms / 1e3,
                         cfg.router.horizon_slots, batch_cap, kv_cap)
    full_s = cap.first_decided_s + cfg.prices.resolve_window_s
    if window is None:
        live.empty(now, cap.why_empty())
    elif now < full_s:   # as the simulator's: the first once a whole window has passed
        live.empty(now, f"the first window is not over yet (at {full_s:.3f} s)")
    else:
        live.submit(window, now, st.now)


def summary(res: Resolution) -> dict[str, Any]:
    """A re-solve as shown: without its duals (an array), and not applied yet."""
    return {OUTCOME: res.outcome, "t0_s": res.t0_s, "requests": res.requests,
            "solve_s": res.solve_s, "lp_value": res.lp_value, "error": res.error,
            "applied_s": None}


def collected(st: ServerState, doc: dict[str, Any], res: Resolution | None) -> None:
    """A finished re-solve, on the loop: its duals handed over if ok (a newer
    re-solve's replace those the tick has not taken yet), else counted by outcome; an
    ok one is counted when the tick has taken it (``applied``: ok, or error if its duals
    did not fit the book)."""
    if res is not None and res.outcome == OK and res.p is not None:
        st.handover = Handover(st.router, float(res.t0_s), np.asarray(res.p, dtype=np.float64),
                               doc)
    else:
        st.metrics.resolved(str(doc[OUTCOME]))


def take_handover(st: ServerState, router: Router) -> Handover | None:
    """The duals waiting for this tick of ``router`` (on the loop, before the tick);
    those of a router a reload replaced are dropped."""
    handover, st.handover = st.handover, None
    return handover if handover is not None and handover.router is router else None


def warm_start(router: Router, handover: Handover, now_s: float) -> str | None:
    """The duals into the policy's book (in the tick's thread, holding the book's
    lock); why not, if they do not fit it."""
    books = router.policy.price_books()
    if len(books) != 1 or not isinstance(books[0], PriceBook):
        return f"the policy has {len(books)} price books, not one PriceBook"
    try:
        books[0].warm_start(handover.t0_s, handover.p, now_s)
    except ValueError as exc:
        return f"warm start: {exc}"
    return None


def applied(st: ServerState, handover: Handover, now_s: float, error: str | None) -> None:
    """After the tick, on the loop: the re-solve's document says when its duals became
    the prices, or why they did not, and it is counted so."""
    if error is None:
        handover.doc["applied_s"] = now_s
    else:
        handover.doc.update({OUTCOME: "error", "error": error})
    st.metrics.resolved(str(handover.doc[OUTCOME]))


def resolve_doc(st: ServerState) -> dict[str, Any]:
    """``resolve`` (the last re-solve, or None) and ``resolve_message`` (why there is
    none) for ``GET /prices``."""
    cfg = st.loaded.config.prices
    if st.router.policy_name != "bid_price" or st.router.pools.disaggregated:
        why = "the re-solves price bid_price on mixed instances only"
    elif cfg.resolve_period_s is None:
        why = "prices.resolve_period_s is null: the re-solves are off"
    elif st.live_resolve is None:
        why = "no resolver: the router was started without the LP (olproute serve has it)"
    elif st.shared is not None and not st.shared.leading:
        why = "this replica adopts the leader's prices: the leader re-solves"
    elif st.live_resolve.last is None:
        why = f"no re-solve yet (the first after {cfg.resolve_period_s:g} s)"
    else:
        return {"resolve": st.live_resolve.last, "resolve_message": None}
    return {"resolve": None, "resolve_message": why}
