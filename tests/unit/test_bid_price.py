"""Reward terms, usage columns, the price step (JAX against NumPy), the PriceBook's
dynamics, and the bid-price policy's decisions and central buffer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.config.loader import AdmissionConfig, PriceConfig, RewardConfig
from olproute.estimate.calibration import InstanceCalibration
from olproute.policies import REGISTRY, PolicyEnv
from olproute.policies.admission import engine_has_room
from olproute.policies.bid_price import BidPrice, can_start_now
from olproute.pricing.book import PriceBook
from olproute.pricing.reward import (
    Columns,
    SampleExtent,
    column_price,
    decode_slots,
    dense,
    first_token_slot,
    fits_under,
    free_capacity,
    prefill_span,
    price_cumsums,
    resident_usage,
    reward_terms,
    sample_extent,
    shifted_usage,
    slots_since,
    take_column,
    usage_columns,
)
from olproute.pricing.step_jax import _build_jax_steps
from olproute.pricing.step_ref import (
    Samples,
    demand_numpy,
    dual_step_numpy,
    saa_dual_value,
    step_sizes,
)
from olproute.routing.outlook import Outlook
from olproute.sim import metrics
from olproute.sim.scenario import CalibrationSource, build_requests, simulate
from olproute.types import EngineSnapshot, InstanceSpec, PrefixMatch, Request, RoutingContext
from solvers.problem import prefill_interval, random_instance
from tests.conftest import CONV_TRACE, make_config

SLOT, H = 0.05, 100
SPEC = InstanceSpec(name="a", model="llama-2-7b", gpu="a100-80gb", tensor_parallel=1,
                    max_num_seqs=4, max_num_batched_tokens=512, block_size=16,
                    num_kv_blocks=625)  # 10,000 KV tokens
CAL = InstanceCalibration(beta=(0.01, 1e-5, 1e-7, 1e-9), prefill_tokens_per_s=20_000,
                          tpot_s=0.025, mean_batch_seqs=4)


def _outlook(decode: list[float], quality: list[float] | None = None) -> Outlook:
    q = quality or [0.0] * len(decode)
    return Outlook(decode_tokens=np.array(decode, dtype=float), quality=np.array(q),
                   cost_musd=np.zeros(len(decode)))


def test_slots_and_columns_by_hand() -> None:
    ttft = np.array([0.0, 0.12, np.inf])
    assert first_token_slot(ttft, SLOT, H).tolist() == [0, 3, H]
    assert decode_slots(np.array([100.0]), np.array([0.025]), SLOT).tolist() == [50]
    cols = usage_columns(999, np.array([100.0, 100.0, 100.0]), ttft, np.full(3, 0.025),
                         np.full(3, 4.0), np.full(3, 10_000.0), np.full(3, 400.0), SLOT, H)
    assert cols.start.tolist() == [0, 3, H] and cols.end.tolist() == [50, 53, H]
    # the prompt needs ceil(999 / 400) = 3 slots of the budget, the slots before k0's
    # (a first token now: its prefill is done, none left from now on)
    assert cols.pre_start.tolist() == [0, 0, H] and cols.pre_end.tolist() == [0, 3, H]
    d = dense(cols, H)
    # batch row: 1/B on [k0, k0 + D); KV row: (s + 1 + 2 tokens per slot) / M
    assert d[0, 0, 0] == 0.25 and d[0, 49, 0] == 0.25 and d[0, 50, 0] == 0.0
    assert d[1, 3, 1] == pytest.approx(1000 / 10_000)
    assert d[1, 13, 1] == pytest.approx((1000 + 2 * 10) / 10_000)
    # compute row: 999 / (3 x 400) of the budget on [0, 3), none on the decode's slots
    assert d[1, 0:3, 2] == pytest.approx([999 / 1200] * 3) and d[1, 3:, 2].sum() == 0.0
    assert d[0, :, 2].sum() == 0.0
    assert d[2].sum() == 0.0  # never starts within the horizon: uses nothing


@settings(max_examples=60, deadline=None, derandomize=True)
@given(start=st.integers(0, H), length=st.integers(0, H), a=st.floats(0, 1),
       b=st.floats(0, 0.1), seed=st.integers(0, 10))
def test_column_price_by_cumsums_equals_dense_dot(start: int, length: int, a: float,
                                                  b: float, seed: int) -> None:
    p = np.random.default_rng(seed).uniform(0, 5, (1, H, 3))
    pre = max(start + 1 - length // 3, 0)
    cols = Columns(start=np.array([start]), end=np.array([min(start + length, H)]),
                   batch_a=np.array([a]), kv_a=np.array([a / 2]), kv_b=np.array([b]),
                   pre_start=np.array([min(pre, H)]), pre_end=np.array([min(start + 1, H)]),
                   compute_a=np.array([a / 3]))
    p0, p1 = price_cumsums(p)
    fast = column_price(cols, p0, p1)[0]
    assert fast == pytest.approx(float((dense(cols, H)[0] * p[0]).sum()), rel=1e-9, abs=1e-9)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(s=st.integers(0, 30), d=st.integers(0, 12), p=st.integers(0, 5), k=st.integers(-8, 8),
       ba=st.floats(0, 1), ka=st.floats(0, 1), kb=st.floats(0, 0.2), seed=st.integers(0, 99))
def test_fits_under_and_take_column_are_the_usage_without_the_usage(s: int, d: int, p: int, k: int,
                                                        ba: float, ka: float, kb: float,
                                                        seed: int) -> None:
    """fits_under answers exactly as (free - usage).min() >= 0 over shifted_usage's
    slots, and take_column leaves the curve as free[span] -= usage does, on curves with
    slack, tight spots and over-committed (negative) slots."""
    h = 32
    free = np.random.default_rng(seed).choice([-0.1, 0.0, 0.3, 0.9, 1.0], size=(h, 3))
    e = min(s + d, h)
    col = (s, e, ba, ka, kb, max(s - p, 0), s, 0.5)
    win = shifted_usage(col, k, h)
    want = True if win is None else bool((free[win[0], :2] - win[1][:, :2]).min() >= 0.0)
    assert fits_under(free, col, k, h) == want
    # and take_column subtracts exactly what shifted_usage builds
    taken, expected = free.copy(), free.copy()
    take_column(taken, col, k, h)
    if win is not None:
        expected[win[0]] -= win[1]
    np.testing.assert_array_equal(taken, expected)


def test_reward_terms_by_hand() -> None:
    w = RewardConfig(sigma=1.0, alpha=0.5, token_norm=1000, beta=0.01, gamma=0.02,
                     zeta1=3.0, eel_threshold_s=2.0, zeta2=4.0, ttft_threshold_s=None,
                     omega=2.0, cost_lambda=0.1)
    out = Outlook(decode_tokens=np.array([40.0, 40.0]), quality=np.array([0.9, 0.5]),
                  cost_musd=np.array([1.0, 0.0]))
    ttft = np.array([0.1, 0.6])
    t = reward_terms(200, 0.5, out, ttft, np.array([0.025, 0.025]), w, SLOT, H)
    # k0 = 2 and 12; D = ceil(40 * 0.025 / 0.05) = 20 slots
    assert t.qps.tolist() == [1.0, 1.0]
    assert t.throughput == pytest.approx([0.5 * 240 / 1000] * 2)
    assert t.eel_saved == pytest.approx([0.01 * (100 - 22), 0.01 * (100 - 32)])
    assert t.ttft_saved == pytest.approx([0.02 * 98, 0.02 * 88])
    assert t.eel_slo.tolist() == [3.0, 3.0]          # EEL 1.1 s and 1.6 s <= 2 s
    assert t.ttft_slo.tolist() == [4.0, 0.0]         # the target is 0.5 s
    assert t.utility == pytest.approx([2.0 * (0.9 - 0.1), 2.0 * 0.5])
    assert t.total == pytest.approx(sum(getattr(t, n) for n in
                                        ("qps", "throughput", "eel_saved", "ttft_saved",
                                         "eel_slo", "ttft_slo", "utility")))
    assert min(t.total) > 0  # every term is >= 0: serving is never worse than not


def test_resident_usage_matches_dense_columns() -> None:
    table = np.array([[100, 5, 45, 104, 7], [300, 0, 20, 0, 0]], dtype=np.int64)
    snap = EngineSnapshot(time_s=0.0, table=table, num_running=1, num_free_blocks=600,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(2))
    got = resident_usage(snap, 4.0, 10_000.0, 0.025, 200.0, SLOT, H)
    # resident 0: 40 tokens left -> 20 slots, context 105; resident 1: 20 -> 10, 300,
    # and its whole prompt still to prefill: 300 tokens at 200 a slot, 1.5 slots
    cols = Columns(start=np.array([0, 0]), end=np.array([20, 10]),
                   batch_a=np.full(2, 0.25), kv_a=np.array([105.0, 300.0]) / 10_000,
                   kv_b=np.full(2, 2.0 / 10_000), pre_start=np.array([0, 0]),
                   pre_end=np.array([0, 2]), compute_a=np.array([0.0, 1.0]))
    want = dense(cols, H).sum(axis=0)
    want[1, 2] = 0.5
    np.testing.assert_allclose(got, want, atol=1e-12)
    # over-committed: the free capacity is clipped at 0, as the LP's right-hand side
    free = free_capacity([snap], [SPEC], np.array([0.025]), np.array([200.0]), SLOT, H)
    np.testing.assert_allclose(free[0], np.maximum(1.0 - got, 0.0))
    crowded = replace(snap, table=np.repeat(table, 3, axis=0), request_ids=np.arange(6))
    free = free_capacity([crowded], [SPEC], np.array([0.025]), np.array([200.0]), SLOT, H)
    assert free.min() == 0.0 and free[0, 0, 0] == 0.0  # 6 residents on 4 slots


def _samples(rng: np.random.Generator, w: int, g: int,
             delays: tuple[int, ...] = (0, 3, 10)) -> Samples:
    smp = Samples.empty(w, g, delays)
    start = rng.integers(0, 20, (w, g))
    smp.reward[:] = rng.uniform(0, 10, (w, g, len(delays)))
    smp.reward[rng.uniform(size=(w, g, len(delays))) < 0.1] = -np.inf
    smp.start[:] = start
    smp.end[:] = start + rng.integers(1, 60, (w, g))
    smp.batch_a[:] = 0.25
    smp.kv_a[:] = rng.uniform(0, 0.05, (w, g))
    smp.kv_b[:] = rng.uniform(0, 1e-3, (w, g))
    smp.pre_lo[:] = rng.integers(0, 4, (w, g))
    smp.pre_hi[:] = rng.integers(0, 3, (w, g))
    smp.prefill_work[:] = rng.uniform(0, 4, (w, g))
    smp.earliest[:] = rng.integers(0, 4, w)
    return smp


@pytest.mark.parametrize("rule", ["inverse_sqrt", "adagrad"])
def test_jax_steps_equal_the_numpy_reference(rule: str) -> None:
    import jax

    rng = np.random.default_rng(7)
    g, w, s, k = 3, 50, 32, 6
    p = rng.uniform(0, 1, (g, H, 3))
    acc = rng.uniform(0, 1, (g, H, 3))
    c = rng.uniform(0, 1, (g, H, 3))
    smp = _samples(rng, w, g)
    idx = rng.integers(0, w, (k, s))
    mask = np.ones((k, s), dtype=bool)
    mask[:, 25:] = False
    off = rng.integers(0, H, (k, s))
    etas = step_sizes(0.5, rule, 3, k)
    ref, ref_acc = p.copy(), acc.copy()
    for j in range(k):
        ref, ref_acc = dual_step_numpy(ref, ref_acc, c, smp, idx[j], mask[j], off[j], 40.0,
                                       float(etas[j]), rule, 0.9)
        assert ref.min() >= 0.0
    with jax.enable_x64(True):
        got, got_acc = _build_jax_steps(rule)(p, acc, c, smp.arrays, smp.delays, idx, mask,
                                              off, 40.0, etas, 0.9)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got_acc), ref_acc, rtol=1e-6, atol=1e-9)


def test_demand_takes_each_sample_at_its_best_delay() -> None:
    """One sample, one instance: at zero prices it starts at the delay of the highest
    reward; pricing that start's slots moves it to another delay; a start past the
    horizon is no column at all."""
    smp = Samples.empty(1, 1, (0, 10, 90))
    smp.reward[0, 0] = [1.0, 2.0, 5.0]     # delay 90: starts at slot 95 >= ... valid
    smp.start[0], smp.end[0] = 5, 15
    smp.batch_a[0], smp.pre_lo[0], smp.prefill_work[0] = 0.5, 2, 0.5   # 0.25 a slot
    p = np.zeros((1, H, 3))
    one = (np.zeros(1, dtype=np.int64), np.ones(1, dtype=bool))
    use = demand_numpy(p, smp, *one, np.zeros(1, dtype=np.int64))
    assert use[0, 95:, 0].tolist() == [0.5] * 5 and use[0, :95, 0].sum() == 0.0
    assert use[0, 92:96, 2].tolist() == [0.0, 0.25, 0.25, 0.0]  # prefill: 2 slots before k0
    p[0, 95:, 0] = 10.0                                # 5 slots x 0.5 x 10 = 25 > 5
    use = demand_numpy(p, smp, *one, np.zeros(1, dtype=np.int64))
    assert use[0, 15:25, 0].tolist() == [0.5] * 10      # delay 10 now pays best
    use = demand_numpy(np.zeros((1, H, 3)), smp, *one, np.full(1, 10, dtype=np.int64))
    assert use[0, 25:35, 0].tolist() == [0.5] * 10      # moved by 10: delay 90 is past H


def test_arrival_rate_has_no_start_up_bias_and_decays_in_a_pause() -> None:
    """N_H's rate: 20 req/s for 30 s reads 20 (the bare decayed count, 17.5 after three
    half-lives of 10 s); a 10 s pause halves it; one arrival is not a burst."""
    book = PriceBook([SPEC], SLOT, H, PriceConfig(arrival_rate_halflife_s=10.0),
                     np.random.default_rng(0), backend="numpy")
    book.observe_arrival(0.0)
    assert book.arrival_rate_per_s(0.0) < 0.5
    for i in range(1, 600):
        book.observe_arrival(i / 20)
    assert book.arrival_rate_per_s(30.0) == pytest.approx(20.0, rel=0.03)
    assert book.arrival_rate_per_s(30.0 + 10.0) == pytest.approx(10.0, rel=0.1)


def test_decisions_read_a_moving_average_of_the_steps_prices() -> None:
    """With a half-life of 2 updates the handed-out prices move a third of the way
    (1 - 2^-1/2 = 0.29) to the steps' prices each update; with 0 they are the steps'."""
    runs = {}
    for hl in (0.0, 2.0):
        cfg = PriceConfig(step_size=2.0, schedule="constant", window=200, minibatch=64,
                          steps_per_period=5, arrival_rate_halflife_s=5.0,
                          sample_delays_slots=(0,), average_halflife_updates=hl)
        book = PriceBook([SPEC, SPEC], SLOT, H, cfg, np.random.default_rng(0),
                         backend="numpy")
        _feed(book, rate=20.0, seconds=1.0)
        runs[hl] = book
    last, avg = runs[0.0], runs[2.0]
    np.testing.assert_array_equal(last.p, last._iterate)
    assert 0.0 < avg.p.sum() < avg._iterate.sum()
    before = avg.p.copy()
    avg.update(avg.origin_s + 0.5 * SLOT)     # no shift: one more update in place
    w = 0.5 ** 0.5
    np.testing.assert_allclose(avg.p, w * before + (1 - w) * avg._iterate, atol=1e-12)


def test_a_sample_books_its_whole_prefill_on_either_kind_of_column() -> None:
    """A mixed column's prefill ends before its first-token slot; a disaggregated prefill
    engine's column is its prefill. Either way the sample's demand is its share on each
    of its P slots (the review found the second kind booked on one slot only), and a
    prefill the arrival cuts spreads over the slots left, at most the whole budget."""
    one = (np.zeros(1, dtype=np.int64), np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64))
    p = np.zeros((1, H, 3))
    mixed = Columns(start=np.array([7]), end=np.array([10]), batch_a=np.array([0.25]),
                    kv_a=np.array([0.1]), kv_b=np.array([0.0]), pre_start=np.array([4]),
                    pre_end=np.array([7]), compute_a=np.array([0.5]))
    prefill = Columns(start=np.array([3]), end=np.array([6]), batch_a=np.array([0.0]),
                      kv_a=np.array([0.1]), kv_b=np.array([0.0]), pre_start=np.array([3]),
                      pre_end=np.array([6]), compute_a=np.array([0.5]))
    extents = (SampleExtent(mixed.end, np.array([3]), np.array([1.5])),
               SampleExtent.of_columns(prefill))
    for cols, extent, slots in zip((mixed, prefill), extents, ([4, 5, 6], [3, 4, 5]),
                                   strict=True):
        smp = Samples.empty(1, 1, (0,))
        smp.put(0, np.array([5.0]), cols, extent)
        use = demand_numpy(p, smp, *one)
        assert np.flatnonzero(use[0, :, 2]).tolist() == slots
        assert use[0, slots, 2].tolist() == [0.5] * 3
    smp.earliest[0] = 4                        # arrived in slot 4: 2 slots left of 3
    use = demand_numpy(p, smp, *one)
    assert use[0, :, 2].tolist()[3:7] == [0.0, 0.75, 0.75, 0.0]
    smp.earliest[0] = 5                        # 1 slot left: the whole budget
    assert demand_numpy(p, smp, *one)[0, 5, 2] == 1.0


def test_a_sample_past_the_horizon_is_prorated_by_its_whole_decode() -> None:
    """A request decoding for 2H slots from slot 0 keeps end = 2H as a sample (its column
    is cut at H): at zero prices its margin is half its reward, not all of it, as the LP
    prorates a column at the grid's end."""
    tpot = np.full(1, 0.025)
    decode = np.full(1, 2 * H * SLOT / 0.025)            # 2H slots of decode
    cols = usage_columns(100, decode, np.full(1, 0.01), tpot, np.full(1, 4.0),
                         np.full(1, 1e9), np.full(1, 1e4), SLOT, H)
    extent = sample_extent(cols, 100, decode, tpot, np.full(1, 1e4), SLOT)
    assert cols.end.tolist() == [H] and extent.end.tolist() == [1 + 2 * H]
    assert extent.pre_lo.tolist() == [1] and extent.prefill_work.tolist() == [0.01]
    smp = Samples.empty(1, 1, (0,))
    smp.put(0, np.array([10.0]), cols, extent)
    zero = np.zeros(1, dtype=np.int64)
    value = saa_dual_value(np.zeros((1, H, 3)), np.zeros((1, H, 3)), smp, zero, zero, 1.0)
    assert value == pytest.approx(10.0 * (H - 1) / (2 * H))


