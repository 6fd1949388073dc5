"""The compiled decision kernel (``olproute.pricing._score``) against its NumPy twin
(``reward.score_reference``) and ``bea.decode_step_times_s`` (the loads counted by the
BEA replay's pass): the same doubles."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute._core import replay_ttft_many
from olproute.config.schema import RewardConfig
from olproute.estimate.bea import decode_step_times_s
from olproute.estimate.decode_load import load_aware_tpot
from olproute.pricing import _score, score_fields
from olproute.pricing.reward import pack_cumsums, price_cumsums, reward_weights, score_reference
from olproute.types import EngineSnapshot, InstanceSpec

H = 40
SLOT = 0.05


def _spec(max_num_seqs: int) -> InstanceSpec:
    return InstanceSpec(name="a", model="m", gpu="g", tensor_parallel=1,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=512, block_size=16,
                        num_kv_blocks=4000)


def _snapshot(rng: np.random.Generator, rows: int) -> EngineSnapshot:
    table = np.zeros((rows, 5), dtype=np.int64)
    table[:, 0] = rng.integers(1, 4000, rows)
    table[:, 1] = rng.integers(0, 900, rows)
    return EngineSnapshot(time_s=0.0, table=table, num_running=rows,
                          num_free_blocks=100, inflight=np.zeros((0, 2), dtype=np.int64),
                          inflight_start_s=0.0, request_ids=np.arange(rows))


def test_the_kernel_reads_the_layout_as_declared() -> None:
    """``score_fields`` declares the rows once: the kernel's numbers are its, and each
    tuple of names lists its rows in order."""
    names = [n for n in vars(score_fields) if n.startswith(("F_", "I_", "W_", "NUM_"))]
    assert len(names) == 16 + 4 + 11 + 3
    for n in names:
        assert getattr(_score, n) == getattr(score_fields, n), n
    for prefix, rows, num in (("F_", score_fields.FLOAT_ROWS, score_fields.NUM_F),
                              ("I_", score_fields.INT_ROWS, score_fields.NUM_I),
                              ("W_", score_fields.WEIGHTS, score_fields.NUM_W)):
        assert num == len(rows)
        assert [getattr(score_fields, prefix + r.upper()) for r in rows] == list(range(num))
        assert sorted(n for n in names if n.startswith(prefix)) == sorted(
            prefix + r.upper() for r in rows)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), g=st.integers(1, 9),
       sampled=st.booleans(), shift=st.integers(0, H + 3), threshold=st.booleans(),
       zeta=st.floats(0, 3), hits=st.booleans())
def test_the_kernel_gives_the_twins_numbers(seed: int, n: int, g: int, sampled: bool,
                                            shift: int, threshold: bool,
                                            zeta: float, hits: bool) -> None:
    """Random requests, instances, prices and weights (TTFTs past the horizon and
    infinite ones included; every instance or a sample of them; with or without cached
    prefixes): every float and integer output equal, and the step times equal
    ``decode_step_times_s``."""
    rng = np.random.default_rng(seed)
    specs = [_spec(int(rng.integers(2, 12))) for _ in range(g)]
    snaps = [_snapshot(rng, int(rng.integers(0, 14))) for _ in range(g)]
    idx = (np.sort(rng.choice(g, size=int(rng.integers(1, g + 1)), replace=False))
           if sampled else np.arange(g)).astype(np.int64)
    d = idx.size
    prompt = rng.integers(1, 6000, n).astype(np.float64)
    decode = rng.uniform(1, 900, (n, d))
    utility = rng.uniform(-2, 2, (n, d))
    ttft = rng.choice([0.0, 0.013, 0.5, 1.7, 2.0, 2.5, 7.3, np.inf], (n, d)) \
        + rng.uniform(0, 0.3, (n, d))
    waited = rng.uniform(0, 1.5, n)
    target = rng.uniform(0.1, 3.0, n)
    beta = rng.uniform(0, 1e-3, (g, 4))
    batch_cap = rng.integers(2, 256, g).astype(np.float64)
    kv_cap = rng.uniform(1e3, 2e5, g)
    budget = rng.uniform(50, 3000, g)
    w = RewardConfig(sigma=float(rng.uniform(0, 2)), alpha=float(rng.uniform(0, 2)),
                     beta=float(rng.uniform(0, 0.05)), gamma=float(rng.uniform(0, 0.05)),
                     zeta1=zeta, zeta2=zeta / 2, omega=float(rng.uniform(0, 2)),
                     eel_threshold_s=float(rng.uniform(1, 20)),
                     ttft_threshold_s=1.0 if threshold else None,
                     delta=float(rng.uniform(0, 3)))
    p0, p1 = price_cumsums(rng.uniform(0, 1, (g, H, 3)) * (rng.uniform(0, 1, (g, H, 3)) > 0.5))
    loads = _loads(snaps, specs, idx, beta)
    args = (prompt, decode, utility, ttft, loads[:, 0].copy(), loads[:, 1].copy(), beta,
            waited, target, batch_cap, kv_cap, budget, SLOT, H)
    # each instance's steady decode step: known on some (> 0), not yet on the others
    steady = rng.uniform(0.005, 0.2, g) * (rng.uniform(0, 1, g) > 0.4)
    scorer = _score.Scorer(beta, batch_cap, kv_cap, budget, reward_weights(w), SLOT, H,
                           steady)
    cached = (np.floor(rng.uniform(0, 1, (n, d)) * (prompt[:, None] - 1)) if hits
              else None)
    got_f, got_i, got_on = scorer.score(loads, idx, prompt, decode, utility, ttft, waited,
                                        target, pack_cumsums(p0, p1), shift, cached)
    want_f, want_i, want_on = score_reference(*args, w, p0, p1, shift, idx, g, cached,
                                              steady)
    np.testing.assert_array_equal(got_f, want_f)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_on, want_on)
    # the loads the replay counted give the step times decode_step_times_s gives, held
    # at the steady step where an instance has one (decode_load.load_aware_tpot)
    tpot = decode_step_times_s([snaps[i] for i in idx], [specs[i] for i in idx], beta[idx],
                               prompt.astype(np.int64))
    np.testing.assert_array_equal(got_f[score_fields.F_TPOT][:, idx],
                                  load_aware_tpot(tpot, steady[idx]))
    known = steady[idx] > 0
    np.testing.assert_array_equal(got_f[score_fields.F_TPOT][:, idx][:, known],
                                  np.broadcast_to(steady[idx][known], (n, int(known.sum()))))


def _loads(snaps: list[EngineSnapshot], specs: list[InstanceSpec],
           idx: np.ndarray, beta: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    """Each instance of ``idx``'s decode load, as the BEA replay counts it in its pass."""
    loads = np.empty((idx.size, 2))
    limits = np.array([[s.num_kv_blocks, s.block_size, s.max_num_seqs,
                        s.max_num_batched_tokens] for s in specs], dtype=np.int64)
    replay_ttft_many([snaps[i] for i in idx], limits[idx], beta[idx],
                     np.ones(1, dtype=np.int64), np.ones((1, idx.size), dtype=np.int64), 0.0,
                     loads=loads)
    return loads


