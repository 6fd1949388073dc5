"""BEA replay, its Python twin, calibration by NNLS and the closed-form estimators."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute._core import BatchCore, replay_ttft, replay_ttft_many
from olproute.core_ref import replay_ttft_reference
from olproute.estimate.bea import (
    BeaEstimator,
    PrefillTpsEstimator,
    lps_wait_s,
    lps_wait_variability_s,
    make_estimator,
)
from olproute.estimate.calibration import (
    CalibrationError,
    InstanceCalibration,
    OnlineCalibrator,
    calibrate_log,
    design_matrix,
    fit_beta,
    read_batch_log,
    read_calibration,
    write_calibration,
)
from olproute.sim import metrics
from olproute.sim.cluster import Cluster
from olproute.sim.estimate_eval import EstimatorProbe
from olproute.sim.scenario import build_requests, build_timers, calibrate_result, simulate
from olproute.types import EngineSnapshot, InstanceSpec, Request, RoutingContext
from tests.conftest import CONV_TRACE, make_config

BETA = (2e-3, 4e-5, 2e-8, 3e-9)


def _spec(blocks: int = 1000, block: int = 16, seqs: int = 8, budget: int = 512) -> InstanceSpec:
    return InstanceSpec(name="i", model="m", gpu="g", tensor_parallel=1, max_num_seqs=seqs,
                        max_num_batched_tokens=budget, block_size=block, num_kv_blocks=blocks)


def _empty(spec: InstanceSpec, t: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(time_s=t, table=np.zeros((0, 5), dtype=np.int64), num_running=0,
                          num_free_blocks=spec.num_kv_blocks,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=t,
                          request_ids=np.zeros(0, dtype=np.int64))


def _ctx(spec: InstanceSpec, snaps: tuple[EngineSnapshot, ...], prompt: int, decode: int,
         now: float = 0.0) -> RoutingContext:
    req = Request(request_id=0, arrival_s=now, prompt_tokens=prompt, decode_tokens=decode,
                  predicted_decode_tokens=decode, ttft_target_s=1.0)
    return RoutingContext(request=req, now_s=now, instances=(), specs=(spec,) * len(snaps),
                          snapshots=snaps)


def _cal(beta: tuple[float, float, float, float] = BETA) -> InstanceCalibration:
    return InstanceCalibration(beta=beta, prefill_tokens_per_s=20_000.0, tpot_s=0.01,
                               mean_batch_seqs=8.0, service_rate_per_s=10.0, service_scv=1.0)


def _t(tokens: float, dec_ctx: float = 0.0, attn: float = 0.0) -> float:
    b0, b1, b2, b3 = BETA
    return b0 + b1 * tokens + b2 * dec_ctx + b3 * attn


def test_empty_instance_is_one_chunked_prefill() -> None:
    spec = _spec(budget=512)
    s = 1300  # chunks of 512, 512, 276
    est = BeaEstimator([spec], [_cal()]).estimate(_ctx(spec, (_empty(spec),), s, 10))
    expected = 0.0
    done = 0
    while done < s:
        c = min(512, s - done)
        expected += _t(c, attn=c * done + c * (c + 1) / 2)
        done += c
    assert math.ceil(s / 512) == 3
    assert est.ttft_s[0] == pytest.approx(expected, rel=1e-12)
    assert est.wait_s[0] == 0.0
    assert est.prefill_s[0] == pytest.approx(expected, rel=1e-12)


def test_full_instance_starts_when_first_slot_frees() -> None:
    # 4 slots, all decoding with context 100, predicted to finish after 3, 5, 7, 9 more
    spec = _spec(seqs=4)
    remaining = [3, 5, 7, 9]
    table = np.array([[100, 1, 1 + r, 100, 7] for r in remaining], dtype=np.int64)
    snap = EngineSnapshot(time_s=0.0, table=table, num_running=4,
                          num_free_blocks=spec.num_kv_blocks - 28,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(4, dtype=np.int64))
    est = BeaEstimator([spec], [_cal()]).estimate(_ctx(spec, (snap,), 200, 5))
    # 3 decode batches of 4 requests, contexts 100..102 each; the first then leaves
    wait = sum(_t(4, dec_ctx=4 * (100 + k)) for k in range(3))
    # the new request's prefill joins the three remaining decoders (context 103)
    prefill = _t(3 + 200, dec_ctx=3 * 103, attn=200 * 201 / 2)
    assert est.wait_s[0] == pytest.approx(wait, rel=1e-12)
    assert est.ttft_s[0] == pytest.approx(wait + prefill, rel=1e-12)


snapshot_programs = st.fixed_dictionaries({
    "blocks": st.integers(8, 64), "block": st.sampled_from([1, 4, 16]),
    "seqs": st.integers(1, 6), "budget": st.integers(8, 128),
    "reqs": st.lists(st.tuples(st.integers(1, 150), st.integers(1, 30), st.integers(-5, 5)),
                     max_size=12),
    "steps": st.integers(0, 30), "inflight": st.booleans(),
    "age": st.sampled_from([0.0, 0.002, 0.05]),
    "extras": st.lists(st.tuples(st.integers(1, 100), st.integers(1, 20),
                                 st.sampled_from([0.99, 1.0, 1.001, 1.01, 1.04])), max_size=3),
    "new": st.tuples(st.integers(1, 200), st.integers(1, 20)),
})


def _program_snapshot(p: dict) -> EngineSnapshot:  # type: ignore[type-arg]
    """The engine a snapshot program leaves: its requests added, its steps run, its
    batch in flight (or none) at 1.0 s, started at 0.999 s."""
    core = BatchCore(p["blocks"], p["block"], p["seqs"], p["budget"])
    predicted = np.zeros(core.capacity, dtype=np.int64)
    for prompt, out, err in p["reqs"]:
        if math.ceil((prompt + out) / p["block"]) <= p["blocks"]:
            predicted[core.add_request(prompt, out)] = max(out + err, 1)
    for _ in range(p["steps"]):
        core.schedule()
        core.commit()
        for slot, flags in core.event_list():
            if flags & 2:
                core.release_slot(slot)
    busy = p["inflight"] and core.schedule()[0] > 0
    table, _ids, n_run, free, inflight = core.snapshot(predicted, np.arange(core.capacity))
    if not busy:
        inflight = inflight[:0]
    return EngineSnapshot(time_s=1.0, table=table, num_running=n_run, num_free_blocks=free,
                          inflight=inflight, inflight_start_s=0.999,
                          request_ids=np.arange(len(table), dtype=np.int64))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(p=snapshot_programs, hits=st.none() | st.lists(st.integers(0, 220), min_size=4,
                                                      max_size=4))
def test_compiled_replay_matches_python_reference(p: dict,  # type: ignore[type-arg]
                                                  hits: list[int] | None) -> None:
    """Also with cached prompt tokens (``hits``: the new request's, then its later
    dispatches' as a fourth column), past their prompts too (cut at all but the last)."""
    snap = _program_snapshot(p)
    table, n_run, free, inflight = snap.table, snap.num_running, snap.num_free_blocks, \
        snap.inflight
    ext = sorted(p["extras"], key=lambda e: e[2])
    extras = np.array(ext, dtype=np.float64).reshape(len(ext), 3)
    cached = 0
    if hits is not None:
        cached = hits[0]
        extras = np.column_stack([extras, np.array(hits[1:1 + len(ext)], dtype=np.float64)])
    limits = np.array([[p["blocks"], p["block"], p["seqs"], p["budget"]]], dtype=np.int64)
    beta = np.array([BETA])
    prompt, decode = p["new"]
    if math.ceil((prompt + decode) / p["block"]) > p["blocks"]:
        return
    now = 1.0 + p["age"]
    fast = replay_ttft([snap], limits, beta, prompt, np.array([decode], dtype=np.int64), now,
                       [extras], new_cached=None if hits is None
                       else np.array([cached], dtype=np.int64))[0]
    ref = replay_ttft_reference(table, n_run, free, inflight, 0.999, 1.0,
                                (p["blocks"], p["block"], p["seqs"], p["budget"]),
                                list(BETA), prompt, decode, now, extras, new_cached=cached)
    assert fast[0] == ref[0] and fast[1] == ref[1] and int(fast[2]) == ref[2]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(p=snapshot_programs,
       news=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 20)), min_size=1,
                     max_size=5))
