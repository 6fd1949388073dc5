"""The contract every registered policy keeps, on a small heterogeneous Qwen3 pool: valid
decisions with a reason, every request finished, and the same records on a rerun with
the same seed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from olproute.config.loader import LoadedConfig
from olproute.estimate.calibration import InstanceCalibration
from olproute.policies import REGISTRY, Policy, PolicyEnv
from olproute.sim.scenario import CalibrationSource, profile_calibration, simulate
from olproute.types import ACTIONS, Decision, RoutingContext
from tests.conftest import make_config

# policies whose explanation holds one figure per instance for every key
PER_INSTANCE = {"bear", "prefill_tps", "latency_agnostic", "lmdeploy", "score",
                "route_balance", "calibrated_cost", "least_outstanding", "cache_aware",
                "prefix_load"}
RECORDS = ("instance", "dispatch_s", "first_token_s", "finish_s", "num_preemptions",
           "decode_tokens", "shed", "batch_log")


def _pool() -> LoadedConfig:
    return make_config(
        instances=[{"name": "q0.6b", "model": "qwen3-0.6b", "gpu": "h100"},
                   {"name": "q8b", "model": "qwen3-8b", "gpu": "h100"},
                   {"name": "q32b", "model": "qwen3-32b", "gpu": "h100",
                    "tensor_parallel": 2}],
        workload={"kind": "synthetic", "rate_per_s": 8.0, "num_requests": 300})


@pytest.fixture(scope="module")
def pool() -> tuple[LoadedConfig, list[InstanceCalibration]]:
    loaded = _pool()
    return loaded, profile_calibration(loaded, "round_robin")


def _recording(decisions: list[tuple[RoutingContext, Decision]]) -> Any:
    """A stand-in for REGISTRY.create that records every (context, decision)."""
    create = REGISTRY.create

    def recording_create(name: str, env: PolicyEnv) -> Policy:
        policy = create(name, env)
        decide = policy.decide

        def recorded(ctx: RoutingContext) -> Decision:
            d = decide(ctx)
            decisions.append((ctx, d))
            return d

        policy.decide = recorded  # type: ignore[method-assign]
        return policy
    return recording_create


@pytest.mark.parametrize("name", REGISTRY.names())
def test_policy_contract(name: str, pool: tuple[LoadedConfig, list[InstanceCalibration]],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    loaded, cal = pool
    num_instances = len(loaded.specs)
    runs, decisions = [], []
    for _ in range(2):
        made: list[tuple[RoutingContext, Decision]] = []
        with monkeypatch.context() as m:
            m.setattr(REGISTRY, "create", _recording(made))
            runs.append(simulate(loaded, name, calibration=CalibrationSource(loaded, cal)))
        decisions.append(made)
    first, second = runs

    n = len(first.requests)
    assert n == 300
    assert np.all(np.isfinite(first.finish_s)), "every request finishes"
    assert not first.shed.any()
    assert len(decisions[0]) >= n
    for ctx, d in decisions[0]:
        assert d.request_id == ctx.request.request_id
        assert d.action in ACTIONS
        assert d.reason.strip()
        if d.action == "dispatch":
            assert d.instance is not None and 0 <= d.instance < num_instances
        for key, values in d.explanation.items():
            assert isinstance(values, tuple), key
            assert all(isinstance(v, float) for v in values), key
            if name in PER_INSTANCE:
                assert len(values) == num_instances, key
    assert len(decisions[0]) == len(decisions[1])
    for (_, d1), (_, d2) in zip(decisions[0], decisions[1], strict=True):
        assert (d1.request_id, d1.action, d1.instance, d1.reason) == \
            (d2.request_id, d2.action, d2.instance, d2.reason)
        assert d1.explanation.keys() == d2.explanation.keys()
        for key in d1.explanation:
            assert np.array_equal(d1.explanation[key], d2.explanation[key], equal_nan=True)
    for field in RECORDS:
        a, b = getattr(first, field), getattr(second, field)
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), field
