"""No policy reads ground truth.

A policy may read what a router in front of a real fleet knows: the request's prompt,
targets and predictions, the instance snapshots, the outcomes of finished requests. It
must not read the simulator's truth: true output lengths (``decode_tokens``,
``decode_tokens_by_model``), the true per-model quality, the task family, or the batch
timer's noise draws.

The check: every call a policy gets in a simulation (``decide`` with its context,
``observe`` with an outcome, ``tick`` with snapshots) is recorded; then a fresh policy,
built the same way but from a configuration whose batch-time noise differs, receives the
same calls in the same order, with every request's truth replaced by other values and
its predictions, snapshots and outcomes unchanged. A policy that reads only what it may
decides exactly as it did; one that reads the truth anywhere decides differently
somewhere (the last test shows the check catching one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from olproute.config.loader import Config, LoadedConfig, load_config
from olproute.policies import REGISTRY, Policy
from olproute.policies.base import PolicyEnv, dispatch
from olproute.sim.prompts import TASKS
from olproute.sim.scenario import CalibrationSource, build_requests, make_cluster, make_policy
from olproute.types import Decision, EngineSnapshot, Outcome, Request, RoutingContext
from tests.conftest import CONV_TRACE, REPO, make_config

SEED = 3


class Recorder(Policy):
    """Stands in for a policy in the simulator and records every call it gets."""

    def __init__(self, policy: Policy) -> None:
        self.inner = policy
        self.calls: list[tuple[str, Any]] = []
        self.name = policy.name
        self.needs_snapshots = policy.needs_snapshots
        self.tick_s = policy.tick_s
        self.joint_release = policy.joint_release

    def decide(self, ctx: RoutingContext) -> Decision:
        decision = self.inner.decide(ctx)
        self.calls.append(("decide", (ctx, decision)))
        return decision

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        """Forwarded; the requests, the contexts the pass asked for and its decisions
        are recorded in the order the pass began (sheds it causes are observed after)."""
        built: dict[int, RoutingContext] = {}
        decisions: list[Decision] = []
        self.calls.append(("held", (list(requests), built, decisions)))

        def context_of(r: Request) -> RoutingContext:
            built[r.request_id] = context(r)
            return built[r.request_id]

        for d in self.inner.decide_held(requests, context_of):
            decisions.append(d)
            yield d

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)
        self.calls.append(("observe", outcome))

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        self.inner.tick(now_s, snapshots)
        self.calls.append(("tick", (now_s, snapshots)))


def perturbed(requests: Sequence[Request], seed: int) -> dict[int, Request]:
    """Each request with other truth: output lengths, per-model lengths and quality, and
    task drawn anew; prompt, targets, text and every prediction kept."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in requests:
        by_model = (None if r.decode_tokens_by_model is None else
                    {m: int(rng.integers(1, 3000)) for m in r.decode_tokens_by_model})
        quality = (None if r.quality_by_model is None else
                   {m: float(rng.random()) for m in r.quality_by_model})
        others = [t for t in TASKS if t != r.task]
        out[r.request_id] = replace(
            r, decode_tokens=int(rng.integers(1, 3000)) + (r.decode_tokens == 1),
            decode_tokens_by_model=by_model, quality_by_model=quality,
            task=others[int(rng.integers(len(others)))])
    return out


def same(a: Decision, b: Decision) -> bool:
    """Equal decisions, explanations included (NaN equal to NaN)."""
    return ((a.request_id, a.action, a.instance, a.decode_instance, a.reason)
            == (b.request_id, b.action, b.instance, b.decode_instance, b.reason)
            and a.explanation.keys() == b.explanation.keys()
            and all(np.array_equal(a.explanation[k], b.explanation[k], equal_nan=True)
                    for k in a.explanation))


@dataclass(frozen=True)
class Replay:
    num_decisions: int
    num_changed: int
    first_change: str


