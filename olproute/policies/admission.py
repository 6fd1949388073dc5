"""The central buffer's rules, shared by the bid-price policies (mixed instances and
prefill/decode pools) and the server's buffer: can an instance start a request now, how
long may a request be held, and what becomes of a request no instance takes now (held
while patient; then shed, or deferred to the instance the policy names).

"Start now" (``can_start_now``) is the router's rule for sending a request at once: a
free batch slot, KV blocks for its prompt, and at most ``admission.max_waiting`` already
waiting there (default 0: holding a request in the router while an engine has a queue
is late binding, to whichever instance frees first).

Where the best instance that can start a request is not *quiet* (``quiet``: at most
``admission.max_waiting`` requests there without an output token yet, waiting or in
prefill), bid_price sends it to the best-scoring quiet replica of the same engine (model,
GPU, tensor parallel) instead, if one can start it. A prefill started beside another
shares the step's token budget with it, so both reach their first token later; a quiet
replica gives the new one its budget alone. Between different engines the score also
says what each serves, and decides; with no quiet replica the request goes to the best,
never held for quiet.

A refusal needs a reason that holds, read off the engines' state. At its next steps an
engine (vLLM's scheduler) admits its waiting requests in order while it has a batch slot
and KV blocks for each prompt, as fast as its token budget lets it (``engine_has_room``).
Once a request's patience runs out under ``admission: shed`` it goes to the best
instance whose engine has room for it and would start it within another TTFT target
(the policy's ``Room``); it is refused only when no engine has room (``no_room``) or every
one that has would queue it past that (``late``: the engines are saturated in compute,
their queues growing). The prices and the score may hold a request while it is patient,
never refuse what the engines can take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from olproute.config.schema import AdmissionConfig
from olproute.types import (
    SNAP_COMPUTED,
    SNAP_OUTPUT,
    SNAP_PROMPT,
    Decision,
    EngineSnapshot,
    Request,
    RoutingContext,
)


def can_start_now(snap: EngineSnapshot, prompt_tokens: int, block_size: int,
                  max_num_seqs: int, max_waiting: int) -> bool:
    """A free batch slot, free KV blocks for the prompt, and a short enough queue."""
    return bool(room_to_start(snap.num_running, snap.num_resident - snap.num_running,
                              snap.num_free_blocks, math.ceil(prompt_tokens / block_size),
                              max_num_seqs, max_waiting))


def unstarted(snap: EngineSnapshot) -> int:
    """Requests at the engine without an output token yet: waiting, or running in
    prefill."""
    prefilling = np.count_nonzero(snap.table[: snap.num_running, SNAP_OUTPUT] == 0)
    return snap.num_resident - snap.num_running + int(prefilling)


def quiet(snap: EngineSnapshot, max_waiting: int) -> bool:
    """At most ``max_waiting`` requests at the engine without a token yet (module
    docstring)."""
    return unstarted(snap) <= max_waiting


def room_to_start(num_running: Any, waiting: Any, free_blocks: Any, need_blocks: Any,
                  max_num_seqs: Any, max_waiting: int) -> Any:
    """``can_start_now`` on counts (numbers, or NumPy arrays over instances alike): a
    free batch slot, a queue of at most ``max_waiting``, and ``need_blocks`` free KV
    blocks."""
    return ((num_running < max_num_seqs) & (waiting <= max_waiting)
            & (free_blocks >= need_blocks))


def engine_has_room(snap: EngineSnapshot, prompt_tokens: int, block_size: int,
                    max_num_seqs: int) -> bool:
    """Would the engine take the request in as soon as its token budget lets it: a batch
    slot and KV blocks for its prompt left after the requests waiting there got theirs
    (its scheduler's own admission rule; module docstring)."""
    slots, blocks = room_left(snap, block_size, max_num_seqs)
    return slots > 0 and blocks >= math.ceil(prompt_tokens / block_size)


def room_left(snap: EngineSnapshot, block_size: int, max_num_seqs: int) -> tuple[int, int]:
    """(batch slots, free KV blocks) an engine has left once the requests waiting there
    got theirs."""
    return (max_num_seqs - snap.num_resident,
            snap.num_free_blocks - queued_blocks(snap, block_size))


def queued_blocks(snap: EngineSnapshot, block_size: int) -> int:
    """The KV blocks the waiting requests' prompts will take when the engine starts them
    (less what of each is computed already)."""
    waiting = snap.table[snap.num_running:]
    if not len(waiting):
        return 0
    fresh = np.maximum(waiting[:, SNAP_PROMPT] - waiting[:, SNAP_COMPUTED], 0)
    return int((-(-fresh // block_size)).sum())


def with_room(ctx: RoutingContext, instances: Sequence[int] | None = None) -> list[int]:
    """The instances (of ``instances``, every one by default) whose engines have room for
    ``ctx.request`` (``engine_has_room``); none without snapshots."""
    snaps = ctx.snapshots
    if snaps is None:
        return []
    prompt = ctx.request.prompt_tokens
    return [g for g in (range(len(snaps)) if instances is None else instances)
            if engine_has_room(snaps[g], prompt, ctx.specs[g].block_size,
                               ctx.specs[g].max_num_seqs)]


def fullness(ctx: RoutingContext) -> str:
    """Why no engine has room for ``ctx.request`` (a refusal's reason): per instance,
    the figure that keeps it out."""
    snaps = ctx.snapshots
    if snaps is None:
        return "no instance's state is known"
    parts = []
    for snap, spec in zip(snaps, ctx.specs, strict=True):
        slots, free = room_left(snap, spec.block_size, spec.max_num_seqs)
        if slots <= 0:
            parts.append(f"{spec.name} {snap.num_running}/{spec.max_num_seqs} running, "
                         f"{snap.num_resident - snap.num_running} waiting")
        else:
            need = math.ceil(ctx.request.prompt_tokens / spec.block_size)
            parts.append(f"{spec.name} {max(free, 0)} KV blocks free after its queue, "
                         f"{need} needed")
    return "no engine has room for it: " + "; ".join(parts)


def patience_s(adm: AdmissionConfig, request: Request) -> float:
    """How long a request may be held: ``admission.patience_s``, or its TTFT target,
    at most ``admission.max_patience_s``."""
    patience = adm.patience_s if adm.patience_s is not None else request.ttft_target_s
    return min(patience, adm.max_patience_s)


def still_patient(adm: AdmissionConfig, request: Request, waited_s: float) -> bool:
    """Has a held request waited less than its patience (``patience_s``)?"""
    return waited_s + 1e-12 < patience_s(adm, request)


@dataclass(frozen=True, slots=True)
class Room:
    """Where a request out of patience may still go under ``admission: shed``: the
    instances, the policy's best first; when none, the refusal's kind
    (``olproute.types.REFUSALS``) and its reason (default: ``fullness``)."""

    instances: list[int]
    refusal: str = "no_room"
    why: str | None = None


def hold_shed_or_defer(ctx: RoutingContext, adm: AdmissionConfig, why: str,
                       explanation: Mapping[str, tuple[float, ...]],
                       forget: Callable[[int], None],
                       defer: Callable[[float, int | None], Decision],
                       room: Callable[[], Room] | None = None) -> Decision:
    """No instance takes the request now (``why``): hold it while it is patient. Once its
    patience has run out the policy ``forget``s it, and ``defer(waited_s, None)`` decides
    where it goes (``admission: defer``); under ``admission: shed`` it goes as
    ``defer(waited_s, g)`` to the first instance ``room()`` names and is refused only
    when it names none, typed as it says (``Decision.refusal``). Without ``room`` it is
    refused (``patience``)."""
    req = ctx.request
    waited = ctx.now_s - req.arrival_s
    if still_patient(adm, req, waited):
        return Decision(req.request_id, "hold", None, f"held: {why}", explanation)
    forget(req.request_id)
    if adm.mode == "defer":
        return defer(waited, None)
    if room is None:
        return Decision(req.request_id, "shed", None, f"shed after {waited * 1e3:.0f} ms: "
                        f"{why}", explanation, refusal="patience")
    where = room()
    if where.instances:
        return defer(waited, where.instances[0])
    return Decision(req.request_id, "shed", None, f"shed after {waited * 1e3:.0f} ms: "
                    f"{where.why or fullness(ctx)}", explanation, refusal=where.refusal)