def test_the_prefill_ends_before_the_first_token_slot_online_and_in_the_lp() -> None:
    """The prefill takes the P slots before k0 = ceil(TTFT / slot), never k0 itself (where
    the decode holds its batch slot), clipped at now online and at the arrival in the
    LP; the LP's interval is the online one moved to the arrival's slot."""
    budget = np.full(4, 400.0)
    k0 = np.array([1, 3, 10, 2])
    ps, pe, share = prefill_span(999.0, k0, budget, H)
    assert ps.tolist() == [0, 0, 7, 0] and pe.tolist() == k0.tolist()
    # P = 3 slots of 400; a first token sooner than that spreads the prompt over the
    # slots left, at most the whole budget (999 / 800 and 999 / 400 are over it)
    assert share == pytest.approx([1.0, 999 / 1200, 999 / 1200, 1.0])
    wide = prefill_span(999.0, np.array([2]), np.array([600.0]), H)
    assert wide[2] == pytest.approx([999 / 1200])  # P = 2 slots: not cut
    prob = random_instance(30, 2, 40, seed=3, max_delay=5, horizon=H)
    j = np.arange(30)[:, None]
    g = np.arange(2)[None, :]
    kk = first_token_slot(prob.exec_ttft_s, SLOT, H)
    lo, hi, share = prefill_interval(prob, j, g, prob.arrival_slot[:, None] + kk)
    on_ps, on_pe, on_share = prefill_span(prob.prompt_tokens[:, None], kk,
                                          prob.compute_cap[None, :], H)
    inside = prob.arrival_slot[:, None] + kk < prob.num_slots
    assert np.array_equal((lo - prob.arrival_slot[:, None])[inside], on_ps[inside])
    assert np.array_equal((hi - prob.arrival_slot[:, None])[inside], on_pe[inside])
    assert (hi == prob.arrival_slot[:, None] + kk)[inside].all()
    np.testing.assert_allclose(share[inside], on_share[inside])


