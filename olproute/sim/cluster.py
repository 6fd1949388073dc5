"""Discrete-event simulation of a cluster of engines behind one routing policy.

Events live on a heap of (time, priority, seq, kind, arg); ``seq`` is a counter owned by
the simulation, so ties break deterministically. At equal times a finishing batch is
handled before an arrival (it frees slots and blocks the arrival may use), an arrival
before a held request's retry, and that before a policy's periodic tick (price
updates, off the request path).

Requests reach an engine the instant they are dispatched; an idle engine starts a batch
at once, a busy one takes the request into its next batch. A held request is decided
again every slot (``slot_s``); a shed one is recorded and never served. At most
``max_held`` requests are held at once, as in the server: a request the policy would hold
past that is shed.

With disaggregated pools (``olproute.disagg``) a dispatch names a prefill and a decode
instance. The prefill engine runs the prompt and one token (not the client's); the KV
cache then moves for ``transfer(prompt tokens)`` seconds (a transfer event, handled with
the batch completions) and the decode engine admits the request with all but the last
prompt token computed; its first output token is the request's first token (TTFT).
Until its KV arrives the request counts as outstanding on the decode instance and shows
in the context's ``inbound`` rows there.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.disagg import Pools, decode_admission
from olproute.policies.base import Policy
from olproute.sim.engine import BATCH_LOG_COLUMNS, FINISHED, FIRST_TOKEN, BatchTimer, SimEngine
from olproute.sim.snapshots import SnapshotFeed
from olproute.types import Decision, InstanceSpec, Outcome, Request, RoutingContext

_BATCH_DONE, _ARRIVAL, _RETRY, _TICK, _TRANSFER = 0, 1, 2, 3, 4
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ProgressFn = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class SimResult:
    """Everything one run produced. Per-request arrays are indexed by request_id; NaN
    marks a time that never happened (shed requests), -1 an instance never chosen."""

    specs: tuple[InstanceSpec, ...]
    requests: tuple[Request, ...]
    instance: IntArray
    dispatch_s: FloatArray
    first_token_s: FloatArray
    finish_s: FloatArray
    num_preemptions: IntArray
    decode_tokens: IntArray          # output tokens actually generated (0 if shed)
    decode_instance: IntArray        # disaggregated pools: the decode instance (else -1)
    prefill_end_s: FloatArray        # when its prefill instance finished the prompt
    kv_arrival_s: FloatArray         # when its KV cache reached the decode instance
    shed: npt.NDArray[np.bool_]
    batch_log: FloatArray            # shape (num_batches, len(BATCH_LOG_COLUMNS))
    in_system_t: FloatArray          # times at which the number of requests in system changed
    in_system_n: IntArray            # the number from that time on
    end_s: float
    num_events: int


class Cluster:
    """Runs one policy over a list of requests on engines built from specs."""

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        timers: Sequence[BatchTimer],
        policy: Policy,
        slot_s: float,
        record_batches: bool = True,
        reference_core: bool = False,
        snapshot_age_s: float = 0.0,
        transfer: Callable[[int], float] | None = None,
        max_held: int | None = None,
    ) -> None:
        if len(specs) != len(timers):
            raise ValueError("one timer per instance")
        self.specs = tuple(specs)
        self.pools = Pools.of(specs)
        if self.pools.disaggregated and transfer is None:
            raise ValueError("disaggregated pools need a KV transfer time")
        self._transfer = transfer
        self.max_held = max_held
        self._role = [s.role for s in specs]
        self._log: array[float] | None = array("d") if record_batches else None
        self.engines = [SimEngine(i, s, t, self._log, reference_core)
                        for i, (s, t) in enumerate(zip(specs, timers, strict=True))]
        self.policy = policy
        self.slot_s = slot_s
        self.outstanding = [0] * len(specs)
        self.feed = SnapshotFeed(self.engines, snapshot_age_s)
        self._needs_snapshots = policy.needs_snapshots
        # a policy with tick_s > 0 learns off the request path every tick_s seconds
        self._tick_s = policy.tick_s

    def run(self, requests: Sequence[Request], progress: ProgressFn | None = None) -> SimResult:
        n = len(requests)
        if any(r.request_id != i for i, r in enumerate(requests)):
            raise ValueError("request_id must equal the request's position in the list")
        instance = np.full(n, -1, dtype=np.int64)
        decode_instance = np.full(n, -1, dtype=np.int64)
        dispatch_s = np.full(n, np.nan)
        first_s = np.full(n, np.nan)
        prefill_end_s = np.full(n, np.nan)
        kv_arrival_s = np.full(n, np.nan)
        finish_s = np.full(n, np.nan)
        preempt = np.zeros(n, dtype=np.int64)
        decode = np.zeros(n, dtype=np.int64)
        shed = np.zeros(n, dtype=bool)
        in_t: array[float] = array("d", [0.0])
        in_n: array[int] = array("q", [0])

        heap: list[tuple[float, int, int, int, int]] = []
        seq = 0
        for r in requests:
            heap.append((r.arrival_s, _ARRIVAL, seq, _ARRIVAL, r.request_id))
            seq += 1
        if self._tick_s > 0 and requests:
            heap.append((requests[0].arrival_s, _TICK, seq, _TICK, 0))
            seq += 1
        heapq.heapify(heap)
        arrived = 0
        engines, outstanding, policy, feed = self.engines, self.outstanding, self.policy, self.feed
        disagg, role, transfer = self.pools.disaggregated, self._role, self._transfer
        # per instance: request_id -> (dispatch time, prompt, predicted decode) of requests
        # bound for it as their decode instance whose KV has not arrived yet
        inbound: list[dict[int, tuple[float, int, int]]] = [{} for _ in engines]
        held: set[int] = set()
        in_system = 0
        done = 0
        num_events = 0
        now = 0.0

        def start(g: int, t: float) -> None:
            nonlocal seq
            duration = engines[g].start_batch(t)
            feed.publish(g, t)
            if duration is not None:
                heapq.heappush(heap, (t + duration, _BATCH_DONE, seq, _BATCH_DONE, g))
                seq += 1

        def complete(rid: int, g: int, t: float) -> None:
            nonlocal in_system, done
            finish_s[rid] = t
            outstanding[g] -= 1
            in_system -= 1
            in_t.append(t)
            in_n.append(in_system)
            done += 1
            d = int(decode_instance[rid])
            policy.observe(self._outcome(requests[rid], int(instance[rid]), dispatch_s[rid],
                                         first_s[rid], t, int(preempt[rid]), int(decode[rid]),
                                         None if d < 0 else d))
            if progress is not None:
                progress(done)

        while heap:
            now, _prio, _seq, kind, arg = heapq.heappop(heap)
            num_events += 1
            if kind == _BATCH_DONE:
                eng = engines[arg]
                prefill_role = role[arg] == "prefill"
                for rid, flags, npre in eng.finish_batch():
                    if prefill_role:
                        # its prompt is done (the one token is not the client's): the KV
                        # cache moves on
                        prefill_end_s[rid] = now
                        preempt[rid] += npre
                        feed.finished(arg, rid)
                        outstanding[arg] -= 1
                        assert transfer is not None
                        heapq.heappush(heap, (now + transfer(requests[rid].prompt_tokens),
                                              _BATCH_DONE, seq, _TRANSFER, rid))
                        seq += 1
                        continue
                    if flags & FIRST_TOKEN:
                        first_s[rid] = now
                    if flags & FINISHED:
                        preempt[rid] += npre
                        feed.finished(arg, rid)
                        complete(rid, arg, now)
                start(arg, now)
                continue
            if kind == _TRANSFER:
                d = int(decode_instance[arg])
                req = requests[arg]
                kv_arrival_s[arg] = now
                _, _, predicted = inbound[d].pop(arg)
                prompt, out, computed = decode_admission(req.prompt_tokens, int(decode[arg]))
                feed.dispatched(d, now, arg, prompt, predicted)
                engines[d].admit(arg, prompt, out, predicted, computed)
                if not engines[d].busy:
                    start(d, now)
                continue
            if kind == _TICK:
                policy.tick(now, feed.view(now)[0])
                if arrived < n or in_system > 0:
                    heapq.heappush(heap, (now + self._tick_s, _TICK, seq, _TICK, 0))
                    seq += 1
                continue
            req = requests[arg]
            if kind == _ARRIVAL:
                arrived += 1
                in_system += 1
                in_t.append(now)
                in_n.append(in_system)
            snaps, pending = feed.view(now) if self._needs_snapshots else (None, None)
            ctx = RoutingContext(
                request=req, now_s=now, specs=self.specs,
                instances=tuple(e.load(outstanding[e.index]) for e in engines),
                snapshots=snaps, pending=pending,
                inbound=_rows(inbound) if disagg else None)
            decision = policy.decide(ctx)
            if decision.action == "hold" and arg not in held:
                if self.max_held is not None and len(held) >= self.max_held:
                    decision = Decision(arg, "shed", None, f"buffer full ({self.max_held} "
                                        "requests held)")
                else:
                    held.add(arg)
            if decision.action != "hold":
                held.discard(arg)
            if decision.action == "dispatch":
                g = decision.instance
                assert g is not None
                if not 0 <= g < len(engines):
                    raise ValueError(f"policy chose instance {g}, out of range")
                instance[arg] = g
                dispatch_s[arg] = now
                outstanding[g] += 1
                model = self.specs[g].model
                predicted = req.predicted_decode_tokens_for(model)
                decode[arg] = req.true_decode_tokens(model)
                if disagg:
                    d = self._check_pair(g, decision.decode_instance)
                    decode_instance[arg] = d
                    outstanding[d] += 1
                    inbound[d][arg] = (now, req.prompt_tokens, predicted)
                    feed.dispatched(g, now, arg, req.prompt_tokens, 1)
                    engines[g].admit(arg, req.prompt_tokens, 1, 1)
                else:
                    feed.dispatched(g, now, arg, req.prompt_tokens, predicted)
                    engines[g].admit(arg, req.prompt_tokens, int(decode[arg]), predicted)
                if not engines[g].busy:
                    start(g, now)
            elif decision.action == "hold":
                heapq.heappush(heap, (now + self.slot_s, _RETRY, seq, _RETRY, arg))
                seq += 1
            else:
                shed[arg] = True
                in_system -= 1
                in_t.append(now)
                in_n.append(in_system)
                done += 1
                policy.observe(self._outcome(req, None, float("nan"), float("nan"),
                                             float("nan"), 0, 0))
                if progress is not None:
                    progress(done)

        width = len(BATCH_LOG_COLUMNS)
        log = (np.frombuffer(self._log, dtype=np.float64).reshape(-1, width).copy()
               if self._log is not None else np.zeros((0, width)))
        return SimResult(
            specs=self.specs, requests=tuple(requests), instance=instance,
            dispatch_s=dispatch_s, first_token_s=first_s, finish_s=finish_s,
            num_preemptions=preempt, decode_tokens=decode, decode_instance=decode_instance,
            prefill_end_s=prefill_end_s, kv_arrival_s=kv_arrival_s, shed=shed, batch_log=log,
            in_system_t=np.frombuffer(in_t, dtype=np.float64).copy(),
            in_system_n=np.frombuffer(in_n, dtype=np.int64).copy(),
            end_s=now, num_events=num_events)

    def _check_pair(self, g: int, d: int | None) -> int:
        """A disaggregated dispatch names a prefill and a decode instance."""
        if self._role[g] != "prefill":
            raise ValueError(f"policy sent a request to {self.specs[g].name!r} "
                             f"(role {self._role[g]}) for its prefill")
        if d is None or not 0 <= d < len(self.specs) or self._role[d] != "decode":
            raise ValueError(f"policy named decode instance {d!r}, not one of the decode "
                             f"pool {self.pools.decode.tolist()}")
        return d

    @staticmethod
    def _outcome(req: Request, g: int | None, dispatch: float, first: float, finish: float,
                 preemptions: int, decode_tokens: int,
                 decode_instance: int | None = None) -> Outcome:
        def opt(x: float) -> float | None:
            return None if x != x else float(x)  # NaN -> None
        return Outcome(
            request_id=req.request_id, instance=g, arrival_s=req.arrival_s,
            dispatch_s=opt(dispatch), first_token_s=opt(first), finish_s=opt(finish),
            prompt_tokens=req.prompt_tokens, decode_tokens=decode_tokens,
            predicted_decode_tokens=req.predicted_decode_tokens, num_preemptions=preemptions,
            decode_instance=decode_instance)


def _rows(inbound: Sequence[dict[int, tuple[float, int, int]]]
          ) -> tuple[FloatArray | None, ...]:
    """Per instance, (prompt, predicted decode, dispatch time) rows of its inbound
    requests in dispatch order, or None when there are none."""
    out: list[FloatArray | None] = []
    for rows in inbound:
        if not rows:
            out.append(None)
            continue
        out.append(np.array([(p, o, t) for t, p, o in rows.values()], dtype=np.float64))
    return tuple(out)
