"""The shipped defaults refuse nothing the engines can take: on the embedded default (four
Llama-2-7B / A100 instances, bid_price as shipped, admission: shed) under a load they
absorb, every request is served, even with a reward that never pays for serving (the
prices and the score then hold every request while it is patient; a refusal needs an
engine without room). Under a load they cannot absorb, refusals say why."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from olproute.config.loader import DEFAULT_CONFIG, load_config
from olproute.policies.base import Policy
from olproute.sim.scenario import build_requests, simulate
from olproute.types import Decision, RoutingContext


def _default(**sections: Any) -> Any:
    loaded = load_config(DEFAULT_CONFIG)
    updates = {k: getattr(loaded.config, k).model_copy(update=v) for k, v in sections.items()}
    return loaded.with_updates(**updates)


def test_the_shipped_defaults_refuse_nothing_under_an_absorbable_load() -> None:
    loaded = _default(workload={"duration_s": 30.0})   # the default's own load, 30 s of it
    reqs = build_requests(loaded)
    res = simulate(loaded, "least_outstanding", reqs)
    assert not res.shed.any()   # a load the engines absorb: nothing queues for long
    for name, run in (("shipped", loaded),
                      ("a reward that never pays", loaded.with_updates(
                          reward=loaded.config.reward.model_copy(
                              update={"sigma": 0.0, "beta": 0.0, "gamma": 0.0})))):
        res = simulate(run, "bid_price", reqs)
        assert not res.shed.any(), name
        assert np.all(np.isfinite(res.finish_s)), name
        held = res.dispatch_s - np.array([r.arrival_s for r in reqs])
        # patience is each request's TTFT target: nothing is held longer
        assert np.all(held <= np.array([r.ttft_target_s for r in reqs]) + 0.05 + 1e-9), name


@pytest.mark.parametrize("view", ["engine", "router"])
def test_near_capacity_nothing_is_held_past_a_slot_and_ttft_beats_least_outstanding(
        view: str) -> None:
    """The default's trace at 1.5 times its load (time_scale 0.2; at 0.15 least
    outstanding's queues grow without bound), seen as the engines hold it or as a
    router rebuilds it from its traffic (``sim.snapshot_view``): shipped bid_price
    refuses nothing, holds nothing past one slot, and its mean and P99 TTFT are no
    worse than least_outstanding's."""
    loaded = _default(workload={"duration_s": 30.0, "time_scale": 0.2},
                      sim={"snapshot_view": view})
    reqs = build_requests(loaded)
    arrival = np.array([r.arrival_s for r in reqs])
    ttft = {}
    for name in ("least_outstanding", "bid_price"):
        res = simulate(loaded, name, reqs)
        assert not res.shed.any(), name
        assert np.all(res.dispatch_s - arrival <= loaded.config.router.slot_ms / 1e3 + 1e-9)
        ttft[name] = res.first_token_s - arrival
    for stat in (np.mean, lambda x: np.percentile(x, 99)):
        assert stat(ttft["bid_price"]) <= stat(ttft["least_outstanding"])


def test_an_overload_is_refused_only_with_engines_full() -> None:
    """Four times the default load for 15 s: bid_price refuses some requests, and every
    refusal is typed by the engines' state, never the prices alone: no_room, its reason
    naming each engine's figure, or late, naming the least queue an engine with room
    would give it."""
    loaded = _default(workload={"duration_s": 15.0, "time_scale": 0.075})
    reqs = build_requests(loaded)
    sheds: list[Decision] = []

    def wrap(policy: Policy, _: Any) -> Policy:   # its sheds recorded
        decide = policy.decide

        def recorded(ctx: RoutingContext) -> Decision:
            d = decide(ctx)
            if d.action == "shed":
                sheds.append(d)
            return d

        policy.decide = recorded  # type: ignore[method-assign]
        return policy

    res = simulate(loaded, "bid_price", reqs, wrap=wrap)
    assert res.shed.any() and len(sheds) == int(res.shed.sum())
    assert {d.refusal for d in sheds} <= {"no_room", "late"}
    for d in sheds:
        if d.refusal == "no_room":
            assert d.reason.count("running") + d.reason.count("KV blocks free") == 4
        else:
            assert "every engine with room would queue it past another" in d.reason
