"""The one policy interface, and the registry of policies by name.

A policy is built once per run from a :class:`PolicyEnv` and then called for every
request (``decide``) and every finished request (``observe``). The simulator and the
server call the same objects. A policy owns its state; randomness comes from the
generator in its environment, never from global state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from olproute.calibration import InstanceCalibration
from olproute.config_schema import AdmissionConfig, PriceConfig, RewardConfig
from olproute.outlook import OutlookSource
from olproute.types import Decision, InstanceSpec, Outcome, RoutingContext


class Policy(Protocol):
    name: str

    def decide(self, ctx: RoutingContext) -> Decision:
        """Choose an instance for ctx.request, or hold or shed it."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Learn from a request that finished (or was shed)."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyEnv:
    """What a policy is built from: the instances, its parameters, its RNG, the slot
    length and horizon, the objective (reward, prices, admission sections of the config),
    and two lazily built sources a policy may need: per-instance batch-time calibration
    (``calibration()``, for TTFT estimators) and per-request expectations
    (``outlook(request)``: predicted tokens, quality, cost per instance). On
    disaggregated pools ``transfer_s(prompt_tokens)`` is the KV transfer time.

    A policy may also declare ``needs_snapshots = True`` (the context then carries
    instance snapshots) and ``tick_s`` > 0 with a ``tick(now_s, snapshots)`` method,
    called every ``tick_s`` seconds off the request path (price updates)."""

    specs: tuple[InstanceSpec, ...]
    rng: np.random.Generator
    params: Mapping[str, Any] = field(default_factory=dict)
    slot_s: float = 0.05
    horizon_slots: int = 600
    reward: RewardConfig = field(default_factory=RewardConfig)
    prices: PriceConfig = field(default_factory=PriceConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    calibration_source: Callable[[], Sequence[InstanceCalibration]] | None = None
    outlook_source: OutlookSource | None = None
    # disaggregated pools: seconds to move a prompt's KV cache from prefill to decode
    transfer_s: Callable[[int], float] | None = None

    def calibration(self) -> tuple[InstanceCalibration, ...]:
        if self.calibration_source is None:
            raise PolicyError("this policy needs batch-time calibration; none was given")
        cal = tuple(self.calibration_source())
        if len(cal) != len(self.specs):
            raise PolicyError("calibration must have one entry per instance")
        return cal

    def outlook(self) -> OutlookSource:
        if self.outlook_source is None:
            raise PolicyError("this policy needs request predictions; none were given")
        return self.outlook_source


PolicyFactory = Callable[[PolicyEnv], Policy]


class PolicyError(ValueError):
    """Unknown policy name, duplicate registration, or bad policy parameters."""


class PolicyRegistry:
    """Policies by name; registering a name twice is an error, never a silent replace."""

    def __init__(self) -> None:
        self._factories: dict[str, PolicyFactory] = {}
        self._pools: set[str] = set()

    def register(self, name: str, disaggregated: bool = False
                 ) -> Callable[[PolicyFactory], PolicyFactory]:
        """Register a factory; ``disaggregated`` when the policy can route prefill/decode
        pools (its decisions then name a decode instance too)."""
        def wrap(factory: PolicyFactory) -> PolicyFactory:
            if name in self._factories:
                raise PolicyError(f"policy {name!r} is already registered")
            self._factories[name] = factory
            if disaggregated:
                self._pools.add(name)
            return factory
        return wrap

    def names(self) -> list[str]:
        return sorted(self._factories)

    def pool_names(self) -> list[str]:
        """The policies that route disaggregated prefill/decode pools."""
        return sorted(self._pools)

    def create(self, name: str, env: PolicyEnv) -> Policy:
        try:
            factory = self._factories[name]
        except KeyError:
            raise PolicyError(
                f"unknown policy {name!r} (known: {', '.join(self.names())})") from None
        if name not in self._pools and any(s.role != "mixed" for s in env.specs):
            raise PolicyError(f"policy {name!r} cannot route disaggregated prefill/decode "
                              f"pools (those that can: {', '.join(self.pool_names())})")
        return factory(env)


REGISTRY = PolicyRegistry()


def check_params(policy: str, params: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Reject parameters a policy does not take, naming them."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise PolicyError(f"policy {policy!r} takes no parameter(s) {', '.join(unknown)}")


def dispatch(ctx: RoutingContext, index: int, reason: str,
             explanation: Mapping[str, tuple[float, ...]] | None = None,
             decode_index: int | None = None) -> Decision:
    return Decision(request_id=ctx.request.request_id, action="dispatch", instance=index,
                    reason=reason, explanation=dict(explanation or {}),
                    decode_instance=decode_index)
