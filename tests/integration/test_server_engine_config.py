"""The engine's own configuration live: a backend's vllm:cache_config_info is read from
its scrapes; where it differs from the profile the difference is logged, shown in
/instances and /metrics, and the router models the engine (its KV blocks in the tracker,
its block size and capacity in its exact prefix index, and the router rebuilt on them:
its policy's limits, BEA's replays, the prices' capacities)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.conftest import HANG_S
from tests.integration.server_harness import Stack
from tests.integration.test_server import CAL, TOKEN, request
from tests.integration.test_server_kv_events import BLOCK, _loaded
from tests.support.processes import free_port


def _instances(s: Stack) -> dict[str, dict[str, Any]]:
    status, _, body = request(s.url, "GET", "/instances")
    assert status == 200
    return {i["name"]: i for i in json.loads(body)["instances"]}


def _mismatch_gauge(s: Stack) -> dict[str, float]:
    _, _, body = request(s.url, "GET", "/metrics")
    return {sample.labels["instance"]: sample.value
            for fam in text_string_to_metric_families(body.decode())
            if fam.name == "olproute_engine_config_mismatch" for sample in fam.samples}


def _until(s: Stack, ready: Any) -> dict[str, dict[str, Any]]:
    t0 = time.monotonic()
    while not ready(inst := _instances(s)):
        assert time.monotonic() - t0 < HANG_S, inst
        time.sleep(0.05)
    return inst


def _until_router(s: Stack, ready: Any) -> None:
    st = s.app[STATE]
    t0 = time.monotonic()
    while not s.call(lambda: ready(st.router.specs)):
        assert time.monotonic() - t0 < HANG_S, s.call(lambda: st.router.specs)
        time.sleep(0.05)


def test_an_engine_that_differs_from_its_profile_is_modelled_as_it_says(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    loaded = _loaded(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    profile_blocks = loaded.specs[1].num_kv_blocks
    s = Stack(loaded, num_fakes=2, calibration=CalibrationSource(loaded, known=[CAL] * 2))
    try:
        # e-0's engine runs blocks of 64 and 500 of them; e-1's is as its profile says
        s.fakes[0].cache_config = {"block_size": "64", "num_gpu_blocks": "500",
                                   "enable_prefix_caching": "True",
                                   "prefix_caching_hash_algo": "sha256_cbor"}
        s.fakes[1].cache_config = {"block_size": str(BLOCK),
                                   "num_gpu_blocks": str(profile_blocks),
                                   "enable_prefix_caching": "True",
                                   "prefix_caching_hash_algo": "sha256"}
        inst = _until(s, lambda i: all(b["engine_config"] for b in i.values()))
        e0, e1 = inst["e-0"], inst["e-1"]
        assert e0["engine_config"]["block_size"] == 64
        assert e0["engine_config"]["num_gpu_blocks"] == 500
        assert [m.split(":")[0] for m in e0["engine_config"]["mismatches"]] == [
            "block_size", "num_gpu_blocks", "prefix_caching_hash_algo"]
        assert e1["engine_config"]["mismatches"] == []
        # the tracker counts the engine's blocks, the profile's where they agree
        assert e0["kv_blocks"] == 500 and e1["kv_blocks"] == profile_blocks
        # e-0's exact index names blocks of the engine's size, as many as it has
        st = s.app[STATE]
        index = st.router.prefixes
        assert s.call(lambda: (index.block_sizes[0], index.capacity[0])) == (64, 500)
        assert s.call(lambda: st.router.namers[0].block_size) == 64
        assert _mismatch_gauge(s) == {"e-0": 1.0, "e-1": 0.0}
        # the router is rebuilt on what the engines say; the prefix index carries over
        _until_router(s, lambda specs: specs[0].num_kv_blocks == 500)
        specs = s.call(lambda: st.router.specs)
        assert (specs[0].block_size, specs[1].num_kv_blocks) == (64, profile_blocks)
        assert s.call(lambda: st.router.prefixes) is index
        err = capfd.readouterr().err
        assert "backend e-0's engine differs from its profile: block_size" in err
        assert "backend e-1's engine differs" not in err
        assert ("router rebuilt on what the engines say: e-0 (blocks of 64 tokens, "
                "500 KV blocks)") in err
        # a reload of the config keeps modelling what the engines say
        status, _, _ = request(s.url, "POST", "/admin/reload",
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        assert s.call(lambda: st.router.specs[0].num_kv_blocks) == 500
        assert request(s.url, "POST", "/v1/completions",
                       {"prompt": "a b c", "max_tokens": 2})[0] == 200
        # the engine restarts as its profile says: the difference is gone
        s.fakes[0].cache_config = {"block_size": str(BLOCK),
                                   "num_gpu_blocks": str(profile_blocks)}
        inst = _until(s, lambda i: i["e-0"]["engine_config"]["mismatches"] == [])
        assert inst["e-0"]["kv_blocks"] == profile_blocks
        assert s.call(lambda: index.block_sizes[0]) == BLOCK
        assert _mismatch_gauge(s)["e-0"] == 0.0
        _until_router(s, lambda specs: specs == loaded.specs)
        assert "every engine as its profile" in capfd.readouterr().err
    finally:
        s.close()


def test_a_backend_that_says_nothing_keeps_its_profile(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    s = Stack(loaded, num_fakes=2, calibration=CalibrationSource(loaded, known=[CAL] * 2))
    try:
        _until(s, lambda i: all(b["scraped_age_s"] is not None for b in i.values()))
        inst = _instances(s)
        assert [b["engine_config"] for b in inst.values()] == [None, None]
        assert [b["kv_blocks"] for b in inst.values()] == [sp.num_kv_blocks
                                                           for sp in loaded.specs]
        assert s.call(lambda: s.app[STATE].router.specs) == loaded.specs
    finally:
        s.close()
