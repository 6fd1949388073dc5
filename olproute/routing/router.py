"""The router: one policy object (the same the simulator runs, built by
``olproute.routing.assembly``) with what it needs around it — request ids, the objective,
predictions (the served predictor on each request's prompt text), calibration — and no
I/O.

The server builds the routing context from its tracker (loads, snapshots) and health
checks, calls ``decide``, and reports back with ``observe``; prices are learned in
``tick``, which the server runs off the event loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from olproute.config.loader import LoadedConfig
from olproute.policies import Policy
from olproute.pricing.reward import RESOURCES
from olproute.routing.assembly import CalibrationSource, build_policy
from olproute.routing.block_hash import PromptNamer
from olproute.routing.disagg import Pools
from olproute.routing.prefix_index import PrefixIndex, prompt_block_hashes
from olproute.types import (
    Decision,
    EngineSnapshot,
    InstanceLoad,
    InstanceSpec,
    Outcome,
    Request,
    RoutingContext,
)

if TYPE_CHECKING:
    from olproute.predict import PoolPredictor, Predictor

# where a request's predicted output length came from: the router's predictor on its
# prompt text, the caller's own figure (``/route``'s ``predicted_tokens``), or the
# request's ``max_tokens`` (no predictor, no text, or no model of the pool it knows)
PredictionSource = Literal["predictor", "request", "max_tokens"]
IntArray = npt.NDArray[np.int64]


class Router:
    """``calibration``: what estimating policies read; without one, the config's file
    (``calibration: auto`` needs a profiler: the server passes the simulator's,
    ``olproute.sim.scenario.CalibrationSource``). ``predictor``: the one that predicts
    each request's output length and quality from its prompt text
    (``olproute.routing.assembly.served_predictor``); None: every request is predicted its
    ``max_tokens``.

    ``prefixes``: where this router sent prompt prefixes (``olproute.routing.prefix_index``), over
    the backends, when one of them caches prefixes and all have one block size (else
    None: no request gets block hashes). A request with prompt text gets its text's block
    hashes (``new_request``), the context the index's match (``context``), and a dispatch
    carried out is recorded with ``routed``. Replicas sharing state on Redis
    (``olproute.server.shared``) each keep their own index, of their own dispatches."""

    def __init__(self, loaded: LoadedConfig, calibration: CalibrationSource | None = None,
                 seed: int | None = None, predictor: Predictor | None = None) -> None:
        self.loaded = loaded
        self.specs = loaded.specs
        # per instance, the most tokens a request (prompt + output) may hold there: its
        # model's context window (max_context_tokens), at most its KV cache
        models = loaded.profiles.models
        self.context_limits = tuple(
            min(s.kv_capacity_tokens, models[s.model].max_context_tokens)
            if s.model in models else s.kv_capacity_tokens for s in self.specs)
        self.policy_name = loaded.config.router.policy
        rng = np.random.default_rng(loaded.config.sim.seed if seed is None else seed)
        self.calibration = calibration or CalibrationSource(loaded)
        self.policy: Policy = build_policy(loaded, self.policy_name, rng, self.calibration)
        self.pools = Pools.of(self.specs)
        self.models = tuple(dict.fromkeys(s.model for s in self.specs))   # the pool's
        self.needs_snapshots = self.policy.needs_snapshots
        self.tick_s = self.policy.tick_s
        self._ids = itertools.count()
        self.prefixes = _prefix_index(self.specs)
        # per backend, how its engine names a prompt's blocks where its index is exact
        # (set_namers); None elsewhere
        self.namers: list[PromptNamer | None] = [None] * len(self.specs)
        self.predictor = predictor
        self.predictions: PoolPredictor | None = None
        if predictor is not None:
            from olproute.predict import PoolPredictor

            self.predictions = PoolPredictor(predictor, self.models)

    def new_request(self, now_s: float, prompt_tokens: int, max_tokens: int,
                    ttft_target_s: float, slo_class: str = "default",
                    text: str | None = None, predicted_tokens: int | None = None,
                    prompt_ids: Sequence[int] | None = None,
                    chat: Sequence[Mapping[str, Any]] | None = None) -> Request:
        """A Request for the policy, with its predictions. With a predictor and prompt
        text: the predictor's output length (capped at ``max_tokens``) and quality on each
        model of the pool it knows, the fields ``apply_predictor`` gives a simulated
        request (``PoolPredictor``), and ``max_tokens`` on any other model. Without:
        ``max_tokens`` (the most the backend will generate) on every model.
        ``predicted_tokens`` (the caller's own figure) is the length on every model; the
        predictor still gives the quality. With a prefix index and prompt text (or
        ``prompt_ids``, a prompt given as token ids), the request carries its block hashes
        (at most its full blocks of ``prompt_tokens``), and for each backend whose index
        is exact its engine's names of them (``set_namers``; of ``chat``, the messages of
        a chat request, where given)."""
        found = (None if self.predictions is None or text is None
                 else self.predictions.predict(text, max_tokens))
        decode = max_tokens if found is None else found.decode_tokens
        by_model = None if found is None else found.decode_by_model
        if predicted_tokens is not None:
            decode, by_model = predicted_tokens, None
        return Request(request_id=next(self._ids), arrival_s=now_s,
                       prompt_tokens=prompt_tokens, decode_tokens=max_tokens,
                       predicted_decode_tokens=decode, ttft_target_s=ttft_target_s,
                       slo_class=slo_class, text=text, predicted_decode_by_model=by_model,
                       predicted_quality_by_model=None if found is None
                       else found.quality_by_model,
                       block_hashes=self._block_hashes(text, prompt_ids, prompt_tokens),
                       engine_block_hashes=self._engine_hashes(text, prompt_ids, chat))

    def set_namers(self, namers: Sequence[PromptNamer | None]) -> None:
        """Backends whose engines publish their KV events: how each names a prompt's
        blocks (None: not exact). Their prefix index is put in exact mode, empty."""
        if len(namers) != len(self.specs):
            raise ValueError("set_namers needs one entry per backend")
        self.namers = list(namers)
        if self.prefixes is None:
            return
        for g, namer in enumerate(self.namers):
            if namer is not None:
                self.prefixes.set_exact(g, block_size=namer.block_size)

    def _engine_hashes(self, text: str | None, ids: Sequence[int] | None,
                       chat: Sequence[Mapping[str, Any]] | None
                       ) -> tuple[IntArray | None, ...] | None:
        """Per backend, the prompt's blocks as its engine names them; a namer shared by
        several backends hashes once. None when no backend's index is exact."""
        if self.prefixes is None or not any(self.namers):
            return None
        done: dict[int, IntArray | None] = {}
        out: list[IntArray | None] = []
        for g, namer in enumerate(self.namers):
            if namer is None or not self.prefixes.exact[g]:
                out.append(None)
                continue
            if id(namer) not in done:
                try:
                    done[id(namer)] = namer.keys(text, ids, chat)
                except ValueError:   # e.g. a chat for a tokenizer without a template
                    done[id(namer)] = None
            out.append(done[id(namer)])
        return tuple(out)

    def _block_hashes(self, text: str | None, ids: Sequence[int] | None,
                      prompt_tokens: int) -> IntArray | None:
        if self.prefixes is None:
            return None
        return prompt_block_hashes(text, ids, self.prefixes.block_size, prompt_tokens)

    def decide(self, request: Request, now_s: float, loads: tuple[InstanceLoad, ...],
               snapshots: tuple[EngineSnapshot, ...] | None,
               healthy: Sequence[bool],
               inbound: tuple[npt.NDArray[np.float64] | None, ...] | None = None) -> Decision:
        """The policy's decision; a dispatch to an unhealthy backend is moved to the best
        healthy one (by the policy's own scores when it gives them, else fewest
        outstanding), and a pool with no healthy backend sheds. On disaggregated pools
        ``inbound`` is the context's inbound rows; the decision names a prefill and a
        decode instance, each moved within its own pool when unhealthy."""
        refused = self._no_backend(request.request_id, healthy)
        if refused is not None:
            return refused
        d = self.policy.decide(self.context(request, now_s, loads, snapshots, inbound))
        return self._healthy(d, loads, healthy)

    def decide_held(self, requests: Sequence[Request], now_s: float,
                    loads: tuple[InstanceLoad, ...],
                    snapshots: tuple[EngineSnapshot, ...] | None,
                    healthy: Callable[[int], Sequence[bool]],
                    inbound: tuple[npt.NDArray[np.float64] | None, ...] | None = None
                    ) -> Iterator[Decision]:
        """One pass of the policy's ``decide_held`` over held requests, on one context
        (for a policy with ``joint_release``). A request no healthy backend can take
        (``healthy(request_id)``: per backend, for that request) is shed first, as
        ``decide`` sheds it, without asking the policy (which forgets it); each dispatch
        of the rest is moved off unhealthy backends as in ``decide``."""
        servable = []
        for r in requests:
            refused = self._no_backend(r.request_id, healthy(r.request_id))
            if refused is None:
                servable.append(r)
            else:
                self.policy.forget(r.request_id)
                yield refused
        for d in self.policy.decide_held(
                servable, lambda r: self.context(r, now_s, loads, snapshots, inbound)):
            yield self._healthy(d, loads, healthy(d.request_id))

    def context(self, request: Request, now_s: float, loads: tuple[InstanceLoad, ...],
                snapshots: tuple[EngineSnapshot, ...] | None,
                inbound: tuple[npt.NDArray[np.float64] | None, ...] | None) -> RoutingContext:
        """What the policy sees for ``request`` now; ``prefixes``, for a request with
        block hashes, is its prompt's prefix as this router's index finds it on each
        backend."""
        pools = self.pools.disaggregated
        hashes = request.block_hashes
        return RoutingContext(request=request, now_s=now_s, instances=loads,
                              specs=self.specs,
                              snapshots=snapshots if self.needs_snapshots else None,
                              inbound=inbound if pools else None,
                              prefixes=None if self.prefixes is None or (
                                  hashes is None and request.engine_block_hashes is None)
                              else self.prefixes.match(hashes, request.prompt_tokens,
                                                       request.engine_block_hashes))

    def routed(self, g: int, request: Request) -> int:
        """``request`` was sent to backend g (a dispatch carried out, where it went after
        any move off an unhealthy backend; on disaggregated pools, its prefill backend):
        its prompt's blocks become g's most recent in the prefix index. Returns its
        prompt tokens the index expected cached there (0 without an index or hashes)."""
        if self.prefixes is None:
            return 0
        hashes = request.block_hashes
        if self.prefixes.exact[g] and request.engine_block_hashes is not None:
            hashes = request.engine_block_hashes[g]
        return self.prefixes.sent(g, hashes, request.prompt_tokens)

    def too_long(self, prompt_tokens: int, max_tokens: int) -> frozenset[int]:
        """The instances whose context or KV cannot hold a request of ``prompt_tokens`` and
        ``max_tokens`` (``context_limits``): their engines would refuse it."""
        return frozenset(g for g, limit in enumerate(self.context_limits)
                         if prompt_tokens + max_tokens > limit)

    def cache_lost(self, g: int) -> None:
        """Backend g was marked down or restarted: whatever it cached is gone, or may be;
        the index forgets it (a short outage that kept the cache costs some misses of
        the router's own estimate, never a wrong hit)."""
        if self.prefixes is not None:
            self.prefixes.clear(g)

    def prefix_index_blocks(self) -> list[int] | None:
        """Blocks the prefix index holds per backend (None without an index)."""
        return None if self.prefixes is None else self.prefixes.sizes().tolist()

    def _no_backend(self, request_id: int, healthy: Sequence[bool]) -> Decision | None:
        """A shed when no healthy backend (in either pool) could take a request."""
        if not any(healthy):
            return Decision(request_id, "shed", None, "no healthy backend",
                            refusal="no_backend")
        if self.pools.disaggregated:
            for role, group in (("prefill", self.pools.prefill), ("decode", self.pools.decode)):
                if not any(healthy[g] for g in group.tolist()):
                    return Decision(request_id, "shed", None, f"no healthy {role} backend",
                                    refusal="no_backend")
        return None

    def _healthy(self, d: Decision, loads: tuple[InstanceLoad, ...],
                 healthy: Sequence[bool]) -> Decision:
        """The policy's dispatch moved off unhealthy backends (``decide``)."""
        if d.action != "dispatch" or d.instance is None:
            return d
        if not self.pools.disaggregated:
            g = self._healthy_choice(d, d.instance, range(len(self.specs)), loads, healthy)
            return d if g == d.instance else replace(
                d, instance=g, reason=f"{self.specs[d.instance].name} unhealthy; "
                f"moved to {self.specs[g].name} ({d.reason})")
        self._check_pair(d)
        assert d.decode_instance is not None
        p = self._healthy_choice(d, d.instance, self.pools.prefill.tolist(), loads, healthy)
        q = self._healthy_choice(d, d.decode_instance, self.pools.decode.tolist(), loads,
                                 healthy)
        moved = [f"{self.specs[a].name} unhealthy; moved to {self.specs[b].name}"
                 for a, b in ((d.instance, p), (d.decode_instance, q)) if a != b]
        if not moved:
            return d
        self.policy.rerouted(d.request_id, p, q)  # what it holds for it moves too
        return replace(d, instance=p, decode_instance=q,
                       reason=f"{'; '.join(moved)} ({d.reason})")

    def _healthy_choice(self, d: Decision, g: int, group: Iterable[int],
                        loads: tuple[InstanceLoad, ...], healthy: Sequence[bool]) -> int:
        """``g`` if healthy, else the healthy member of ``group`` the policy scores best
        (fewest outstanding without scores); the caller made sure there is one."""
        if healthy[g]:
            return g
        candidates = [i for i in group if healthy[i]]
        scores = d.explanation.get("score")
        if scores is not None and len(scores) == len(healthy):
            return max(candidates, key=lambda i: scores[i])
        return min(candidates, key=lambda i: loads[i].num_outstanding)

    def _check_pair(self, d: Decision) -> None:
        """On disaggregated pools a dispatch names a prefill and a decode instance."""
        roles = [s.role for s in self.specs]
        if d.instance is None or roles[d.instance] != "prefill":
            raise ValueError(f"policy {self.policy_name!r} sent a request to instance "
                             f"{d.instance} for its prefill, not one of the prefill pool "
                             f"{self.pools.prefill.tolist()}")
        q = d.decode_instance
        if q is None or not 0 <= q < len(roles) or roles[q] != "decode":
            raise ValueError(f"policy {self.policy_name!r} named decode instance {q!r}, not "
                             f"one of the decode pool {self.pools.decode.tolist()}")

    def continue_ids(self, previous: Router) -> None:
        """Take over the router this one replaces (a reload, a rebuild on what the engines
        say): its request-id sequence, so that ids of requests still in flight are never
        reused, and its prefix index with the backends' namers (the backends are the same,
        and so is what they cache; the index already models each engine's block size)."""
        self._ids = previous._ids
        self.prefixes, self.namers = previous.prefixes, previous.namers

    def observe(self, outcome: Outcome) -> None:
        self.policy.observe(outcome)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        """Learn off the request path (the server runs this in a worker thread)."""
        self.policy.tick(now_s, snapshots)

    def forget(self, request_id: int) -> None:
        """A decision that will not be carried out (``/route`` answers without
        dispatching): the policy drops what it keeps for that request until its outcome
        (a request on its way to a decode instance, its first-sight mark). The capacity
        it took at once comes back at the policy's next tick; the demand sample it added
        to the price books stays (a ``/route`` query counts as demand)."""
        self.policy.forget(request_id)

    def set_beta(self, g: int, beta: Sequence[float]) -> bool:
        """Give the policy a recalibrated batch-time model for instance g; False if it
        has none to update (``Policy.takes_beta``)."""
        return self.policy.set_beta(g, beta)

    def prices(self) -> dict[str, Any] | None:
        """Current shadow prices per instance and slot, one list per resource of
        ``RESOURCES`` (batch, KV and compute: prices per capacity fraction per slot), with
        each bottleneck and compute budget (prefill tokens per slot; None for an instance
        that never prefills, a decode engine of disaggregated pools); None for a policy
        without prices. On disaggregated pools a prefill instance is priced on its compute
        and KV rows, a decode instance on its batch and KV rows."""
        view = self.policy.price_view()
        if view is None:
            return None
        return {
            "policy": self.policy_name, "slot_s": view.slot_s,
            "horizon_slots": view.horizon_slots, "updates": view.num_updates,
            "arrivals_in_horizon": view.arrivals_in_horizon,
            "instances": [
                {"name": s.name, "role": s.role, "bottleneck": view.bottleneck[g],
                 **{res: [_finite(x) for x in view.prices[g, :, r].tolist()]
                    for r, res in enumerate(RESOURCES)},
                 "compute_budget_tokens_per_slot": _budget(float(view.compute_budget[g]))}
                for g, s in enumerate(self.specs)],
        }


def prediction_source(request: Request, given: bool) -> PredictionSource:
    """Where the predicted length of a request ``Router.new_request`` made came from:
    ``given`` it (``predicted_tokens``), per-model lengths (only its predictor gives
    them), else ``max_tokens``."""
    if given:
        return "request"
    return "max_tokens" if request.predicted_decode_by_model is None else "predictor"


def _prefix_index(specs: Sequence[InstanceSpec]) -> PrefixIndex | None:
    """An index over the backends, unless none caches prefixes or their block sizes
    differ (a block's hash names a block of one size)."""
    if not any(s.enable_prefix_caching for s in specs) \
            or len({s.block_size for s in specs}) != 1:
        return None
    return PrefixIndex(specs)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _budget(x: float) -> float | None:
    """A compute budget for JSON: an infinite one (no compute row) is None."""
    return x if math.isfinite(x) else None