def replay_with_other_truth(loaded: LoadedConfig, name: str, cal: CalibrationSource,
                            requests: Sequence[Request],
                            create: Callable[[LoadedConfig, str], Policy] | None = None
                            ) -> Replay:
    """Run ``name`` on ``requests``, then feed its recorded calls to a fresh copy with
    the truth perturbed; count the decisions that differ."""
    build = create or (lambda ld, n: make_policy(ld, n, SEED, cal))
    recorder = Recorder(build(loaded, name))
    make_cluster(loaded, recorder, SEED).run(requests)  # type: ignore[arg-type]
    other_noise = LoadedConfig(loaded.path, loaded.config.model_copy(update={
        "sim": loaded.config.sim.model_copy(update={"noise_cv": 0.2, "seed": SEED + 1})}),
        loaded.profiles)
    twin = build(other_noise, name)
    truth = perturbed(requests, seed=SEED + 2)
    num, changed, first = 0, 0, ""
    for kind, arg in recorder.calls:
        if kind == "observe":
            twin.observe(arg)
        elif kind == "tick":
            twin.tick(*arg)  # type: ignore[attr-defined]
        elif kind == "held":
            held, built, decided = arg
            pass_ = twin.decide_held([truth[r.request_id] for r in held],
                                     lambda r, b=built: replace(b[r.request_id], request=r))
            for seen, again in zip(decided, pass_, strict=True):
                num += 1
                if not same(again, seen):
                    changed += 1
                    first = first or _change(seen, again, "held pass")
        else:
            ctx, seen = arg
            again = twin.decide(replace(ctx, request=truth[ctx.request.request_id]))
            num += 1
            if not same(again, seen):
                changed += 1
                first = first or _change(seen, again, f"{ctx.now_s:.3f} s")
    return Replay(num, changed, first)


def _change(seen: Decision, again: Decision, when: str) -> str:
    return (f"request {seen.request_id} at {when}: {seen.action} {seen.instance}/"
            f"{seen.decode_instance} became {again.action} {again.instance}/"
            f"{again.decode_instance}")


# -- the pools ------------------------------------------------------------------------------
def _homogeneous() -> LoadedConfig:
    """Four Llama-2-7B engines near saturation (holds and preemptions happen)."""
    return make_config(workload={"kind": "poisson", "rate_per_s": 22.0, "num_requests": 160,
                                 "lengths_path": str(CONV_TRACE)},
                       sim={"seed": SEED})


def _heterogeneous() -> LoadedConfig:
    """BEAR's Qwen3 pool on synthetic prompts with per-model truth, congested, shedding."""
    return make_config(
        instances=[{"name": "q0.6b", "model": "qwen3-0.6b", "gpu": "h100"},
                   {"name": "q8b", "model": "qwen3-8b", "gpu": "h100"},
                   {"name": "q32b", "model": "qwen3-32b", "gpu": "h100",
                    "tensor_parallel": 2}],
        workload={"kind": "synthetic", "rate_per_s": 40.0, "num_requests": 160},
        admission={"mode": "shed"}, reward={"omega": 5.0, "zeta2": 2.0, "delta": 20.0},
        sim={"seed": SEED})


def _pools() -> LoadedConfig:
    """configs/pd.yaml (2 prefill + 4 decode) at a rate where its decode KV binds."""
    base = load_config(REPO / "configs" / "pd.yaml")
    data = base.config.model_dump()
    data["workload"] = {"kind": "poisson", "rate_per_s": 12.0, "num_requests": 160,
                        "lengths_path": str(REPO / "data" / "traces" / "splitwise_conv.csv")}
    data["sim"]["seed"] = SEED
    return LoadedConfig(base.path, Config.model_validate(data), base.profiles)


SCENARIOS = {"homogeneous": _homogeneous, "heterogeneous": _heterogeneous, "pools": _pools}
_cache: dict[str, tuple[LoadedConfig, CalibrationSource, list[Request]]] = {}


def scenario(kind: str) -> tuple[LoadedConfig, CalibrationSource, list[Request]]:
    """The pool, its calibration (profiled once) and its requests, built once per run."""
    if kind not in _cache:
        loaded = SCENARIOS[kind]()
        cal = CalibrationSource(loaded)
        cal()
        _cache[kind] = (loaded, cal, build_requests(loaded, SEED))
    return _cache[kind]


MIXED = [(kind, name) for kind in ("homogeneous", "heterogeneous") for name in REGISTRY.names()]
POOLS = [("pools", name) for name in REGISTRY.pool_names()]


@pytest.mark.parametrize(("kind", "name"), MIXED + POOLS)
def test_no_decision_reads_the_truth(kind: str, name: str) -> None:
    loaded, cal, requests = scenario(kind)
    result = replay_with_other_truth(loaded, name, cal, requests)
    assert result.num_decisions >= len(requests)
    assert result.num_changed == 0, (
        f"{name} on the {kind} pool: {result.num_changed} of {result.num_decisions} "
        f"decisions changed with the truth ({result.first_change})")


