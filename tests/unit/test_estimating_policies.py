"""Focused tests of the estimating baselines on hand-built contexts: bear, prefill_tps,
latency_agnostic, lmdeploy, score, route_balance, calibrated_cost."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from olproute.config.loader import RewardConfig
from olproute.estimate.calibration import InstanceCalibration
from olproute.policies import REGISTRY, Policy, PolicyEnv, PolicyError
from olproute.policies.route_balance import min_max
from olproute.routing.outlook import Outlook
from olproute.types import EngineSnapshot, InstanceLoad, InstanceSpec, Request, RoutingContext

BETA = (2e-3, 4e-5, 2e-8, 3e-9)
ESTIMATING = ("bear", "calibrated_cost", "latency_agnostic", "lmdeploy", "prefill_tps",
              "route_balance", "score")
PROMPT, DECODE = 200, 50


def _spec(name: str = "i", model: str = "m", blocks: int = 1000) -> InstanceSpec:
    return InstanceSpec(name=name, model=model, gpu="g", tensor_parallel=1, max_num_seqs=8,
                        max_num_batched_tokens=512, block_size=16, num_kv_blocks=blocks)


def _cal(prefill_tps: float = 20_000.0, tpot: float = 0.01,
         mu: float | None = 10.0) -> InstanceCalibration:
    return InstanceCalibration(beta=BETA, prefill_tokens_per_s=prefill_tps, tpot_s=tpot,
                               mean_batch_seqs=8.0, service_rate_per_s=mu, service_scv=1.0)


def _snap(spec: InstanceSpec, running: Sequence[tuple[int, int, int]] = (),
          waiting: Sequence[int] = (), free: int | None = None) -> EngineSnapshot:
    """Decoders as (prompt, output so far, predicted output); waiting requests by prompt
    (predicted output 50, nothing computed)."""
    rows = [[p, o, pred, p + o - 1, math.ceil((p + o) / spec.block_size)]
            for p, o, pred in running]
    rows += [[p, 0, 50, 0, 0] for p in waiting]
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
    used = int(table[:, 4].sum()) if len(rows) else 0
    return EngineSnapshot(time_s=0.0, table=table, num_running=len(running),
                          num_free_blocks=spec.num_kv_blocks - used if free is None else free,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(len(rows), dtype=np.int64))


def _ctx(specs: Sequence[InstanceSpec], snaps: Sequence[EngineSnapshot],
         target_s: float = 1.0, prompt: int = PROMPT, request_id: int = 0,
         pending: tuple[np.ndarray | None, ...] | None = None) -> RoutingContext:
    loads = tuple(InstanceLoad(index=g, name=s.name, num_running=sn.num_running,
                               num_waiting=sn.num_resident - sn.num_running,
                               num_outstanding=sn.num_resident,
                               num_kv_blocks_used=s.num_kv_blocks - sn.num_free_blocks,
                               num_kv_blocks=s.num_kv_blocks, max_num_seqs=s.max_num_seqs)
                  for g, (s, sn) in enumerate(zip(specs, snaps, strict=True)))
    req = Request(request_id=request_id, arrival_s=0.0, prompt_tokens=prompt,
                  decode_tokens=DECODE, predicted_decode_tokens=DECODE, ttft_target_s=target_s)
    return RoutingContext(request=req, now_s=0.0, instances=loads, specs=tuple(specs),
                          snapshots=tuple(snaps), pending=pending)


class FixedOutlook:
    """Stands in for OutlookSource: the same quality and cost for every request."""

    def __init__(self, quality: Sequence[float], cost: Sequence[float],
                 decode: Sequence[float] | None = None) -> None:
        n = len(quality)
        self.outlook = Outlook(
            decode_tokens=np.array(decode if decode is not None else [DECODE] * n, dtype=float),
            quality=np.array(quality, dtype=float), cost_musd=np.array(cost, dtype=float))

    def __call__(self, request: Request) -> Outlook:
        return self.outlook


def _policy(name: str, specs: Sequence[InstanceSpec], quality: Sequence[float] | None = None,
            cost: Sequence[float] | None = None, params: dict[str, Any] | None = None,
            cals: Sequence[InstanceCalibration] | None = None, seed: int = 0,
            decode: Sequence[float] | None = None, **reward: float) -> Policy:
    n = len(specs)
    cal = tuple(cals) if cals is not None else tuple(_cal() for _ in specs)
    env = PolicyEnv(specs=tuple(specs), rng=np.random.default_rng(seed), params=params or {},
                    reward=RewardConfig(**reward),  # type: ignore[arg-type]
                    calibration_source=lambda: cal,
                    outlook_source=FixedOutlook(quality or [0.5] * n, cost or [0.0] * n,
                                                decode))  # type: ignore[arg-type]
    return REGISTRY.create(name, env)


def _decoders(n: int, context: int = 300, remaining: int = 400) -> list[tuple[int, int, int]]:
    return [(context, 1, 1 + remaining)] * n


def _step_s(contexts: Sequence[int], prompt: int = PROMPT,
            beta: Sequence[float] = BETA) -> float:
    """One decode step of residents with these contexts plus the new request, by the
    4-term model (max_num_seqs 8: at most 7 residents join it)."""
    n = min(len(contexts), 7)
    return beta[0] + beta[1] * (n + 1) + beta[2] * (sum(contexts[:n]) + prompt)


THREE = (_spec("a"), _spec("b"), _spec("c"))


# -- registry and parameters --------------------------------------------------------------
@pytest.mark.parametrize("name", ESTIMATING)
def test_registered_with_its_name_and_rejects_unknown_params(name: str) -> None:
    assert name in REGISTRY.names()
    assert _policy(name, THREE).name == name
    with pytest.raises(PolicyError, match=rf"'{name}': parameter bogus: unknown key"):
        _policy(name, THREE, params={"bogus": 1})


@pytest.mark.parametrize(("name", "params", "match"), [
    ("bear", {"form": "soft"}, "form: must be one of 'constrained' or 'lagrangian'"),
    ("prefill_tps", {"form": 3}, "form: must be one of"),
    ("score", {"w_latency": -1.0}, "w_latency: must be >= 0"),
    ("score", {"w_cost": "cheap"}, "w_cost: input should be a valid number"),
    ("route_balance", {"w_quality": float("nan")}, "w_quality: must be a finite number"),
    ("calibrated_cost", {"kv_threshold": 1.5}, "kv_threshold: must be <= 1"),
    ("calibrated_cost", {"size_ref_tokens": 0}, "size_ref_tokens: must be > 0"),
    ("calibrated_cost", {"rho": True}, "rho: input should be a valid number, got True"),
])
def test_bad_param_values_are_rejected(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        _policy(name, THREE, params=params)


@pytest.mark.parametrize("name", ESTIMATING)
def test_decisions_explain_every_instance(name: str) -> None:
    policy = _policy(name, THREE, quality=[0.9, 0.6, 0.3], cost=[300, 100, 50])
    ctx = _ctx(THREE, [_snap(THREE[0], _decoders(4)), _snap(THREE[1]),
                       _snap(THREE[2], waiting=[500, 500])])
    d = policy.decide(ctx)
    assert d.action == "dispatch" and d.instance in (0, 1, 2)
    assert d.reason.strip() and d.request_id == ctx.request.request_id
    assert d.explanation
    for key, values in d.explanation.items():
        assert len(values) == 3, key
        assert all(isinstance(v, float) for v in values), key


# -- bear and prefill_tps -----------------------------------------------------------------
def test_bear_picks_the_best_utility_among_feasible_instances() -> None:
    # a: best utility but a deep decode queue; b: next best, idle; c: worst, idle
    snaps = [_snap(THREE[0], _decoders(8, remaining=600), waiting=[2000] * 4),
             _snap(THREE[1]), _snap(THREE[2])]
    policy = _policy("bear", THREE, quality=[0.9, 0.7, 0.4])
    d = policy.decide(_ctx(THREE, snaps, target_s=0.1))
    ttft = d.explanation["ttft_s"]
    assert ttft[0] > 0.1 > max(ttft[1], ttft[2])
    assert d.explanation["feasible"] == (0.0, 1.0, 1.0)
    assert d.instance == 1
    assert "highest utility of the 2 instance(s)" in d.reason
    # with a target the busy instance meets, its higher utility wins
    assert policy.decide(_ctx(THREE, snaps, target_s=ttft[0] + 1.0)).instance == 0


def test_bear_utility_subtracts_lambda_times_cost() -> None:
    # equal quality; b is cheaper, so at lambda > 0 it has the higher utility
    policy = _policy("bear", THREE[:2], quality=[0.8, 0.8], cost=[400.0, 100.0],
                     cost_lambda=1e-3)
    d = policy.decide(_ctx(THREE[:2], [_snap(THREE[0]), _snap(THREE[1])]))
    assert d.explanation["utility"] == pytest.approx((0.4, 0.7))
    assert d.instance == 1


def test_bear_falls_back_to_the_least_estimated_ttft() -> None:
    snaps = [_snap(THREE[0], _decoders(8), waiting=[1500] * 3),
             _snap(THREE[1], _decoders(2)),
             _snap(THREE[2], _decoders(6), waiting=[800])]
    d = _policy("bear", THREE, quality=[0.9, 0.3, 0.6]).decide(
        _ctx(THREE, snaps, target_s=1e-6))
    ttft = d.explanation["ttft_s"]
    assert d.explanation["feasible"] == (0.0, 0.0, 0.0)
    assert d.instance == int(np.argmin(ttft)) == 1
    assert "least estimated TTFT" in d.reason


def test_bear_lagrangian_trades_utility_against_delta_times_ttft() -> None:
    specs = THREE[:2]
    snaps = [_snap(specs[0], _decoders(8, remaining=600), waiting=[1000] * 2), _snap(specs[1])]
    ctx = _ctx(specs, snaps, target_s=1e-6)  # nothing feasible: the form alone decides

    def decide(delta: float) -> tuple[int | None, dict[str, tuple[float, ...]]]:
        d = _policy("bear", specs, quality=[0.9, 0.6], params={"form": "lagrangian"},
                    delta=delta).decide(ctx)
        return d.instance, dict(d.explanation)

    g, why = decide(0.0)
    assert g == 0  # no latency penalty: the higher utility
    gap_s = why["ttft_s"][0] - why["ttft_s"][1]
    assert gap_s > 0
    breakeven = (0.9 - 0.6) / gap_s
    assert decide(0.5 * breakeven)[0] == 0
    g, why = decide(2.0 * breakeven)
    assert g == 1
    expected = np.array(why["utility"]) - 2.0 * breakeven * np.array(why["ttft_s"])
    assert why["score"] == pytest.approx(tuple(expected))


def test_bear_breaks_utility_ties_by_estimated_ttft() -> None:
    snaps = [_snap(THREE[0], _decoders(6)), _snap(THREE[1], _decoders(1)),
             _snap(THREE[2], _decoders(3))]
    d = _policy("bear", THREE, quality=[0.7, 0.7, 0.7]).decide(_ctx(THREE, snaps))
    assert d.instance == 1


def test_prefill_tps_estimates_pending_prefill_over_throughput() -> None:
    cals = [_cal(prefill_tps=10_000.0), _cal(prefill_tps=40_000.0)]
    specs = (_spec("a"), _spec("b", model="faster"))  # two kinds: each keeps its profile
    snaps = [_snap(specs[0], waiting=[1000, 3000]), _snap(specs[1], waiting=[6000, 2000])]
    d = _policy("prefill_tps", specs, quality=[0.8, 0.8], cals=cals).decide(
        _ctx(specs, snaps, prompt=1000))
    assert d.explanation["ttft_s"] == pytest.approx((5000 / 10_000, 9000 / 40_000))
    assert d.instance == 1


# -- latency_agnostic ---------------------------------------------------------------------
def test_latency_agnostic_ignores_load() -> None:
    policy = _policy("latency_agnostic", THREE, quality=[0.3, 0.8, 0.5])
    loads = [[_snap(s) for s in THREE],
             [_snap(THREE[0]), _snap(THREE[1], _decoders(8), waiting=[4000] * 5),
              _snap(THREE[2])]]
    for k, snaps in enumerate(loads):
        d = policy.decide(_ctx(THREE, snaps, request_id=k))
        assert d.instance == 1
        assert d.explanation["utility"] == pytest.approx((0.3, 0.8, 0.5))


def test_latency_agnostic_splits_ties_at_random_from_its_generator() -> None:
    def picks(seed: int) -> list[int | None]:
        policy = _policy("latency_agnostic", THREE, quality=[0.8, 0.8, 0.1], seed=seed)
        return [policy.decide(_ctx(THREE, [_snap(s) for s in THREE], request_id=k)).instance
                for k in range(200)]

    counts = Counter(picks(4))
    assert set(counts) == {0, 1} and min(counts.values()) > 60
    assert picks(4) == picks(4)
    assert picks(4) != picks(5)


# -- lmdeploy -----------------------------------------------------------------------------
@pytest.mark.parametrize(("outstanding", "rates", "expected"), [
    ([2, 2, 2], [10.0, 20.0, 40.0], 2),     # 3/10, 3/20, 3/40
    ([0, 5, 12], [10.0, 20.0, 40.0], 0),    # 1/10, 6/20, 13/40
    ([4, 1, 9], [10.0, 10.0, 10.0], 1),     # equal speeds: least outstanding
    ([0, 3, 0], [None, None, 40.0], 2),     # unknown speeds take the mean of the known
    ([3, 1, 2], [None, None, None], 1),     # none known: least outstanding
])
def test_lmdeploy_picks_least_unfinished_over_speed(
        outstanding: list[int], rates: list[float | None], expected: int) -> None:
    snaps = [_snap(s, _decoders(n)) for s, n in zip(THREE, outstanding, strict=True)]
    policy = _policy("lmdeploy", THREE, cals=[_cal(mu=mu) for mu in rates])
    d = policy.decide(_ctx(THREE, snaps))
    assert d.instance == expected
    known = [mu for mu in rates if mu is not None]
    fill = float(np.mean(known)) if known else 1.0
    speed = [fill if mu is None else mu for mu in rates]
    assert d.explanation["expected_latency_s"] == pytest.approx(
        tuple((n + 1) / s for n, s in zip(outstanding, speed, strict=True)))


# -- score --------------------------------------------------------------------------------
def test_score_latency_grows_with_the_queue_and_steers_away() -> None:
    specs = THREE[:2]
    policy = _policy("score", specs, quality=[0.7, 0.7], cost=[100.0, 100.0])
    latencies = []
    for n in (0, 2, 6):
        d = policy.decide(_ctx(specs, [_snap(specs[0], waiting=[2000] * n), _snap(specs[1])]))
        latencies.append(d.explanation["latency_s"][0])
        assert d.instance == 1 if n else d.instance in (0, 1)
    assert latencies[0] < latencies[1] < latencies[2]
    # queue delay: waiting prefill over throughput, plus predicted output x the decode
    # step now (beta at this instance's load), not the profiled tpot_s
    assert latencies[2] == pytest.approx(6 * 2000 / 20_000 + DECODE * _step_s([2000] * 6))


@pytest.mark.parametrize("name", ["score", "calibrated_cost", "prefill_tps"])
def test_profiled_noise_does_not_herd_identical_replicas(name: str) -> None:
    """Two identical replicas whose profiled mean TPOT and prefill throughput differ by
    calibration noise alone: on equal states they tie (coin flip) instead of the
    faster-profiled one taking everything (per-token time from beta at each one's load,
    prefill throughput one figure per kind of instance), and the loaded one is avoided
    whatever its profile says."""
    specs = THREE[:2]
    cals = [_cal(tpot=0.0096, prefill_tps=20_400.0), _cal(tpot=0.0104, prefill_tps=19_600.0)]
    chosen = {_policy(name, specs, cals=cals, seed=seed).decide(
        _ctx(specs, [_snap(specs[0]), _snap(specs[1])])).instance for seed in range(16)}
    assert chosen == {0, 1}
    loaded = [_snap(specs[0], _decoders(5), waiting=[1000, 1000]), _snap(specs[1], _decoders(1))]
    assert _policy(name, specs, cals=cals).decide(_ctx(specs, loaded)).instance == 1


def test_score_weighs_quality_against_latency_with_w_latency() -> None:
    specs = THREE[:2]
    snaps = [_snap(specs[0], waiting=[4000] * 5), _snap(specs[1])]  # a: 1 s of queue
    for w_latency, expected in ((0.1, 0), (1.0, 1)):
        d = _policy("score", specs, quality=[0.9, 0.6], cost=[200.0, 100.0],
                    params={"w_latency": w_latency}, cost_lambda=1e-4).decide(
            _ctx(specs, snaps))
        assert d.instance == expected
        q, c, lat = (np.array(d.explanation[k]) for k in ("quality", "cost_musd",
                                                          "latency_s"))
        assert d.explanation["score"] == pytest.approx(tuple(q - 1e-4 * c - w_latency * lat))


def test_score_latency_weight_defaults_to_reward_delta() -> None:
    specs = THREE[:2]
    snaps = [_snap(specs[0], waiting=[4000] * 5), _snap(specs[1])]
    for delta, expected in ((0.1, 0), (1.0, 1)):
        policy = _policy("score", specs, quality=[0.9, 0.6], delta=delta)
        assert policy.decide(_ctx(specs, snaps)).instance == expected


# -- route_balance ------------------------------------------------------------------------
@pytest.mark.parametrize(("x", "expected"), [
    ([1.0, 3.0, 2.0], [0.0, 1.0, 0.5]),
    ([5.0, 5.0], [0.0, 0.0]),
    ([7.0], [0.0]),
    ([0.0, math.inf, 4.0], [0.0, 1.0, 1.0]),
])
def test_min_max_normalises_across_instances(x: list[float], expected: list[float]) -> None:
    assert min_max(np.array(x)).tolist() == pytest.approx(expected)


def test_route_balance_steers_away_from_pending_decode_work() -> None:
    specs = THREE[:2]
    policy = _policy("route_balance", specs, quality=[0.7, 0.7], cost=[100.0, 100.0])
    light = policy.decide(_ctx(specs, [_snap(specs[0], _decoders(1)),
                                       _snap(specs[1], _decoders(4))]))
    heavy = policy.decide(_ctx(specs, [_snap(specs[0], _decoders(6)),
                                       _snap(specs[1], _decoders(2))]))
    assert (light.instance, heavy.instance) == (0, 1)
    # latency: TPOT x pending decode tokens / mean batch size
    assert heavy.explanation["latency_s"] == pytest.approx((0.01 * 6 * 400 / 8,
                                                            0.01 * 2 * 400 / 8))
    assert heavy.explanation["latency_norm"] == (1.0, 0.0)


def test_route_balance_scores_normalised_quality_cost_and_latency() -> None:
    # a: best quality, dearest, loaded; b: middle; c: worst, cheapest, idle
    snaps = [_snap(THREE[0], _decoders(4)), _snap(THREE[1], _decoders(2)), _snap(THREE[2])]
    quality, cost = [0.9, 0.8, 0.2], [500.0, 200.0, 100.0]
    d = _policy("route_balance", THREE, quality=quality, cost=cost).decide(_ctx(THREE, snaps))
    assert d.explanation["quality_norm"] == pytest.approx((1.0, 6 / 7, 0.0))
    assert d.explanation["cost_norm"] == pytest.approx((1.0, 0.25, 0.0))
    assert d.explanation["latency_norm"] == pytest.approx((1.0, 0.5, 0.0))
    assert d.explanation["score"] == pytest.approx((-1.0, 6 / 7 - 0.75, 0.0))
    assert d.instance == 1
    # with no weight on latency and cost, quality alone decides
    d = _policy("route_balance", THREE, quality=quality, cost=cost,
                params={"w_cost": 0.0, "w_latency": 0.0}).decide(_ctx(THREE, snaps))
    assert d.instance == 0


# -- calibrated_cost ----------------------------------------------------------------------
def test_calibrated_cost_prefers_the_emptier_of_equal_instances() -> None:
    specs = THREE[:2]
    policy = _policy("calibrated_cost", specs)
    busy = _snap(specs[0], _decoders(2), waiting=[1500, 1500])
    assert policy.decide(_ctx(specs, [busy, _snap(specs[1])])).instance == 1
    busy = _snap(specs[1], _decoders(2), waiting=[1500, 1500])
    d = policy.decide(_ctx(specs, [_snap(specs[0]), busy]))
    assert d.instance == 0
    assert d.explanation["queue"] == (0.0, 2.0)
    assert d.explanation["backlog_s"] == pytest.approx((0.0, 3000 / 20_000))


def test_calibrated_cost_grows_with_kv_pressure() -> None:
    spec = _spec(blocks=1000)
    policy = _policy("calibrated_cost", [spec], params={"size_ref_tokens": PROMPT})
    own = math.ceil((PROMPT + DECODE) / 16)  # the request's blocks at its peak
    costs, press = [], []
    for used in (300, 700, 850, 950):
        d = policy.decide(_ctx([spec], [_snap(spec, free=1000 - used)]))
        costs.append(d.explanation["cost"][0])
        press.append(d.explanation["kv_pressure"][0])
    assert press[:2] == [0.0, 0.0]
    assert press[2:] == pytest.approx([(850 + own) / 1000 - 0.8, (950 + own) / 1000 - 0.8])
    assert costs[0] == costs[1] < costs[2] < costs[3]
    # the decode term is o x tpot x (1 + rho x press) x size, size = 1 here, with tpot
    # the decode step of this (empty) instance with the request
    assert costs[3] == pytest.approx(DECODE * _step_s([]) * (1 + press[3]))
    assert d.explanation["tpot_s"] == pytest.approx((_step_s([]),))


def test_calibrated_cost_avoids_the_pressured_instance() -> None:
    specs = THREE[:2]
    policy = _policy("calibrated_cost", specs, params={"rho": 5.0})
    d = policy.decide(_ctx(specs, [_snap(specs[0], free=20), _snap(specs[1], free=500)]))
    assert d.instance == 1
    assert d.explanation["kv_pressure"][0] > 0 == d.explanation["kv_pressure"][1]


def test_calibrated_cost_counts_dispatches_a_stale_snapshot_misses() -> None:
    specs = THREE[:2]
    policy = _policy("calibrated_cost", specs)
    pending = (np.array([[1200.0, 50.0, 0.0], [800.0, 50.0, 0.0]]), None)
    d = policy.decide(_ctx(specs, [_snap(specs[0]), _snap(specs[1])], pending=pending))
    assert d.instance == 1
    assert d.explanation["queue"] == (2.0, 0.0)
    assert d.explanation["backlog_s"] == pytest.approx((2000 / 20_000, 0.0))


def test_calibrated_cost_formula_and_size_factor() -> None:
    specs = THREE[:2]
    slow = (4e-3, 8e-5, 4e-8, 3e-9)
    cals = [InstanceCalibration(beta=slow, prefill_tokens_per_s=10_000.0, tpot_s=0.02,
                                mean_batch_seqs=8.0),
            _cal(prefill_tps=30_000.0)]
    snaps = [_snap(specs[0], waiting=[1000]), _snap(specs[1], waiting=[3000, 3000, 3000])]
    params = {"w_backlog": 2.0, "w_service": 0.5, "w_queue": 0.1, "size_ref_tokens": 100.0}
    d = _policy("calibrated_cost", specs, params=params, cals=cals, decode=[40, 80]).decide(
        _ctx(specs, snaps, prompt=300))
    size = 300 / 100
    tpot = (_step_s([1000], 300, slow), _step_s([3000] * 3, 300))
    expected = (2.0 * (1000 / 10_000) * size + 0.5 * 40 * tpot[0] * size + 0.1 * 1,
                2.0 * (9000 / 30_000) * size + 0.5 * 80 * tpot[1] * size + 0.1 * 3)
    assert d.explanation["cost"] == pytest.approx(expected)
    assert d.instance == int(np.argmin(expected))


def test_calibrated_cost_size_factor_is_relative_to_the_running_mean_prompt() -> None:
    spec = _spec()
    policy = _policy("calibrated_cost", [spec])
    sizes = [policy.decide(_ctx([spec], [_snap(spec)], prompt=p, request_id=k))
             .explanation["size"][0] for k, p in enumerate((100, 300, 200))]
    assert sizes == pytest.approx([1.0, 300 / 200, 200 / 200])


def test_least_tokens_counts_prefill_and_predicted_decode_left() -> None:
    specs = [_spec(f"i{g}") for g in range(3)]
    snaps = [_snap(specs[0], waiting=[1000]),                        # 1000 + 50 tokens
             _snap(specs[1], running=[(100, 10, 500)]),              # 490 to generate
             _snap(specs[2], running=[(100, 10, 60)], waiting=[200])]  # 50 + 200 + 50
    env = PolicyEnv(specs=tuple(specs), rng=np.random.default_rng(0))
    policy = REGISTRY.create("least_tokens", env)
    d = policy.decide(_ctx(specs, snaps))
    assert d.instance == 2 and d.decode_instance is None
    assert d.explanation["prefill_tokens"] == (1000.0, 0.0, 200.0)
    assert d.explanation["decode_tokens"] == (50.0, 490.0, 100.0)
    # the router's dispatches after a stale snapshot count too: 500 + 100 more on i2
    pending = (None, None, np.array([[500.0, 100.0, 0.0]]))
    assert policy.decide(_ctx(specs, snaps, pending=pending)).instance == 1


def test_least_tokens_on_pools_picks_per_pool_and_counts_inbound() -> None:
    from dataclasses import replace

    specs = [replace(_spec(f"p{i}"), role="prefill") for i in range(2)] + [
        replace(_spec(f"d{i}"), role="decode") for i in range(2)]
    snaps = [_snap(specs[0], waiting=[800]), _snap(specs[1], waiting=[300]),
             _snap(specs[2], running=[(100, 10, 300)]),              # 290 to generate
             _snap(specs[3], running=[(100, 10, 100)])]              # 90 to generate
    env = PolicyEnv(specs=tuple(specs), rng=np.random.default_rng(0))
    policy = REGISTRY.create("least_tokens", env)
    d = policy.decide(_ctx(specs, snaps))
    assert (d.instance, d.decode_instance) == (1, 3)
    # a request on its way to d1 (in prefill or transfer) with 400 tokens to generate
    ctx = replace(_ctx(specs, snaps), inbound=(None, None, None, np.array([[300.0, 400.0, 0.0]])))
    d = policy.decide(ctx)
    assert (d.instance, d.decode_instance) == (1, 2)
    assert d.explanation["decode_tokens"][3] == 490.0


def test_calibrated_cost_on_pools_splits_its_cost_per_pool() -> None:
    from dataclasses import replace

    specs = [replace(_spec(f"p{i}"), role="prefill") for i in range(2)] + [
        replace(_spec(f"d{i}"), role="decode") for i in range(2)]
    policy = _policy("calibrated_cost", specs, params={"size_ref_tokens": PROMPT})
    snaps = [_snap(specs[0], waiting=[2000]), _snap(specs[1], waiting=[100]),
             _snap(specs[2]), _snap(specs[3])]
    d = policy.decide(_ctx(specs, snaps))
    assert d.instance == 1                        # the smaller prefill backlog
    first = d.decode_instance
    assert first in (2, 3)                        # empty decode engines tie
    # two requests on their way to the first: its queue counts them
    inbound: list[np.ndarray | None] = [None] * 4
    inbound[first] = np.array([[300.0, 50.0, 0.0], [400.0, 50.0, 0.0]])
    d = policy.decide(replace(_ctx(specs, snaps), inbound=tuple(inbound)))
    assert d.decode_instance == 5 - first
    assert d.explanation["queue"][first] == 2.0