def test_many_new_requests_replay_as_each_alone(p: dict, news: list) -> None:  # type: ignore[type-arg]
    """replay_ttft_many replays each instance to now once and each new request from a
    copy of that state: every row equals replay_ttft for that request alone, on two
    instances (one busy as the program left it, one idle)."""
    snaps = [_program_snapshot(p),
             EngineSnapshot(time_s=1.0, table=np.zeros((0, 5), dtype=np.int64),
                            num_running=0, num_free_blocks=p["blocks"],
                            inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                            request_ids=np.zeros(0, dtype=np.int64))]
    ext = sorted(p["extras"], key=lambda e: e[2])
    extras = [np.array(ext, dtype=np.float64).reshape(len(ext), 3), None]
    limits = np.array([[p["blocks"], p["block"], p["seqs"], p["budget"]]] * 2, dtype=np.int64)
    beta = np.array([BETA, BETA])
    news = [(s, d) for s, d in news if math.ceil((s + d) / p["block"]) <= p["blocks"]]
    now = 1.0 + p["age"]
    prompts = np.array([s for s, _ in news], dtype=np.int64)
    decodes = np.array([[d, d + 1] for _, d in news], dtype=np.int64).reshape(len(news), 2)
    many = replay_ttft_many(snaps, limits, beta, prompts, decodes, now, extras)
    assert many.shape == (len(news), 2, 3)
    for i, (s, _) in enumerate(news):
        alone = replay_ttft(snaps, limits, beta, int(s), decodes[i].copy(), now, extras)
        np.testing.assert_array_equal(many[i], alone)


