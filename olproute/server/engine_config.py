"""What a backend's engine says it runs with, against what its instance's profile says.

vLLM exports its cache configuration as the labels of one gauge,
``vllm:cache_config_info{block_size="32",num_gpu_blocks="16384",
enable_prefix_caching="True",prefix_caching_hash_algo="sha256",...} 1.0``. The router reads
it from each scrape of the backend's ``/metrics``; the line is parsed again only when it
changes (a restart with other flags), so reading it costs a string comparison per scrape.

Where the engine and the profile differ, the engine is right (a CPU build started without
``--block-size`` runs blocks of 128, whatever the profile says): the router logs each
difference once, shows it in ``/instances`` (``engine_config``) and in
``olproute_engine_config_mismatch``, and models what the engine says where it can while
serving (``engine_spec``): the tracker's KV accounting and each backend's exact prefix
index (block size, capacity) follow the engine at once, and the router is built again on
what the engines say (its policy's instance limits, BEA's replays, the prices'
capacities; its learned prices start again), as a reload builds it. A reload keeps what
the engines say; the log line says which profile key to fix so that a restart of the
router starts right.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from olproute.types import InstanceSpec

CACHE_CONFIG_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def cache_config_line(text: str) -> str | None:
    """The ``vllm:cache_config_info`` sample line of a Prometheus text page, or None."""
    start = text.find(CACHE_CONFIG_INFO + "{")
    while start > 0 and text[start - 1] != "\n":   # a comment or a longer name
        start = text.find(CACHE_CONFIG_INFO + "{", start + 1)
    if start < 0:
        return None
    end = text.find("\n", start)
    return text[start:] if end < 0 else text[start:end]


def parse_labels(line: str) -> dict[str, str]:
    """The labels of one sample line (Prometheus' escapes undone)."""
    inner = line[line.find("{") + 1:line.rfind("}")]
    return {k: re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], v)
            for k, v in _LABEL.findall(inner)}


def _int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        value = int(labels[key])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def _bool(labels: Mapping[str, str], key: str) -> bool | None:
    value = labels.get(key, "").lower()
    return True if value == "true" else False if value == "false" else None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine says (None: it does not say)."""

    block_size: int | None
    num_gpu_blocks: int | None
    prefix_caching: bool | None
    hash_algo: str | None

    @classmethod
    def of_labels(cls, labels: Mapping[str, str]) -> EngineConfig:
        algo = labels.get("prefix_caching_hash_algo") or None
        return cls(_int(labels, "block_size"), _int(labels, "num_gpu_blocks"),
                   _bool(labels, "enable_prefix_caching"), algo)

    @classmethod
    def of_metrics(cls, text: str) -> EngineConfig | None:
        line = cache_config_line(text)
        return None if line is None else cls.of_labels(parse_labels(line))

    def as_doc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mismatches(spec: InstanceSpec, engine: EngineConfig,
               hash_algo: str | None = None) -> list[str]:
    """Where the engine and the instance's profile (and, with KV events, the configured
    hash setting ``hash_algo``) differ, one sentence each naming the key to fix."""
    out = []
    if engine.block_size is not None and engine.block_size != spec.block_size:
        out.append(f"block_size: the engine runs blocks of {engine.block_size} tokens, the "
                   f"profile says {spec.block_size} (instances[].block_size; vLLM's "
                   "--block-size)")
    if engine.num_gpu_blocks is not None and engine.num_gpu_blocks != spec.num_kv_blocks:
        out.append(f"num_gpu_blocks: the engine has {engine.num_gpu_blocks} KV blocks "
                   f"({engine.num_gpu_blocks * (engine.block_size or spec.block_size):,} "
                   f"tokens), the profile {spec.num_kv_blocks} "
                   f"({spec.kv_capacity_tokens:,} tokens; instances[].kv_capacity_tokens)")
    if engine.prefix_caching is not None and engine.prefix_caching != spec.enable_prefix_caching:
        out.append(f"enable_prefix_caching: the engine has it {_on(engine.prefix_caching)}, "
                   f"the profile {_on(spec.enable_prefix_caching)} "
                   "(instances[].enable_prefix_caching)")
    if hash_algo is not None and engine.hash_algo is not None and engine.hash_algo != hash_algo:
        out.append(f"prefix_caching_hash_algo: the engine hashes with {engine.hash_algo}, the "
                   f"router with {hash_algo} (server.backends[].kv_events.hash_algo)")
    return out


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def engine_spec(spec: InstanceSpec, engine: EngineConfig) -> InstanceSpec:
    """The instance as its engine says it is: its block size, KV blocks and prefix
    caching where it says them, the profile's where it does not."""
    return dataclasses.replace(
        spec, block_size=engine.block_size or spec.block_size,
        num_kv_blocks=engine.num_gpu_blocks or spec.num_kv_blocks,
        enable_prefix_caching=spec.enable_prefix_caching if engine.prefix_caching is None
        else engine.prefix_caching)
