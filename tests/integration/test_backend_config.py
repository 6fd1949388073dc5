"""A router configured for real backends: each backend gets the model name it answers to
(``server.backends[].served_model``), the config needs no workload section (and
``calibration: auto`` then sweeps the profiles in the simulator), and ``serve
--calibration`` reads a file or stops with its name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from olproute.cli.main import main
from olproute.config.loader import ConfigError, load_config
from olproute.server.state import STATE as ROUTER_STATE
from olproute.sim.requests import build_requests
from olproute.sim.scenario import SWEEP_DECODE_TOKENS, CalibrationSource, sweep_calibration
from tests.conftest import PROFILES
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, request

SERVED = ["Org/Model-A", "Org/Model-A", None]


def _config(tmp_path: Path, any_model: bool = False, **extra: Any) -> Path:
    """Three qwen3-0.6b instances; q-0 and q-1 answer to 'Org/Model-A', q-2 to its
    profile's name. No workload section; ``server.any_model`` as given."""
    backends = []
    for i, name in enumerate(SERVED):
        b: dict[str, Any] = {"name": f"q-{i}", "url": f"http://127.0.0.1:{9 + i}"}
        if name is not None:
            b["served_model"] = name
        backends.append(b)
    data: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 3}],
        "router": {"policy": "round_robin"},
        "prediction": {"serve": "max_tokens"},
        "server": {"health_period_s": 0.1, "scrape_period_s": 0.2, "backends": backends,
                   "any_model": any_model},
    }
    data.update(extra)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_each_backend_gets_the_name_it_serves(tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):   # round robin: each backend twice (all serve the profile's)
            client.completions.create(model="qwen3-0.6b", prompt=f"hello {i}", max_tokens=2)
        assert [[b["model"] for b in f.bodies] for f in s.fakes] == [
            ["Org/Model-A"] * 2, ["Org/Model-A"] * 2, ["qwen3-0.6b"] * 2]
        # a served name confines the choice to the backends that answer to it
        for _ in range(4):
            client.chat.completions.create(model="Org/Model-A", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        counts = [len(f.bodies) for f in s.fakes]
        assert counts[2] == 2 and counts[0] + counts[1] == 8 and min(counts[:2]) > 2
        assert s.fakes[0].bodies[-1]["model"] == "Org/Model-A"
        inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
        assert [i["served_model"] for i in inst] == ["Org/Model-A", "Org/Model-A",
                                                     "qwen3-0.6b"]
        assert [i["model"] for i in inst] == ["qwen3-0.6b"] * 3
    finally:
        s.close()


def test_models_lists_the_served_names_and_an_unknown_model_is_404(tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        listed = client.models.list()
        assert [m.id for m in listed.data] == ["Org/Model-A", "qwen3-0.6b"]
        assert {(m.object, m.owned_by) for m in listed.data} == {("model", "olproute")}
        assert client.models.retrieve("Org/Model-A").id == "Org/Model-A"
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("gpt-4")
        assert missing.value.code == "model_not_found"
        for create in (
                lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=2),
                lambda: client.chat.completions.create(
                    model="gpt-4", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                    stream=True)):
            with pytest.raises(openai.NotFoundError) as refused:
                create()
            err = refused.value.body
            assert isinstance(err, dict)
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert err["type"] == "invalid_request_error" and "gpt-4" in err["message"]
        assert sum(len(f.bodies) for f in s.fakes) == 0   # nothing reached a backend
        # /route's model follows the same rule
        status, _, raw = request(s.url, "POST", "/route",
                                 {"prompt": "hi", "model": "Org/Model-A"})
        assert status == 200 and json.loads(raw)["instance"] in ("q-0", "q-1")
        status, _, raw = request(s.url, "POST", "/route", {"prompt": "hi", "model": "gpt-4"})
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    finally:
        s.close()


def test_any_model_routes_an_unknown_name_to_the_whole_pool(tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path, any_model=True))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):
            client.completions.create(model="any-alias", prompt=f"hello {i}", max_tokens=2)
        # each backend gets the name it serves, the alias none of them
        assert [[b["model"] for b in f.bodies] for f in s.fakes] == [
            ["Org/Model-A"] * 2, ["Org/Model-A"] * 2, ["qwen3-0.6b"] * 2]
    finally:
        s.close()


def test_a_backend_without_vllm_gauges_is_named_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        s.call(lambda: setattr(s.fakes[1], "gauges", False))
        said: list[str] = []

        def warned() -> bool:
            said.append(capsys.readouterr().err)
            inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
            return "".join(said).count("q-1's /metrics") >= 1 and all(
                i["scraped_age_s"] is not None for i in inst)

        assert wait_until(warned)
        inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
        assert inst[1]["scraped"] == {} and "vllm:num_requests_running" in inst[0]["scraped"]
        wait_until(lambda: False, timeout=1.0)   # several more scrapes
        said.append(capsys.readouterr().err)
        text = "".join(said)
        assert text.count("q-1's /metrics has none of vllm:num_requests_running") == 1
        assert "--disable-log-stats" in text and "q-0's /metrics" not in text
    finally:
        s.close()