def test_a_decision_prices_its_column_on_the_slots_of_now() -> None:
    """Between updates the book's slot 0 is its last update's: a column k slots from now
    is priced on book slots k + elapsed, as the start-and-fit check moves it."""
    book = _book()
    book.update(1.0)                       # slot 0 of the book starts at t = 1 s
    book.p[:, :, 0] = np.arange(H)[None, :]
    book.set_cumsums()
    cols = usage_columns(100, np.full(2, 2 * SLOT / 0.025), np.full(2, 0.01),
                         np.full(2, 0.025), np.full(2, 4.0), np.full(2, 1e9),
                         np.full(2, 1e4), SLOT, H)     # batch 1/4 on slots [1, 3)
    assert book.price(cols, 1.0).tolist() == pytest.approx([0.25 * (1 + 2)] * 2)
    assert book.price(cols, 1.0 + 4.5 * SLOT).tolist() == pytest.approx([0.25 * (5 + 6)] * 2)
    late = book.price(cols, 1.0 + (H - 2) * SLOT)   # moved to [H - 1, H + 1): cut at H
    assert late.tolist() == pytest.approx([0.25 * (H - 1)] * 2)
    book.update(1.5)               # 10 slots of 50 ms later, not 9 (0.5 // 0.05 == 9.0)
    assert book.origin_s == pytest.approx(1.5) and slots_since(1.5, 1.0, SLOT) == 10


def test_a_fixed_schedule_is_replayed_from_now() -> None:
    """Oracle prices: absolute slot k of the schedule is price slot k - (now - t0) / slot
    at each update, and 0 past the schedule's end; nothing is learned."""
    book = _book()
    sched = np.zeros((2, 110, 3))
    sched[:, :, 0] = np.arange(110)[None, :]
    book.set_schedule(1.0, sched)
    book.update(1.0 + 20 * SLOT)
    assert book.p[0, :3, 0].tolist() == [20.0, 21.0, 22.0]
    assert book.p[1, 89, 0] == 109.0 and book.p[1, 90:, 0].sum() == 0.0
    _feed(book, rate=20.0, seconds=2.0, start=2.0)      # samples change nothing
    assert book.p[0, 0, 0] == pytest.approx((book.origin_s - 1.0) / SLOT)
    with pytest.raises(ValueError, match="scheduled prices"):
        book.set_schedule(0.0, np.zeros((3, 10, 3)))


def test_step_sizes() -> None:
    assert step_sizes(2.0, "constant", 5, 3).tolist() == [2.0, 2.0, 2.0]
    assert step_sizes(2.0, "inverse_sqrt", 0, 2) == pytest.approx([2.0, 2.0 / np.sqrt(2)])


def _book(backend: str = "numpy") -> PriceBook:
    cfg = PriceConfig(step_size=2.0, schedule="constant", window=200, minibatch=64,
                      steps_per_period=5, arrival_rate_halflife_s=5.0, sample_delays_slots=(0,),
                      average_halflife_updates=0.0)  # the steps' own prices
    return PriceBook([SPEC, SPEC], SLOT, H, cfg, np.random.default_rng(0), backend=backend)


def _feed(book: PriceBook, rate: float, seconds: float, reward: float = 10.0,
          start: float = 0.0) -> None:
    """Requests of 2,000 prompt tokens and 200 output tokens at ``rate`` per second from
    ``start`` for ``seconds``, with a price update every half second."""
    t = start
    cols = usage_columns(2000, np.full(2, 200.0), np.full(2, 0.1), np.full(2, 0.025),
                         np.full(2, 4.0), np.full(2, 10_000.0), np.full(2, 1e4), SLOT, H)
    while t < start + seconds:
        book.observe_arrival(t)
        book.add_sample(np.full(2, reward), cols, sample_extent(
            cols, 2000, np.full(2, 200.0), np.full(2, 0.025), np.full(2, 1e4), SLOT))
        t += 1.0 / rate
        if int(t / 0.5) != int((t - 1.0 / rate) / 0.5):
            book.update(t)


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_prices_rise_under_scarcity_and_decay_when_ample(backend: str) -> None:
    book = _book(backend)
    _feed(book, rate=20.0, seconds=20.0)      # far more demand than 2 x 4 slots hold
    assert book.p.min() >= 0.0
    scarce = book.p.sum()
    assert scarce > 1.0
    assert set(book.bottleneck()) <= {"batch", "kv", "compute"}
    assert "none" not in book.bottleneck()
    _feed(book, rate=0.05, seconds=300.0, start=20.0)  # almost nothing arrives
    assert book.p.min() >= 0.0
    assert book.p.sum() < 1e-6 * scarce
    assert book.bottleneck() == ["none", "none"]


