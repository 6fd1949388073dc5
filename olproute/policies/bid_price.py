"""Bid-price routing (docs/design.md section 1): for each request and instance

    score_jg = r_jg - delta * TTFT_jg - a_jg . p_g

with r_jg the multi-objective reward, TTFT from the BEA replay and a_jg . p_g the shadow
price of the request's usage column. The request goes to the best-scoring instance with
a positive score that can start it now (a free batch slot, KV blocks for its prompt,
and no more than ``admission.max_waiting`` requests queued there), or in its place a
quiet replica of the same engine (no more than that many there without a token yet,
waiting or in prefill: ``olproute.policies.admission``); with none it is held in the
router's central buffer and re-scored every slot. When its patience runs
out (default: its TTFT target), ``admission: defer`` sends it to the best instance and
``admission: shed`` to the best instance whose engine has room for it (a batch slot and
KV blocks left after its queue) and would start it within another TTFT target, refusing
it only when there is none (``olproute.policies.admission``): the prices may hold a
request, never refuse what the engines can take.

Against herding on the momentarily cheapest instance: the TTFT term reads fresh
snapshots that already hold the router's own dispatches (stale ones get the router's
later dispatches added, ``ctx.pending``), and ``admission.candidates`` samples d of the
G instances per decision. Prices are learned off the request path in ``tick``.

Parameter ``form`` (BEAR's two forms, with the prices):

- ``lagrangian`` (default): the score above, TTFT a cost of delta per second;
- ``constrained``: TTFT a constraint, as BEAR's eq. 5: among the instances predicted
  on time (TTFT, counted from the arrival, within the request's target) the highest
  r_jg - a_jg . p_g, ties to the smaller TTFT; with none on time the request is held
  (a later slot may find one) until its patience, then deferred to the best Lagrangian
  score or, under shed, as above. On disaggregated pools the same over pairs (there a
  request out of patience is shed without the room check);
- ``primal``: the online LP's primal rule (Agrawal, Wang and Ye; Li and Ye), an
  ablation of the others: the request goes, at its first decision, to the instance
  with the highest r_jg - a_jg . p_g if that is positive and its usage column fits the
  instance's free capacity, whether or not the instance can start it now (its engine
  queues it); otherwise it is refused there and then (no TTFT term, no start-now check,
  no hold). Mixed instances only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field

from olproute.estimate.bea import BeaEstimator, decode_step_times_s
from olproute.estimate.decode_load import DecodeLoad, load_aware_tpot
from olproute.policies.admission import (
    Room,
    can_start_now,
    hold_shed_or_defer,
    quiet,
    room_to_start,
    still_patient,
    unstarted,
    with_room,
)
from olproute.policies.base import REGISTRY, Policy, PolicyEnv, PolicyError, PolicyParams
from olproute.policies.bid_price_pools import PoolBidPrice
from olproute.policies.release import Chosen, ReleaseName, ReleaseRule, release_rule
from olproute.pricing._score import (
    Scorer,
    fits_column,
    subtract_column,
)
from olproute.pricing.book import PriceBook
from olproute.pricing.reward import (
    HARD,
    TERMS,
    Columns,
    capacities,
    column_at,
    column_mass,
    compute_budget,
    free_capacity,
    reward_terms,
    reward_weights,
    sample_extent,
    shifted_usage,
    slots_since,
)
from olproute.pricing.score_fields import (
    F_COMPUTE_A,
    F_EEL_SAVED,
    F_EEL_SLO,
    F_FINITE_TTFT,
    F_KV_A,
    F_KV_B,
    F_LAGRANGIAN,
    F_PRICE,
    F_QPS,
    F_REWARD,
    F_THROUGHPUT,
    F_TPOT,
    F_TTFT,
    F_TTFT_SAVED,
    F_TTFT_SLO,
    F_UTILITY,
    I_END,
    I_PRE_END,
    I_PRE_START,
    I_START,
)
from olproute.routing.disagg import Pools
from olproute.routing.outlook import Outlook
from olproute.types import (
    Decision,
    EngineSnapshot,
    Explanation,
    InstanceSpec,
    Outcome,
    PrefixMatch,
    PriceView,
    Request,
    RoutingContext,
)

FloatArray = npt.NDArray[np.float64]


class BidPriceParams(PolicyParams):
    """``router.policy_params.bid_price``."""

    backend: Literal["jax", "numpy"] = Field(
        default="jax", description="the dual step's implementation (numpy: the reference)")
    decode_slack: float = Field(
        default=0.25, ge=0, strict=True, allow_inf_nan=False,
        description="disaggregated pools only: the decode admission check plans for the "
        "output running this fraction over its prediction")
    kv_headroom: float = Field(
        default=0.03, ge=0, strict=True, allow_inf_nan=False,
        description="disaggregated pools only: fraction of each decode engine's KV kept "
        "free by admission (as vLLM keeps a watermark of free blocks)")
    form: Literal["lagrangian", "constrained", "primal"] = Field(
        default="lagrangian", description="lagrangian: the highest reward - "
        "reward.delta x predicted TTFT - price; constrained (BEAR eq. 5): the highest "
        "reward - price among the instances predicted to meet the TTFT target, else hold "
        "until patience; primal (an ablation, mixed instances only): the online LP's "
        "rule, the highest reward - price if positive and the usage fits, else refused "
        "at once (no TTFT term, start-now check or hold)")
    release: ReleaseName = Field(
        default="in_order", description="how each slot's pass decides the held requests: "
        "one by one in arrival order (in_order); or together, greedily by score per use "
        "of the instance (density) or by score, or as the exact assignment with the "
        "largest sum of scores that fits (assignment)")


@dataclass(frozen=True, slots=True)
class _Row:
    """One request's figures on every instance (arrays of length G)."""

    ttft: FloatArray
    tpot: FloatArray
    cols: Columns
    decode: FloatArray     # predicted output tokens
    reward: FloatArray
    lagrangian: FloatArray
    net: FloatArray
    on_time: npt.NDArray[np.bool_]
    finite_ttft: FloatArray