def test_a_backend_whose_prefix_query_counter_goes_down_is_forgotten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A restart between health probes: the scraped vllm:prefix_cache_queries_total goes
    down, and the router's prefix index drops what it had sent there."""
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        s.call(lambda: setattr(s.fakes[0], "prefix_queries", 5000.0))
        prompt = " ".join(f"w{i}" for i in range(100))   # 6 full blocks of 16 words
        status, headers, _ = request(s.url, "POST", "/v1/completions",
                                     {"prompt": prompt, "max_tokens": 2})
        assert status == 200 and headers["x-olproute-instance"] == "q-0"

        def blocks() -> list[int]:
            inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
            return [i["prefix_index_blocks"] for i in inst]

        assert blocks() == [6, 0, 0]
        # several scrapes of the same total, then one of a larger: nothing dropped
        wait_until(lambda: False, timeout=0.6)
        s.call(lambda: setattr(s.fakes[0], "prefix_queries", 7000.0))
        wait_until(lambda: False, timeout=0.6)
        assert blocks() == [6, 0, 0]
        s.call(lambda: setattr(s.fakes[0], "prefix_queries", 12.0))   # restarted
        assert wait_until(lambda: blocks() == [0, 0, 0])
        err = capsys.readouterr().err
        assert err.count("q-0's prefix-cache query counter went down") == 1
    finally:
        s.close()


def test_a_connection_closed_before_the_answer_is_retried_once(tmp_path: Path) -> None:
    """A backend that closes the connection before answering (as uvicorn closes an idle
    kept-alive one the request was sent on) gets the request once more, on a new
    connection: the client sees one answer, the backend stays healthy."""
    loaded = load_config(_config(tmp_path))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        s.call(lambda: setattr(s.fakes[0], "mode", "drop_once"))
        status, headers, raw = request(s.url, "POST", "/v1/completions",
                                       {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        assert headers["x-olproute-instance"] == "q-0"     # round robin's first
        assert s.fakes[0].requests == 2
        inst = json.loads(request(s.url, "GET", "/instances")[2])["instances"]
        assert inst[0]["healthy"] and inst[0]["failures"] == 0
    finally:
        s.close()


def test_a_server_config_needs_no_workload(tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path))
    assert not loaded.has_workload
    with pytest.raises(ConfigError, match=r"router\.yaml: workload: required"):
        build_requests(loaded)
    # calibration: auto sweeps each instance's profile in the simulator instead
    cal = CalibrationSource(loaded)()
    assert len(cal) == 3
    swept = sweep_calibration(loaded)[0]
    assert cal[0] == swept   # seeded: the same sweep twice
    # alike instances, each timed with its own noise: alike figures
    assert all(abs(c.tpot_s / swept.tpot_s - 1) < 0.1 for c in cal)
    assert all(b >= 0 for b in swept.beta) and swept.beta[0] > 0
    assert swept.tpot_s > swept.beta[0] and swept.prefill_tokens_per_s > 0
    assert swept.service_rate_per_s is not None and swept.service_rate_per_s > 0
    assert swept.service_scv is None    # every sweep output is SWEEP_DECODE_TOKENS long
    assert SWEEP_DECODE_TOKENS > 1


def test_simulate_without_workload_names_the_key(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--config", str(_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "router.yaml: workload: required" in err


def test_serve_calibration_file_is_checked_first(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = str(_config(tmp_path))
    missing = tmp_path / "nope.yaml"
    assert main(["serve", "--config", config, "--calibration", str(missing)]) == 2
    assert f"{missing}: --calibration: no such file" in capsys.readouterr().err
    partial = tmp_path / "cal.yaml"
    partial.write_text(yaml.safe_dump({"calibration": {"q-0": CAL.as_dict()}}))
    assert main(["serve", "--config", config, "--calibration", str(partial)]) == 2
    err = capsys.readouterr().err
    assert "calibration:" in err and "no entry for instance(s) q-1, q-2" in err


@pytest.mark.parametrize("name", ["vllm_gpu_example.yaml", "vllm_cpu.yaml"])
def test_shipped_backend_configs_load(name: str) -> None:
    loaded = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    backends = loaded.config.server.backends
    assert not loaded.has_workload
    assert [b.name for b in backends] == [s.name for s in loaded.specs]
    assert all(b.served_model for b in backends)


def test_a_failed_backend_is_probed_after_a_backoff_capped_by_the_config(
        tmp_path: Path) -> None:
    loaded = load_config(_config(tmp_path, server={
        "health_period_s": 0.1, "health_max_backoff_s": 2.0,
        "backends": [{"name": f"q-{i}", "url": "http://127.0.0.1:9"} for i in range(3)]}))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        tracker = s.app[ROUTER_STATE].tracker

        def backoffs() -> list[float]:
            out = []
            for _ in range(8):
                tracker.mark_failure(0, 100.0)
                out.append(tracker.backends[0].next_probe_s - 100.0)
            return out

        # doubling from 0.5 s, capped at health_max_backoff_s
        assert s.call(backoffs) == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    finally:
        s.close()