def test_prices_shift_as_time_advances() -> None:
    book = _book()
    book.advance(0.0)
    book.p[:, :, 0] = np.arange(H)[None, :]
    book.advance(3 * SLOT + 1e-9)
    assert book.p[0, :3, 0].tolist() == [3.0, 4.0, 5.0]
    assert book.p[0, H - 4, 0] == H - 1
    mean = (H - 1) / 2
    assert book.p[0, -1, 0] == mean and book.p[0, -3, 0] == mean  # the exposed tail
    book.advance(10 * H * SLOT)  # a gap longer than the horizon
    assert np.allclose(book.p[0, :, 0], book.p[0, :, 0].mean())


# -- the policy ----------------------------------------------------------------------------
def _snap(n_running: int = 0, n_waiting: int = 0, free: int = 625) -> EngineSnapshot:
    rows = [[500, 10, 100, 509, 32]] * n_running + [[500, 0, 100, 0, 0]] * n_waiting
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
    return EngineSnapshot(time_s=0.0, table=table, num_running=n_running,
                          num_free_blocks=free, inflight=np.zeros((0, 2), dtype=np.int64),
                          inflight_start_s=0.0, request_ids=np.arange(len(rows)))


def _policy(reward: RewardConfig | None = None, admission: AdmissionConfig | None = None,
            g: int = 2, form: str = "lagrangian", release: str = "in_order",
            specs: tuple[InstanceSpec, ...] | None = None) -> BidPrice:
    from olproute.config.loader import load_profiles
    from olproute.routing.outlook import OutlookSource
    from tests.conftest import PROFILES

    specs = specs or (SPEC,) * g
    env = PolicyEnv(specs=specs, rng=np.random.default_rng(0), slot_s=SLOT, horizon_slots=H,
                    reward=reward or RewardConfig(), admission=admission or AdmissionConfig(),
                    prices=PriceConfig(window=100, minibatch=32),
                    calibration_source=lambda: (CAL,) * g,
                    outlook_source=OutlookSource(specs, load_profiles(PROFILES)),
                    params={"backend": "numpy", "form": form, "release": release})
    policy = REGISTRY.create("bid_price", env)
    assert isinstance(policy, BidPrice)
    return policy


def _ctx(snaps: tuple[EngineSnapshot, ...], now: float = 0.0, arrival: float = 0.0,
         target: float = 0.5, rid: int = 1) -> RoutingContext:
    req = Request(request_id=rid, arrival_s=arrival, prompt_tokens=300, decode_tokens=50,
                  predicted_decode_tokens=50, ttft_target_s=target)
    return RoutingContext(request=req, now_s=now, instances=(), specs=(SPEC,) * len(snaps),
                          snapshots=snaps)


def test_zero_prices_pick_the_max_reward_instance() -> None:
    policy = _policy()
    d = policy.decide(_ctx((_snap(n_running=3), _snap(n_running=0))))
    assert d.action == "dispatch" and d.instance == 1
    assert d.explanation["price_cost"] == (0.0, 0.0)
    reward = d.explanation["reward"]
    assert reward[1] >= reward[0]
    for key in ("ttft_s", "tpot_s", "score", "qps", "eel_saved", "ttft_saved", "utility"):
        assert len(d.explanation[key]) == 2
    assert d.reason


def test_an_instance_with_a_huge_price_is_never_chosen() -> None:
    policy = _policy()
    policy.book.p[1] = 1e6
    policy.book.advance(0.0)

    policy.book.set_cumsums()
    for n in range(4):
        d = policy.decide(_ctx((_snap(n_running=n), _snap(n_running=0)), rid=n))
        assert d.instance in (0, None)
        assert d.explanation["price_cost"][1] > 1e3


def test_hold_then_defer_or_shed_at_patience() -> None:
    full = _snap(n_running=4)  # every slot taken: cannot start now
    for mode, final in (("defer", "dispatch"), ("shed", "shed")):
        policy = _policy(admission=AdmissionConfig(mode=mode, patience_s=0.2))
        d = policy.decide(_ctx((full, full), now=0.0))
        assert d.action == "hold" and "can start it now" in d.reason
        d = policy.decide(_ctx((full, full), now=0.15))
        assert d.action == "hold"
        d = policy.decide(_ctx((full, full), now=0.2))
        assert d.action == final and "after 200 ms" in d.reason
        assert d.refusal == (None if mode == "defer" else "no_room")


def test_can_start_now() -> None:
    assert can_start_now(_snap(), 300, 16, 4, 0)
    assert not can_start_now(_snap(n_running=4), 300, 16, 4, 0)
    assert not can_start_now(_snap(n_running=1, n_waiting=1), 300, 16, 4, 0)
    assert can_start_now(_snap(n_running=1, n_waiting=1), 300, 16, 4, 1)
    assert not can_start_now(_snap(free=10), 300, 16, 4, 0)


def test_engine_has_room_is_the_engines_admission_rule() -> None:
    """As vLLM's scheduler takes its queue in: a batch slot and the prompt's KV blocks
    left once the requests waiting ahead got theirs (a 300-token prompt needs 19 blocks
    of 16; a waiting 500-token prompt takes 32)."""
    assert engine_has_room(_snap(n_running=1, n_waiting=2), 300, 16, 4)
    assert not engine_has_room(_snap(n_running=1, n_waiting=3), 300, 16, 4)
    assert not engine_has_room(_snap(n_running=4), 300, 16, 4)
    assert engine_has_room(_snap(n_running=1, n_waiting=1, free=51), 300, 16, 4)
    assert not engine_has_room(_snap(n_running=1, n_waiting=1, free=50), 300, 16, 4)


def test_a_held_request_is_refused_only_when_no_engine_has_room() -> None:
    """The prices may hold a request while it is patient; once its patience runs out
    under shed it goes to the best instance whose engine has room for it, and is refused
    (typed no_room, each engine's figure in its reason) only when none has."""
    policy = _policy(admission=AdmissionConfig(mode="shed", patience_s=0.2))
    policy.book.p[:] = 1e6   # every instance priced far above the request's reward
    policy.book.advance(0.0)
    policy.book.set_cumsums()
    queued = (_snap(n_running=1, n_waiting=1), _snap(n_running=2, n_waiting=1))
    d = policy.decide(_ctx(queued, now=0.0))
    assert d.action == "hold" and "<= 0" in d.reason
    d = policy.decide(_ctx(queued, now=0.2))
    assert d.action == "dispatch" and d.refusal is None
    assert "not refused after 200 ms" in d.reason and "has room for it" in d.reason
    full = (_snap(n_running=4), _snap(n_running=3, n_waiting=1))
    policy.decide(_ctx(full, now=0.0, rid=2))
    d = policy.decide(_ctx(full, now=0.2, rid=2))
    assert d.action == "shed" and d.refusal == "no_room"
    assert "4/4 running, 0 waiting" in d.reason and "3/4 running, 1 waiting" in d.reason


def test_a_held_request_is_refused_late_when_every_engine_with_room_would_queue_it() -> None:
    """Engines with free slots and KV but a prefill queue (three 500-token prompts
    waiting): a request with a 20 ms target, held by the prices to the end of its
    patience, would wait longer than another target for its prefill on each: refused,
    typed late, naming the least queue. With a target that queue fits in it is sent."""
    policy = _policy(admission=AdmissionConfig(mode="shed", patience_s=0.2))
    policy.book.p[:] = 1e6
    policy.book.advance(0.0)
    policy.book.set_cumsums()
    queued = (_snap(n_waiting=3), _snap(n_waiting=3))
    later = tuple(replace(q, time_s=0.2, inflight_start_s=0.2) for q in queued)  # as now
    policy.decide(_ctx(queued, now=0.0, target=0.02))
    d = policy.decide(_ctx(later, now=0.2, target=0.02))
    assert d.action == "shed" and d.refusal == "late"
    assert "would queue it past another 20 ms TTFT target (the least: a" in d.reason
    policy.decide(_ctx(queued, now=0.0, target=5.0, rid=2))
    d = policy.decide(_ctx(later, now=0.2, target=5.0, rid=2))
    assert d.action == "dispatch" and "has room for it" in d.reason