@dataclass(frozen=True, slots=True)
class _Scores:
    """What a decision reads for N requests on G instances: (N, G) arrays (``waited``
    (N,): seconds each has been held; the columns' per-instance fields stay (G,)), from
    one context."""

    outlooks: list[Outlook]
    ttft: FloatArray
    tpot: FloatArray
    cols: Columns
    figures: FloatArray               # the kernel's (F, N, G) floats, by score_fields.F_*
    reward: FloatArray
    price: FloatArray
    lagrangian: FloatArray
    on_time: npt.NDArray[np.bool_]
    finite_ttft: FloatArray
    waited: FloatArray
    mass: FloatArray | None           # reward.column_mass of each column (density only)
    complete: bool                    # every instance scored (else a sample of them)
    rows: list[_Row | None] = field(default_factory=list)   # row(j), built once

    def row(self, j: int) -> _Row:
        if not self.rows:
            self.rows.extend([None] * len(self.ttft))
        row = self.rows[j]
        if row is None:
            c = self.cols   # batch_a is per instance only: the same each row
            row = self.rows[j] = _Row(
                self.ttft[j], self.tpot[j],
                Columns(c.start[j], c.end[j], c.batch_a, c.kv_a[j], c.kv_b[j],
                        c.pre_start[j], c.pre_end[j], c.compute_a[j]),
                self.outlooks[j].decode_tokens, self.reward[j], self.lagrangian[j],
                self.reward[j] - self.price[j], self.on_time[j], self.finite_ttft[j])
        return row


@dataclass(slots=True)
class _Figures:
    """What a decision's explanation is built from: request j of the decision's scores,
    its context, and (built when a figure of an instance the decision did not sample is
    first read) the request scored on every instance."""

    sc: _Scores
    j: int
    ctx: RoutingContext
    full: _Scores | None = None


@dataclass(frozen=True, slots=True)
class _Pass:
    """One slot's joint pass over the held requests (``release.JointPass``): the policy's
    two forms of it, bound to the pass's requests and context."""

    policy: BidPrice
    ctx: RoutingContext
    requests: Sequence[Request]
    src: list[tuple[_Scores, int]]
    cands: list[npt.NDArray[np.int64]]
    prefixes: Sequence[PrefixMatch | None]

    def greedy(self, rule: ReleaseRule) -> Chosen:
        return self.policy._assign(self.ctx, self.requests, self.src, self.cands,
                                   self.prefixes, rule)

    def exact(self) -> Chosen:
        return self.policy._assign_exact(self.ctx, self.requests, self.src, self.cands)


POOL_ONLY = ("decode_slack", "kv_headroom")
# a decision's explanation: its keys, and the kernel's row of each that is one
_TERM_ROWS = {"ttft_s": F_TTFT, "tpot_s": F_TPOT, "reward": F_REWARD, "price_cost": F_PRICE,
              "qps": F_QPS, "throughput": F_THROUGHPUT, "eel_saved": F_EEL_SAVED,
              "ttft_saved": F_TTFT_SAVED, "eel_slo": F_EEL_SLO, "ttft_slo": F_TTFT_SLO,
              "utility_term": F_UTILITY}
# (utility: quality - lambda x cost, unweighted, as the LP checks read it; the reward's
# weighted term is utility_term)
_TERM_INDEX = list(_TERM_ROWS.values())
EXPLAINED = ("ttft_s", "tpot_s", "reward", "price_cost", "score", "on_time",
             "decode_tokens", "utility", "exec_ttft_s", "candidates",
             *(t if t != "utility" else "utility_term" for t in TERMS))
LOST_PLACE = ("an instance could take it, but this slot's place there went to held "
              "requests ranked higher")


