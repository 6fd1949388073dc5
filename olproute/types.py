"""Messages passed between the parts of olproute.

Every message is a frozen, slotted dataclass: the owners of mutable state (engines, the
tracker, the price book) hand these out as immutable views. Times are seconds on the
simulator's (or server's) clock unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Action = Literal["dispatch", "hold", "shed"]
ACTIONS: tuple[Action, ...] = ("dispatch", "hold", "shed")
# why a request is shed: no instance's engine has room to start it, or every one that has
# would queue it past another TTFT target (its patience run out), its patience run out
# where the policy knows no room (no snapshots, P/D pairs), the central buffer full, no
# healthy backend, the primal form's price above its reward
REFUSALS = ("no_room", "late", "patience", "buffer_full", "no_backend", "price")
# what an instance serves: both phases (mixed), or one side of disaggregated pools
Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")
# Columns of a batch-log row (one per batch an engine ran): what the simulator and the
# emulator write and what batch-time calibration reads
BATCH_LOG_COLUMNS = (
    "instance", "start_s", "duration_s", "num_seqs", "num_tokens", "num_decode_tokens",
    "sum_decode_context", "num_prefill_tokens", "sum_prefill_attention", "num_prefill_seqs",
    "sum_prefill_context",
)


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request, with what the router may read and what only the simulator
    may read.

    The router's side: arrival, prompt (tokens and text), targets, class, and the
    predictions: ``predicted_decode_tokens`` (for a model without an entry in
    ``predicted_decode_by_model``) and, per model name, ``predicted_decode_by_model`` and
    ``predicted_quality_by_model``. They are made when the workload is built (noisy
    truth with independent noise per model, or a trained predictor), so every policy
    compared on a workload sees the same ones. ``block_hashes`` names the prompt's full
    blocks of the engines' block size for their prefix caches (a hash chain: a block's
    hash stands for its whole prefix; int64 >= 0, read-only), when the workload has them
    (None: no block can be found cached); as an array it takes no part in equality.

    Ground truth, for the simulator and the metrics only (no policy reads it; the test
    ``tests/sim/test_no_ground_truth.py`` perturbs it and checks that no decision
    changes): ``decode_tokens`` (the true output length), ``decode_tokens_by_model`` and
    ``quality_by_model`` (per-model truth on a heterogeneous pool, overriding
    ``decode_tokens`` for the models they name), and ``task`` (the task family).
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    decode_tokens: int
    predicted_decode_tokens: int
    ttft_target_s: float
    tpot_target_s: float | None = None
    slo_class: str = "default"
    text: str | None = None
    task: str | None = None
    decode_tokens_by_model: Mapping[str, int] | None = None
    quality_by_model: Mapping[str, float] | None = None
    predicted_decode_by_model: Mapping[str, int] | None = None
    predicted_quality_by_model: Mapping[str, float] | None = None
    block_hashes: npt.NDArray[np.int64] | None = field(default=None, compare=False)
    # per instance, the prompt's blocks as that backend's engine names them (its
    # tokenizer and vLLM's block hash: olproute.routing.block_hash), for the instances
    # whose prefix index is exact (fed by the engine's KV events); None elsewhere, and
    # None altogether where no instance needs names of its own
    engine_block_hashes: tuple[npt.NDArray[np.int64] | None, ...] | None = field(
        default=None, compare=False)

    def true_decode_tokens(self, model: str) -> int:
        """Output length if served by ``model`` (simulator ground truth)."""
        if self.decode_tokens_by_model is not None and model in self.decode_tokens_by_model:
            return self.decode_tokens_by_model[model]
        return self.decode_tokens

    def predicted_decode_tokens_for(self, model: str) -> int:
        """The predicted output length on ``model`` (never the truth): its own entry in
        ``predicted_decode_by_model``, else ``predicted_decode_tokens``."""
        by_model = self.predicted_decode_by_model
        if by_model is not None and model in by_model:
            return max(int(by_model[model]), 1)
        return max(self.predicted_decode_tokens, 1)

    def predicted_quality_for(self, model: str) -> float | None:
        """The predicted response quality on ``model`` in [0, 1], or None when the
        request carries no prediction for it."""
        by_model = self.predicted_quality_by_model
        if by_model is None or model not in by_model:
            return None
        return float(by_model[model])


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predictions for one request, one entry per model named in ``models``: decode
    tokens (mean head, optionally a P90 head) and response quality in [0, 1]."""

    models: tuple[str, ...]
    decode_tokens: tuple[float, ...]
    quality: tuple[float, ...]
    decode_tokens_p90: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """Static description of one serving instance (what its engine is configured with)."""

    name: str
    model: str
    gpu: str
    tensor_parallel: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    role: Role = "mixed"
    enable_prefix_caching: bool = True

    @property
    def kv_capacity_tokens(self) -> int:
        """KV cache capacity in tokens (blocks x block size)."""
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """Cheap summary of one instance's state at decision time.

    ``num_outstanding`` counts requests dispatched to the instance that have not finished,
    including ones the router sent that the engine has not yet received.
    """

    index: int
    name: str
    num_running: int
    num_waiting: int
    num_outstanding: int
    num_kv_blocks_used: int
    num_kv_blocks: int
    max_num_seqs: int
    age_s: float = 0.0