@pytest.mark.parametrize("release", ["density", "assignment"])
def test_no_joint_release_reads_the_truth(release: str) -> None:
    """bid_price deciding its held requests together, on two Llama-2-7B engines of 16
    batch slots at 40 req/s holding requests up to 2 s (about 110 passes, 4,800 held
    decisions): every decision is the same with the truth perturbed."""
    loaded = make_config(
        instances=[{"name": "l", "model": "llama-2-7b", "gpu": "a100-80gb", "replicas": 2,
                    "max_num_seqs": 16}],
        workload={"kind": "poisson", "rate_per_s": 40.0, "num_requests": 160,
                  "lengths_path": str(CONV_TRACE)},
        admission={"mode": "defer", "patience_s": 2.0},
        router={"policy": "bid_price", "policy_params": {"bid_price": {"release": release}}},
        sim={"seed": SEED})
    cal = CalibrationSource(loaded)
    requests = build_requests(loaded, SEED)
    result = replay_with_other_truth(loaded, "bid_price", cal, requests)
    assert result.num_decisions >= len(requests) + 1000   # the passes' decisions counted
    assert result.num_changed == 0, (
        f"{result.num_changed} of {result.num_decisions} decisions changed with the truth "
        f"({result.first_change})")


def test_the_perturbation_changes_every_kind_of_truth() -> None:
    _, _, requests = scenario("heterogeneous")
    other = perturbed(requests, seed=SEED + 2)
    for r in requests:
        o = other[r.request_id]
        assert o.task != r.task and o.decode_tokens_by_model != r.decode_tokens_by_model
        assert o.quality_by_model != r.quality_by_model
        assert (o.predicted_decode_by_model, o.predicted_quality_by_model,
                o.predicted_decode_tokens, o.text) == (
            r.predicted_decode_by_model, r.predicted_quality_by_model,
            r.predicted_decode_tokens, r.text)
    assert sum(other[r.request_id].decode_tokens != r.decode_tokens for r in requests) > 150


class _PeeksAtTheTruth(Policy):
    """A policy that breaks the rule: the shortest true output wins."""

    name = "peeks"
    needs_snapshots = False

    def __init__(self, env: PolicyEnv) -> None:
        self._models = [s.model for s in env.specs]

    def decide(self, ctx: RoutingContext) -> Decision:
        lengths = [ctx.request.true_decode_tokens(m) for m in self._models]
        return dispatch(ctx, int(np.argmin(lengths)), "shortest true output")

    def observe(self, outcome: Outcome) -> None:
        pass


def test_the_check_catches_a_policy_that_reads_the_truth() -> None:
    loaded, cal, requests = scenario("heterogeneous")
    env = PolicyEnv(specs=loaded.specs, rng=np.random.default_rng(0))
    result = replay_with_other_truth(loaded, "peeks", cal, requests,
                                     create=lambda ld, n: _PeeksAtTheTruth(env))
    assert result.num_changed > len(requests) // 4


# -- predictions: per model, independent, never the truth's ratio --------------------------
def test_each_model_has_its_own_prediction_error() -> None:
    """Noisy mode: every model's predicted length has its own error (the old rule
    scaled each model's truth by the first model's error ratio, which made the model
    with the shortest predicted output the truly shortest one for nearly every
    request), and quality is predicted with noise, not read from the task table."""
    _, _, requests = scenario("heterogeneous")
    models = ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]
    ratio = np.array([[r.predicted_decode_tokens_for(m) / r.true_decode_tokens(m)
                       for m in models] for r in requests
                      if min(r.true_decode_tokens(m) for m in models) >= 50])
    assert len(ratio) > 50
    assert np.all((ratio > 0.79) & (ratio < 1.21))  # the +/-20% noise (and rounding)
    corr = np.corrcoef(ratio.T)
    assert np.all(np.abs(corr[np.triu_indices(3, 1)]) < 0.3)
    quality_error = np.array([[(r.predicted_quality_for(m) or 0.0) - r.quality_by_model[m]
                               for m in models] for r in requests
                              if r.quality_by_model is not None])
    assert quality_error.std() > 0.05 and np.abs(quality_error).max() <= 0.3 + 1e-9
    agree = np.mean([
        np.argmin([r.predicted_decode_tokens_for(m) for m in models])
        == np.argmin([r.true_decode_tokens(m) for m in models]) for r in requests])
    assert agree < 0.97