def test_instances_not_sampled_read_as_never_started() -> None:
    """Outside ``idx``: TTFT infinite, score and reward -inf, columns empty at the
    horizon, not on time."""
    g, idx = 3, np.array([1], dtype=np.int64)
    p0, p1 = price_cumsums(np.zeros((g, H, 3)))
    snaps = [_snapshot(np.random.default_rng(0), 2) for _ in range(g)]
    beta = np.full((g, 4), 1e-4)
    scorer = _score.Scorer(beta, np.full(g, 8.0), np.full(g, 1e4), np.full(g, 500.0),
                           reward_weights(RewardConfig()), SLOT, H)
    f, i, on = scorer.score(_loads(snaps, [_spec(8)] * g, idx, beta), idx,
                            np.array([100.0]), np.array([[50.0]]), np.zeros((1, 1)),
                            np.array([[0.2]]), np.zeros(1), np.ones(1), pack_cumsums(p0, p1),
                            0)
    assert np.isfinite(f[score_fields.F_LAGRANGIAN, 0, 1])
    for other in (0, 2):
        assert f[score_fields.F_TTFT, 0, other] == np.inf
        assert f[score_fields.F_LAGRANGIAN, 0, other] == -np.inf
        assert (i[:, 0, other] == H).all() and not on[0, other]
    assert on[0, 1]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(-3, H + 3))
def test_fits_and_take_compiled_as_their_twins(seed: int, k: int) -> None:
    """``_score.fits_column`` and ``_score.subtract_column`` against ``reward.fits_under`` and
    ``reward.take_column`` on random curves (some slots already over-committed) and
    columns (empty, cut at the horizon, prefill only), shifted k slots."""
    from olproute.pricing import reward

    rng = np.random.default_rng(seed)
    free = rng.uniform(-0.05, 1.0, (H, 3))
    s = int(rng.integers(0, H + 1))
    e = int(rng.integers(s, H + 1)) if rng.uniform() < 0.8 else s
    ps = int(rng.integers(0, H + 1))
    pe = int(rng.integers(ps, H + 1))
    col = (s, e, float(rng.uniform(0, 0.2)), float(rng.uniform(0, 0.3)),
           float(rng.uniform(0, 0.02)), ps, pe, float(rng.uniform(0, 1)))
    s_, e_, ba, ka, kb, ps_, pe_, ca = col
    assert _score.fits_column(free, s_, e_, ba, ka, kb, ps_, pe_, k, H) == reward.fits_under(
        free, col, k, H)
    mine, theirs = free.copy(), free.copy()
    _score.subtract_column(mine, s_, e_, ba, ka, kb, ps_, pe_, ca, k, H)
    reward.take_column(theirs, col, k, H)
    np.testing.assert_array_equal(mine, theirs)