@pytest.mark.parametrize("release", ["in_order", "density"])
@pytest.mark.parametrize("mode", ["defer", "shed"])
def test_central_buffer_loses_and_duplicates_nothing(mode: str, release: str) -> None:
    """Overloaded, with holds: every request ends exactly once, dispatched or shed, and
    no later than its patience after arrival (plus the slot until the next pass), with
    the held requests decided one by one or together. 10 s of the trace (174 requests)
    holds 82 of them under defer and sheds 46 under shed (one by one); the first 5 s hold
    none."""
    loaded = make_config(
        instances=[{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                    "max_num_seqs": 8, "kv_capacity_tokens": 30_000}],
        workload={"kind": "trace", "path": str(CONV_TRACE), "rate_per_s": 30.0,
                  "duration_s": 10},
        admission={"mode": mode, "patience_s": 0.5}, prices={"window": 200, "minibatch": 64},
        router={"policy": "bid_price",
                "policy_params": {"bid_price": {"release": release}}})
    cal = CalibrationSource(loaded, known=[CAL, CAL])
    reqs = build_requests(loaded)
    res = simulate(loaded, "bid_price", reqs, calibration=cal)
    arrival = np.array([r.arrival_s for r in reqs])
    served = np.isfinite(res.finish_s)
    assert np.all(served ^ res.shed), "each request is served or shed, never both or neither"
    assert np.all(res.dispatch_s[served] - arrival[served] <= 0.5 + 0.05 + 1e-9)
    held = res.dispatch_s[served] - arrival[served] > 0
    assert held.any(), "the load must have made the router hold some requests"
    if mode == "shed":
        assert res.shed.any()
    else:
        assert not res.shed.any()
    s = metrics.summarize(res)
    assert s.num_served + s.num_shed == len(reqs)


def test_time_held_counts_against_the_on_time_bonus() -> None:
    """A request re-scored after waiting in the buffer is judged from its arrival: once
    its target has passed, the TTFT indicator no longer pays."""
    policy = _policy(reward=RewardConfig(sigma=0.0, beta=0.0, gamma=0.0, zeta2=10.0,
                                         delta=1.0),
                     admission=AdmissionConfig(mode="shed", patience_s=1.0), g=1)
    fresh = policy.decide(_ctx((_snap(),), now=0.0, arrival=0.0, target=0.2, rid=1))
    assert fresh.explanation["ttft_slo"] == (10.0,) and fresh.action == "dispatch"
    late = policy.decide(_ctx((_snap(),), now=0.5, arrival=0.0, target=0.2, rid=2))
    assert late.explanation["ttft_slo"] == (0.0,)
    assert late.action == "hold"  # nothing left to gain: the score is not positive


def test_request_predicts_per_model_lengths_from_predictions_only() -> None:
    r = Request(request_id=0, arrival_s=0.0, prompt_tokens=10, decode_tokens=100,
                predicted_decode_tokens=120, ttft_target_s=1.0,
                decode_tokens_by_model={"a": 100, "b": 50},
                predicted_decode_by_model={"a": 120, "b": 41},
                quality_by_model={"a": 0.9, "b": 0.5},
                predicted_quality_by_model={"a": 0.7})
    assert r.predicted_decode_tokens_for("a") == 120
    assert r.predicted_decode_tokens_for("b") == 41   # its own prediction, not truth x ratio
    assert r.predicted_decode_tokens_for("c") == 120  # none for c: the single prediction
    assert r.predicted_quality_for("a") == 0.7
    assert r.predicted_quality_for("b") is None       # never the true 0.5
    bare = replace(r, predicted_decode_by_model=None)
    assert bare.predicted_decode_tokens_for("b") == 120  # the truth by model is not read


def test_a_free_instance_beats_waiting_for_a_busy_better_one() -> None:
    """The top-scoring instance is full; a free one with a positive score takes the
    request rather than holding it."""
    policy = _policy()
    long_ctx = np.array([[2990, 10, 100, 2999, 188]] * 3, dtype=np.int64)  # slow decodes
    slow = EngineSnapshot(time_s=0.0, table=long_ctx, num_running=3, num_free_blocks=61,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(3))

    policy.book.p[1] = 0.6  # instance 1 is dearer, so the full instance 0 scores best
    policy.book.set_cumsums()
    d = policy.decide(_ctx((_snap(n_running=4), slow), rid=2))
    score = d.explanation["score"]
    assert score[0] > score[1] > 0, "the full instance must be the better-scoring one"
    assert d.action == "dispatch" and d.instance == 1
    assert "best startable score" in d.reason


def _prefilling(n_decoding: int, n_prefill: int) -> EngineSnapshot:
    """``n_decoding`` decoders and ``n_prefill`` requests running in prefill (no token
    yet), nothing waiting."""
    rows = [[500, 10, 100, 509, 32]] * n_decoding + [[500, 0, 100, 0, 32]] * n_prefill
    return EngineSnapshot(time_s=0.0, table=np.array(rows, dtype=np.int64),
                          num_running=len(rows), num_free_blocks=500,
                          inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=0.0,
                          request_ids=np.arange(len(rows)))


@pytest.mark.parametrize("release", ["in_order", "density"])
def test_a_quiet_instance_goes_first_and_none_quiet_holds_nothing(release: str) -> None:
    """Two replicas of one engine: instance 0 has a prompt in prefill and scores best
    (instance 1 is dearer); the quiet instance 1, with decoders only, takes the request.
    With a prefill on both, the best-scoring one takes it at once: not being quiet holds
    nothing. A joint pass over held requests chooses alike."""
    policy = _priced(_policy(release=release), 1, 0.3)
    snaps = (_prefilling(1, 1), _prefilling(2, 0))
    d = policy.decide(_ctx(snaps))
    assert d.explanation["score"][0] > d.explanation["score"][1] > 0
    assert d.action == "dispatch" and d.instance == 1
    d = policy.decide(_ctx((_prefilling(1, 1), _prefilling(2, 1)), rid=2))
    assert d.action == "dispatch" and d.instance == 0
    if release == "density":
        reqs = [replace(_ctx(snaps, rid=3).request, arrival_s=-0.01)]
        (held,) = policy.decide_held(reqs, lambda r: replace(_ctx(snaps), request=r))
        assert held.action == "dispatch" and held.instance == 1


def test_a_quiet_instance_of_another_engine_does_not_outrank_the_score() -> None:
    """The same two snapshots, but instance 1 another engine (tensor parallel 2): the
    score decides between engines, and the busy best-scoring instance 0 takes it."""
    policy = _priced(_policy(specs=(SPEC, replace(SPEC, name="b", tensor_parallel=2))), 1, 0.3)
    d = policy.decide(_ctx((_prefilling(1, 1), _prefilling(2, 0))))
    assert d.explanation["score"][0] > d.explanation["score"][1] > 0
    assert d.action == "dispatch" and d.instance == 0


def _priced(policy: BidPrice, g: int, batch_price: float) -> BidPrice:
    """Instance g's batch slots priced at ``batch_price`` on every slot from t = 0."""

    policy.book.advance(0.0)
    policy.book.p[g, :, 0] = batch_price
    policy.book.set_cumsums()
    return policy


def test_the_constrained_form_takes_the_best_on_time_instance() -> None:
    """Instance 0 is idle (TTFT 13 ms) but dearer, instance 1 has a prompt queued (TTFT
    28 ms) and scores best: with a 20 ms target the Lagrangian form sends the request to
    1, late; the constrained form to 0, the only one on time."""
    snaps = (_snap(), _snap(n_running=1, n_waiting=1))
    adm = AdmissionConfig(max_waiting=1)
    results = {}
    for form in ("lagrangian", "constrained"):
        policy = _priced(_policy(admission=adm, form=form), 0, 0.05)
        results[form] = policy.decide(_ctx(snaps, target=0.02))
    lag, con = results["lagrangian"], results["constrained"]
    assert lag.explanation["ttft_s"][0] < 0.02 < lag.explanation["ttft_s"][1]
    assert lag.explanation["on_time"] == (1.0, 0.0)
    assert lag.explanation["score"][1] > lag.explanation["score"][0] > 0
    assert lag.action == "dispatch" and lag.instance == 1
    assert con.action == "dispatch" and con.instance == 0
    assert "of the 1 on time" in con.reason
    # the constrained score is the reward net of the price: no TTFT cost
    net = np.array(con.explanation["reward"]) - np.array(con.explanation["price_cost"])
    assert con.explanation["score"] == pytest.approx(tuple(net))