def test_replay_reproduces_the_simulator_exactly() -> None:
    """Truth = the 4-term model, no noise, oracle lengths, live snapshots: for every request
    that no later arrival could disturb, the estimate equals the simulated TTFT."""
    loaded = make_config(
        instances=[{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                    "max_num_seqs": 16, "max_num_batched_tokens": 1024,
                    "kv_capacity_tokens": 40_000}],
        workload={"kind": "trace", "path": str(CONV_TRACE), "rate_per_s": 12.0,
                  "duration_s": 60},
        prediction={"mode": "oracle"},
        sim={"timing": "linear", "noise_cv": 0.0, "linear_beta": list(BETA)})
    cal = [_cal()] * 2
    from olproute.policies import REGISTRY, PolicyEnv

    probe = EstimatorProbe(REGISTRY.create("round_robin", PolicyEnv(loaded.specs,
                                                                    np.random.default_rng(0))),
                           [BeaEstimator(loaded.specs, cal)])
    reqs = build_requests(loaded)
    res = Cluster(loaded.specs, build_timers(loaded), probe, slot_s=0.05).run(reqs)
    ttft = metrics.ttft_s(res)
    arrival = np.array([r.arrival_s for r in reqs])
    checked = 0
    for rid, (g, (est,)) in probe.estimates.items():
        first = res.first_token_s[rid]
        later = (res.instance == g) & (arrival > arrival[rid]) & (arrival < first)
        if later.any():
            continue
        assert est == pytest.approx(ttft[rid], rel=1e-9, abs=1e-12)
        checked += 1
    assert checked > 0.3 * len(reqs)
    assert res.batch_log[:, 2].sum() > 0.3 * res.end_s  # the instances were busy


def test_stale_snapshot_counts_the_routers_own_dispatches() -> None:
    spec = _spec(budget=512)
    est = BeaEstimator([spec], [_cal()])
    alone = est.estimate(_ctx(spec, (_empty(spec),), 300, 5)).ttft_s[0]
    ctx = _ctx(spec, (_empty(spec),), 300, 5)
    pending = (np.array([[400, 50, 0.0]], dtype=np.float64),)
    behind = est.estimate(RoutingContext(ctx.request, ctx.now_s, ctx.instances, ctx.specs,
                                         ctx.snapshots, pending)).ttft_s[0]
    assert behind > alone
    # the same dispatch expected to find 384 of its 400 prompt tokens cached
    cached = (np.array([[400, 50, 0.0, 384]], dtype=np.float64),)
    behind_hit = est.estimate(RoutingContext(ctx.request, ctx.now_s, ctx.instances,
                                             ctx.specs, ctx.snapshots, cached)).ttft_s[0]
    assert alone < behind_hit < behind


def test_nnls_recovers_beta_from_a_four_term_truth() -> None:
    loaded = make_config(sim={"timing": "linear", "noise_cv": 0.0, "linear_beta": list(BETA)},
                         workload={"kind": "trace", "path": str(CONV_TRACE),
                                   "duration_s": 120, "time_scale": 0.3})
    res = simulate(loaded, "round_robin")
    for c in calibrate_result(res):
        np.testing.assert_allclose(c.beta, BETA, rtol=1e-6)


