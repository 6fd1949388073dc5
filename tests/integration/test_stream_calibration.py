"""Calibration from live streams: ``olproute calibrate --backend`` against in-process
emulators (its beta's TTFT predictions against the emulator's exact batch-record fit, on
a virtual clock; the command line in real time, and its errors), and the router refitting
the beta of a backend without ``/olproute/batches`` from the streams it relays."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from olproute.cli.main import main
from olproute.config.loader import LoadedConfig, load_config
from olproute.core_ref import replay_ttft_reference
from olproute.emulator import RunningEmulator, start_emulators, stop_emulators
from olproute.estimate.calibration import InstanceCalibration, fit_beta, read_calibration
from olproute.estimate.sweep import QUICK_PLAN, sweep_backend
from olproute.routing.assembly import CalibrationSource as FileCalibration
from olproute.routing.tracked import tracked_snapshot
from olproute.server import app as server_app
from olproute.sim.scenario import CalibrationSource
from olproute.types import InstanceSpec
from tests.conftest import HANG_S, PROFILES
from tests.integration.server_harness import FakeState, Stack, _serve, fake_backend_app, wait_until
from tests.integration.test_server import request
from tests.virtual_time import run_virtual

# batch records: instance, start_s, duration_s, num_seqs, num_tokens, num_decode_tokens,
# sum_decode_context, num_prefill_tokens, sum_prefill_attention, ...
_DUR, _TOK, _CTX, _ATT = 2, 4, 6, 8


def _config(tmp_path: Path, replicas: int = 1, **extra: Any) -> LoadedConfig:
    data: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "e", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": replicas, "max_num_seqs": 16,
                       "max_num_batched_tokens": 512}],
        "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                     "prompt_tokens": 10, "decode_tokens": 10},
    }
    data.update(extra)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _batch_fit(records: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], np.ndarray,
                                                            np.ndarray]:
    r = np.asarray(records, dtype=np.float64)
    x = np.column_stack([np.ones(len(r)), r[:, _TOK], r[:, _CTX], r[:, _ATT]])
    return fit_beta(x, r[:, _DUR]), x, r[:, _DUR]


def _ttfts(spec: InstanceSpec, beta: Sequence[float], seed: int) -> np.ndarray:
    """BEA's TTFT of a new prompt on 60 seeded snapshots (decoders, a queue) of ``spec``."""
    rng = np.random.default_rng(seed)
    limits = (spec.num_kv_blocks, spec.block_size, spec.max_num_seqs,
              spec.max_num_batched_tokens)
    out = []
    for _ in range(60):
        running = int(rng.integers(0, 15))
        waiting = int(rng.integers(0, 3))
        n = running + waiting
        prompt = rng.integers(16, 512, n).tolist()
        tokens = [int(rng.integers(1, 60)) for _ in range(running)] + [0] * waiting
        snap = tracked_snapshot(0.0, spec, list(range(n)), prompt, tokens, [64] * n,
                                [0] * n, [t > 0 for t in tokens], 0)
        ttft, _, _ = replay_ttft_reference(
            snap.table, snap.num_running, snap.num_free_blocks, snap.inflight,
            snap.inflight_start_s, snap.time_s, limits, list(beta),
            int(rng.choice([16, 128, 512])), 32, 0.0)
        out.append(ttft)
    return np.array(out)