def test_the_constrained_form_holds_what_the_lagrangian_form_sends_late() -> None:
    """A 5 ms target no instance can meet: the Lagrangian form dispatches (late, with a
    positive score); the constrained form holds the request while it is patient, then
    sends it to the best Lagrangian score (admission: defer) or, under shed, to the best
    instance whose engine has room: a missed target is no reason to refuse what the
    engines can serve. With every engine full it is shed."""
    snaps = (_snap(), _snap(n_running=2))
    lag = _policy().decide(_ctx(snaps, target=0.005))
    assert lag.action == "dispatch" and lag.explanation["on_time"] == (0.0, 0.0)
    for mode in ("shed", "defer"):
        policy = _policy(admission=AdmissionConfig(mode=mode, patience_s=0.2),
                         form="constrained")
        d = policy.decide(_ctx(snaps, now=0.0, target=0.005))
        assert d.action == "hold" and "no instance is predicted to meet its 5 ms" in d.reason
        d = policy.decide(_ctx(snaps, now=0.2, target=0.005))
        assert d.action == "dispatch" and "after 200 ms" in d.reason
        assert d.instance == lag.instance
    policy = _policy(admission=AdmissionConfig(mode="shed", patience_s=0.2),
                     form="constrained")
    full = (_snap(n_running=4), _snap(n_running=4))
    policy.decide(_ctx(full, now=0.0, target=0.005))
    d = policy.decide(_ctx(full, now=0.2, target=0.005))
    assert d.action == "shed" and d.refusal == "no_room"


def test_the_primal_form_dispatches_on_reward_net_of_price_or_refuses_at_once() -> None:
    """The online LP's rule: both instances full (neither can start now), so the
    Lagrangian form holds; the primal form sends the request at its first decision to
    the higher reward net of the price, queued at the engine. With that net <= 0 on
    every instance it refuses at once, patient or not: it never holds."""
    full = (_snap(n_running=4), _snap(n_running=4))
    adm = AdmissionConfig(mode="shed", patience_s=5.0)
    lag = _policy(admission=adm).decide(_ctx(full))
    assert lag.action == "hold"
    policy = _priced(_policy(admission=adm, form="primal"), 0, 0.05)
    d = policy.decide(_ctx(full))
    net = np.array(d.explanation["reward"]) - np.array(d.explanation["price_cost"])
    assert d.explanation["score"] == pytest.approx(tuple(net))
    assert net[1] > net[0] and net[1] > 0
    assert d.action == "dispatch" and d.instance == 1
    dear = _priced(_priced(_policy(admission=adm, form="primal"), 0, 1e3), 1, 1e3)
    d = dear.decide(_ctx(full, rid=2))
    assert d.action == "shed" and d.reason.startswith("refused: best score")
    assert max(d.explanation["score"]) <= 0


def test_the_primal_form_ignores_the_ttft_term() -> None:
    """A 5 ms target no instance meets and delta large: the Lagrangian score is negative
    and the request is held; the primal score, reward net of price, still dispatches."""
    snaps = (_snap(), _snap(n_running=2))
    heavy = RewardConfig(delta=5000.0)
    lag = _policy(reward=heavy).decide(_ctx(snaps, target=0.005))
    assert max(lag.explanation["score"]) <= 0 and lag.action == "hold"
    d = _policy(reward=heavy, form="primal").decide(_ctx(snaps, target=0.005))
    assert d.action == "dispatch"
    assert d.explanation["score"][d.instance] > 0


def _held_pass(release: str) -> dict[int, tuple[str, float]]:
    """Two held requests, one instance with batch room for one of them over the horizon:
    a long one that arrived first and a short one. Per request id: (action, its score on
    the instance)."""
    policy = _policy(reward=RewardConfig(sigma=1.0, alpha=0.0, beta=0.01, gamma=0.0,
                                         zeta1=0.0, zeta2=0.0, omega=0.0, delta=0.0),
                     g=1, release=release)
    free = np.ones((1, H, 3))
    free[0, :, 0] = 0.3                      # one more request (1/4 of the batch) fits
    policy._free, policy._free_time_s = free, 0.1
    snaps = (_snap(n_running=1),)
    long_ = Request(request_id=1, arrival_s=0.0, prompt_tokens=300, decode_tokens=400,
                    predicted_decode_tokens=400, ttft_target_s=5.0)
    short = replace(long_, request_id=2, arrival_s=0.01, decode_tokens=20,
                    predicted_decode_tokens=20)
    out = {}
    for d in policy.decide_held([long_, short], lambda r: RoutingContext(
            request=r, now_s=0.1, instances=(), specs=(SPEC,), snapshots=snaps)):
        out[d.request_id] = (d.action, d.explanation["score"][0])
    return out


def test_a_joint_release_beats_arrival_order_on_a_hand_built_buffer() -> None:
    """Arrival order gives the one place to the long request that came first; the joint
    pass (greedy by density or by score, or the exact assignment) gives it to the short
    one, whose score is higher, and the long one stays held (its patience has not run
    out)."""
    in_order = _held_pass("in_order")
    assert in_order[1][0] == "dispatch" and in_order[2][0] == "hold"
    for release in ("density", "score", "assignment"):
        joint = _held_pass(release)
        assert joint[2][0] == "dispatch" and joint[1][0] == "hold", release
        assert joint[2][1] > in_order[1][1] > 0
    # the scores are the same either way: only who gets the place differs
    assert _held_pass("density")[1][1] == pytest.approx(in_order[1][1])


@pytest.mark.parametrize("release", ["density", "score", "assignment"])
def test_a_joint_pass_starts_no_more_prefill_than_a_slot_holds(release: str) -> None:
    """One instance, prefill budget 1,000 tokens a slot (20,000 tokens/s x 50 ms), room
    for everything else (a queue of 8 allowed): of three 400-token prompts a pass starts
    two (800) and holds the third; a 1,500-token prompt, longer than the budget, still
    starts, alone."""
    def pass_(prompts: list[int]) -> list[str]:
        policy = _policy(g=1, release=release, admission=AdmissionConfig(max_waiting=8))
        policy._free, policy._free_time_s = np.ones((1, H, 3)), 0.1
        reqs = [Request(request_id=i, arrival_s=0.0, prompt_tokens=s, decode_tokens=20,
                        predicted_decode_tokens=20, ttft_target_s=5.0)
                for i, s in enumerate(prompts)]
        snaps = (_snap(n_running=0),)
        out = {d.request_id: d.action for d in policy.decide_held(
            reqs, lambda r: RoutingContext(request=r, now_s=0.1, instances=(),
                                           specs=(SPEC,), snapshots=snaps))}
        return [out[i] for i in range(len(prompts))]

    assert sorted(pass_([400, 400, 400])) == ["dispatch", "dispatch", "hold"]
    assert pass_([1500]) == ["dispatch"]
    assert sorted(pass_([1500, 300])) == ["dispatch", "hold"]


@pytest.mark.parametrize("release", ["density", "score", "assignment"])
def test_a_joint_pass_counts_its_own_dispatches_as_decide_would(release: str) -> None:
    """Two short requests, one idle instance with room for both: with no queue allowed
    (admission.max_waiting 0) the first dispatch queues there and the second is held,
    saying it lost its place, as one by one the second would see the first in its
    snapshot; with a queue of one allowed both go."""
    def pass_(max_waiting: int) -> list[Any]:
        policy = _policy(g=1, release=release,
                         admission=AdmissionConfig(max_waiting=max_waiting))
        policy._free, policy._free_time_s = np.ones((1, H, 3)), 0.1
        reqs = [Request(request_id=i, arrival_s=0.0, prompt_tokens=100, decode_tokens=20,
                        predicted_decode_tokens=20, ttft_target_s=5.0) for i in (1, 2)]
        snaps = (_snap(n_running=0),)
        return list(policy.decide_held(reqs, lambda r: RoutingContext(
            request=r, now_s=0.1, instances=(), specs=(SPEC,), snapshots=snaps)))

    none = pass_(0)
    assert sorted(d.action for d in none) == ["dispatch", "hold"]
    assert "place there went to held requests ranked higher" in next(
        d.reason for d in none if d.action == "hold")
    assert [d.action for d in pass_(1)] == ["dispatch", "dispatch"]


