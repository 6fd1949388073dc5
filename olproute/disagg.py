"""Disaggregated prefill/decode pools: which instances play which role, and how long a
request's KV cache takes to move between them.

A request on disaggregated pools is prefilled on a prefill instance, which produces its
first token; its KV cache (prompt tokens x the model's KV bytes per token) then moves to
a decode instance over a link of ``link_gbytes_per_s`` after ``latency_ms`` of set-up,
and is decoded there. The decode instance admits it with its prompt's KV already
computed (``computed_tokens``): its first step feeds the first token and yields the
second. A request whose output is one token ends on the prefill instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config import ModelProfile, TransferConfig
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
    first token came from the prefill instance: the prompt plus that token, of which the
    prompt's KV arrived computed; the other ``decode_tokens - 1`` outputs to generate."""
    if decode_tokens < 2:
        raise ValueError("a request with one output token has no decode phase")
    return prompt_tokens + 1, decode_tokens - 1, prompt_tokens


__all__ = ["KvTransfer", "Pools", "decode_admission"]
