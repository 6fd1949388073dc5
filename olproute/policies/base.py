"""The one policy interface, the parameters a policy is built with, and the registry of
policies by name.

A policy is built once per run from a :class:`PolicyEnv` and its own typed parameters
(a :class:`PolicyParams` model registered with its factory) and then called for every
request (``decide``) and every finished request (``observe``). The simulator and the
server call the same objects, through :class:`Policy` alone: every hook a caller uses is
on the base with a harmless default, so no caller asks a policy what it has. A policy
owns its state; randomness comes from the generator in its environment, never from
global state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from olproute.config.read import problems_of
from olproute.config.schema import AdmissionConfig, PriceConfig, RewardConfig
from olproute.estimate.calibration import InstanceCalibration
from olproute.routing.outlook import OutlookSource
from olproute.types import (
    Decision,
    Demand,
    EngineSnapshot,
    InstanceSpec,
    Outcome,
    PriceState,
    PriceView,
    Request,
    RoutingContext,
)


class SharedPriceBook(Protocol):
    """A price book as router replicas share it (``Policy.price_books``;
    ``olproute.server.shared``, ``olproute.sim.replicas``): each replica's books drain
    the demand they gathered and add the others'; the leader's books (``leading``) learn
    and hand out their state, which the followers' books adopt. ``PriceBook``
    (``olproute.pricing.book``) is one; this protocol keeps the policy interface free of
    the pricing modules."""

    leading: bool
    num_updates: int

    def share_demand(self, on: bool = True) -> None: ...

    def drain_demand(self) -> Demand | None: ...

    def add_demand(self, demand: Demand, shift_s: float = 0.0) -> None: ...

    def state(self) -> PriceState: ...

    def adopt(self, state: PriceState, shift_s: float = 0.0) -> None: ...


class Policy(ABC):
    """Decides where each request goes and learns from how it went.

    The core is ``decide`` and ``observe``. The rest are optional hooks whose defaults
    suit a policy that does not need them (as vLLM's scheduler interface does it):

    - ``joint_release`` / ``decide_held``: a policy that decides its held requests
      together sets ``joint_release``; its callers then run ``decide_held`` once per slot
      over all of them, and otherwise ``decide`` each held request again every slot;

    - ``needs_snapshots``: the context carries instance snapshots (else ``None``);
    - ``tick_s`` > 0: ``tick(now_s, snapshots)`` runs every ``tick_s`` seconds off the
      request path (price updates);
    - ``forget``: a decision will not be carried out; drop what is kept for it;
    - ``rerouted``: the router moved a dispatch off an unhealthy instance;
    - ``takes_beta`` / ``set_beta``: a recalibrated batch-time model for one instance;
    - ``price_view``: the shadow prices, for a policy that learns them.

    **Threads.** The simulator (``olproute.sim.cluster``, ``olproute.sim.replicas``) calls
    every hook from its one thread, in event order. The server calls them from two
    threads, and lets a tick run while the loop decides:

    - *The event loop, the request path*: ``decide`` (``ServerState.decide``, from
      ``proxy.decide_until_dispatch`` and ``app.route``, which then calls ``forget``:
      ``POST /route`` only asks), ``decide_held``, or ``decide`` again, on the held
      requests every slot (``HoldQueue.rescore_together`` / ``rescore``), ``rerouted``
      (inside ``Router.decide``), ``observe`` (``ServerState.observe``, when a relayed
      request ends), ``forget`` (``ServerState.forget``, a held request's client left),
      ``set_beta`` (``app._from_batches`` / ``_from_streams``, after the refit ran in a
      worker thread; ``admin.reload`` on a new router) and ``price_view`` for ``GET
      /prices`` and ``GET /dashboard`` (``Router.prices``). None takes a lock or waits;
      each must not block the loop for more than about 1 ms (a decision's whole budget):
      whatever is slower belongs in ``tick``. The snapshots a context carries are built
      on the loop too, per decision (``ServerState.snapshots``: ``Tracker.snapshots``).
    - *The tick thread*: every ``tick_s`` the loop takes the snapshots (``app._tick``)
      and hands them to a worker thread of its default executor, which runs ``tick``
      (``Router.tick``) and then ``price_view`` (``app._ticked``), both holding
      ``ServerState.book_lock``; the view goes back to the loop (price metrics, and
      ``ServerState.ticked``, which records it for the live certificate and the
      re-solves); a re-solve's duals waiting for it (``resolving.take_handover``) go
      into the book after the tick (``resolving.warm_start``), still holding it. For
      ``bid_price`` the tick builds the demand samples its decisions queued
      (``BidPrice._add_samples``), the free capacity from the snapshots, and the price
      update (``PriceBook.update``: ``advance``, K steps in ``step_jax.run_steps``, the
      average, ``set_cumsums``). What of it holds the GIL (Python, most of NumPy, JAX's
      tracing at a first compile) makes the loop wait up to the switch interval at a
      time (``app.GIL_SWITCH_S``, 0.5 ms, set by ``run_server``; Python's default 5 ms
      elsewhere).
    - ``book_lock`` is taken by ``app._ticked`` (waiting, in the tick thread) and by the
      replicas' exchanges with ``price_books`` (``SharedState.try_books``, on the loop,
      never waiting: ``share_demand`` / ``drain_demand``, ``add_demand`` / ``adopt``,
      ``state``; a tick in progress puts them off to the next sync). The request path
      does not take it: what a tick hands to the loop goes by reference stores or an
      atomic container (``bid_price``: each update's new cumulative sums array, read by
      ``PriceBook.cumsums``; decisions queue their samples on a deque the tick pops,
      ``BidPrice._unsampled``), and the loop writes the arrival count for the tick
      (``PriceBook.observe_arrival``), unlocked. Where a hand-over is two stores a
      decision in between reads a mismatched pair: ``PriceBook.advance`` moves the
      prices' slot 0 (``origin_s``) before it rebuilds the cumulative sums (prices read
      ``shift`` slots off), and ``BidPrice.tick`` stores its free capacity before that
      capacity's time; ``advance`` also rolls ``p`` in place, which a ``price_view`` on
      the loop may copy half rolled.
    - The LP check runs in neither: every ``prices.certify_period_s`` a task on the loop
      packs the captured window (``certify_live.check_now``: ``capture.pack``) and a
      worker process solves it (``LiveCert.submit``); its result comes back to the loop
      (``call_soon_threadsafe``). The re-solves likewise, every
      ``prices.resolve_period_s``, in a worker process of their own
      (``resolving.resolve_now``: ``capture.pack_recent``). A reload (``admin.reload``)
      builds the new router in a worker thread (without start-up's warm-up tick,
      ``app._warm``) and swaps it in on the loop; a tick of the old router still running
      finishes on it.
    """

    name: str = ""
    needs_snapshots: bool = False
    joint_release: bool = False
    tick_s: float = 0.0
    takes_beta: bool = False

    @abstractmethod
    def decide(self, ctx: RoutingContext) -> Decision:
        """Choose an instance for ctx.request, or hold or shed it."""

    @abstractmethod
    def observe(self, outcome: Outcome) -> None:
        """Learn from a request that finished (or was shed)."""

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        """One slot's pass over the router's buffer of held requests: one decision per
        request, yielded in the order they are to be carried out; the caller carries out
        each before it asks for the next, so a context built after a dispatch sees it.
        The default decides them one by one in the order given, each on its own fresh
        context."""
        for request in requests:
            yield self.decide(context(request))

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:  # noqa: B027 (optional hook)
        """Learn off the request path, every ``tick_s`` seconds (when > 0)."""

    def forget(self, request_id: int) -> None:  # noqa: B027 (optional hook)
        """A decision that will not be carried out: drop what is kept for the request
        until its outcome. Nothing by default."""

    def rerouted(self, request_id: int, prefill: int, decode: int) -> None:  # noqa: B027 (optional hook)
        """The router moved a disaggregated dispatch to other instances (global indices;
        the first ones were unhealthy). Nothing by default."""

    def set_beta(self, g: int, beta: Sequence[float]) -> bool:
        """A recalibrated batch-time model (4 coefficients) for instance g; False when
        the policy has none to update (the default, and whenever ``takes_beta`` is
        False)."""
        return False

    def price_view(self) -> PriceView | None:
        """The current shadow prices per instance, or None for a policy without them."""
        return None

    def price_books(self) -> tuple[SharedPriceBook, ...]:
        """The price books the policy learns (none by default), in a fixed order, for
        router replicas that share demand and prices (``olproute.server.shared``): one
        leader learns, the others adopt its books' states."""
        return ()


class PolicyParams(BaseModel):
    """A policy's own parameters (``router.policy_params.<name>`` in the config), one
    model per policy, registered with its factory: unknown keys, wrong types and bounds
    are errors naming the key."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class NoParams(PolicyParams):
    """For a policy that takes no parameters."""


# a finite number >= 0; strict: a bool or a numeric string is refused, not converted
Weight = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]


@dataclass(frozen=True, slots=True)
class PolicyEnv:
    """What a policy is built from: the instances, its raw parameters (validated into its
    registered :class:`PolicyParams` model by ``PolicyRegistry.create``), its RNG, the
    slot length and horizon, the objective (reward, prices, admission sections of the
    config), and two lazily built sources a policy may need: per-instance batch-time
    calibration (``calibration()``, for TTFT estimators) and per-request expectations
    (``outlook(request)``: predicted tokens, quality, cost per instance). On
    disaggregated pools ``transfer_s(prompt_tokens)`` is the KV transfer time."""

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


class PolicyError(ValueError):
    """Unknown policy name, duplicate registration, or bad policy parameters."""


P = TypeVar("P", bound=PolicyParams)
PolicyFactory = Callable[[PolicyEnv, P], Policy]


@dataclass(frozen=True, slots=True)
class Registration(Generic[P]):
    """A registered policy: its factory, its parameter model, whether it routes
    disaggregated prefill/decode pools."""

    name: str
    factory: PolicyFactory[P]
    params: type[P]
    disaggregated: bool


class PolicyRegistry:
    """Policies by name; registering a name twice is an error, never a silent replace.

    ``load_with(load)`` defers registrations to the first lookup: ``olproute.policies``
    gives ``REGISTRY`` the import of its built-in policies (each registers itself), so
    that importing this module (the interface) imports no policy, nor what they price
    with."""

    def __init__(self) -> None:
        self._entries: dict[str, Registration[Any]] = {}
        self._load: Callable[[], None] | None = None

    def load_with(self, load: Callable[[], None]) -> None:
        """Run ``load`` (which registers policies) before the next lookup or
        registration, once."""
        self._load = load

    def _loaded(self) -> dict[str, Registration[Any]]:
        """The entries, after the deferred registrations (``load_with``)."""
        load, self._load = self._load, None
        if load is not None:
            load()
        return self._entries

    def register(self, name: str, params: type[P], disaggregated: bool = False
                 ) -> Callable[[PolicyFactory[P]], PolicyFactory[P]]:
        """Register a factory with the model of its parameters; ``disaggregated`` when
        the policy can route prefill/decode pools (its decisions then name a decode
        instance too)."""
        def wrap(factory: PolicyFactory[P]) -> PolicyFactory[P]:
            if name in self._loaded():
                raise PolicyError(f"policy {name!r} is already registered")
            self._entries[name] = Registration(name, factory, params, disaggregated)
            return factory
        return wrap

    def names(self) -> list[str]:
        return sorted(self._loaded())

    def pool_names(self) -> list[str]:
        """The policies that route disaggregated prefill/decode pools."""
        return sorted(n for n, e in self._loaded().items() if e.disaggregated)

    def entry(self, name: str) -> Registration[Any]:
        try:
            return self._loaded()[name]
        except KeyError:
            raise PolicyError(
                f"unknown policy {name!r} (known: {', '.join(self.names())})") from None

    def param_problems(self, name: str, params: Mapping[str, Any], quote: bool = True
                       ) -> list[tuple[str, str]]:
        """(key, message) per problem of ``params`` against the policy's model."""
        try:
            self.entry(name).params.model_validate(params)
        except ValidationError as exc:
            return problems_of(exc, quote)
        return []

    def create(self, name: str, env: PolicyEnv) -> Policy:
        """Build the named policy: ``env.params`` validated into its parameter model
        (a PolicyError naming each bad key), then its factory."""
        entry = self.entry(name)
        if not entry.disaggregated and any(s.role != "mixed" for s in env.specs):
            raise PolicyError(f"policy {name!r} cannot route disaggregated prefill/decode "
                              f"pools (those that can: {', '.join(self.pool_names())})")
        problems = self.param_problems(name, env.params)
        if problems:
            raise PolicyError(f"policy {name!r}: " + "; ".join(
                f"parameter {k}: {m}" if k else m for k, m in problems))
        return entry.factory(env, entry.params.model_validate(env.params))


REGISTRY = PolicyRegistry()


def dispatch(ctx: RoutingContext, index: int, reason: str,
             explanation: Mapping[str, tuple[float, ...]] | None = None,
             decode_index: int | None = None) -> Decision:
    return Decision(request_id=ctx.request.request_id, action="dispatch", instance=index,
                    reason=reason, explanation=dict(explanation or {}),
                    decode_instance=decode_index)
