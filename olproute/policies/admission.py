"""The central buffer's rules, shared by the bid-price policies (mixed instances and
prefill/decode pools) and the server's buffer: can an instance start a request now, how
long may a request be held, and what becomes of a request no instance takes now (held
while patient; then shed, or deferred to the instance the policy names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from olproute.config.schema import AdmissionConfig
from olproute.types import Decision, EngineSnapshot, Request, RoutingContext


def can_start_now(snap: EngineSnapshot, prompt_tokens: int, block_size: int,
                  max_num_seqs: int, max_waiting: int) -> bool:
    """A free batch slot, free KV blocks for the prompt, and a short enough queue."""
    return bool(room_to_start(snap.num_running, snap.num_resident - snap.num_running,
                              snap.num_free_blocks, math.ceil(prompt_tokens / block_size),
                              max_num_seqs, max_waiting))


def room_to_start(num_running: Any, waiting: Any, free_blocks: Any, need_blocks: Any,
                  max_num_seqs: Any, max_waiting: int) -> Any:
    """``can_start_now`` on counts (numbers, or NumPy arrays over instances alike): a
    free batch slot, a queue of at most ``max_waiting``, and ``need_blocks`` free KV
    blocks."""
    return ((num_running < max_num_seqs) & (waiting <= max_waiting)
            & (free_blocks >= need_blocks))


def patience_s(adm: AdmissionConfig, request: Request) -> float:
    """How long a request may be held: ``admission.patience_s``, or its TTFT target,
    at most ``admission.max_patience_s``."""
    patience = adm.patience_s if adm.patience_s is not None else request.ttft_target_s
    return min(patience, adm.max_patience_s)


def still_patient(adm: AdmissionConfig, request: Request, waited_s: float) -> bool:
    """Has a held request waited less than its patience (``patience_s``)?"""
    return waited_s + 1e-12 < patience_s(adm, request)


def hold_shed_or_defer(ctx: RoutingContext, adm: AdmissionConfig, why: str,
                       explanation: Mapping[str, tuple[float, ...]],
                       forget: Callable[[int], None],
                       defer: Callable[[float], Decision]) -> Decision:
    """No instance takes the request now (``why``): hold it while it is patient. Once its
    patience has run out the policy ``forget``s it, and it is shed (``admission: shed``)
    or dispatched as ``defer(waited_s)`` decides (``admission: defer``)."""
    req = ctx.request
    waited = ctx.now_s - req.arrival_s
    if still_patient(adm, req, waited):
        return Decision(req.request_id, "hold", None, f"held: {why}", explanation)
    forget(req.request_id)
    if adm.mode == "shed":
        return Decision(req.request_id, "shed", None, f"shed after {waited * 1e3:.0f} ms: {why}",
                        explanation)
    return defer(waited)