def test_a_request_out_of_patience_goes_first_in_a_joint_pass() -> None:
    """One place (no queue allowed), two requests: the one whose patience has run out
    takes it although its score per use is lower (a long output); the other, still
    patient, is held. One by one in arrival order it would be the same here only
    because it came first; by density alone the short one would win."""
    policy = _policy(g=1, release="density",
                     admission=AdmissionConfig(mode="shed", patience_s=0.5))
    policy._free, policy._free_time_s = np.ones((1, H, 3)), 1.0
    late = Request(request_id=1, arrival_s=0.0, prompt_tokens=100, decode_tokens=400,
                   predicted_decode_tokens=400, ttft_target_s=5.0)
    fresh = replace(late, request_id=2, arrival_s=0.9, decode_tokens=10,
                    predicted_decode_tokens=10)
    snaps = (_snap(n_running=0),)
    out = {d.request_id: d.action for d in policy.decide_held(
        [late, fresh], lambda r: RoutingContext(request=r, now_s=1.0, instances=(),
                                                specs=(SPEC,), snapshots=snaps))}
    assert out == {1: "dispatch", 2: "hold"}


def test_the_exact_assignment_takes_the_best_set_not_the_best_first() -> None:
    """Batch room 1.0 in each of 3 slots of one instance: one request of score 3 using
    0.8, two of score 2 using 0.5 each. Greedy by score takes the first alone (3); the
    exact assignment takes the other two (4). A request with pairs on two instances is
    taken at most once, on the better one when both fit."""
    from olproute.policies.bid_price import _best_subset

    def win(use: float) -> tuple[slice, np.ndarray]:
        usage = np.zeros((3, 3))
        usage[:, 0] = use
        return slice(0, 3), usage

    free = np.ones((2, 3, 3))
    pairs = [(0, 0, 3.0), (1, 0, 2.0), (2, 0, 2.0)]
    assert _best_subset(pairs, [win(0.8), win(0.5), win(0.5)], 3, free) == [
        False, True, True]
    twice = [(0, 0, 1.0), (0, 1, 1.5)]
    assert _best_subset(twice, [win(0.5), win(0.5)], 1, free) == [False, True]
    # before the first tick there is no curve: each request's best pair
    assert _best_subset(pairs, [None] * 3, 3, None) == [True, True, True]


def test_a_joint_release_scores_the_requests_left_again_behind_each_round() -> None:
    """Two instances, the first idle and the second busy; three 600-token prompts, a
    prefill budget of 1,000 tokens a slot each. Round 1: all choose the idle one, which
    takes one. Round 2, scored again behind it (its TTFT there has grown): the busy one
    takes one. The third is held: neither has 600 tokens of budget left."""
    policy = _policy(g=2, release="density")
    policy._free, policy._free_time_s = np.ones((2, H, 3)), 0.1
    snaps = (_snap(n_running=0), _snap(n_running=3))
    reqs = [Request(request_id=i, arrival_s=0.0, prompt_tokens=600, decode_tokens=20,
                    predicted_decode_tokens=20, ttft_target_s=5.0) for i in (1, 2, 3)]
    out = list(policy.decide_held(reqs, lambda r: RoutingContext(
        request=r, now_s=0.1, instances=(), specs=(SPEC,) * 2, snapshots=snaps)))
    assert [(d.action, d.instance) for d in out] == [
        ("dispatch", 0), ("dispatch", 1), ("hold", None)]
    first, second = out[0].explanation["ttft_s"], out[1].explanation["ttft_s"]
    assert first[0] < first[1]                 # the idle instance was the better one
    assert second[0] > first[0]                # scored again behind the first dispatch
    assert "released 2 of 3 held, by density" in out[1].reason


def test_the_admission_check_holds_a_request_to_batch_and_kv_not_compute() -> None:
    """Compute is a rate: with no prefill budget left anywhere in the horizon a request
    still fits (its wait is in its TTFT and its price); with no KV it does not."""
    policy = _policy()
    cols = usage_columns(300, np.full(2, 50.0), np.full(2, 0.12), np.full(2, 0.025),
                         np.full(2, 4.0), np.full(2, 10_000.0), np.full(2, 400.0), SLOT, H)
    assert dense(cols, H)[0, :, 2].sum() > 0          # the column does use compute
    policy._free, policy._free_time_s = np.ones((2, H, 3)), 0.0
    policy._free[:, :, 2] = 0.0
    assert policy._fits(0, cols, 0.0)
    policy._free[1, :, 1] = 0.0
    assert not policy._fits(1, cols, 0.0)


