"""Disaggregated prefill/decode pools: roles, KV transfer, two-stage routing (issue 9)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from olproute.config.loader import ConfigError, load_config
from olproute.core_ref import ReferenceCore
from olproute.policies import REGISTRY, PolicyError
from olproute.pricing.reward import COMPUTE
from olproute.routing.disagg import KvTransfer, Pools, decode_admission
from olproute.sim import metrics
from olproute.sim.engine import SimEngine
from olproute.sim.scenario import CalibrationSource, build_requests, kv_transfer, simulate
from tests.conftest import CONV_TRACE, REPO, make_config

POOL_POLICIES = ("round_robin", "least_outstanding", "least_tokens", "calibrated_cost",
                 "bid_price")


def pd_config(num_prefill: int = 2, num_decode: int = 4, decode_kv: int = 60000,
              rate: float = 6.0, duration_s: float = 40.0, **sections: Any) -> Any:
    data: dict[str, Any] = {
        "instances": [
            {"name": "prefill", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill",
             "replicas": num_prefill},
            {"name": "decode", "model": "qwen2.5-3b", "gpu": "a40", "role": "decode",
             "replicas": num_decode, "kv_capacity_tokens": decode_kv}],
        "workload": {"kind": "mmpp2", "rate_per_s": rate, "duration_s": duration_s,
                     "lengths_path": str(CONV_TRACE)},
        "slo": {"mode": "classes"},
        "prediction": {"mode": "noisy", "noise": 0.2},
        "transfer": {"link_gbytes_per_s": 12.5, "latency_ms": 1.0},
    }
    data.update(sections)
    return make_config(**data)


class AdmitLog:
    """Records every admission of every engine: (engine, request, prompt, max output,
    computed tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[tuple[int, int, int, int, int]] = []
        original = SimEngine.admit
        log = self.rows

        def admit(engine: SimEngine, request_id: int, prompt_tokens: int, decode_tokens: int,
                  predicted_decode_tokens: int, computed_tokens: int = 0) -> int:
            log.append((engine.index, request_id, prompt_tokens, decode_tokens,
                        computed_tokens))
            return original(engine, request_id, prompt_tokens, decode_tokens,
                            predicted_decode_tokens, computed_tokens)

        monkeypatch.setattr(SimEngine, "admit", admit)


@pytest.mark.parametrize("policy", POOL_POLICIES)
def test_every_request_is_prefilled_once_and_decoded_once(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = pd_config()
    cal = CalibrationSource(loaded)
    cal()  # profile first: its own runs admit requests too
    log = AdmitLog(monkeypatch)
    res = simulate(loaded, policy, calibration=cal)
    pools = Pools.of(loaded.specs)
    served = np.flatnonzero(~res.shed)
    assert served.size > 100
    prefill_rows = [r for r in log.rows if r[0] in set(pools.prefill.tolist())]
    decode_rows = [r for r in log.rows if r[0] in set(pools.decode.tolist())]
    # once on a prefill engine: the whole prompt, one output token, nothing precomputed
    assert sorted(r[1] for r in prefill_rows) == served.tolist()
    for eng, rid, prompt, out, computed in prefill_rows:
        req = res.requests[rid]
        assert (eng, prompt, out, computed) == (res.instance[rid], req.prompt_tokens, 1, 0)
    # once on its decode engine, all but the last prompt token computed, for every output
    # (one-token answers included)
    assert sorted(r[1] for r in decode_rows) == served.tolist()
    for eng, rid, prompt, out, computed in decode_rows:
        req = res.requests[rid]
        assert eng == res.decode_instance[rid]
        assert (prompt, out, computed) == decode_admission(req.prompt_tokens,
                                                          int(res.decode_tokens[rid]))
    # every served request finished with all its output
    assert np.isfinite(res.finish_s[served]).all()
    assert (res.decode_tokens[served] == [res.requests[i].decode_tokens for i in served]).all()


def test_prefill_runs_every_prompt_token_and_decode_only_one_per_request() -> None:
    """Counted in the batch logs: the prefill pool computes each prompt once, the decode
    pool recomputes one prompt token per request (which samples its first output) and
    runs one decode step for each further output."""
    loaded = pd_config()
    res = simulate(loaded, "least_outstanding")
    pools = Pools.of(loaded.specs)
    log = res.batch_log
    on_prefill = np.isin(log[:, 0], pools.prefill)
    col = {c: i for i, c in enumerate(metrics.BATCH_LOG_COLUMNS)}
    served = ~res.shed
    prompts = np.array([r.prompt_tokens for r in res.requests])
    assert res.num_preemptions.sum() == 0   # 60k-token decode engines at this load
    assert log[on_prefill, col["num_prefill_tokens"]].sum() == prompts[served].sum()
    assert log[on_prefill, col["num_decode_tokens"]].sum() == 0
    assert log[~on_prefill, col["num_prefill_tokens"]].sum() == served.sum()
    assert log[~on_prefill, col["num_decode_tokens"]].sum() == (
        res.decode_tokens[served] - 1).sum()


def test_transfer_time_is_accounted(monkeypatch: pytest.MonkeyPatch) -> None:
    from olproute.sim.snapshots import SnapshotFeed

    handed: dict[tuple[int, int], float] = {}   # (engine, request) -> when it got it
    original = SnapshotFeed.dispatched

    def record(feed: SnapshotFeed, g: int, now_s: float, request_id: int, prompt: int,
               predicted: int) -> None:
        handed[(g, request_id)] = now_s
        original(feed, g, now_s, request_id, prompt, predicted)

    monkeypatch.setattr(SnapshotFeed, "dispatched", record)
    loaded = pd_config()
    res = simulate(loaded, "round_robin")
    xfer = kv_transfer(loaded)
    model = loaded.profiles.models["qwen2.5-3b"]
    # Qwen2.5-3B: 2 x 36 layers x 2 KV heads x 128 x 2 bytes = 36,864 bytes a token
    assert model.kv_bytes_per_token == 36864
    assert xfer.seconds(1000) == pytest.approx(1e-3 + 1000 * 36864 / 12.5e9)
    decoded = np.flatnonzero(~res.shed)
    for i in decoded:
        expected = xfer.seconds(res.requests[i].prompt_tokens)
        assert res.kv_arrival_s[i] - res.prefill_end_s[i] == pytest.approx(expected, abs=1e-9)
        # the client's first token comes from the decode engine, after the KV arrived
        assert res.first_token_s[i] > res.kv_arrival_s[i]
    # the prefill engine gets the request at its dispatch, the decode engine at its KV's
    # arrival, not before
    for i in decoded:
        assert handed[(int(res.instance[i]), int(i))] == res.dispatch_s[i]
        assert handed[(int(res.decode_instance[i]), int(i))] == res.kv_arrival_s[i]
        assert res.prefill_end_s[i] < res.kv_arrival_s[i]
    # a slower link: each transfer takes its modelled time, and TTFT grows by about it
    slow = pd_config(transfer={"link_gbytes_per_s": 0.5, "latency_ms": 20.0})
    res_slow = simulate(slow, "round_robin")
    xs = kv_transfer(slow)
    added = np.array([xs.seconds(res.requests[i].prompt_tokens)
                      - xfer.seconds(res.requests[i].prompt_tokens) for i in decoded])
    for i in decoded[:50]:
        assert (res_slow.kv_arrival_s[i] - res_slow.prefill_end_s[i]
                == pytest.approx(xs.seconds(res.requests[i].prompt_tokens), abs=1e-9))
    ttft_fast = metrics.ttft_s(res)[decoded]
    ttft_slow = metrics.ttft_s(res_slow)[decoded]
    assert np.median(ttft_slow - ttft_fast) > 0.5 * np.median(added) > 0


@pytest.mark.parametrize("learn_prices", [True, False])
def test_a_decode_pool_at_kv_capacity_holds_admission_back(learn_prices: bool) -> None:
    """Decode engines with room for a handful of requests: round robin overflows them
    (preemptions, recomputed prompts); bid_price holds requests in its buffer until a
    decode engine has the KV for them, and none is preempted. The free-capacity check
    works with the prices switched off too.

    Size: 10 s of arrivals (80 requests) and 8 s of patience. Round robin preempts 39
    times; held requests stay up to the patience, so bid_price serves ~75% (more with more
    patience, but every held request is decided again each slot and the run's cost grows
    with it: 30 s of arrivals and 30 s of patience took 30 s a case for the same facts).
    Shorter runs leave too few preemptions for the noisy check's 10% ratio to mean much."""
    common: dict[str, Any] = dict(num_prefill=1, num_decode=2, decode_kv=6000, rate=8.0,
                                  duration_s=10.0,
                                  admission={"mode": "shed", "patience_s": 8.0},
                                  prices={"enabled": learn_prices})
    loaded = pd_config(**common, prediction={"mode": "oracle"})
    reqs = build_requests(loaded)
    cal = CalibrationSource(loaded)
    rr = simulate(loaded, "round_robin", reqs, calibration=cal)
    bp = simulate(loaded, "bid_price", reqs, calibration=cal)
    assert rr.num_preemptions.sum() > 30
    assert bp.num_preemptions.sum() == 0
    waited = bp.dispatch_s - np.array([r.arrival_s for r in reqs])
    assert np.nanmax(waited) > 1.0          # held in the router, not queued on the engine
    assert (~bp.shed).sum() > 0.6 * len(reqs)
    # with +/-20% noise on the predicted lengths it overflows rarely, not never
    noisy = pd_config(**common)
    reqs = build_requests(noisy)
    rr = simulate(noisy, "round_robin", reqs, calibration=cal)
    bp = simulate(noisy, "bid_price", reqs, calibration=cal)
    assert bp.num_preemptions.sum() <= 0.1 * rr.num_preemptions.sum()


def _pool_decisions(loaded: Any) -> list[Any]:
    """Every decision PoolBidPrice takes in a simulation of ``loaded``."""
    from olproute.policies import bid_price_pools

    decisions: list[Any] = []
    original = bid_price_pools.PoolBidPrice.decide

    def spy(self: Any, ctx: Any) -> Any:
        d = original(self, ctx)
        decisions.append(d)
        return d

    bid_price_pools.PoolBidPrice.decide = spy  # type: ignore[method-assign]
    try:
        simulate(loaded, "bid_price")
    finally:
        bid_price_pools.PoolBidPrice.decide = original  # type: ignore[method-assign]
    return decisions


def test_bid_price_decisions_name_both_instances_and_explain_pairs() -> None:
    loaded = pd_config(duration_s=10.0)
    decisions = _pool_decisions(loaded)
    sent = [d for d in decisions if d.action == "dispatch"]
    assert sent
    for d in sent:
        assert loaded.specs[d.instance].role == "prefill"
        assert loaded.specs[d.decode_instance].role == "decode"
        assert len(d.explanation["pair_score"]) == 2 * 4
        assert "prefill on prefill-" in d.reason and "decode on decode-" in d.reason


def _chosen_on_time(d: Any) -> bool:
    e = d.explanation
    k = next(i for i, (p, q) in enumerate(zip(e["pair_prefill"], e["pair_decode"],
                                                strict=True))
             if p == d.instance and q == d.decode_instance)
    return bool(e["pair_on_time"][k])


def test_the_constrained_form_on_pools_sends_only_on_time_pairs() -> None:
    """Overloaded pools (12 req/s on one prefill engine): the Lagrangian form sends some
    requests to pairs predicted late; the constrained form sends none (but those it
    defers at their patience), holding a request while no pair is on time."""
    late = {}
    for form in ("lagrangian", "constrained"):
        loaded = pd_config(num_prefill=1, num_decode=2, rate=12.0, duration_s=10.0,
                           router={"policy": "bid_price",
                                   "policy_params": {"bid_price": {"form": form}}})
        decisions = _pool_decisions(loaded)
        sent = [d for d in decisions if d.action == "dispatch" and "deferred" not in d.reason]
        assert sent
        late[form] = sum(not _chosen_on_time(d) for d in sent)
        if form == "constrained":
            assert any(d.action == "hold" and "no pair is predicted to meet" in d.reason
                       for d in decisions)
    assert late["lagrangian"] > 0 and late["constrained"] == 0


def test_policies_that_cannot_route_pools_say_so() -> None:
    loaded = pd_config()
    assert set(POOL_POLICIES) <= set(REGISTRY.pool_names())
    with pytest.raises(PolicyError, match="'bear' cannot route disaggregated"):
        simulate(loaded, "bear")
    joint = loaded.with_updates(router=loaded.config.router.model_copy(update={
        "policy_params": {"bid_price": {"release": "density"}}}))
    with pytest.raises(PolicyError, match="release on mixed instances only"):
        simulate(joint, "bid_price")
    primal = loaded.with_updates(router=loaded.config.router.model_copy(update={
        "policy_params": {"bid_price": {"form": "primal"}}}))
    with pytest.raises(PolicyError, match="form: primal on mixed instances only"):
        simulate(primal, "bid_price")


def test_a_policy_naming_a_wrong_decode_instance_is_an_error() -> None:
    from olproute.policies import Policy
    from olproute.sim.cluster import Cluster
    from olproute.sim.scenario import build_timers
    from olproute.types import Decision

    loaded = pd_config(duration_s=5.0)

    class Bad(Policy):
        name = "bad"

        def decide(self, ctx: Any) -> Decision:
            return Decision(ctx.request.request_id, "dispatch", 0, "prefill only")

        def observe(self, outcome: Any) -> None:
            pass

    cluster = Cluster(loaded.specs, build_timers(loaded), Bad(), slot_s=0.05,
                      transfer=kv_transfer(loaded).seconds)
    with pytest.raises(ValueError, match="decode instance None"):
        cluster.run(build_requests(loaded))


@pytest.mark.parametrize(("instances", "key", "message"), [
    ([{"name": "p", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill"}],
     "instances", "at least one decode instance"),
    ([{"name": "p", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill"},
      {"name": "d", "model": "qwen2.5-3b", "gpu": "a40", "role": "decode"},
      {"name": "m", "model": "qwen2.5-3b", "gpu": "a40"}],
     "instances[2].role", "mixed instance cannot sit beside"),
    ([{"name": "p", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill"},
      {"name": "d", "model": "qwen2-7b", "gpu": "a40", "role": "decode"}],
     "instances", "serve one model"),
])
def test_pool_config_errors_name_the_key(tmp_path: Any, instances: list[dict[str, Any]],
                                         key: str, message: str) -> None:
    import yaml

    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump({
        "profiles": str(REPO / "configs" / "profiles.yaml"), "instances": instances,
        "workload": {"kind": "poisson", "rate_per_s": 1.0, "num_requests": 5,
                     "prompt_tokens": 10, "decode_tokens": 10}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert str(path) in text and f"{key}: " in text and message in text


def test_the_shipped_pd_config_loads() -> None:
    loaded = load_config(REPO / "configs" / "pd.yaml")
    pools = Pools.of(loaded.specs)
    assert pools.prefill.tolist() == [0, 1] and pools.decode.tolist() == [2, 3, 4, 5]
    assert all(loaded.specs[i].kv_capacity_tokens == 60000 for i in pools.decode)


def test_decode_admission_and_transfer_arithmetic() -> None:
    assert decode_admission(100, 5) == (100, 5, 99)
    assert decode_admission(1, 1) == (1, 1, 0)
    with pytest.raises(ValueError, match="must be >= 1"):
        decode_admission(100, 0)
    t = KvTransfer(bytes_per_token=1000.0, bytes_per_s=1e6, latency_s=0.01)
    assert t.seconds(0) == 0.01 and t.seconds(500) == pytest.approx(0.51)


def test_core_admits_a_request_with_its_prompt_computed() -> None:
    from olproute._core import BatchCore

    for cls in (BatchCore, ReferenceCore):
        core = cls(100, 16, 8, 512)
        slot = core.add_request(100, 3, 99)
        n, sums = core.schedule()
        # the last prompt token recomputed, attending to the 99 computed ones; it samples
        # the first output token
        assert n == 1 and sums[4] == 1 and sums[7] == 99
        assert core.commit() == 1 and core.event_list() == [(slot, 1)]   # first token
        assert core.request(slot)[1:5] == (1, 3, 100, 7)   # all 100 tokens' blocks held
        with pytest.raises(ValueError, match="computed_tokens"):
            core.add_request(10, 3, 10)


def test_router_prices_show_both_pools_books() -> None:
    from olproute.routing.router import Router

    loaded = pd_config(router={"policy": "bid_price", "horizon_slots": 40})
    router = Router(loaded, CalibrationSource(loaded))
    book = router.policy.book_prefill  # type: ignore[attr-defined]
    book.p[0, :, COMPUTE] = 2.0        # the first prefill engine's token budget is dear
    prices = router.prices()
    assert prices is not None
    rows = prices["instances"]
    assert [r["role"] for r in rows] == ["prefill"] * 2 + ["decode"] * 4
    assert rows[0]["compute"] == [2.0] * 40 and rows[0]["bottleneck"] == "compute"
    assert rows[0]["batch"] == [0.0] * 40
    assert all(r["bottleneck"] == "none" and len(r["kv"]) == 40 for r in rows[1:])
    # prefill engines have a compute budget; decode engines none (no compute row)
    assert all(r["compute_budget_tokens_per_slot"] > 0 for r in rows[:2])
    assert all(r["compute_budget_tokens_per_slot"] is None for r in rows[2:])


def test_recalibrated_beta_reaches_the_right_pool_instance() -> None:
    from olproute.routing.router import Router

    loaded = pd_config(router={"policy": "bid_price"})
    router = Router(loaded, CalibrationSource(loaded))
    policy: Any = router.policy
    before = policy._bea.beta.copy()
    assert router.set_beta(1, (0.5, 0.0, 0.0, 0.0))       # the second prefill engine
    assert router.set_beta(4, (0.25, 0.0, 0.0, 0.0))      # a decode engine
    assert policy._bea.beta[1].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert policy._bea.beta[0].tolist() == before[0].tolist()
    assert policy._beta[4].tolist() == [0.25, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="4 coefficients"):
        router.set_beta(0, (1.0, 2.0))


def test_a_rerouted_dispatch_moves_its_decode_column_with_it() -> None:
    """The router moves a bid_price pair off an unhealthy decode engine: the policy then
    holds the request's decode column on the engine it actually goes to."""
    from olproute.routing.router import Router
    from olproute.sim.engine import SimEngine
    from olproute.sim.scenario import build_timers

    loaded = pd_config(router={"policy": "bid_price"})
    router = Router(loaded, CalibrationSource(loaded))
    engines = [SimEngine(g, s, t) for g, (s, t) in enumerate(
        zip(loaded.specs, build_timers(loaded), strict=True))]
    loads = tuple(e.load(0) for e in engines)
    snaps = tuple(e.snapshot(0.0) for e in engines)
    req = router.new_request(0.0, 500, 50, 1.0)
    first = router.decide(req, 0.0, loads, snaps, [True] * 6)
    assert first.action == "dispatch" and first.decode_instance is not None
    policy: Any = router.policy
    policy.forget(req.request_id)
    healthy = [True] * 6
    healthy[first.decode_instance] = False
    d = router.decide(req, 0.0, loads, snaps, healthy)
    assert d.decode_instance is not None and d.decode_instance != first.decode_instance
    assert "unhealthy" in d.reason
    held = policy._inbound[req.request_id].decode
    assert int(policy._dec[held]) == d.decode_instance