# -- the sweep on a virtual clock ------------------------------------------------------------
def test_a_sweep_of_an_emulator_predicts_ttft_as_its_batch_records_do(tmp_path: Path) -> None:
    """The emulator's engine (the simulator's roofline, 3% noise) on a virtual clock, so
    that stream timings are exact: the sweep's beta predicts BEA's TTFTs within a few
    percent of the beta fitted to the emulator's own batch records, and its batches
    nearly as well."""
    loaded = _config(tmp_path)
    spec = loaded.specs[0]

    async def main_() -> tuple[Any, list[tuple[float, ...]]]:
        loop = asyncio.get_running_loop()
        running = await start_emulators([spec], loaded=loaded, exact_lengths=True,
                                         clock=loop.time)
        try:
            async with aiohttp.ClientSession() as session:
                result = await sweep_backend(session, "e", running[0].url, spec.model, spec,
                                             4096, QUICK_PLAN, clock=loop.time)
            return result, running[0].instance.batch_records()[1]
        finally:
            await stop_emulators(running)

    result, records = run_virtual(main_)
    exact, x, y = _batch_fit(records)
    swept = result.calibration.beta
    assert result.num_prefill_rows >= 40 and result.num_decode_rows >= 40
    ratio = _ttfts(spec, swept, seed=0) / _ttfts(spec, exact, seed=0)
    assert float(np.mean(np.abs(ratio - 1.0))) < 0.05
    mape_swept = float(np.mean(np.abs(x @ np.array(swept) / y - 1.0)))
    mape_exact = float(np.mean(np.abs(x @ np.array(exact) / y - 1.0)))
    assert mape_swept < mape_exact + 0.02
    assert result.overhead_s < 0.1 * exact[0]   # nothing outside the steps here
    cal = result.calibration
    decode = y[(x[:, 1] > 0) & (np.asarray(records)[:, 7] == 0)]   # decode-only batches
    assert cal.tpot_s == pytest.approx(float(decode.mean()), rel=0.15)
    assert cal.mean_batch_seqs == pytest.approx(16, rel=0.1)   # the saturated phases
    assert cal.service_rate_per_s is not None and cal.service_rate_per_s > 0


# -- the command line, in real time ------------------------------------------------------------
class Emulators:
    """Emulated instances served from an event loop in a thread of their own."""

    def __init__(self, specs: Sequence[InstanceSpec], loaded: LoadedConfig,
                 **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.running: list[RunningEmulator] = self._run(start_emulators(
            specs, loaded=loaded, exact_lengths=True, **kwargs))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_S)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.running]

    def close(self) -> None:
        try:
            self._run(stop_emulators(self.running))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[LoadedConfig, Emulators]]:
    loaded = _config(tmp_path, replicas=2)
    emus = Emulators(loaded.specs, loaded, time_scale=0.1)
    try:
        yield loaded, emus
    finally:
        emus.close()


