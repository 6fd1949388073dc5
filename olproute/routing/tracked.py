"""The snapshot a router rebuilds of a backend from the traffic it proxies.

A router in front of real backends does not see their schedulers. What it knows of a
backend is what it sent there and what came back (``olproute.server.tracker``): each
request in flight, its prompt, its predicted output, its dispatch time and the tokens it
has streamed. From these it rebuilds the ``EngineSnapshot`` BEA replays:

* a request that has streamed a token is a running decoder (context = prompt + tokens,
  all of it computed but the last token, its KV blocks held); the first
  ``max_num_seqs`` of them in dispatch order run, the rest wait;
* a request the engine said it scheduled (its KV events stored some of its prompt's
  blocks, or its scraped running count covers it: ``server.prefill_from_kv_events``,
  ``server.running_from_scrape``) runs in prefill, the prompt tokens it said computed
  done;
* of the others, those the backend's scheduler takes into its next step run in prefill
  (``admitted``): as vLLM's scheduler forms a batch, in dispatch order while its token
  budget lasts, a batch slot is free and KV blocks for the whole prompt remain, the
  first that does not fit and every later one waiting. Each holds its prompt's blocks,
  nothing of it computed but what arrived or was expected cached (below). Without this
  a request in prefill looks waiting for as long as its prefill runs, and an engine
  with one looks queued to the rule that starts requests only where none waits;
* the rest wait in dispatch order with nothing computed (their prefill may have begun
  inside the backend: the replay then over-estimates their remaining prefill), except
  the prompt tokens whose KV arrived computed from a prefill instance, and (live) those
  the router's prefix index expected cached there when it sent the request;
* no batch is in flight (the replay starts at the snapshot's time), and the free KV
  blocks are the capacity less the running requests' blocks (``used_blocks``, which the
  live tracker reconciles with the backend's scraped KV gauge).

What it cannot know: which batch is running and since when, how far each queued prefill
has got, and which requests the backend preempted (they look running). The simulator
gives its policies this same view of its exact engine state with
``sim.snapshot_view: router`` (``router_view``), so what the lost information costs is
measured offline, with everything else equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from olproute.types import (
    SNAP_COMPUTED,
    SNAP_OUTPUT,
    SNAP_PREDICTED,
    SNAP_PROMPT,
    EngineSnapshot,
    InstanceSpec,
)


def tracked_blocks(prompt: Sequence[int], tokens: Sequence[int], running: Sequence[bool],
                   block_size: int) -> int:
    """KV blocks the running requests hold: context prompt + tokens (at least one)."""
    return sum(math.ceil((p + max(t, 1)) / block_size)
               for p, t, r in zip(prompt, tokens, running, strict=True) if r)


def admitted(prompt: Sequence[int], computed: Sequence[int], running: Sequence[bool],
             spec: InstanceSpec, used_blocks: int) -> tuple[list[int], int]:
    """Of the requests in flight on a backend, in dispatch order, those not taken to be
    running that its scheduler has taken in (module docstring), and the KV blocks their
    prompts hold: the batch its next step forms, as vLLM's scheduler forms it. Each
    running request takes a token of the step's budget (``max_num_batched_tokens``);
    then, in order, each waiting one its prompt's uncomputed tokens (at most what is
    left) while some budget is left, a batch slot is free (``max_num_seqs`` less the
    running) and blocks for its whole prompt remain of those ``used_blocks`` leaves; the
    first that does not fit stops it (no skipping ahead)."""
    slots = spec.max_num_seqs - sum(1 for r in running if r)
    budget = spec.max_num_batched_tokens - sum(1 for r in running if r)
    free = spec.num_kv_blocks - min(used_blocks, spec.num_kv_blocks)
    taken: list[int] = []
    held = 0
    for i, (p, c, r) in enumerate(zip(prompt, computed, running, strict=True)):
        if r:
            continue
        need = -(-p // spec.block_size)
        if slots <= 0 or budget <= 0 or need > free:
            break
        taken.append(i)
        slots -= 1
        budget -= max(p - c, 1)
        free -= need
        held += need
    return taken, held


def tracked_snapshot(now_s: float, spec: InstanceSpec, request_ids: Sequence[int],
                     prompt: Sequence[int], tokens: Sequence[int],
                     predicted: Sequence[int], computed: Sequence[int],
                     running: Sequence[bool], used_blocks: int,
                     prefilling: Sequence[bool] | None = None) -> EngineSnapshot:
    """The snapshot of one backend from its requests in flight, given in dispatch order:
    their ids, prompt tokens, tokens streamed, predicted output, prompt tokens whose KV
    arrived computed (or the engine said it computed), and whether each is taken to be
    running; ``used_blocks`` the KV blocks taken to be used (module docstring).
    ``prefilling``: which running ones are still in prefill, as the engine said (its KV
    events, its scraped running count): no output yet, ``computed`` of the prompt done."""
    order = range(len(request_ids))
    run = [i for i in order if running[i]][: spec.max_num_seqs]
    taken, held = admitted(prompt, computed, running, spec, used_blocks)
    entered = set(taken)
    run = sorted(run + taken)
    ran = set(run)
    wait = [i for i in order if i not in ran]
    rows = []
    for i in run:
        if i in entered:
            rows.append((prompt[i], 0, predicted[i], min(computed[i], prompt[i] - 1),
                         -(-prompt[i] // spec.block_size)))
            continue
        if prefilling is not None and prefilling[i]:
            done = min(computed[i], prompt[i] - 1)
            rows.append((prompt[i], 0, predicted[i], done,
                         math.ceil(max(done, 1) / spec.block_size)))
            continue
        out = max(tokens[i], 1)
        ctx = prompt[i] + out
        rows.append((prompt[i], out, predicted[i], ctx - 1, math.ceil(ctx / spec.block_size)))
    rows.extend((prompt[i], 0, predicted[i], computed[i], 0) for i in wait)
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 5)
    return EngineSnapshot(
        time_s=now_s, table=table, num_running=len(run),
        num_free_blocks=spec.num_kv_blocks - min(used_blocks + held, spec.num_kv_blocks),
        inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=now_s,
        request_ids=np.array([request_ids[i] for i in run + wait], dtype=np.int64))


def router_view(snap: EngineSnapshot, dispatch_s: Mapping[int, float],
                spec: InstanceSpec, cached: Mapping[int, int] | None = None) -> EngineSnapshot:
    """What a router tracking its own traffic rebuilds of an engine's exact state
    ``snap``: its resident requests in dispatch order (``dispatch_s`` by request id),
    those with an output token running, every one's tokens so far, and for a waiting
    request on a decode instance the prompt it received computed (otherwise what
    ``cached`` says the router expected cached, by request id, or nothing); the rest as
    ``tracked_snapshot`` says, which this computes on arrays (the
    simulator asks for it at every decision; ``tests/unit/test_tracked.py`` holds the two
    equal)."""
    ids = snap.request_ids
    when = np.array([dispatch_s.get(i, math.inf) for i in ids.tolist()], dtype=np.float64)
    order = np.argsort(when, kind="stable")
    ordered = ids[order]
    t = snap.table[order]
    prompt, tokens = t[:, SNAP_PROMPT], t[:, SNAP_OUTPUT]
    running = tokens > 0
    context = prompt + np.maximum(tokens, 1)
    blocks = -(-context // spec.block_size)
    used = int(blocks[running].sum())
    if spec.role == "decode":
        computed = t[:, SNAP_COMPUTED] * ~running
    elif cached:
        computed = np.array([cached.get(i, 0) for i in ordered.tolist()], dtype=np.int64)
    else:
        computed = np.zeros(len(ids), dtype=np.int64)
    # the requests without a token the scheduler has taken in (``admitted``: each
    # condition holds for a prefix of them, so together they do)
    idle = np.flatnonzero(~running)
    need = -(-prompt[idle] // spec.block_size)
    num_running = int(np.count_nonzero(running))
    tokens_before = np.cumsum(np.maximum(prompt[idle] - computed[idle], 1)) - np.maximum(
        prompt[idle] - computed[idle], 1)
    fits = ((np.cumsum(need) <= spec.num_kv_blocks - min(used, spec.num_kv_blocks))
            & (np.arange(1, len(idle) + 1) <= spec.max_num_seqs - num_running)
            & (tokens_before < spec.max_num_batched_tokens - num_running))
    taken = idle[: int(np.argmin(fits)) if not fits.all() else len(idle)]
    kept = np.zeros(len(ids), dtype=bool)
    kept[np.flatnonzero(running)[: spec.max_num_seqs]] = True
    entered = np.zeros(len(ids), dtype=bool)
    entered[taken] = True
    run = np.flatnonzero(kept | entered)
    wait = np.flatnonzero(~(kept | entered))
    done = np.where(entered, np.minimum(computed, prompt - 1), context - 1)
    held = np.where(entered, -(-prompt // spec.block_size), blocks)
    table = np.empty((len(ids), 5), dtype=np.int64)
    table[: len(run)] = np.stack([prompt[run], tokens[run], t[run, SNAP_PREDICTED],
                                  done[run], held[run]], axis=1)
    table[len(run):] = np.stack([prompt[wait], np.zeros(len(wait), dtype=np.int64),
                                 t[wait, SNAP_PREDICTED], computed[wait],
                                 np.zeros(len(wait), dtype=np.int64)], axis=1)
    return EngineSnapshot(
        time_s=snap.time_s, table=table, num_running=len(run),
        num_free_blocks=spec.num_kv_blocks - min(used + int(need[: len(taken)].sum()),
                                                 spec.num_kv_blocks),
        inflight=np.zeros((0, 2), dtype=np.int64), inflight_start_s=snap.time_s,
        request_ids=ordered[np.concatenate([run, wait])])