# Columns of EngineSnapshot.table.
SNAP_PROMPT, SNAP_OUTPUT, SNAP_PREDICTED, SNAP_COMPUTED, SNAP_BLOCKS = range(5)


@dataclass(frozen=True, slots=True, eq=False)
class EngineSnapshot:
    """One instance's scheduler state at ``time_s``, as the BEA estimator replays it.

    ``table`` is int64 of shape (n, 5), one row per resident request: prompt tokens,
    output tokens so far, predicted total output tokens, tokens whose KV is computed,
    KV blocks held (columns SNAP_*). The first ``num_running`` rows are the running
    requests in scheduling order, the rest the waiting queue in order. ``inflight`` is
    int64 (m, 2): the batch being processed at ``time_s`` as (row, tokens), started at
    ``inflight_start_s``; empty when the engine was idle. ``request_ids`` names the rows.
    """

    time_s: float
    table: npt.NDArray[np.int64]
    num_running: int
    num_free_blocks: int
    inflight: npt.NDArray[np.int64]
    inflight_start_s: float
    request_ids: npt.NDArray[np.int64]

    @property
    def num_resident(self) -> int:
        return int(self.table.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class PrefixMatch:
    """The router's estimate, for one request, of its prompt's prefix cached on each
    instance (``PrefixIndex.match``).

    ``cached_tokens[g]``: prompt tokens instance g would find cached (whole blocks, at
    most the prompt's tokens less one, as vLLM computes a prompt's last token again);
    ``matched_blocks[g]``: the blocks behind them; ``request_blocks``: the request's
    full prompt blocks with a hash; ``index_blocks[g]``: the blocks the index holds for
    instance g (how much it believes g caches)."""

    cached_tokens: npt.NDArray[np.int64]
    matched_blocks: npt.NDArray[np.int64]
    request_blocks: int
    index_blocks: npt.NDArray[np.int64]

    def of(self, instances: npt.NDArray[np.int64]) -> PrefixMatch:
        """The match on ``instances`` alone, in their order (a pool's)."""
        return PrefixMatch(cached_tokens=self.cached_tokens[instances],
                           matched_blocks=self.matched_blocks[instances],
                           request_blocks=self.request_blocks,
                           index_blocks=self.index_blocks[instances])

    @property
    def hit_fraction(self) -> npt.NDArray[np.float64]:
        """Per instance, the fraction of the request's hashed blocks found (0 without)."""
        if self.request_blocks == 0:
            return np.zeros(len(self.matched_blocks))
        return self.matched_blocks / float(self.request_blocks)


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """What a policy sees when it decides for one request. ``snapshots`` is filled only
    for policies that declare ``needs_snapshots``."""

    request: Request
    now_s: float
    instances: tuple[InstanceLoad, ...]
    specs: tuple[InstanceSpec, ...]
    snapshots: tuple[EngineSnapshot, ...] | None = None
    # per instance: (prompt, predicted decode, dispatch time) rows, in dispatch order, of
    # requests the router dispatched there after its snapshot (None for fresh snapshots)
    pending: tuple[npt.NDArray[np.float64] | None, ...] | None = None
    # disaggregated pools, per instance: (prompt, predicted decode, dispatch time) rows of
    # requests bound for it as their decode instance whose decode has not started there
    # (in prefill or in transfer); None without pools or when empty
    inbound: tuple[npt.NDArray[np.float64] | None, ...] | None = None
    # the router's estimate of the request's prompt prefix cached on each instance
    # (``olproute.routing.prefix_index``), for a request with block hashes; None without
    prefixes: PrefixMatch | None = None


class Explanation(Mapping[str, tuple[float, ...]]):
    """A decision's explanation built as it is read: the policy hands over its keys and
    the function that builds one of them (``one(key)``), so a decision nobody audits (a
    proxied request without the explain header, a simulator run that records nothing)
    costs nothing for it, and a reader of a few keys (the live certificate's capture) pays
    for those alone. Each key is built once. ``every()``, when the policy gives one, builds
    all keys at once with the values ``one`` would give, for a reader of all of them
    (``items``: the ``/route`` answer, the explain header)."""

    __slots__ = ("_data", "_every", "_keys", "_one")

    def __init__(self, keys: tuple[str, ...],
                 one: Callable[[str], tuple[float, ...]],
                 every: Callable[[], dict[str, tuple[float, ...]]] | None = None) -> None:
        self._keys = keys
        self._one = one
        self._every = every
        self._data: dict[str, tuple[float, ...]] = {}

    @property
    def built(self) -> bool:
        """Has anything read a value yet?"""
        return bool(self._data)

    def __getitem__(self, key: str) -> tuple[float, ...]:
        value = self._data.get(key)
        if value is None:
            if key not in self._keys:
                raise KeyError(key)
            value = self._data[key] = self._one(key)
        return value

    def items(self) -> ItemsView[str, tuple[float, ...]]:
        """Every key and its figures, in key order, built at once when ``every`` is given
        (a key read before keeps the value it was built with)."""
        if self._every is not None and len(self._data) < len(self._keys):
            built = self._every()
            self._data = {k: self._data.get(k, built[k]) for k in self._keys}
            return self._data.items()
        return ItemsView(self)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"Explanation({dict(self)!r})"


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one request.

    ``instance`` is the index into the cluster's instance list when ``action`` is
    ``dispatch`` and None otherwise. With disaggregated pools ``instance`` is the prefill
    instance and ``decode_instance`` the decode instance the KV cache moves to; it is None
    for a mixed instance, which serves both phases. ``explanation`` carries the
    per-instance figures the policy used (scores, estimates), keyed by a short name, so a
    decision can be audited (an ``Explanation`` builds them when first read).
    """

    request_id: int
    action: Action
    instance: int | None
    reason: str
    explanation: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    decode_instance: int | None = None
    # a shed's kind (``REFUSALS``), for the 429's code and the per-reason counter
    refusal: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Decision.action must be one of {ACTIONS}, got {self.action!r}")
        if (self.action == "dispatch") != (self.instance is not None):
            raise ValueError("Decision.instance must be set exactly when action is 'dispatch'")
        if self.decode_instance is not None and self.action != "dispatch":
            raise ValueError("Decision.decode_instance is only set when action is 'dispatch'")
        if self.refusal is not None and (self.action != "shed" or self.refusal not in REFUSALS):
            raise ValueError(f"Decision.refusal is one of {REFUSALS}, set only on a shed")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request; fed back to the policy through ``observe``.

    ``first_token_s`` and ``finish_s`` are None for a request that was shed;
    ``finish_s`` is None (and ``first_token_s`` too unless the client got a token) for
    one that did not finish (its backend failed, or its client left).
    """

    request_id: int
    instance: int | None
    arrival_s: float
    dispatch_s: float | None
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    decode_tokens: int
    predicted_decode_tokens: int
    num_preemptions: int = 0
    decode_instance: int | None = None   # disaggregated pools: where it was decoded

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival at the router."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def eel_s(self) -> float | None:
        """End-to-end latency, from arrival at the router to the last token."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class PriceView:
    """Shadow prices as an operator reads them (``olproute.pricing.book.PriceBook.view``),
    one row per instance in instance order: prices ``p[g, k, r]`` and free capacity
    ``c[g, k, r]`` (copies; resources ``olproute.pricing.reward.RESOURCES``), each
    instance's bottleneck and compute budget (prefill tokens per slot), and the learning's
    state: slot length, horizon, updates so far, N_H and the time of price slot 0 (None
    before the first update). A policy with one book per pool reports the state of one of
    them."""

    slot_s: float
    horizon_slots: int
    num_updates: int
    arrivals_in_horizon: float
    origin_s: float | None
    prices: npt.NDArray[np.float64]
    free: npt.NDArray[np.float64]
    bottleneck: tuple[str, ...]
    compute_budget: npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand a price book gathered since it was last drained, for other replicas' books
    (``PriceBook.drain_demand``): its new samples' rows, each array of ``Samples.arrays``
    cut to those rows (K first), and its arrival times (seconds, the book's clock)."""

    rows: tuple[npt.NDArray[Any], ...]
    arrivals_s: npt.NDArray[np.float64]

    @property
    def num_samples(self) -> int:
        return int(self.rows[0].shape[0])


@dataclass(frozen=True, slots=True)
class PriceState:
    """What a book's learning leaves, for replicas that read prices rather than learn
    them (``PriceBook.state`` / ``adopt``): the handed-out prices, the steps' own prices
    and the step rule's accumulator (G, H, R), the time of price slot 0 (the book's clock;
    None before the first update), N_H, the updates and steps so far, the break-even
    price the step is scaled by."""

    p: npt.NDArray[np.float64]
    iterate: npt.NDArray[np.float64]
    acc: npt.NDArray[np.float64]
    origin_s: float | None
    arrivals_in_horizon: float
    num_updates: int
    num_steps: int
    price_scale: float
