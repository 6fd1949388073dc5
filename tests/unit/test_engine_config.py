"""What an engine says it runs with (vLLM's vllm:cache_config_info), read and compared
with the instance's profile."""

from __future__ import annotations

import json
from pathlib import Path

from olproute.server.engine_config import (
    EngineConfig,
    cache_config_line,
    engine_spec,
    mismatches,
    parse_labels,
)
from olproute.types import InstanceSpec

RECORDED = Path(__file__).resolve().parents[1] / "data" / "kv_events" / "vllm-0.32.0-sha256.json"
SPEC = InstanceSpec(name="cpu0", model="tiny-llama", gpu="cpu-2core", tensor_parallel=1,
                    max_num_seqs=16, max_num_batched_tokens=512, block_size=32,
                    num_kv_blocks=16384)


def recorded_page() -> str:
    """A /metrics page around the line the CPU build exported."""
    line = json.loads(RECORDED.read_text())["metrics_cache_config_info"][0]
    return ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n" + line + "\n"
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n')


def test_the_cpu_builds_line_is_read() -> None:
    page = recorded_page()
    line = cache_config_line(page)
    assert line is not None and line.startswith("vllm:cache_config_info{")
    labels = parse_labels(line)
    assert labels["block_size"] == "32" and labels["kv_cache_layout"] == "None"
    engine = EngineConfig.of_metrics(page)
    assert engine == EngineConfig(block_size=32, num_gpu_blocks=16, prefix_caching=True,
                                  hash_algo="sha256")


def test_a_page_without_it_says_nothing() -> None:
    assert cache_config_line('vllm:num_requests_running{a="b"} 0.0\n') is None
    assert EngineConfig.of_metrics("") is None
    # a longer name that contains it is not it
    assert cache_config_line('x_vllm:cache_config_info{block_size="8"} 1.0\n') is None


def test_escaped_labels_are_undone() -> None:
    labels = parse_labels(r'm{a="x\"y",b="c\\d",n="1\n2"} 1.0')
    assert labels == {"a": 'x"y', "b": "c\\d", "n": "1\n2"}


def test_every_difference_is_named_with_the_key_to_fix() -> None:
    engine = EngineConfig(block_size=128, num_gpu_blocks=16, prefix_caching=False,
                          hash_algo="sha256_cbor")
    found = mismatches(SPEC, engine, hash_algo="sha256")
    assert [m.split(":")[0] for m in found] == ["block_size", "num_gpu_blocks",
                                                "enable_prefix_caching",
                                                "prefix_caching_hash_algo"]
    assert "instances[].block_size" in found[0] and "128" in found[0] and "32" in found[0]
    assert "2,048 tokens" in found[1] and "524,288 tokens" in found[1]
    assert "server.backends[].kv_events.hash_algo" in found[3]
    # the same engine as the profile: nothing; a hash unchecked without KV events
    same = EngineConfig(block_size=32, num_gpu_blocks=16384, prefix_caching=True,
                        hash_algo="sha256_cbor")
    assert mismatches(SPEC, same) == []


def test_the_engines_word_replaces_the_profiles_where_it_says_it() -> None:
    spec = engine_spec(SPEC, EngineConfig(128, 40, None, None))
    assert (spec.block_size, spec.num_kv_blocks, spec.enable_prefix_caching) == (128, 40, True)
    assert spec.name == SPEC.name and spec.max_num_seqs == SPEC.max_num_seqs
    assert engine_spec(SPEC, EngineConfig(None, None, None, None)) == SPEC