class BidPrice(Policy):
    name = "bid_price"
    needs_snapshots = True
    takes_beta = True

    def __init__(self, env: PolicyEnv, params: BidPriceParams) -> None:
        self._specs = env.specs
        # each instance's kind: replicas of one engine (model, GPU, tensor parallel) share it
        kinds = [(x.model, x.gpu, x.tensor_parallel) for x in env.specs]
        self._kind = np.array([kinds.index(k) for k in kinds], dtype=np.int64)
        self._cal = env.calibration()
        self._bea = BeaEstimator(env.specs, self._cal)
        self._outlook = env.outlook()
        self._w = env.reward
        self._adm = env.admission
        self._slot_s = env.slot_s
        self._horizon = env.horizon_slots
        self._batch_cap, self._kv_cap = capacities(env.specs)
        self._batch_a = 1.0 / self._batch_cap
        self._all = np.arange(len(env.specs), dtype=np.int64)
        self._budget = compute_budget(self._cal, env.slot_s)
        # each instance's steady decode step under its load (decode_load), which the
        # kernel reads where it lies: the tick writes it in place
        halflife = env.prices.decode_load_halflife_s
        self._load = None if halflife is None else DecodeLoad(len(env.specs), halflife)
        self._steady = np.zeros(len(env.specs))
        self._token_budget = np.array([s.max_num_batched_tokens for s in env.specs],
                                      dtype=np.float64)
        self._scorer = Scorer(self._bea.beta_view, self._batch_cap, self._kv_cap,
                              self._budget, reward_weights(env.reward), self._slot_s,
                              self._horizon, self._steady)
        self._theta = np.array([c.prefill_tokens_per_s for c in self._cal])
        self._rng = env.rng
        self.book = PriceBook(env.specs, env.slot_s, env.horizon_slots, env.prices, env.rng,
                              backend=params.backend, compute_budget=self._budget)
        # the tick refreshes the free capacity the admission checks read even when the
        # prices are not learned (prices.enabled: false keeps them at zero)
        self.tick_s = env.prices.period_slots * env.slot_s
        self._learn = env.prices.enabled
        self._form = params.form
        self._release = release_rule(params.release)
        self.joint_release = self._release.joint
        self._seen: set[int] = set()
        # first sights whose demand samples the next tick adds (appended on the request
        # path, taken in the server's tick thread: a deque's append and popleft are atomic),
        # the newest prices.window of them
        self._unsampled: deque[tuple[Request, _Scores, int, RoutingContext]] = deque(
            maxlen=env.prices.window)
        # free capacity (G, H, 2) as of the last tick, less the dispatches since
        self._free: FloatArray | None = None
        self._free_time_s = 0.0

    def _score(self, ctx: RoutingContext, requests: Sequence[Request],
               instances: npt.NDArray[np.int64] | None = None,
               prefixes: Sequence[PrefixMatch | None] | None = None) -> _Scores:
        """Every figure a decision reads, for N requests deciding on the same context,
        each as if it alone joined now: (N, G) arrays, from one BEA call and one call of
        the compiled kernel (``_score.Scorer``, with this policy's constants bound; its
        twin is ``reward.score_reference``). With ``instances``,
        only those are estimated and scored; the others read as never started there
        (``complete`` is then False). ``prefixes``: each request's prefix as the router
        finds it cached (default: the context's, for its own request alone); the replay
        prefills only the rest, and the compute and KV columns leave it out."""
        snaps = ctx.snapshots
        if snaps is None:
            raise ValueError("bid_price needs instance snapshots in the context")
        outs = [self._outlook(r) for r in requests]
        complete = instances is None
        idx = self._all if instances is None else instances
        decode = _rows_of([o.decode_tokens for o in outs])
        utility = _rows_of([o.utility(self._w.cost_lambda) for o in outs])
        if not complete:
            decode, utility = decode[:, idx], utility[:, idx]
        prompt = np.array([r.prompt_tokens for r in requests], dtype=np.int64)
        cached = _cached(ctx, requests, prefixes, idx)
        loads = np.empty((idx.shape[0], 2))
        ttft = self._bea.ttft_many(ctx, prompt, np.rint(decode).astype(np.int64),
                                   None if complete else idx, loads, cached)
        waited = np.array([ctx.now_s - r.arrival_s for r in requests])
        target = np.array([r.ttft_target_s for r in requests])
        f, i, on_time = self._scorer.score(loads, idx, prompt.astype(np.float64),
                                           decode, utility, ttft, waited, target,
                                           *self.book.cumsums(ctx.now_s),
                                           None if cached is None
                                           else cached.astype(np.float64))
        cols = Columns(start=i[I_START], end=i[I_END], batch_a=self._batch_a,
                       kv_a=f[F_KV_A], kv_b=f[F_KV_B], pre_start=i[I_PRE_START],
                       pre_end=i[I_PRE_END], compute_a=f[F_COMPUTE_A])
        return _Scores(outs, f[F_TTFT], f[F_TPOT], cols, f, f[F_REWARD], f[F_PRICE],
                       f[F_LAGRANGIAN], on_time, f[F_FINITE_TTFT], waited,
                       column_mass(cols) if self._release.uses_mass else None,
                       complete)

    def decide(self, ctx: RoutingContext) -> Decision:
        req = ctx.request
        candidates = self._candidates()
        sc = self._score(ctx, (req,), None if candidates is self._all else candidates)
        row = sc.row(0)
        if req.request_id not in self._seen:  # first sight: a sample of demand
            self._sample(req, sc, 0, ctx)
        score, order = self._ranking(candidates, row.lagrangian, row.net, row.on_time,
                                     row.finite_ttft)
        g = int(order[0])
        explanation = self._explanation(req, sc, 0, score, candidates, ctx)
        snaps = ctx.snapshots
        assert snaps is not None
        mw = self._adm.max_waiting

        def can(c: int) -> bool:
            return self._form == "primal" or can_start_now(
                snaps[c], req.prompt_tokens, self._specs[c].block_size,
                self._specs[c].max_num_seqs, mw)

        eligible = self._eligible(order, row)
        c = next(self._startable_in(eligible, score, can, row.cols, ctx.now_s), None)
        if c is not None and self._form != "primal" and not quiet(snaps[c], mw):
            c = self._quiet_peer(c, eligible, score, row.cols, ctx.now_s,
                                 lambda k: quiet(snaps[k], mw) and can(k))
        if c is not None:
            self._account(c, row, ctx.now_s)
            return self._dispatch(req, c, g, score, row.on_time, candidates, explanation)
        return self._not_now(ctx, row, g, score, candidates, explanation)

    def decide_held(self, requests: Sequence[Request],
                    context: Callable[[Request], RoutingContext]) -> Iterator[Decision]:
        """One slot's pass over the held requests. ``release: in_order``: one by one in
        the order given (the base's). Otherwise together, from one context
        (``_assign``); the dispatches are yielded first, in the order they were chosen,
        then the others, held, shed or deferred as ``decide`` would."""
        if not self._release.joint or not requests:
            yield from super().decide_held(requests, context)
            return
        ctx = context(requests[0])
        # each request's own prefix (the context's is the first one's; none without hashes)
        prefixes = [None if r.block_hashes is None else ctx.prefixes if j == 0
                    else context(r).prefixes for j, r in enumerate(requests)]
        sc = self._score(ctx, requests, prefixes=prefixes)
        for j, req in enumerate(requests):
            if req.request_id not in self._seen:
                self._sample(req, sc, j, replace(ctx, request=req, prefixes=prefixes[j]))
        cands = [self._candidates() for _ in requests]
        src: list[tuple[_Scores, int]] = [(sc, j) for j in range(len(requests))]
        chosen, had = self._release.release(_Pass(self, ctx, requests, src, cands, prefixes))
        done = {j for j, _ in chosen}
        for rank, (j, c) in enumerate(chosen, 1):
            req = requests[j]
            row, score, order = self._ranked(src[j], cands[j])
            yield self._dispatch(req, c, int(order[0]), score, row.on_time, cands[j],
                                 self._explanation(req, *src[j], score, cands[j], ctx),
                                 f" (released {rank} of {len(requests)} held, by "
                                 f"{self._release.name})")
        for j, req in enumerate(requests):
            if j in done:
                continue
            row, score, order = self._ranked(src[j], cands[j])
            yield self._not_now(replace(ctx, request=req), row, int(order[0]), score,
                                cands[j], self._explanation(req, *src[j], score, cands[j],
                                                            ctx),
                                LOST_PLACE if j in had else None)

    def _assign(self, ctx: RoutingContext, requests: Sequence[Request],
                src: list[tuple[_Scores, int]], cands: list[npt.NDArray[np.int64]],
                prefixes: Sequence[PrefixMatch | None], rule: ReleaseRule) -> Chosen:
        """The joint pass, greedy (``release.Density``, ``release.ScoreOrder``):
        (request index, instance) dispatches in the order chosen, and the requests that had
        an instance to go to in some round. In rounds: each request's choice is its own
        first startable instance (as ``decide`` picks it, with this pass's dispatches
        accounted) among those with prefill budget left this slot (``_slot_budget``); each
        instance takes the requests that chose it in order of ``rule.key`` — score per use
        (``density``: ``reward.column_mass``) or score (``score``) — while its budget lasts
        and each still fits; then the requests left are scored again at once behind the
        round's dispatches (their ``src`` entries replaced), until a round takes none. A
        request whose patience has run out goes before the others of its round."""
        snaps = ctx.snapshots
        assert snaps is not None
        budget, take = self._slot_budget(requests)
        starts = _Starts(snaps, self._specs, requests, self._adm.max_waiting)
        expired = [not still_patient(self._adm, r, ctx.now_s - r.arrival_s) for r in requests]
        # per instance: this pass's dispatches (prompt, decode, time, cached prompt tokens)
        pending: list[list[tuple[float, float, float, float]]] = [[] for _ in snaps]
        chosen: list[tuple[float, int, int]] = []
        had: set[int] = set()
        left = list(range(len(requests)))
        while left:
            wants: list[tuple[float, int, int]] = []
            for j in left:
                ch = self._choice(ctx, src[j], cands[j], starts.row(j), starts.quiet(),
                                  budget >= take[j] - 1e-9, rule)
                if ch is not None:
                    wants.append((ch[0], j, ch[1]))
                    had.add(j)
            taken = []
            # a request whose patience has run out first: it is shed or deferred otherwise
            for key, j, c in sorted(wants, key=lambda w: (not expired[w[1]], -w[0])):
                sc, i = src[j]
                cols = sc.row(i).cols
                if (budget[c] < take[j, c] - 1e-9 or not starts.ok(j, c)
                        or not self._fits(c, cols, ctx.now_s)):
                    continue   # an earlier take this round filled it: choose again
                self._account(c, sc.row(i), ctx.now_s)
                starts.take(j, c)
                budget[c] -= take[j, c]
                taken.append((key, j, c))
                hit = prefixes[j]
                pending[c].append((float(requests[j].prompt_tokens),
                                   float(np.rint(sc.outlooks[i].decode_tokens[c])),
                                   ctx.now_s,
                                   0.0 if hit is None else float(hit.cached_tokens[c])))
            if not taken:
                break
            chosen += taken
            done = {j for _, j, _ in taken}
            left = [j for j in left if j not in done]
            if not left or not (budget > 1e-9).any():
                break
            extra = tuple(self._pending_with(ctx, g, pending[g]) for g in range(len(snaps)))
            again = self._score(replace(ctx, pending=extra), [requests[j] for j in left],
                                prefixes=[prefixes[j] for j in left])
            for i, j in enumerate(left):
                src[j] = (again, i)
        return [(j, c) for _, j, c in chosen], had

    def _slot_budget(self, requests: Sequence[Request]) -> tuple[FloatArray, FloatArray]:
        """(b_g per instance, what each request takes of it (N, G)): the prefill tokens
        an instance can start in one slot, ``reward.compute_budget``; a request takes its
        prompt, at most the whole budget (a prompt longer than b_g still starts alone)."""
        prompts = np.array([r.prompt_tokens for r in requests], dtype=np.float64)
        return self._budget.copy(), np.minimum(prompts[:, None], self._budget[None, :])

    def _choice(self, ctx: RoutingContext, src: tuple[_Scores, int],
                cands: npt.NDArray[np.int64], startable: npt.NDArray[np.bool_],
                quiet_: npt.NDArray[np.bool_], open_: npt.NDArray[np.bool_],
                rule: ReleaseRule) -> tuple[float, int] | None:
        """(key, instance): the request's first instance in its own ranking with a
        positive score (on time under ``constrained``) that can start it, has budget
        left (``open_``) and holds its predicted usage, a quiet one (``quiet_``) first;
        None when there is none."""
        sc, i = src
        row, score, order = self._ranked(src, cands)
        eligible = self._eligible(order, row)
        c = next(self._startable_in(eligible, score,
                                    lambda c: bool(startable[c] and open_[c]), row.cols,
                                    ctx.now_s), None)
        if c is not None and not quiet_[c]:
            c = self._quiet_peer(c, eligible, score, row.cols, ctx.now_s,
                                 lambda k: bool(quiet_[k] and startable[k] and open_[k]))
        if c is None:
            return None
        return rule.key(float(score[c]), None if sc.mass is None
                        else float(sc.mass[i, c])), c

    def _assign_exact(self, ctx: RoutingContext, requests: Sequence[Request],
                      src: list[tuple[_Scores, int]], cands: list[npt.NDArray[np.int64]]
                      ) -> Chosen:
        """The joint pass as an exact assignment (``release: assignment``): the set of
        (request, instance) dispatches with the largest sum of scores such that each
        request goes at most once, only where ``decide`` could send it alone (a positive
        score, on time under ``constrained``, an instance that can start it and whose
        free batch slots and KV hold it), and together they fit each instance's prefill
        budget this slot (``_slot_budget``), its queue and free KV blocks (``_Starts``)
        and its free batch slots and KV in every slot (``reward.HARD``): a 0/1 program
        (``_best_subset``). Scores are the slot's (no
        one is scored again behind the pass's dispatches). Dispatched in order of
        score."""
        snaps = ctx.snapshots
        assert snaps is not None
        budget, take = self._slot_budget(requests)
        starts = _Starts(snaps, self._specs, requests, self._adm.max_waiting)
        pairs: list[tuple[int, int, float]] = []
        windows: list[tuple[slice, FloatArray] | None] = []
        for j in range(len(requests)):
            row, score, order = self._ranked(src[j], cands[j])
            for g in self._startable_in(self._eligible(order, row), score,
                                        partial(starts.ok, j), row.cols, ctx.now_s):
                pairs.append((j, g, float(score[g])))
                windows.append(self._window(g, row.cols, ctx.now_s))
        if not pairs:
            return [], set()
        x = _best_subset(pairs, windows, len(requests), self._free, (
            ([float(take[j, g]) for j, g, _ in pairs], budget),
            ([1.0] * len(pairs), starts.queue_room()),
            ([float(starts.need[j, g]) for j, g, _ in pairs], starts.free.astype(float))))
        chosen = sorted((p for p, on in zip(pairs, x, strict=True) if on), key=lambda p: -p[2])
        for j, g, _ in chosen:
            self._account(g, src[j][0].row(src[j][1]), ctx.now_s)
        return [(j, g) for j, g, _ in chosen], {j for j, _, _ in pairs}

    @staticmethod
    def _pending_with(ctx: RoutingContext, g: int,
                      rows: list[tuple[float, float, float, float]]) -> FloatArray | None:
        """Instance g's rows of dispatches since its snapshot, with this pass's after (four
        columns: the cached prompt tokens last, 0 for rows that came without)."""
        before = None if ctx.pending is None else ctx.pending[g]
        if not rows:
            return before
        new = np.array(rows, dtype=np.float64)
        if before is None:
            return new
        if before.shape[1] == 3:
            before = np.column_stack([before, np.zeros(len(before))])
        return np.concatenate([before, new])

    def _dispatch(self, req: Request, c: int, best: int, score: FloatArray,
                  on_time: npt.NDArray[np.bool_], candidates: npt.NDArray[np.int64],
                  explanation: Explanation, joint: str = "") -> Decision:
        among = (f" of the {int(on_time[candidates].sum())} on time"
                 if self._form == "constrained" else "")
        rank = ("best score" if c == best else
                f"best startable score (best: {score[best]:.3f})")
        return Decision(req.request_id, "dispatch", c, f"{rank}{among} {score[c]:.3f} on "
                        f"{self._specs[c].name}, which can start it now{joint}", explanation)

    def _not_now(self, ctx: RoutingContext, row: _Row, g: int, score: FloatArray,
                 candidates: npt.NDArray[np.int64],
                 explanation: Explanation, why: str | None = None
                 ) -> Decision:
        """No instance takes the request now: hold, shed or defer it (``admission``)."""
        req = ctx.request
        snaps = ctx.snapshots
        assert snaps is not None
        g, held_why = self._why_held(ctx, snaps, g, score, bool(row.on_time[candidates].any()),
                                     int(candidates[np.argmax(row.lagrangian[candidates])]))
        why = held_why if why is None else why
        spec = self._specs[g]
        if self._form == "primal":   # decided once, at arrival: refused now
            self._seen.discard(req.request_id)
            return Decision(req.request_id, "shed", None, f"refused: {why}", explanation,
                            refusal="price")

        def defer(waited_s: float, to: int | None) -> Decision:
            if to is None:
                self._account(g, row, ctx.now_s)
                return Decision(req.request_id, "dispatch", g, f"deferred to {spec.name} "
                                f"after {waited_s * 1e3:.0f} ms: {why}", explanation)
            self._account(to, row, ctx.now_s)
            return Decision(req.request_id, "dispatch", to, f"not refused after "
                            f"{waited_s * 1e3:.0f} ms: {self._specs[to].name}'s engine has "
                            f"room for it (held: {why})", explanation)

        def room() -> Room:
            # the candidates whose engines have room, best first, that would start it
            # within another TTFT target (its predicted wait for its prefill to begin)
            ranked = candidates[np.argsort(-score[candidates], kind="stable")]
            open_ = with_room(ctx, ranked.tolist())
            if not open_:
                return Room([])
            queue = row.ttft - req.prompt_tokens / self._theta
            soon = [c for c in open_ if queue[c] <= req.ttft_target_s]
            if soon:
                return Room(soon)
            c = min(open_, key=lambda c: float(queue[c]))
            return Room([], "late", f"every engine with room would queue it past another "
                        f"{req.ttft_target_s * 1e3:.0f} ms TTFT target (the least: "
                        f"{self._specs[c].name}, {float(queue[c]):.2f} s)")

        return hold_shed_or_defer(ctx, self._adm, why, explanation, self._seen.discard, defer,
                                  room)

    def _sample(self, req: Request, sc: _Scores, j: int, ctx: RoutingContext) -> None:
        """A request's first sight: an arrival for the rate estimate, and a sample of
        demand for the price step, kept as the decision's figures and built into the price
        book off the request path, at the next tick before its update (nothing reads the
        samples in between: the decisions read the prices, which only the update changes).
        At most ``prices.window`` wait: the book keeps no more, so an older one waiting
        would only be overwritten."""
        self._seen.add(req.request_id)
        self.book.observe_arrival(ctx.now_s)
        self._unsampled.append((req, sc, j, ctx))

    def _add_samples(self) -> None:
        """The demand samples of the requests first seen since the last call, in order,
        built together (``reward_terms`` is elementwise: the numbers one by one would
        give). A sample prices every instance: a decision that scored a sample of them
        (``admission.candidates``) is scored again here on all of them. (The rows are
        joined with ``np.array``, which gives ``np.stack``'s array from a list of equal
        rows in a third of its time: a tick's window holds thousands.)"""
        batch: list[tuple[Request, _Row, Outlook, float]] = []
        hits: list[npt.NDArray[Any]] = []   # each one's cached prompt tokens per instance
        none = np.zeros(len(self._specs))
        while self._unsampled:
            req, sc, j, ctx = self._unsampled.popleft()
            hits.append(none if ctx.prefixes is None else ctx.prefixes.cached_tokens)
            if not sc.complete:
                sc, j = self._score(ctx, (req,)), 0
            batch.append((req, sc.row(j), sc.outlooks[j], float(sc.waited[j])))
        if not batch:
            return
        rows = [b[1] for b in batch]
        out = Outlook(*(np.array([getattr(b[2], f) for b in batch])
                        for f in ("decode_tokens", "quality", "cost_musd")))
        prompt = np.array([b[0].prompt_tokens for b in batch], dtype=np.float64)
        # the prompt tokens each computes on each instance (its cached prefix left out)
        fresh = prompt[:, None] - np.array(hits)
        tpot = np.array([r.tpot for r in rows])
        def stacked(f: str) -> npt.NDArray[Any]:
            return np.array([getattr(r.cols, f) for r in rows])

        cols = Columns(stacked("start"), stacked("end"), rows[0].cols.batch_a,
                       stacked("kv_a"), stacked("kv_b"), stacked("pre_start"),
                       stacked("pre_end"), stacked("compute_a"))
        self.book.add_samples(
            self._delayed_rewards(prompt, np.array([b[0].ttft_target_s for b in batch]), out,
                                  np.array([r.ttft for r in rows]), tpot,
                                  np.array([b[3] for b in batch]),
                                  np.array([r.reward for r in rows])),
            cols, sample_extent(cols, fresh, out.decode_tokens, tpot,
                                self._budget, self._slot_s))

    def _explanation(self, req: Request, sc: _Scores, j: int, score: FloatArray,
                     candidates: npt.NDArray[np.int64], ctx: RoutingContext) -> Explanation:
        """Request j's explanation, each key built when read (``_explain``), or all at
        once (``_explain_all``)."""
        fig = _Figures(sc, j, ctx)
        return Explanation(EXPLAINED, partial(self._explain, req, fig, score, candidates),
                           partial(self._explain_all, req, fig, score, candidates))

    def _explain_all(self, req: Request, fig: _Figures, score: FloatArray,
                     candidates: npt.NDArray[np.int64]) -> dict[str, tuple[float, ...]]:
        """Every key of ``EXPLAINED``, as ``_explain`` builds each: the kernel's rows in
        one read where every instance was scored, else key by key."""
        if not fig.sc.complete:
            return {k: self._explain(req, fig, score, candidates, k) for k in EXPLAINED}
        sc, j = fig.sc, fig.j
        terms = dict(zip(_TERM_ROWS, sc.figures[_TERM_INDEX, j].tolist(), strict=True))
        out = sc.outlooks[j]
        rest = {"score": score.tolist(), "on_time": sc.on_time[j].astype(np.float64).tolist(),
                "decode_tokens": out.decode_tokens.tolist(),
                "utility": out.utility(self._w.cost_lambda).tolist(),
                "exec_ttft_s": (req.prompt_tokens / self._theta).tolist(),
                "candidates": [float(c) for c in candidates.tolist()]}
        return {k: tuple(terms[k] if k in terms else rest[k]) for k in EXPLAINED}

    def _explain(self, req: Request, fig: _Figures, score: FloatArray,
                 candidates: npt.NDArray[np.int64], key: str) -> tuple[float, ...]:
        """One key of ``EXPLAINED``: per instance, that figure of the request. ``score``
        and ``candidates`` are the decision's (an instance it did not sample scores
        -inf); every other figure covers all instances, those the decision did not score
        scored when first read, from the decision's context (the LP checks read them)."""
        if key == "score":
            return tuple(score.tolist())
        if key == "candidates":
            return tuple(float(c) for c in candidates.tolist())
        row = self._figure(req, fig.sc, fig.j, key)
        if not fig.sc.complete:
            if fig.full is None:
                fig.full = self._score(fig.ctx, (req,))
            row = self._figure(req, fig.full, 0, key).copy()
            row[candidates] = self._figure(req, fig.sc, fig.j, key)[candidates]
        return tuple(row.tolist())

    def _figure(self, req: Request, sc: _Scores, j: int, key: str) -> npt.NDArray[Any]:
        row: npt.NDArray[Any]
        if key in _TERM_ROWS:
            row = sc.figures[_TERM_ROWS[key], j]
            return row
        if key == "on_time":
            row = sc.on_time[j].astype(np.float64)
            return row
        if key == "decode_tokens":
            return sc.outlooks[j].decode_tokens
        if key == "utility":
            return sc.outlooks[j].utility(self._w.cost_lambda)
        result: npt.NDArray[Any] = req.prompt_tokens / self._theta   # exec_ttft_s
        return result

    def _delayed_rewards(self, prompt: FloatArray, target: FloatArray,
                         out: Outlook, ttft: FloatArray, tpot: FloatArray,
                         waited_s: FloatArray, now: FloatArray) -> FloatArray:
        """(K, G, L) K requests' rewards on each instance if each started each of the
        book's delays later (the first delay is 0: ``now``, the decision's own reward):
        the demand sample prices every start the LP could choose. Per request (K,):
        ``prompt``, ``target``, ``waited_s``; per request and instance (K, G): the rest."""
        later = self.book.delays[1:]
        if later.size == 0:
            return now[:, :, None]
        ttft_later = ttft[:, None, :] + (later * self._slot_s)[None, :, None]
        terms = reward_terms(prompt[:, None, None], target[:, None, None],
                             Outlook(out.decode_tokens[:, None, :], out.quality[:, None, :],
                                     out.cost_musd[:, None, :]), ttft_later,
                             tpot[:, None, :], self._w, self._slot_s, self._horizon,
                             waited_s=waited_s[:, None, None])
        result: FloatArray = np.concatenate([now[:, :, None],
                                             terms.total.transpose(0, 2, 1)], axis=2)
        return result

    def _why_held(self, ctx: RoutingContext, snaps: tuple[EngineSnapshot, ...], g: int,
                  score: FloatArray, any_on_time: bool, best_late: int) -> tuple[int, str]:
        """(the instance a deferral would take, why nothing takes the request now): the
        best-ranked instance ``g``; under the constrained form with none on time, the best
        Lagrangian score ``best_late``."""
        req = ctx.request
        if self._form == "constrained" and not any_on_time:
            return best_late, (f"no instance is predicted to meet its "
                               f"{req.ttft_target_s * 1e3:.0f} ms TTFT target")
        spec = self._specs[g]
        startable = can_start_now(snaps[g], req.prompt_tokens, spec.block_size,
                                  spec.max_num_seqs, self._adm.max_waiting)
        return g, (f"best score {score[g]:.3f} <= 0" if score[g] <= 0
                   else "no instance with a positive score can start it now" if not startable
                   else "its predicted usage fits no instance with a positive score")

    def _ranking(self, candidates: npt.NDArray[np.int64], lagrangian: FloatArray,
                 net: FloatArray, on_time: npt.NDArray[np.bool_], ttft: FloatArray
                 ) -> tuple[FloatArray, npt.NDArray[np.int64]]:
        """(score per instance, candidates best first) of the policy's form: the
        Lagrangian score; for ``constrained`` the reward net of the price, the
        instances on time first, ties to the smaller TTFT; for ``primal`` the reward net
        of the price."""
        if self._form == "primal":
            return net, candidates[np.argsort(-net[candidates], kind="stable")]
        if self._form == "constrained":
            order = np.lexsort((ttft[candidates], -net[candidates], ~on_time[candidates]))
            return net, candidates[order]
        if candidates is self._all:
            return lagrangian, np.argsort(-lagrangian, kind="stable")
        return lagrangian, candidates[np.argsort(-lagrangian[candidates], kind="stable")]

    def _startable_in(self, order: npt.NDArray[np.int64], score: FloatArray,
                      can_start: Callable[[int], bool], cols: Columns,
                      now_s: float) -> Iterator[int]:
        """The instances of ``order`` (best first), up to the first score <= 0, that can
        start the request now and hold it as predicted: a lower-scoring free instance
        beats waiting for a busy better one (``decide`` takes the first of them). The
        curve's shift since the last tick is taken once, at the first instance."""
        free = self._free
        k = 0 if free is None else slots_since(now_s, self._free_time_s, self._slot_s)
        scores = score.tolist()
        for c in order.tolist():
            if scores[c] <= 0:
                return
            if can_start(c) and (free is None or self._fits_at(free, c, cols, k)):
                yield c

    def _quiet_peer(self, c: int, order: npt.NDArray[np.int64], score: FloatArray,
                    cols: Columns, now_s: float, ok: Callable[[int], bool]) -> int:
        """``c``, the best instance that can start the request, or in its place the
        best-scoring quiet one of its kind (``ok``: quiet, and it can start it): between
        replicas of one engine a prefill started where none runs has the step's token
        budget alone (``olproute.policies.admission``); between kinds the score also
        says what each serves, and decides."""
        same = order[self._kind[order] == self._kind[c]]
        return next(self._startable_in(same, score, ok, cols, now_s), c)

    def _eligible(self, order: npt.NDArray[np.int64], row: _Row) -> npt.NDArray[np.int64]:
        """The ranking's instances a request may go to: under ``constrained``, only
        those predicted on time."""
        return order[row.on_time[order]] if self._form == "constrained" else order

    def _ranked(self, src: tuple[_Scores, int], cands: npt.NDArray[np.int64]
                ) -> tuple[_Row, FloatArray, npt.NDArray[np.int64]]:
        """A request's row of scores, and its score and ranking by the policy's form."""
        row = src[0].row(src[1])
        score, order = self._ranking(cands, row.lagrangian, row.net, row.on_time,
                                     row.finite_ttft)
        return row, score, order

    def _window(self, g: int, cols: Columns, now_s: float) -> tuple[slice, FloatArray] | None:
        """The slots of g's free-capacity curve the request's column covers (the curve is
        as of the last tick, so the column moves by the slots elapsed since), and its usage
        there; None before the first tick or when the column misses the curve."""
        if self._free is None:
            return None
        return shifted_usage(column_at(cols, g),
                             slots_since(now_s, self._free_time_s, self._slot_s),
                             self._horizon)

    def _fits(self, g: int, cols: Columns, now_s: float) -> bool:
        """Does the request's predicted usage on g fit under g's free batch slots and KV
        (as of the last tick, less the router's own dispatches since; ``reward.HARD``)?
        (``reward.fits_under``, compiled.)"""
        if self._free is None:
            return True
        return self._fits_at(self._free, g, cols,
                             slots_since(now_s, self._free_time_s, self._slot_s))

    def _fits_at(self, free: FloatArray, g: int, cols: Columns, k: int) -> bool:
        """``_fits`` on the curve ``free`` computed k slots ago."""
        st, e, ba, ka, kb, ps, pe, _ = column_at(cols, g)
        return fits_column(free[g], st, e, ba, ka, kb, ps, pe, k, self._horizon)

    def _account(self, g: int, row: _Row, now_s: float) -> None:
        """Immediate accounting: the dispatch holds capacity before the next snapshot
        (``reward.take_column``, compiled), and counts in g's load (the prompt tokens it
        computes are its KV column's, ``kv_a`` = (fresh + 1) / M)."""
        cols = row.cols
        if self._load is not None:
            fresh = float(cols.kv_a[g]) * float(self._kv_cap[g]) - 1.0
            self._load.add(g, now_s, fresh, float(row.decode[g]))
        if self._free is not None:
            subtract_column(self._free[g], *column_at(cols, g),
                        slots_since(now_s, self._free_time_s, self._slot_s), self._horizon)

    def _candidates(self) -> npt.NDArray[np.int64]:
        g = len(self._specs)
        d = self._adm.candidates
        if d is None or d >= g:
            return self._all
        return np.sort(self._rng.choice(g, size=d, replace=False)).astype(np.int64)

    def observe(self, outcome: Outcome) -> None:
        self.forget(outcome.request_id)

    def forget(self, request_id: int) -> None:
        """Drop what is kept for a request until its outcome (its first sight)."""
        self._seen.discard(request_id)

    def tick(self, now_s: float, snapshots: tuple[EngineSnapshot, ...]) -> None:
        """Off the request path: each instance's steady decode step from its load, free
        capacity from the snapshots (residents at the load-aware decode speed), then K
        dual steps (when prices are learned)."""
        self._add_samples()
        if self._load is not None:
            self._steady[:] = self._load.steady_step_time(
                now_s, self._bea.beta, self._batch_cap, self._token_budget)[0]
        tpot = load_aware_tpot(decode_step_times_s(snapshots, self._specs, self._bea.beta, 0),
                               self._steady)
        free = free_capacity(snapshots, self._specs, tpot, self._budget, self._slot_s,
                             self._horizon)
        self.book.set_free_capacity(free)
        self._free = free.copy()
        self._free_time_s = now_s
        if self._learn:
            self.book.update(now_s)


    def set_beta(self, g: int, beta: Sequence[float]) -> bool:
        """A recalibrated batch-time model for instance g: the BEA replay reads it."""
        self._bea.set_beta(g, beta)
        return True

    def price_view(self) -> PriceView:
        return self.book.view()

    def price_books(self) -> tuple[PriceBook, ...]:
        return (self.book,)