def test_fit_beta_clips_to_non_negative_and_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(1, 100, (50, 3))])
    y = x @ np.array([1.0, 0.5, 0.0, 0.2]) - 0.01 * x[:, 3]  # a slightly negative effect
    assert min(fit_beta(x, y)) >= 0.0
    with pytest.raises(CalibrationError):
        fit_beta(x[:2], y[:2])
    with pytest.raises(CalibrationError):
        fit_beta(x, -y)


def test_online_calibrator_tracks_a_change() -> None:
    rng = np.random.default_rng(1)
    oc = OnlineCalibrator(initial=(1.0, 1.0, 1.0, 1.0), window=512, refit_every=128)
    for beta in (BETA, (4e-3, 2e-5, 1e-8, 6e-9)):
        for _ in range(600):
            tok, dctx, attn = rng.uniform(1, 2048), rng.uniform(0, 5e4), rng.uniform(0, 2e6)
            t = beta[0] + beta[1] * tok + beta[2] * dctx + beta[3] * attn
            oc.add(t, tok, dctx, attn)
        np.testing.assert_allclose(oc.beta, beta, rtol=1e-6)
    assert oc.num_refits >= 8


def test_batch_log_round_trip_and_calibration_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    loaded = make_config(workload={"kind": "trace", "path": str(CONV_TRACE), "duration_s": 60})
    res = simulate(loaded, "round_robin")
    metrics.write_batch_log(res, tmp_path / "b.csv")
    log, names = read_batch_log(tmp_path / "b.csv")
    assert sorted(names) == sorted(s.name for s in loaded.specs)
    assert log.shape == res.batch_log.shape
    cal = calibrate_log(log, names)
    write_calibration(cal, tmp_path / "cal.yaml")
    back = read_calibration(tmp_path / "cal.yaml")
    assert back == cal
    (tmp_path / "bad.csv").write_text("instance,start_s\nx,1\n")
    with pytest.raises(CalibrationError, match="line 1"):
        read_batch_log(tmp_path / "bad.csv")
    lines = (tmp_path / "b.csv").read_text().splitlines()
    lines[5] = lines[5].replace(",", ",x", 1)
    (tmp_path / "bad2.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match="line 6"):
        read_batch_log(tmp_path / "bad2.csv")


def _simulate_lps(alpha: float, mu: float, k: int, n: int, seed: int) -> float:
    """Mean FCFS wait of an M/M/1-LPS(k) queue: the number present is a birth-death chain
    (departures at rate mu whenever busy); an arrival finding m >= k present waits for
    m - k + 1 departures."""
    rng = np.random.default_rng(seed)
    present = 0
    waits: list[float] = []
    waiting_since: list[float] = []  # FCFS queue of arrival times beyond the k in service
    t = 0.0
    while len(waits) < n:
        rate = alpha + (mu if present > 0 else 0.0)
        t += rng.exponential(1.0 / rate)
        if rng.random() < alpha / rate:
            present += 1
            if present <= k:
                waits.append(0.0)
            else:
                waiting_since.append(t)
        else:
            present -= 1
            if waiting_since:
                waits.append(t - waiting_since.pop(0))
    return float(np.mean(waits[n // 10:]))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_lps_formula_matches_a_simulated_lps_queue(rho: float) -> None:
    mu, k = 10.0, 3
    simulated = _simulate_lps(rho * mu, mu, k, 200_000, seed=3)
    assert lps_wait_s(rho * mu, mu, k) == pytest.approx(simulated, rel=0.10)
    # Poisson arrivals and exponential service: the variability form coincides
    assert lps_wait_variability_s(rho * mu, mu, k, 1.0, 1.0) == pytest.approx(
        lps_wait_s(rho * mu, mu, k), rel=1e-12)


def test_prefill_tps_counts_pending_prefill() -> None:
    spec = _spec()
    table = np.array([[1000, 0, 10, 200, 63], [500, 0, 10, 0, 0]], dtype=np.int64)
    snap = EngineSnapshot(time_s=0.0, table=table, num_running=1, num_free_blocks=900,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(2, dtype=np.int64))
    est = PrefillTpsEstimator([_cal()]).estimate(_ctx(spec, (snap,), 300, 5))
    assert est.wait_s[0] == pytest.approx((800 + 500) / 20_000.0)
    assert est.ttft_s[0] == pytest.approx((800 + 500 + 300) / 20_000.0)


def test_every_named_estimator_gives_finite_estimates() -> None:
    spec = _spec()
    for name in ("bea", "prefill_tps", "lps", "lps_var", "score", "route_balance", "lmdeploy"):
        e = make_estimator(name, [spec], [_cal()])
        e.observe_dispatch(0, 0.0)
        e.observe_dispatch(0, 0.2)
        out = e.estimate(_ctx(spec, (_empty(spec),), 100, 10, now=0.2))
        assert out.ttft_s.shape == (1,) and np.isfinite(out.ttft_s).all() and out.ttft_s[0] > 0
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("nope", [spec], [_cal()])


def test_design_matrix_columns() -> None:
    log = np.zeros((1, 11))
    log[0, 4], log[0, 6], log[0, 8] = 10, 20, 30
    assert design_matrix(log).tolist() == [[1.0, 10.0, 20.0, 30.0]]


def test_the_replay_refuses_a_snapshot_array_it_cannot_read_in_place() -> None:
    """The replay reads each snapshot's table and in-flight batch through their data
    pointers: an array of another dtype, shape or order is a ValueError naming it, not a
    wrong read."""
    from olproute._core import replay_ttft_many
    from olproute.types import EngineSnapshot

    good = np.zeros((2, 5), dtype=np.int64)
    good[:, 0] = 100
    limits = np.array([[1000, 16, 8, 512]], dtype=np.int64)
    beta = np.full((1, 4), 1e-4)
    args = (limits, beta, np.array([10], dtype=np.int64), np.ones((1, 1), dtype=np.int64),
            0.0)
    for bad, name in ((good.astype(np.float64), "table"), (good[:, :4].copy(), "table"),
                      (np.asfortranarray(np.zeros((3, 5), dtype=np.int64)), "table")):
        snap = EngineSnapshot(time_s=0.0, table=bad, num_running=0, num_free_blocks=10,
                              inflight=np.zeros((0, 2), dtype=np.int64),
                              inflight_start_s=0.0, request_ids=np.arange(len(bad)))
        with pytest.raises(ValueError, match=name):
            replay_ttft_many([snap], *args)
    snap = EngineSnapshot(time_s=0.0, table=good, num_running=0, num_free_blocks=10,
                          inflight=np.zeros((0, 3), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(2))
    with pytest.raises(ValueError, match="inflight"):
        replay_ttft_many([snap], *args)
    ok = EngineSnapshot(time_s=0.0, table=good, num_running=0, num_free_blocks=10,
                        inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                        request_ids=np.arange(2))
    assert np.isfinite(replay_ttft_many([ok], *args)[0, 0, 0])


def test_the_replay_refuses_a_swapped_table_and_a_batch_naming_no_row() -> None:
    """A big-endian table would be misread through its data pointer, and an in-flight
    batch row naming no table row would index out of the replay's scratch: both are a
    ValueError. An int64 of another type number (longlong) is read as int64."""
    from olproute._core import replay_ttft_many
    from olproute.types import EngineSnapshot

    table = np.zeros((2, 5), dtype=np.int64)
    table[:, 0], table[:, 1], table[:, 3] = 100, 5, 104
    limits = np.array([[1000, 16, 8, 512]], dtype=np.int64)
    args = (limits, np.full((1, 4), 1e-4), np.array([10], dtype=np.int64),
            np.ones((1, 1), dtype=np.int64), 0.0)

    def snap(t: np.ndarray, inflight: np.ndarray) -> EngineSnapshot:  # type: ignore[type-arg]
        return EngineSnapshot(time_s=0.0, table=t, num_running=2, num_free_blocks=10,
                              inflight=inflight, inflight_start_s=0.0,
                              request_ids=np.arange(2))

    none = np.zeros((0, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="table"):
        replay_ttft_many([snap(table.astype(">i8"), none)], *args)
    with pytest.raises(ValueError, match="names row 7"):
        replay_ttft_many([snap(table, np.array([[7, 1]], dtype=np.int64))], *args)
    want = replay_ttft_many([snap(table, np.array([[1, 1]], dtype=np.int64))], *args)
    got = replay_ttft_many([snap(table.astype(np.longlong),
                                 np.array([[1, 1]], dtype=np.longlong))], *args)
    np.testing.assert_array_equal(got, want)
