"""Helpers shared by the estimating baselines (bear, prefill_tps, latency_agnostic,
lmdeploy, score, route_balance, calibrated_cost): picking the best instance with
deterministic tie-breaks, and the per-instance figures of a decision."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.policies.base import Policy
from olproute.routing.outlook import Outlook
from olproute.types import Outcome

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class NoFeedback(Policy):
    """For policies that read the instances' state at every decision: nothing to learn
    from a finished request."""

    def observe(self, outcome: Outcome) -> None:
        """No-op: the next decision sees the finish through the instance state."""


def pick_best(score: FloatArray, rng: np.random.Generator | None = None,
              among: BoolArray | None = None, tie: FloatArray | None = None) -> int:
    """Index of the highest ``score`` (only over ``among`` when given). Exact ties go to
    the smallest ``tie`` value, then at random with ``rng`` (the lowest index without
    one). NaN counts as -inf. ``rng`` is drawn from only when a tie is left, so a
    policy's coin flips stay reproducible from its environment's generator."""
    s = np.where(np.isnan(score), -np.inf, score)
    candidates = np.arange(len(s)) if among is None else np.flatnonzero(among)
    if candidates.size == 0:
        raise ValueError("pick_best needs at least one candidate")
    top = candidates[s[candidates] == s[candidates].max()]
    if tie is not None and top.size > 1:
        t = np.where(np.isnan(tie[top]), np.inf, tie[top])
        top = top[t == t.min()]
    if top.size == 1 or rng is None:
        return int(top[0])
    return int(top[int(rng.integers(top.size))])


def decode_per_instance(outlook: Outlook) -> IntArray:
    """Predicted output tokens of the request on every instance, as whole tokens >= 1
    (the estimators' ``predicted_decode``)."""
    result: IntArray = np.maximum(np.rint(outlook.decode_tokens), 1).astype(np.int64)
    return result


def figures(**columns: npt.NDArray[Any]) -> dict[str, tuple[float, ...]]:
    """A Decision's ``explanation``: one tuple of floats per named per-instance array."""
    return {k: tuple(float(x) for x in np.asarray(v, dtype=np.float64))
            for k, v in columns.items()}
