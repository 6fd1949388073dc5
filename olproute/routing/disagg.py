"""Disaggregated prefill/decode pools: which instances play which role, and how long a
request's KV cache takes to move between them.

As vLLM's disaggregated serving does it (a proxy and the NIXL connector): the prefill
instance runs the prompt with ``max_tokens = 1``; its one token is not sent to the
client. The KV cache (prompt tokens x the model's KV bytes per token) moves to the
decode instance over a link of ``link_gbytes_per_s`` after ``latency_ms`` of set-up. The
decode instance admits the request with all but the last prompt token computed
(``computed_tokens = prompt - 1``): its first step recomputes that token and samples the
first output token, which is the client's first token (TTFT), then it generates the
rest. Every request has both phases, a one-token answer included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config.schema import ModelProfile, TransferConfig
from olproute.types import InstanceSpec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Pools:
    """Instance indices by role; ``disaggregated`` when there are prefill/decode pools
    (then every instance is in exactly one of them)."""

    prefill: IntArray
    decode: IntArray

    @property
    def disaggregated(self) -> bool:
        return self.prefill.size > 0

    @property
    def num_instances(self) -> int:
        return int(self.prefill.size + self.decode.size)

    def role_mask(self, role: str) -> npt.NDArray[np.bool_]:
        """Boolean mask over the instances of the prefill or the decode pool."""
        idx = self.prefill if role == "prefill" else self.decode
        mask = np.zeros(self.num_instances, dtype=bool)
        mask[idx] = True
        return mask

    @classmethod
    def of(cls, specs: Sequence[InstanceSpec]) -> Pools:
        roles = [s.role for s in specs]
        prefill = np.array([i for i, r in enumerate(roles) if r == "prefill"], dtype=np.int64)
        decode = np.array([i for i, r in enumerate(roles) if r == "decode"], dtype=np.int64)
        if (prefill.size == 0) != (decode.size == 0) or (
                prefill.size and prefill.size + decode.size != len(specs)):
            raise ValueError("disaggregated pools need prefill and decode instances and no "
                             f"mixed ones; got roles {roles}")
        return cls(prefill, decode)


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """Transfer time of a KV cache: ``latency_s + tokens x bytes_per_token /
    bytes_per_s``."""

    bytes_per_token: float
    bytes_per_s: float
    latency_s: float

    @classmethod
    def of(cls, model: ModelProfile, cfg: TransferConfig) -> KvTransfer:
        return cls(model.kv_bytes_per_token, cfg.link_gbytes_per_s * 1e9,
                   cfg.latency_ms / 1e3)

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s


def decode_admission(prompt_tokens: int, decode_tokens: int) -> tuple[int, int, int]:
    """(prompt, max output, computed) with which a decode instance admits a request whose
    prompt a prefill instance ran: the whole prompt, of which all but the last token
    arrived computed, and all ``decode_tokens`` outputs to generate."""
    if prompt_tokens < 1 or decode_tokens < 1:
        raise ValueError("prompt_tokens and decode_tokens must be >= 1")
    return prompt_tokens, decode_tokens, prompt_tokens - 1


__all__ = ["KvTransfer", "Pools", "decode_admission"]