def test_a_decode_past_any_horizon_or_nan_ends_at_the_horizon() -> None:
    """An output estimate that is NaN, infinite or past int64 in slots (a predictor's
    inf, a zero budget) ends the column at the horizon instead of wrapping to a negative
    slot (boundscheck is off: that would read another instance's prices)."""
    g, idx = 2, np.arange(2, dtype=np.int64)
    p0, p1 = price_cumsums(np.ones((g, H, 3)))
    loads = np.zeros((2, 2))
    scorer = _score.Scorer(np.full((g, 4), 1e-4), np.full(g, 8.0), np.full(g, 1e4),
                           np.array([500.0, 0.0]),
                           reward_weights(RewardConfig()), SLOT, H)
    for decode in (np.nan, np.inf, 1e30):
        f, i, _ = scorer.score(loads, idx, np.array([100.0]), np.full((1, 2), decode),
                               np.zeros((1, 2)), np.array([[0.2, 0.2]]), np.zeros(1),
                               np.ones(1), pack_cumsums(p0, p1), 3)
        assert (i >= 0).all() and (i <= H).all(), decode
        assert (i[score_fields.I_END] == H).all()
        assert np.isfinite(f[score_fields.F_PRICE]).all()


def test_a_nan_in_the_free_curve_never_fits() -> None:
    """As the twin's min() says: a slot whose free capacity is NaN has no room."""
    from olproute.pricing import reward

    free = np.ones((H, 3))
    free[3, 1] = np.nan
    col = (2, 6, 0.01, 0.01, 0.0, 0, 0, 0.0)
    s, e, ba, ka, kb, ps, pe, _ = col
    assert not reward.fits_under(free, col, 0, H)
    assert not _score.fits_column(free, s, e, ba, ka, kb, ps, pe, 0, H)
    assert _score.fits_column(free, s, e, ba, ka, kb, ps, pe, 10, H)   # moved past it


def test_a_cached_prefix_leaves_the_compute_and_kv_columns_not_the_decode() -> None:
    """The same request on one instance with and without 3000 of its 4000 prompt tokens
    cached: its prefill work and KV column shrink to those of a 1000-token prompt, its
    decode step time (attention reads the whole context) and reward stay."""
    rng = np.random.default_rng(3)
    snaps = [_snapshot(rng, 4)]
    beta = np.array([[1e-2, 1e-4, 1e-6, 1e-6]])
    scorer = _score.Scorer(beta, np.array([64.0]), np.array([50_000.0]), np.array([5000.0]),
                           reward_weights(RewardConfig()), SLOT, H)
    idx = np.arange(1, dtype=np.int64)
    loads = _loads(snaps, [_spec(8)], idx, beta)
    p0, p1 = price_cumsums(np.zeros((1, H, 3)))

    def scored(prompt: float, cached: float | None) -> tuple[np.ndarray, np.ndarray]:
        f, i, _ = scorer.score(loads, idx, np.array([float(prompt)]), np.full((1, 1), 50.0),
                               np.zeros((1, 1)), np.full((1, 1), 0.4), np.zeros(1),
                               np.ones(1), pack_cumsums(p0, p1), 0,
                               None if cached is None else np.full((1, 1), float(cached)))
        return f[:, 0, 0], i[:, 0, 0]

    whole, hit, short = scored(4000, None), scored(4000, 3000), scored(1000, None)
    for r in (score_fields.F_KV_A, score_fields.F_COMPUTE_A):
        assert hit[0][r] == short[0][r] < whole[0][r]
    assert (hit[1][score_fields.I_PRE_START], hit[1][score_fields.I_PRE_END]) == (
        short[1][score_fields.I_PRE_START], short[1][score_fields.I_PRE_END])
    tpot = score_fields.F_TPOT
    assert hit[0][tpot] == whole[0][tpot] > short[0][tpot]
    assert hit[0][score_fields.F_REWARD] == whole[0][score_fields.F_REWARD]
