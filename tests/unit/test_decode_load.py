"""Load-aware decode durations (olproute.estimate.decode_load): the steady step's fixed
point and limits, the decayed rate and moments, and one TPOT in every place bid_price
holds a request for its decode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.estimate.bea import decode_step_times_s
from olproute.estimate.decode_load import DecodeLoad, load_aware_tpot, steady_step_time
from olproute.pricing.reward import decode_slots, free_capacity
from tests.unit.test_bid_price import SLOT, _ctx, _policy, _snap


@settings(max_examples=200, deadline=None)
@given(b0=st.floats(1e-3, 0.05), b1=st.floats(0, 1e-4), b2=st.floats(0, 1e-6),
       b3=st.floats(0, 1e-9), rate=st.floats(0.01, 200), o=st.floats(1, 800),
       s=st.floats(1, 8000), batch=st.integers(1, 256), budget=st.integers(256, 16384))
def test_the_steady_step_is_the_fixed_point_within_the_limits(
        b0: float, b1: float, b2: float, b3: float, rate: float, o: float, s: float,
        batch: int, budget: int) -> None:
    """T = beta0 + lambda_e T k with lambda_e <= lambda; the mean decoders lambda_e o T
    within B and the tokens per step lambda_e (o + s) T within kappa; lambda_e = lambda
    unless one of them is at its limit."""
    beta = np.array([[b0, b1, b2, b3]])
    moments = np.array([[o + s, o * s + o * o / 2, s * (s + 1) / 2, o]])
    t, n = steady_step_time(beta, np.array([rate]), moments, np.array([float(batch)]),
                            np.array([float(budget)]))
    k = b1 * (o + s) + b2 * (o * s + o * o / 2) + b3 * s * (s + 1) / 2
    lam = n[0] / (o * t[0])          # the rate served, by Little's law
    assert t[0] == pytest.approx(b0 + lam * t[0] * k, rel=1e-9)
    assert lam <= rate * (1 + 1e-9)
    assert n[0] <= batch * (1 + 1e-9)
    assert lam * (o + s) * t[0] <= budget * (1 + 1e-9)
    at_limit = (n[0] >= batch * (1 - 1e-6) or lam * (o + s) * t[0] >= budget * (1 - 1e-6))
    assert lam == pytest.approx(rate, rel=1e-6) or at_limit

def test_no_rate_no_steady_step() -> None:
    t, n = steady_step_time(np.array([[0.01, 1e-5, 1e-7, 0.0]]), np.zeros(1),
                            np.zeros((1, 4)), np.array([16.0]), np.array([2048.0]))
    assert t.tolist() == [0.0] and n.tolist() == [0.0]
    # the step of now where no steady step is known, the steady one where it is
    assert load_aware_tpot(np.array([0.02, 0.02]), np.array([0.0, 0.05])).tolist() == [
        0.02, 0.05]


def test_the_decayed_rate_and_moments_are_the_dispatches() -> None:
    """Poisson dispatches at 12 per second on instance 0 (none on 1): the rate within 10%
    after a minute, from the first seconds on within 25% (the start-up correction), the
    moments the lengths' own."""
    rng = np.random.default_rng(3)
    load = DecodeLoad(2, halflife_s=5.0)
    times = np.cumsum(rng.exponential(1 / 12.0, 800))
    prompts = rng.integers(100, 2000, times.size).astype(float)
    outputs = rng.integers(10, 400, times.size).astype(float)
    early = None
    for t, s, o in zip(times, prompts, outputs, strict=True):
        load.add(0, float(t), float(s), float(o))
        if early is None and t > 3.0:
            early = load.rates(float(t))[0][0]
    assert early == pytest.approx(12.0, rel=0.25)
    rate, moments = load.rates(float(times[-1]))
    assert rate[0] == pytest.approx(12.0, rel=0.1) and rate[1] == 0.0
    recent = times > times[-1] - 15.0
    o, s = outputs[recent], prompts[recent]
    assert moments[0, 3] == pytest.approx(o.mean(), rel=0.1)
    assert moments[0, 0] == pytest.approx((o + s).mean(), rel=0.1)
    assert moments[1].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="halflife_s"):
        DecodeLoad(1, halflife_s=0.0)


def test_one_tpot_for_the_decision_the_sample_the_lp_and_the_residents() -> None:
    """After dispatches and a tick, a decision's TPOT on an instance with a rate is that
    instance's steady step; its usage column and its demand sample hold it for o_hat x
    that TPOT; and the free capacity the tick computed holds the residents at the same
    speed."""
    policy = _policy()
    snaps = (_snap(n_running=3), _snap(n_running=1))
    for i in range(40):
        d = policy.decide(_ctx(snaps, now=i * 0.05, arrival=i * 0.05, rid=100 + i))
        assert d.action == "dispatch"
    policy.tick(2.0, snaps)
    steady = policy._steady.copy()
    assert (steady > 0).all()   # both instances were dispatched to
    d = policy.decide(_ctx(snaps, now=2.0, arrival=2.0, rid=7))
    tpot = np.array(d.explanation["tpot_s"])
    np.testing.assert_array_equal(tpot, steady)
    decode = np.array(d.explanation["decode_tokens"])
    policy.tick(2.05, snaps)       # the decision's demand sample goes into the book
    book = policy.book
    last = (book._next - 1) % book.samples.end.shape[0]
    np.testing.assert_array_equal(book.samples.end[last] - book.samples.start[last],
                                  decode_slots(decode, tpot, SLOT))
    want = free_capacity(snaps, policy._specs, load_aware_tpot(
        decode_step_times_s(snaps, policy._specs, policy._bea.beta, 0), policy._steady),
        policy._budget, SLOT, policy._horizon)
    np.testing.assert_array_equal(policy.book.c, want)