class _Starts:
    """``can_start_now`` through a joint pass: each instance's snapshot with this pass's
    dispatches counted as it goes (each joins the queue and takes its prompt's KV
    blocks), as ``decide`` one by one would see them in the next request's snapshot."""

    def __init__(self, snaps: Sequence[EngineSnapshot], specs: Sequence[InstanceSpec],
                 requests: Sequence[Request], max_waiting: int) -> None:
        self.running = np.array([s.num_running for s in snaps])
        self.max_num_seqs = np.array([spec.max_num_seqs for spec in specs])
        self.waiting = np.array([s.num_resident - s.num_running for s in snaps])
        self.unstarted = np.array([unstarted(s) for s in snaps])
        self.free = np.array([s.num_free_blocks for s in snaps])
        block = np.array([spec.block_size for spec in specs])
        prompts = np.array([r.prompt_tokens for r in requests])
        self.need = -(-prompts[:, None] // block)
        self.max_waiting = max_waiting

    def row(self, j: int) -> npt.NDArray[np.bool_]:
        result: npt.NDArray[np.bool_] = room_to_start(
            self.running, self.waiting, self.free, self.need[j], self.max_num_seqs,
            self.max_waiting)
        return result

    def ok(self, j: int, g: int) -> bool:
        return bool(self.row(j)[g])

    def queue_room(self) -> FloatArray:
        """Per instance, how many more requests may join its queue (0 without a free
        batch slot)."""
        result: FloatArray = np.where(
            self.running < self.max_num_seqs,
            np.maximum(self.max_waiting - self.waiting + 1, 0), 0).astype(float)
        return result

    def quiet(self) -> npt.NDArray[np.bool_]:
        """Per instance, is it quiet (``admission.quiet``) with this pass's dispatches."""
        result: npt.NDArray[np.bool_] = self.unstarted <= self.max_waiting
        return result

    def take(self, j: int, g: int) -> None:
        self.waiting[g] += 1
        self.unstarted[g] += 1
        self.free[g] -= self.need[j, g]


def _cached(ctx: RoutingContext, requests: Sequence[Request],
            prefixes: Sequence[PrefixMatch | None] | None,
            idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
    """Each request's prompt tokens cached on each instance of ``idx`` (N, d), as the
    router's prefix index finds them; None when none has any."""
    if prefixes is None:
        if len(requests) != 1 or requests[0] is not ctx.request:
            return None
        prefixes = (ctx.prefixes,)
    if all(p is None for p in prefixes):
        return None
    d = idx.shape[0]
    return np.stack([np.zeros(d, dtype=np.int64) if p is None else p.cached_tokens[idx]
                     for p in prefixes])


def _rows_of(arrays: list[FloatArray]) -> FloatArray:
    """(N, G) from N arrays of (G,) (a view for one)."""
    return arrays[0][None, :] if len(arrays) == 1 else np.stack(arrays)


def _best_subset(pairs: Sequence[tuple[int, int, float]],
                 windows: Sequence[tuple[slice, FloatArray] | None], num_requests: int,
                 free: FloatArray | None,
                 limits: Sequence[tuple[Sequence[float], FloatArray]] = (),
                 time_limit_s: float = 0.05) -> list[bool]:
    """Which of the (request, instance, score) pairs to take: max the sum of scores, each
    request at most once, the taken pairs' usage (``windows``: the slots each covers on
    its instance's free-capacity curve and its use there) within ``free`` (G, H, 3) in
    the batch and KV rows (no curve before the first tick), and for each of ``limits``
    (what each pair takes, what each instance has) the taken pairs' sum within each
    instance's. HiGHS (scipy's ``milp``) stops at
    ``time_limit_s`` with the best set it has (none found: nothing taken)."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = len(pairs)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    for p, (j, _, _) in enumerate(pairs):
        rows.append(j)
        cols.append(p)
        vals.append(1.0)
    lower += [0.0] * num_requests
    upper += [1.0] * num_requests
    if free is not None:
        total = np.zeros((*free.shape[:2], 2))
        for (_, g, _), win in zip(pairs, windows, strict=True):
            if win is not None:
                total[g, win[0]] += win[1][:, HARD]
        binding = total > free[:, :, HARD] + 1e-12
        index = np.full(binding.shape, -1, dtype=np.int64)
        index[binding] = num_requests + np.arange(int(binding.sum()))
        for p, ((_, g, _), win) in enumerate(zip(pairs, windows, strict=True)):
            if win is None:
                continue
            at = index[g, win[0]]
            k, r = np.nonzero(at >= 0)
            rows += at[k, r].tolist()
            cols += [p] * len(k)
            vals += win[1][:, HARD][k, r].tolist()
        lower += [-np.inf] * int(binding.sum())
        upper += free[:, :, HARD][binding].tolist()
    for takes, have in limits:
        for g in range(len(have)):
            on = [p for p, (_, h, _) in enumerate(pairs) if h == g]
            if sum(takes[p] for p in on) > have[g] + 1e-9:
                rows += [len(lower)] * len(on)
                cols += on
                vals += [takes[p] for p in on]
                lower.append(-np.inf)
                upper.append(float(have[g]))
    a = coo_matrix((vals, (rows, cols)), shape=(len(lower), n)).tocsr()
    res = milp(c=-np.array([p[2] for p in pairs]), integrality=np.ones(n),
               bounds=(0, 1), constraints=LinearConstraint(a, lower, upper),
               options={"time_limit": time_limit_s})
    if res.x is None:   # no solution within the time limit: take nothing this slot
        return [False] * n
    return [bool(v > 0.5) for v in res.x]


@REGISTRY.register("bid_price", BidPriceParams, disaggregated=True)
def bid_price(env: PolicyEnv, params: BidPriceParams) -> Policy:
    """The one ``bid_price`` of the registry, for both kinds of pool: on mixed instances
    :class:`BidPrice` (this module), on disaggregated prefill/decode pools
    :class:`~olproute.policies.bid_price_pools.PoolBidPrice`, which prices pairs of a
    prefill and a decode instance and takes the two pool-only parameters."""
    if Pools.of(env.specs).disaggregated:
        if "release" in params.model_fields_set and params.release != "in_order":
            raise PolicyError("policy 'bid_price' takes release on mixed instances only: on "
                              "disaggregated prefill/decode pools it decides held requests "
                              "one by one (release: in_order)")
        if params.form == "primal":
            raise PolicyError("policy 'bid_price' takes form: primal on mixed instances "
                              "only (on prefill/decode pools: lagrangian or constrained)")
        return PoolBidPrice(env, backend=params.backend, decode_slack=params.decode_slack,
                            kv_headroom=params.kv_headroom, form=params.form)
    given = sorted(set(params.model_fields_set) & set(POOL_ONLY))
    if given:
        raise PolicyError(f"policy 'bid_price' takes {', '.join(given)} on disaggregated "
                          "prefill/decode pools only")
    return BidPrice(env, params)