def test_free_capacity_is_refreshed_with_prices_off() -> None:
    """prices.enabled: false keeps every price at 0, but the periodic tick still refreshes
    the free capacity the admission checks read. 100 requests (~17 s): round robin
    preempts 428 times (25 requests), bid_price 102 (18 requests), 87 of them three
    prompts of 2,845-4,089 tokens in an 8,000-token cache that the engine preempts and
    re-admits over and over: a column holds the prompt's KV from its first token on, not
    while it is prefilled, and the check cannot see that. (Before the prefill was moved
    to the slots before the first token's, the run's history spared two of the three and
    bid_price preempted 44 times: the bound is about the order of magnitude.)"""
    loaded = make_config(
        instances=[{"name": "q", "model": "qwen2.5-3b", "gpu": "a40", "replicas": 2,
                    "kv_capacity_tokens": 8000}],
        workload={"kind": "poisson", "rate_per_s": 6.0, "num_requests": 100,
                  "lengths_path": str(CONV_TRACE)},
        prediction={"mode": "oracle"}, prices={"enabled": False},
        admission={"mode": "shed", "patience_s": 60.0}, router={"policy": "bid_price"})
    ticks: list[float] = []
    original = BidPrice.tick

    def counting(self: BidPrice, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        original(self, now_s, snapshots)
        ticks.append(now_s)
        assert float(np.abs(self.book.p).max()) == 0.0

    BidPrice.tick = counting  # type: ignore[method-assign]
    cal = CalibrationSource(loaded)
    reqs = build_requests(loaded)
    try:
        res = simulate(loaded, "bid_price", reqs, calibration=cal)
    finally:
        BidPrice.tick = original  # type: ignore[method-assign]
    assert len(ticks) > 10
    # held by the free-capacity check instead of overflowing the 8k-token KV caches
    rr = simulate(loaded, "round_robin", reqs, calibration=cal)
    assert res.num_preemptions.sum() <= 0.25 * rr.num_preemptions.sum()
    assert np.nanmax(res.dispatch_s - np.array([r.arrival_s for r in reqs])) > 0.5


def test_a_demand_sample_carries_the_reward_of_each_later_start() -> None:
    """The sample bid_price adds at a request's first sight holds, per instance, the
    reward of starting now and of each of the book's delays later: exactly the reward
    terms with the TTFT estimate plus that many slots (the LP's columns d = 0..). It is
    built off the request path: the book has it after the next tick, not before; the
    samples of several first sights are built together, each as it would be alone."""
    policy = _policy(g=2)
    snaps = (_snap(n_running=1), _snap())
    decisions = [policy.decide(_ctx(snaps, now=0.1 * k, arrival=0.05 * k, rid=k))
                 for k in range(3)]
    assert policy.book.num_samples == 0
    policy.tick(0.3, snaps)
    assert policy.book.num_samples == 3
    smp, delays = policy.book.samples, policy.book.delays
    assert len(delays) > 1 and delays[0] == 0
    for k, d in enumerate(decisions):
        out = Outlook(decode_tokens=np.array(d.explanation["decode_tokens"]),
                      quality=np.zeros(2), cost_musd=np.zeros(2))
        ttft, tpot = np.array(d.explanation["ttft_s"]), np.array(d.explanation["tpot_s"])
        for li, delay in enumerate(delays):
            want = reward_terms(300, 0.5, out, ttft + delay * SLOT, tpot, RewardConfig(),
                                SLOT, H, waited_s=0.05 * k)
            np.testing.assert_allclose(smp.reward[k, :, li], want.total, rtol=1e-12)
        assert smp.reward[k, :, 0].tolist() == list(d.explanation["reward"])


def test_demand_samples_wait_for_the_tick_but_never_more_than_a_window() -> None:
    """First sights count as arrivals at once and queue their samples for the next tick;
    no more than a window's worth (``prices.window``, 100 here) waits: the newest, as the
    book's ring would keep them."""
    policy = _policy(g=2)
    snaps = (_snap(), _snap())
    for rid in range(130):
        policy.decide(_ctx(snaps, now=rid * 1e-3, arrival=rid * 1e-3, rid=rid))
    assert policy.book.num_samples == 0
    assert policy.book.arrival_rate_per_s(0.13) > 0
    policy.tick(0.13, snaps)
    assert policy.book.num_samples == 100
    # the newest 100: their decode intervals start where request 30's onwards did
    first_kept = policy.book.samples.start[0].copy()
    fresh = _policy(g=2)
    for rid in range(30, 130):
        fresh.decide(_ctx(snaps, now=rid * 1e-3, arrival=rid * 1e-3, rid=rid))
    fresh.tick(0.13, snaps)
    np.testing.assert_array_equal(fresh.book.samples.start[0], first_kept)
    np.testing.assert_array_equal(fresh.book.samples.reward[:100],
                                  policy.book.samples.reward[:100])


def test_an_explanation_is_built_only_when_read() -> None:
    """bid_price's decision carries an explanation that builds its per-instance figures
    when first read, and reads as the dict it builds."""
    from olproute.types import Explanation

    policy = _policy(g=3)
    d = policy.decide(_ctx((_snap(), _snap(n_running=2), _snap())))
    assert isinstance(d.explanation, Explanation) and not d.explanation.built
    score = d.explanation["score"]
    assert d.explanation.built
    assert len(score) == 3 and set(d.explanation) >= {"ttft_s", "reward", "price_cost"}
    assert dict(d.explanation)["score"] == score


@pytest.mark.parametrize("candidates", [None, 2])
def test_an_explanation_read_whole_is_the_one_read_key_by_key(candidates: int | None
                                                               ) -> None:
    """Reading every key at once (``items``: the /route answer, its one read of the
    kernel's rows) gives, in key order, exactly what reading the keys one by one gives;
    with sampled candidates too (the others scored when read), and a key read first keeps
    its value."""
    snaps = (_snap(), _snap(n_running=2), _snap(n_waiting=3), _snap(free=0))
    whole, by_key = (_policy(admission=AdmissionConfig(candidates=candidates), g=4)
                     for _ in range(2))
    a = whole.decide(_ctx(snaps)).explanation
    b = by_key.decide(_ctx(snaps)).explanation
    first = a["ttft_s"]
    got = list(a.items())
    assert [k for k, _ in got] == list(b)
    assert got == [(k, b[k]) for k in b]
    assert a["ttft_s"] is first and all(isinstance(x, float) for _, v in got for x in v)


def test_the_explanations_utility_is_unweighted_and_its_term_weighted() -> None:
    """``utility`` is quality - lambda x cost, as the LP checks read it (the live capture,
    ``solvers.record``); the reward's term omega x utility is ``utility_term`` (it used to
    overwrite ``utility``, so an LP check of an omega = 10 run weighed utility 100x)."""
    policy = _policy(reward=RewardConfig(omega=10.0, cost_lambda=0.0))
    ctx = _ctx((_snap(), _snap(n_running=2)))
    ctx = replace(ctx, request=replace(ctx.request,
                                       predicted_quality_by_model={SPEC.model: 0.7},
                                       predicted_decode_by_model={SPEC.model: 50}))
    d = policy.decide(ctx)
    assert d.explanation["utility"] == (0.7, 0.7)
    np.testing.assert_allclose(np.array(d.explanation["utility_term"]), [7.0, 7.0])
    assert len(set(d.explanation)) == len(d.explanation)


def test_with_candidates_only_the_sampled_instances_are_replayed_and_scored() -> None:
    """``admission.candidates: 2`` of 6: the decision replays the 2 sampled snapshots only
    and scores the others -inf; its explanation's figures still cover all 6 (the LP checks
    read them: every instance scored when they are first read, the sampled two as the
    decision saw them), and so does the demand sample the tick adds."""
    policy = _policy(admission=AdmissionConfig(candidates=2), g=6)
    replayed: list[int] = []
    inner = policy._bea._replay

    def spy(ctx, prompts, decode, instances, loads=None, cached=None):  # type: ignore[no-untyped-def]
        replayed.append(len(ctx.snapshots) if instances is None else len(instances))
        return inner(ctx, prompts, decode, instances, loads, cached)

    policy._bea._replay = spy  # type: ignore[method-assign]
    snaps = tuple(_snap(n_running=k) for k in range(6))
    d = policy.decide(_ctx(snaps))
    assert replayed == [2]
    cands = [int(c) for c in d.explanation["candidates"]]
    assert len(cands) == 2 and d.instance in cands
    for g in range(6):
        assert (d.explanation["score"][g] == -np.inf) == (g not in cands)
    assert replayed == [2]                 # score and candidates are the decision's own
    for key in ("ttft_s", "tpot_s", "reward", "price_cost", "utility"):
        assert np.isfinite(d.explanation[key]).all(), key
    assert replayed == [2, 6]              # scored on every instance once, when read
    policy.tick(0.0, snaps)
    assert replayed == [2, 6, 6]
    assert np.isfinite(policy.book.samples.reward[0, :, 0]).all()


def _prefix_ctx(snaps: tuple[EngineSnapshot, ...], cached: list[int] | None,
                prompt: int = 4000) -> RoutingContext:
    """A 4000-token prompt, with ``cached`` of it found in each instance's cache by the
    router's index (None: no hashes)."""
    req = Request(request_id=1, arrival_s=0.0, prompt_tokens=prompt, decode_tokens=50,
                  predicted_decode_tokens=50, ttft_target_s=5.0)
    prefixes = None if cached is None else PrefixMatch(
        cached_tokens=np.array(cached, dtype=np.int64),
        matched_blocks=np.array(cached, dtype=np.int64) // 16,
        request_blocks=prompt // 16, index_blocks=np.zeros(len(cached), dtype=np.int64))
    return RoutingContext(request=req, now_s=0.0, instances=(), specs=(SPEC,) * len(snaps),
                          snapshots=snaps, prefixes=prefixes)


def test_a_cached_prefix_is_traded_against_the_queue_ahead_of_it() -> None:
    """The same prompt on an idle instance and on one running two decoders: without
    hashes the idle one scores higher; with most of the prompt cached on the busy one, it
    scores higher there (its TTFT estimate, compute and KV columns net of the prefix);
    behind two queued requests that take the busy one's last slots the idle one wins
    again."""
    busy, idle = _snap(n_running=2), _snap()
    plain = _policy().decide(_prefix_ctx((busy, idle), None))
    assert plain.explanation["score"][1] > plain.explanation["score"][0]
    hit = _policy().decide(_prefix_ctx((busy, idle), [3984, 0]))
    assert hit.explanation["score"][0] > hit.explanation["score"][1]
    assert hit.explanation["ttft_s"][0] < 0.5 * plain.explanation["ttft_s"][0]
    assert hit.explanation["ttft_s"][1] == plain.explanation["ttft_s"][1]
    queued = _policy().decide(_prefix_ctx((_snap(n_running=2, n_waiting=2), idle),
                                          [3984, 0]))
    assert queued.explanation["score"][1] > queued.explanation["score"][0]


def test_held_requests_released_together_each_read_their_own_prefix() -> None:
    """A joint release over a request with a cached prefix and one without hashes: the
    kernel gets the first's cached tokens and nothing for the second (not the first's,
    which the release's one context carries)."""
    policy = _policy(release="density")
    snaps = (_snap(n_running=2), _snap())
    hit = _prefix_ctx(snaps, [3984, 0])
    hashed = replace(hit.request, request_id=1, block_hashes=np.arange(250, dtype=np.int64))
    plain = Request(request_id=2, arrival_s=0.0, prompt_tokens=100, decode_tokens=50,
                    predicted_decode_tokens=50, ttft_target_s=5.0)
    seen: list[Any] = []
    score = policy._scorer.score

    def spy(*args: Any) -> Any:
        seen.append(args[-1])
        return score(*args)

    policy._scorer = type("Spy", (), {"score": staticmethod(spy)})()  # type: ignore[assignment]

    def context(r: Request) -> RoutingContext:
        return replace(hit, request=r, prefixes=hit.prefixes if r is hashed else None)

    decisions = list(policy.decide_held([hashed, plain], context))
    assert len(decisions) == 2
    assert seen[0].tolist() == [[3984.0, 0.0], [0.0, 0.0]]
