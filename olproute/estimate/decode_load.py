"""Decode durations that depend on load: the time per output token a request will see
over its decode, from the batch its instance is expected to run then (docs/design.md,
section 1).

A request decoding on an instance waits one engine step per output token, and a step's
time grows with the batch it carries: the other decoders (one token each, their
contexts) and the prefill chunks of the requests starting meanwhile. The decode step of
this instant (``bea.decode_step_time``: the residents of now, no prefill) is therefore
too short as soon as requests keep arriving: 1.3x when batch slots bind, 3.5x when the
prefill budget does, in ``solvers.compare``'s scenarios.

**The steady batch.** Requests reach instance g at rate lambda (time-decayed over the
router's dispatches there, half-life ``prices.decode_load_halflife_s``) with per-request
means of s (prompt tokens it computes) and o (predicted output tokens). Over a long time
every request adds, in total over the steps it is part of, o + s tokens to the beta1
term, o s + o^2 / 2 context to the beta2 term and s (s + 1) / 2 to the beta3 term
(``bea``'s batch-time model, whatever the chunking). So a steady engine's mean step time
T solves

    T = beta0 + lambda_e T k,   k = beta1 E[o + s] + beta2 E[o s + o^2 / 2]
                                    + beta3 E[s (s + 1) / 2],

i.e. T = beta0 / (1 - lambda_e k), with lambda_e the rate it can serve: lambda, or less
where a limit binds: its mean decoders n = lambda_e E[o] T at most max_num_seqs B, its
tokens per step lambda_e E[o + s] T at most the step budget kappa. Each limit gives a
largest rate (n = B: lambda_e <= B / (E[o] beta0 + B k); the budget likewise), always
below 1 / k: the fixed point exists.

**The TPOT a request is held for** (``load_aware_tpot``) is the steady step once the
instance has a rate, else (no dispatch there yet) the step of now, whose count of
decoders includes the requests still queued for their prefill. The compiled decision
kernel (``pricing._score``), its NumPy twin (``reward.score_reference``), the free
capacity the tick computes for the residents (``reward.free_capacity``), the demand
samples and the exact LP (which read the TPOT a decision recorded) all take this one
figure.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# per-request moments kept per instance: 1, o + s, o s + o^2 / 2, s (s + 1) / 2, o
MOMENTS = 5
QUEUED = 65_536   # dispatches kept between two ticks (the newest)


def load_aware_tpot(tpot_now: FloatArray, steady: FloatArray) -> FloatArray:
    """The time per output token a request is held for on each instance: the steady step
    (``DecodeLoad.steady_step_time``) where it is known (> 0), else the decode step of
    now (``bea.decode_step_time``). Shapes broadcast."""
    result: FloatArray = np.where(steady > 0.0, steady, tpot_now)
    return result


def steady_step_time(beta: FloatArray, rate: FloatArray, moments: FloatArray,
                     batch_cap: FloatArray, token_budget: FloatArray
                     ) -> tuple[FloatArray, FloatArray]:
    """(T, n): per instance, the steady mean step time and mean decoders (module
    docstring). ``beta`` (G, 4); ``rate`` (G,) requests per second; ``moments`` (G, 4):
    E[o + s], E[o s + o^2 / 2], E[s (s + 1) / 2], E[o]; ``batch_cap`` B and
    ``token_budget`` kappa (G,). An instance with no rate has T = 0 (unknown), n = 0."""
    k = (beta[:, 1] * moments[:, 0] + beta[:, 2] * moments[:, 1]
         + beta[:, 3] * moments[:, 2])
    o, tokens, b0 = moments[:, 3], moments[:, 0], beta[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        by_batch = np.where(o > 0, batch_cap / (o * b0 + batch_cap * k), np.inf)
        by_tokens = np.where(tokens > 0, token_budget / (tokens * b0 + token_budget * k),
                             np.inf)
    lam = np.minimum(np.maximum(rate, 0.0), np.minimum(by_batch, by_tokens))
    lam = np.where(np.isfinite(lam), lam, 0.0)
    t: FloatArray = np.where(lam > 0, b0 / np.maximum(1.0 - lam * k, 1e-12), 0.0)
    n: FloatArray = np.minimum(lam * o * t, batch_cap)
    return t, n


class DecodeLoad:
    """Per instance, the time-decayed rate and moments of the requests dispatched there
    (``add``, on the request path: one append) and the steady step they make
    (``steady_step_time``, off it: the tick folds the dispatches in)."""

    def __init__(self, num_instances: int, halflife_s: float) -> None:
        if not halflife_s > 0 or not math.isfinite(halflife_s):
            raise ValueError(f"halflife_s must be finite and > 0, got {halflife_s!r}")
        self.num_instances = num_instances
        self._tau = halflife_s / math.log(2.0)
        self._sums = np.zeros((num_instances, MOMENTS))
        self._time_s: float | None = None   # when the sums were last decayed to
        self._start_s: float | None = None  # the first dispatch
        self._queue: deque[tuple[int, float, float, float]] = deque(maxlen=QUEUED)

    def add(self, g: int, now_s: float, prompt_tokens: float, decode_tokens: float) -> None:
        """A dispatch to instance g: ``prompt_tokens`` it computes (its cached prefix left
        out), ``decode_tokens`` predicted."""
        self._queue.append((g, now_s, prompt_tokens, decode_tokens))

    def _fold(self, now_s: float) -> None:
        while self._queue:
            g, t, s, o = self._queue.popleft()
            self._decay_to(t)
            self._sums[g] += (1.0, o + s, o * s + o * o / 2.0, s * (s + 1.0) / 2.0, o)
        self._decay_to(now_s)

    def _decay_to(self, t: float) -> None:
        if self._time_s is None:
            self._time_s = self._start_s = t
            return
        if t > self._time_s:
            self._sums *= math.exp(-(t - self._time_s) / self._tau)
            self._time_s = t

    def rates(self, now_s: float) -> tuple[FloatArray, FloatArray]:
        """(rate (G,) requests per second, moments (G, 4) as ``steady_step_time`` reads
        them), as of ``now_s``. The decayed count over tau is the rate once the
        dispatches span several half-lives; before, it is corrected for the shorter
        span."""
        self._fold(now_s)
        count = self._sums[:, 0]
        if self._start_s is None:
            return np.zeros(self.num_instances), np.zeros((self.num_instances, 4))
        span = max(now_s - self._start_s, 0.0)
        seen = -math.expm1(-span / self._tau) if span > 0 else 0.0
        rate = count / (self._tau * seen) if seen > 1e-9 else np.zeros_like(count)
        with np.errstate(divide="ignore", invalid="ignore"):
            moments = np.where(count[:, None] > 0, self._sums[:, 1:] / count[:, None], 0.0)
        return rate, moments

    def steady_step_time(self, now_s: float, beta: FloatArray, batch_cap: FloatArray,
                         token_budget: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(T, n) per instance (``steady_step_time``) from the dispatches so far; an
        instance with none has T = 0 (unknown), n = 0."""
        rate, moments = self.rates(now_s)
        return steady_step_time(beta, rate, moments, batch_cap, token_budget)