@pytest.mark.parametrize("which", ["--backend", "--all-backends"])
def test_calibrate_backend_writes_a_file_the_config_reads(
        two: tuple[LoadedConfig, Emulators], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], which: str) -> None:
    loaded, emus = two
    out = tmp_path / "live.yaml"
    if which == "--backend":
        args = ["calibrate", "--config", str(loaded.path), "--quick", "--out", str(out)]
        for spec, url in zip(loaded.specs, emus.urls, strict=True):
            args += ["--backend", f"{spec.name}={url}"]
    else:   # the config's server.backends
        doc = yaml.safe_load(loaded.path.read_text())
        doc["server"] = {"backends": [{"name": spec.name, "url": url} for spec, url
                                      in zip(loaded.specs, emus.urls, strict=True)]}
        listed = tmp_path / "listed.yaml"
        listed.write_text(yaml.safe_dump(doc))
        args = ["calibrate", "--config", str(listed), "--quick", "--out", str(out),
                "--all-backends"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "phase 9/9" in captured.err and "warming up" in captured.err
    table = [line.split() for line in captured.out.splitlines()]
    assert table[0][:3] == ["instance", "rows", "pre/dec"]
    assert [row[0] for row in table[1:3]] == ["e-0", "e-1"]
    cal = read_calibration(out)
    assert list(cal) == ["e-0", "e-1"]
    for c in cal.values():
        assert c.beta[0] > 0 and c.tpot_s > 0 and c.prefill_tokens_per_s > 0
    # the file is a calibration the config can name
    named = load_config(loaded.path).with_updates(calibration=str(out))
    assert [c.beta for c in FileCalibration(named)()] == [cal["e-0"].beta, cal["e-1"].beta]


def test_calibrate_backend_errors_name_the_problem(
        two: tuple[LoadedConfig, Emulators], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    loaded, emus = two
    base = ["calibrate", "--config", str(loaded.path), "--quick",
            "--out", str(tmp_path / "x.yaml")]
    assert main([*base, "--backend", f"nope={emus.urls[0]}"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "e-0, e-1" in err
    assert main([*base, "--all-backends"]) == 2   # the config lists none
    assert "server.backends: --all-backends: none listed" in capsys.readouterr().err
    assert main([*base, "--all-backends", "--backend", f"e-0={emus.urls[0]}"]) == 2
    assert "--backend or --all-backends, not both" in capsys.readouterr().err
    # a backend that refuses every completion (and has no /v1/models: --model)
    runner, url = emus._run(_serve(fake_backend_app(FakeState(mode="fail400"))))
    assert main([*base, "--backend", f"e-0={url}", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "answered 400: no" in err and "e-0" in err
    emus._run(runner.cleanup())           # nothing listens there now
    assert main([*base, "--backend", f"e-0={url}"]) == 2
    assert "cannot connect" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


# -- the router, from the streams it relays -----------------------------------------------------
# a hundred times too fast: bid_price prefers a backend whose beta is still this, so
# the traffic moves to whichever backend has not been refitted yet
WRONG = InstanceCalibration(beta=(5e-5, 1e-7, 1e-9, 1e-11), prefill_tokens_per_s=10_000,
                            tpot_s=0.05, mean_batch_seqs=8, service_rate_per_s=5)


async def _traffic(url: str, num: int, seed: int) -> None:
    """Streamed completions at Poisson arrivals (10 per second), prompts of 16 to 400
    words, 24 tokens each."""
    rng = np.random.default_rng(seed)

    async def one(session: aiohttp.ClientSession, words: int) -> None:
        body = {"prompt": " ".join(["w"] * words), "max_tokens": 24, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()

    async with aiohttp.ClientSession() as session:
        tasks = []
        for _ in range(num):
            await asyncio.sleep(float(rng.exponential(0.1)))
            tasks.append(asyncio.create_task(one(session, int(rng.integers(16, 400)))))
        await asyncio.gather(*tasks)


def test_the_router_refits_beta_from_the_streams_of_a_backend_without_batch_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two emulated backends behind the router, a wrong initial beta for both: the one
    with ``/olproute/batches`` is refitted from its records, the one without from the
    streams the router relayed; both then predict their engine's batches."""
    monkeypatch.setattr(server_app, "STREAM_REFIT_EVERY", 8)
    monkeypatch.setattr(server_app, "STREAM_MIN_ROWS", 8)
    monkeypatch.setattr(server_app, "BATCH_REFIT_EVERY", 64)
    loaded = _config(tmp_path, replicas=2, router={"policy": "bid_price", "slot_ms": 20},
                     prices={"period_slots": 5, "window": 200, "minibatch": 32},
                     server={"recalibrate_period_s": 0.5, "health_period_s": 0.2})
    with_records = Emulators(loaded.specs[:1], loaded)
    without = Emulators(loaded.specs[1:], loaded, batch_records=False)
    stack = Stack(loaded, num_fakes=0,
                  calibration=CalibrationSource(loaded, known=[WRONG, WRONG]),
                  backend_urls=with_records.urls + without.urls)
    try:
        def instances() -> list[dict[str, Any]]:
            doc = json.loads(request(stack.url, "GET", "/instances")[2])
            return list(doc["instances"])

        assert [i["beta_source"] for i in instances()] == ["initial", "initial"]
        stack.run(_traffic(stack.url, 80, seed=0), timeout=10 * HANG_S)
        assert wait_until(lambda: [i["beta_source"] for i in instances()]
                          == ["batches", "streams"])
        inst = instances()
        rows = inst[1]["stream_rows"]
        assert rows["prefill"] >= 8 and rows["decode"] >= 8
        assert inst[0]["stream_rows"] == {"prefill": 0, "decode": 0}   # not recorded
        for i, emus in enumerate((with_records, without)):
            records = emus.running[0].instance.batch_records()[1]
            _, x, y = _batch_fit(records)
            mape = float(np.mean(np.abs(x @ np.array(inst[i]["beta"]) / y - 1.0)))
            wrong = float(np.mean(np.abs(x @ np.array(WRONG.beta) / y - 1.0)))
            assert wrong > 0.9 and mape < 0.3, (i, mape)
        families = text_string_to_metric_families(
            request(stack.url, "GET", "/metrics")[2].decode())
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families for s in f.samples}
        assert samples[("olproute_beta_refits_total",
                        (("instance", "e-1"), ("source", "streams")))] >= 1
        assert samples[("olproute_calibration_rows",
                        (("instance", "e-1"), ("kind", "prefill")))] >= 8
    finally:
        stack.close()
        with_records.close()
        without.close()
