"""Live parity: the same requests replayed in the simulator and, in real time, through
``olproute serve`` in front of emulated instances; how far the live figures are from
the simulated ones, and why.

    python bench/live_table.py [--quick] [--json PATH] [--seeds S,S,..]
                               [--scenarios olp,bear] [--policies P,P,..]

Scenarios:

* ``olp``: the OLP table's overloaded scenario (``bench/olp_table.py``: four Llama-2-7B /
  A100-80GB engines, Poisson arrivals at 24 req/s, splitwise_conv lengths, +/-20% noisy
  predictions in the simulator, admission ``defer`` with 60 s of patience; 4,000
  requests). Its longest prompt + output is 14,089 tokens, past Llama-2-7B's 4,096, and
  the emulator refuses what exceeds its model's context, as vLLM does; the simulator has
  no context limit, so both run with the model's context raised to ``OLP_CONTEXT``
  (``_long_context_profiles``) and the requests are the OLP table's.
* ``bear``: the BEAR table's pool (``bench/bear_table.py``: Qwen3-0.6B and -8B on one H100
  each, Qwen3-32B on two), its synthetic prompts at ``BEAR_RATE`` req/s (Poisson), the
  shipped predictor's predictions. Every policy runs with the router's defaults (for
  bid_price the default reward, which counts requests served and latency saved, not the
  BEAR table's quality-and-cost profile: this table compares latency).

Each (scenario, seed) is one list of requests: arrival time, prompt text (the synthetic
prompt; for ``olp`` a filler text of the trace's prompt length in words), ``max_tokens``
2,048 (above every output of both workloads but a handful) and the TTFT target. The output length is
what the emulated model generates for that prompt (``olproute emulate --truth``: the
prompt's true length on that model, capped at ``max_tokens``), and the simulator's truth
is the same number. Prompt tokens are counted as the router and the emulator count them
(whitespace words).

* **sim**: ``olproute.sim.scenario.simulate`` on those requests, with the predictions the
  simulator gives (``olp``: the truth +/-20%; ``bear``: the shipped predictor).
* **live**: ``olproute emulate`` (its own process; same models, GPUs and batch-time
  ground truth as the simulator, seeded alike) and ``olproute serve`` (its own process,
  the scenario's config with the emulators as backends; its calibration is the
  simulator's profiling run, as ``serve`` builds it), and this process as the client:
  each request is sent at its arrival time as a streamed completion with its TTFT target
  in ``x-slo-ttft-ms``, asking for model ``auto`` (an alias of the whole pool). Times are
  real: arrivals and batch times are not compressed (factor 1). The router runs on real
  seconds (its slots, TTFT targets, patience and calibration), and scaling its clock with
  the emulators' ``--time-scale`` is not built; the three processes use about a fifth of
  this machine's two cores at these rates (the CPU figure), so a compressed run would fit.
  The emulators stream every ``STREAM_INTERVAL`` tokens (vLLM's ``--stream-interval``),
  which leaves TTFT and end-to-end latency unchanged.

What the live path lacks, measured for bid_price (the policy that reads predictions and
snapshots) as further simulator runs on the same requests, each adding one thing live
has and the simulator does not: ``sim_live_predictions``, the live router's predictions
(the shipped predictor on the prompt text, capped at max_tokens, in place of the
simulator's); ``sim_live_predictions_router_view``, also the snapshots a router rebuilds
from its own traffic (``sim.snapshot_view: router``, ``olproute.routing.tracked``) in place of
the engines' exact state. What remains between the last and live is the live path
itself: HTTP, the processes sharing two cores (the router's decision time and event-loop
lag are reported), streamed token counts arriving every ``STREAM_INTERVAL`` tokens, and
the emulator's real-time batches.

Per policy and mode: mean / P95 end-to-end latency (EEL) and mean TTFT over the served
requests, TTFT attainment (TTFT within target, over all requests), served fraction and
served tokens per second (prompt + output over first arrival to last finish). Live also
reports refusals by reason, failures, the client's lateness in sending and the machine's
CPU use.

Goals (issue 17): live round robin's mean EEL within 10% of simulated round robin's;
bid_price's relative gain over round robin on mean EEL live within 20% of its simulated
gain (-28% simulated -> at least -22.4% live).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import (
    REPORT_SEEDS,
    add_harness_args,
    add_quick_arg,
    begin,
    fmt_spread,
    free_port,
    spread,
    stop_process,
    wait_healthy,
    write_results,
)
from olproute.config.loader import Config, LoadedConfig, load_profiles
from olproute.server.schema import count_words
from olproute.sim.metrics import eel_s, ttft_s
from olproute.sim.scenario import CalibrationSource, build_requests, simulate
from olproute.types import Request

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
POLICIES = ("round_robin", "least_outstanding", "bid_price")
ATTRIBUTED = ("bid_price",)  # policies reading predictions and snapshots
SCENARIOS = ("olp", "bear")
OLP_RATE = 24.0             # the OLP table's overloaded rate
OLP_CONTEXT = 16384         # Llama-2-7B's context for the olp scenario (see below)
BEAR_RATE = 20.0            # the BEAR table's lowest rate
MAX_TOKENS = 2048           # olproute.sim.prompts.MAX_DECODE_TOKENS
STREAM_INTERVAL = 8
NUM_REQUESTS = {"olp": 4000, "bear": 1500}  # olp: the OLP table's 4,000
QUICK_REQUESTS = {"olp": 60, "bear": 40}
LAG_WINDOW_S = 20.0         # the router's loop lag is read over windows this long
GOAL_RR = 0.10              # |live RR / sim RR - 1| on mean EEL
GOAL_GAIN = 0.20            # live gain >= (1 - 0.2) x simulated gain
# the model clients ask for: a name no instance serves, routed to the whole pool by
# ``server.any_model`` (a pool model's name would confine the router to that model's
# instances)
ANY_MODEL = "auto"
FILLER = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


# -- the requests ----------------------------------------------------------------------------
@dataclass
class Case:
    """One (scenario, seed): the simulator's config, the requests (with text and their
    true output length on every model of the pool), each request's max_tokens, and the
    config sections each policy runs with."""

    scenario: str
    seed: int
    loaded: LoadedConfig
    requests: list[Request]
    max_tokens: list[int]
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def config(self, policy: str) -> LoadedConfig:
        """The config ``policy`` runs with: whole sections of ``sections[policy]`` over
        the case's (the router section merged), validated as a loaded file is."""
        data = self.loaded.config.model_dump(mode="json")
        for section, values in self.sections.get(policy, {}).items():
            data[section] = {**data["router"], **values} if section == "router" else values
        data["router"]["policy"] = policy
        return LoadedConfig(self.loaded.path, Config.model_validate(data),
                            self.loaded.profiles)


def _long_context_profiles(tmp: Path) -> Path:
    """configs/profiles.yaml with Llama-2-7B's context at ``OLP_CONTEXT`` tokens: the OLP
    table's engines serve every splitwise_conv row (the simulator has no context limit;
    its longest prompt + output is 14,089 tokens), and the emulator, as vLLM, refuses a
    request longer than its model's context."""
    data = yaml.safe_load((REPO / "configs" / "profiles.yaml").read_text())
    data["models"]["llama-2-7b"]["max_context_tokens"] = OLP_CONTEXT
    out = tmp / "profiles-long-context.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _filler(request_id: int, seed: int, words: int) -> str:
    """A prompt of ``words`` words, distinct per request and seed."""
    rng = np.random.default_rng([seed, request_id, 17])
    idx = rng.integers(0, len(FILLER), words)
    return " ".join(FILLER[i] for i in idx)


def olp_case(seed: int, num_requests: int, tmp: Path) -> Case:
    import olp_table

    base = olp_table.scenario(OLP_RATE, num_requests, seed)
    profiles = _long_context_profiles(tmp)
    data = base.config.model_dump(mode="json")
    data["profiles"] = str(profiles)
    data["workload"]["lengths_path"] = str(TRACE)
    loaded = LoadedConfig(base.path, Config.model_validate(data), load_profiles(profiles))
    reqs = [replace(r, text=_filler(r.request_id, seed, r.prompt_tokens))
            for r in build_requests(loaded)]
    return Case("olp", seed, loaded, reqs, [MAX_TOKENS] * len(reqs))


def bear_case(seed: int, num_requests: int, predictor_dir: Path) -> Case:
    import bear_table

    point = bear_table.Point("poisson", "poisson", 1.0, BEAR_RATE, num_requests, seed)
    loaded = bear_table._loaded(point, prediction={"mode": "predictor",
                                                    "model_dir": str(predictor_dir)})
    reqs = build_requests(loaded)
    # the router and the emulator count whitespace words; the generator counted its own
    # tokens (punctuation apart): the requests carry the count both live sides see
    reqs = [replace(r, prompt_tokens=max(count_words(r.text or ""), 1)) for r in reqs]
    # a model answers a prompt one way: where the generator drew the same text twice
    # (short instruction prompts repeat), both requests get the first one's true lengths
    first: dict[str, Request] = {}
    for k, r in enumerate(reqs):
        f = first.setdefault(str(r.text), r)
        if f is not r:
            reqs[k] = replace(r, decode_tokens=f.decode_tokens,
                              decode_tokens_by_model=f.decode_tokens_by_model)
    return Case("bear", seed, loaded, reqs, [MAX_TOKENS] * len(reqs))


def write_truth(case: Case, tmp: Path) -> Path:
    """The emulator's ``--truth`` file: every request's prompt and true output length on
    each model of the pool (CSV: prompt, model, output_tokens)."""
    models = list(dict.fromkeys(s.model for s in case.loaded.specs))
    path = tmp / f"{case.scenario}-{case.seed}-truth.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("prompt", "model", "output_tokens"))
        w.writerows((str(r.text), m, r.true_decode_tokens(m))
                    for r in case.requests for m in models)
    return path


def predictor_dir() -> Path:
    """The predictor ``olproute serve`` loads by default, which the simulator uses too."""
    from olproute.predict import SHIPPED_DIR

    return Path(SHIPPED_DIR)


# -- the simulator ---------------------------------------------------------------------------
@dataclass
class PerRequest:
    """What one mode measured of each request (seconds from its arrival; NaN when it
    never happened)."""

    ttft: np.ndarray
    eel: np.ndarray
    served: np.ndarray
    target: np.ndarray
    tokens: np.ndarray        # prompt + output of served requests (0 otherwise)
    arrival: np.ndarray
    instance: list[str | None] | None = None  # live: the instance that served each

    def figures(self) -> dict[str, float]:
        s = self.served
        ttft, eel = self.ttft[s], self.eel[s]
        finish = (self.arrival + self.eel)[s]
        span = float(finish.max() - self.arrival.min()) if s.any() else math.nan
        return {
            "eel_mean_s": float(eel.mean()) if s.any() else math.nan,
            "eel_p95_s": float(np.percentile(eel, 95)) if s.any() else math.nan,
            "ttft_mean_s": float(ttft.mean()) if s.any() else math.nan,
            "ttft_attainment": float((s & (self.ttft <= self.target)).mean()),
            "served_fraction": float(s.mean()),
            "tokens_per_s": float(self.tokens[s].sum() / span) if s.any() else math.nan,
        }


def live_predictions(case: Case) -> list[Request]:
    """The requests with the predictions ``olproute serve`` makes of them: its
    ``PoolPredictor`` (the shipped predictor on the prompt text, for every model of the
    pool, capped at the request's max_tokens), as ``Router.new_request`` calls it."""
    from olproute.predict import PoolPredictor, Predictor

    pool = PoolPredictor(Predictor.load(predictor_dir()),
                         [s.model for s in case.loaded.specs])
    out = []
    for r, mt in zip(case.requests, case.max_tokens, strict=True):
        found = pool.predict(str(r.text), mt)
        assert found is not None  # the shipped predictor knows every model of both pools
        out.append(replace(r, predicted_decode_tokens=found.decode_tokens,
                           predicted_decode_by_model=found.decode_by_model,
                           predicted_quality_by_model=found.quality_by_model))
    return out


def run_sim(case: Case, policy: str, cal: CalibrationSource,
            requests: Sequence[Request] | None = None, view: str = "engine") -> PerRequest:
    """The simulator on the case's requests (or ``requests``: the same with other
    predictions), outputs capped at max_tokens as the emulator caps them; ``view`` what
    snapshot-reading policies see (``sim.snapshot_view``)."""
    loaded = case.config(policy)
    if view != "engine":
        loaded = loaded.with_updates(sim=loaded.config.sim.model_copy(
            update={"snapshot_view": view}))
    reqs = [replace(r, decode_tokens=min(r.decode_tokens, mt),
                    decode_tokens_by_model=None if r.decode_tokens_by_model is None else {
                        m: min(v, mt) for m, v in r.decode_tokens_by_model.items()})
            for r, mt in zip(requests or case.requests, case.max_tokens, strict=True)]
    res = simulate(loaded, policy, reqs, calibration=cal)
    served = ~res.shed & np.isfinite(res.finish_s)
    prompt = np.array([r.prompt_tokens for r in reqs], dtype=np.float64)
    return PerRequest(ttft=ttft_s(res), eel=eel_s(res), served=served,
                      target=np.array([r.ttft_target_s for r in reqs]),
                      tokens=np.where(served, prompt + res.decode_tokens, 0.0),
                      arrival=np.array([r.arrival_s for r in reqs]))


def attribution(case: Case, policy: str, cal: CalibrationSource) -> dict[str, dict[str, float]]:
    """The simulator given, one at a time, what the live path lacks: the live router's
    predictions, then also its rebuilt snapshots (``sim.snapshot_view: router``)."""
    live_pred = live_predictions(case)
    return {"live_predictions": run_sim(case, policy, cal, live_pred).figures(),
            "live_predictions_router_view": run_sim(case, policy, cal, live_pred,
                                                    "router").figures()}


# -- live ------------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int = 0
    ttft: float = math.nan
    eel: float = math.nan
    tokens: int = 0
    finish_reason: str | None = None
    complete: bool = False
    reason: str | None = None   # a refusal's or failure's message
    late_s: float = 0.0         # how late the client sent it
    instance: str | None = None  # the instance that served it (x-olproute-instance)


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                target_ms: float, due: float) -> Reply:
    now = time.perf_counter()
    if due > now:
        await asyncio.sleep(due - now)
    rep = Reply(late_s=max(time.perf_counter() - due, 0.0))
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"x-slo-ttft-ms": f"{target_ms:.3f}"}) as resp:
            rep.status = resp.status
            rep.instance = resp.headers.get("x-olproute-instance")
            if resp.status != 200:
                text = await resp.text()
                try:
                    rep.reason = str(json.loads(text)["error"]["message"])
                except (ValueError, KeyError, TypeError):
                    rep.reason = text[:200] or f"HTTP {resp.status}"
                return rep
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    rep.complete = rep.finish_reason is not None
                    rep.eel = time.perf_counter() - due
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    rep.reason = str(chunk["error"].get("message"))
                    continue
                for choice in chunk.get("choices") or []:
                    if choice.get("text") and math.isnan(rep.ttft):
                        rep.ttft = time.perf_counter() - due
                    if choice.get("finish_reason"):
                        rep.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    rep.tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
            if not rep.complete and rep.reason is None:
                rep.reason = "the stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        rep.reason = f"{type(exc).__name__}: {exc}"
    return rep


async def replay(url: str, case: Case) -> tuple[list[Reply], list[float]]:
    """Every request sent at its arrival time (from now), all awaited; and the router's
    event-loop lag p99 (ms) over each ``LAG_WINDOW_S`` of the run."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=1800.0, sock_connect=10.0)
    lags: list[float] = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def sample_lag() -> None:
            while True:
                await asyncio.sleep(LAG_WINDOW_S)
                async with session.get(url + "/debug/loop-lag",
                                       params={"seconds": f"{LAG_WINDOW_S:g}"}) as r:
                    if r.status == 200:
                        lags.append(float((await r.json())["p99_ms"]))

        sampler = asyncio.create_task(sample_lag())
        t0 = time.perf_counter() + 0.5
        tasks = []
        for r, mt in zip(case.requests, case.max_tokens, strict=True):
            body = {"model": ANY_MODEL, "prompt": r.text, "max_tokens": mt,
                    "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(
                _send(session, url, body, r.ttft_target_s * 1e3, t0 + r.arrival_s)))
        replies = list(await asyncio.gather(*tasks))
        sampler.cancel()
        if not lags:  # a run shorter than one window: its whole length
            seconds = min(max(time.perf_counter() - t0, 1.0), LAG_WINDOW_S)
            async with session.get(url + "/debug/loop-lag",
                                   params={"seconds": f"{seconds:.3f}"}) as r:
                if r.status == 200:
                    lags.append(float((await r.json())["p99_ms"]))
    return replies, lags


def _per_request(case: Case, replies: Sequence[Reply]) -> PerRequest:
    """The live figures of each request; which instance served it in ``instance``."""
    served = np.array([r.status == 200 and r.complete for r in replies])
    return PerRequest(ttft=np.array([r.ttft for r in replies]),
                      eel=np.array([r.eel for r in replies]), served=served,
                      target=np.array([r.ttft_target_s for r in case.requests]),
                      tokens=np.array([float(r.tokens) for r in replies]),
                      arrival=np.array([r.arrival_s for r in case.requests]),
                      instance=[r.instance for r in replies])


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as f:  # the child holds its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "olproute.cli", *argv], stdout=f,
                                stderr=subprocess.STDOUT, text=True, env=env)


def _wait_lines(log: Path, proc: subprocess.Popen[str], marker: str,
                limit_s: float = 180.0) -> list[str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        text = log.read_text(errors="replace")
        if marker in text:
            return text.splitlines()
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(map(str, proc.args))} exited with "
                             f"{proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    raise SystemExit(f"no {marker!r} in {log} within {limit_s:g} s")


def _config_file(loaded: LoadedConfig, path: Path,
                 server: dict[str, Any] | None = None) -> Path:
    data = loaded.config.model_dump(mode="json", exclude_none=True)
    data["profiles"] = str(loaded.resolve(loaded.config.profiles))
    wl = data.get("workload", {})
    for key in ("path", "lengths_path"):
        if wl.get(key):
            wl[key] = str(loaded.resolve(wl[key]))
    pred = data.get("prediction", {})
    if pred.get("model_dir"):
        pred["model_dir"] = str(loaded.resolve(pred["model_dir"]))
    if server is not None:
        data["server"] = {**data.get("server", {}), **server}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


# what the live router knows of each engine beyond its own traffic (``--engine-state``):
# nothing (its rebuilt view), the engines' KV events for the exact prefix index alone,
# also for prefill progress (server.prefill_from_kv_events), and also their running
# counts scraped every 100 ms (server.running_from_scrape)
ENGINE_STATES = ("router", "kv_events_index", "kv_events", "kv_events_scrape")


def _backends(lines: Sequence[str], kv_events: bool) -> list[dict[str, Any]]:
    """The emulators' backends from what ``olproute emulate`` printed: each instance's
    line (name, URL), and with KV events the line after it (its PUB and replay sockets)."""
    out: list[dict[str, Any]] = []
    for ln in lines:
        parts = ln.split()
        if parts[1:2] and parts[1].startswith("http"):
            out.append({"name": parts[0], "url": parts[1]})
        elif kv_events and out and parts[:2] == ["KV", "events"]:
            out[-1]["kv_events"] = {"endpoint": parts[2].rstrip(","),
                                    "replay_endpoint": parts[4], "topic": "",
                                    "tokenizer": "words"}
    if kv_events and not all("kv_events" in b for b in out):
        raise SystemExit("olproute emulate printed no KV-events sockets for every instance")
    return out


def run_live(case: Case, policy: str, tmp: Path, truth: Path,
             stream_interval: int = STREAM_INTERVAL,
             engine_state: str = "router") -> tuple[PerRequest, dict[str, Any]]:
    """One live run: emulators and router in processes of their own, this process the
    client; what it measured, and the run's side figures. ``engine_state``: one of
    ENGINE_STATES."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    loaded = case.config(policy)
    tag = f"{case.scenario}-{case.seed}-{policy}-{engine_state}"
    events = engine_state != "router"
    emu_cfg = _config_file(loaded, tmp / f"{tag}-emulate.yaml")
    emu_log = tmp / f"{tag}-emulate.log"
    emu = _start(["emulate", "--config", str(emu_cfg), "--seed", str(case.seed),
                  "--truth", str(truth), "--stream-interval", str(stream_interval),
                  *(["--kv-events-base-port", "0"] if events else [])],
                 emu_log, env)
    serve: subprocess.Popen[str] | None = None
    try:
        lines = _wait_lines(emu_log, emu, "emulated instance(s) serving")
        backends = _backends(lines, events)
        port = free_port()
        extra: dict[str, Any] = ({"prefill_from_kv_events": True}
                                 if events and engine_state != "kv_events_index" else {})
        if engine_state == "kv_events_scrape":
            extra |= {"running_from_scrape": True, "scrape_period_s": 0.1}
        serve_cfg = _config_file(loaded, tmp / f"{tag}-serve.yaml",
                                 {"backends": backends, "port": port,
                                  "host": "127.0.0.1", "any_model": True, **extra})
        serve_log = tmp / f"{tag}-serve.log"
        serve = _start(["serve", "--config", str(serve_cfg)], serve_log, env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, serve, serve_log, poll_s=0.25)
        busy0, total0 = _cpu_busy()
        t0 = time.perf_counter()
        replies, lags = asyncio.run(replay(url, case))
        wall = time.perf_counter() - t0
        busy1, total1 = _cpu_busy()
        metrics = asyncio.run(_scrape(url))
    finally:
        if serve is not None:
            stop_process(serve, 60.0)
        stop_process(emu, 60.0)
    reasons: dict[str, int] = {}
    for r in replies:
        if not (r.status == 200 and r.complete):
            key = f"{r.status} {r.reason}"
            reasons[key] = reasons.get(key, 0) + 1
    late = np.array([r.late_s for r in replies])
    side = {"wall_s": wall, "cpu_busy": (busy1 - busy0) / max(total1 - total0, 1e-9),
            "client_late_p99_s": float(np.percentile(late, 99)),
            "not_served": reasons,
            "finish_reasons": {k: sum(r.finish_reason == k for r in replies)
                               for k in ("stop", "length")},
            "decision_us": _decision_mean(metrics),
            "loop_lag_p99_ms": max(lags, default=math.nan)}
    return _per_request(case, replies), side


def _decision_mean(text: str) -> dict[str, float]:
    """Mean decision time (us) from the router's /metrics histogram."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("olproute_decision_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("olproute_decision_seconds_count"):
            count += float(line.split()[-1])
    return {"mean": 1e6 * total / count if count else math.nan, "count": count}


# -- the table -------------------------------------------------------------------------------
def gain(policy: dict[str, float], rr: dict[str, float], key: str = "eel_mean_s") -> float:
    return policy[key] / rr[key] - 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_quick_arg(ap, "few requests, one seed")
    add_harness_args(ap, digest=True)
    ap.add_argument("--seeds", help="comma-separated seeds (default: the report seeds)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, help="requests per scenario")
    ap.add_argument("--keep", metavar="DIR", help="keep configs and logs in DIR")
    ap.add_argument("--stream-interval", type=int, default=STREAM_INTERVAL,
                    help="the emulators' stream interval (default: %(default)s)")
    ap.add_argument("--engine-state", action="store_true",
                    help="also run bid_price live with the engines' KV events for its "
                         "prefix index (live_kv_events_index), for prefill progress too "
                         "(live_kv_events), and with their running counts scraped every "
                         "100 ms too (live_kv_events_scrape)")
    ap.add_argument("--live-only", action="store_true",
                    help="skip the simulator's attribution runs (sim and live only)")
    args = ap.parse_args()
    begin(args, ap)
    seeds = ([int(s) for s in args.seeds.split(",")] if args.seeds
             else list(REPORT_SEEDS[:1] if args.quick else REPORT_SEEDS))
    scenarios = [s for s in args.scenarios.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown {s!r} (known: {', '.join(SCENARIOS)})")
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="live-table-"))
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"scenarios": []}
    for scenario in scenarios:
        n = args.requests or (QUICK_REQUESTS if args.quick else NUM_REQUESTS)[scenario]
        per_seed: dict[str, dict[str, list[dict[str, float]]]] = {p: {} for p in policies}
        sides: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for seed in seeds:
            case = (olp_case(seed, n, tmp) if scenario == "olp"
                    else bear_case(seed, n, predictor_dir()))
            truth = write_truth(case, tmp)
            cal = CalibrationSource(case.loaded)
            for policy in policies:
                t0 = time.perf_counter()
                sim = run_sim(case, policy, cal).figures()
                modes = {"sim": sim}
                if policy in ATTRIBUTED and not args.live_only:
                    modes |= {f"sim_{k}": v for k, v in attribution(case, policy, cal).items()}
                live_pr, side = run_live(case, policy, tmp, truth, args.stream_interval)
                live = modes["live"] = live_pr.figures()
                if args.engine_state and policy in ATTRIBUTED:
                    for state in ENGINE_STATES[1:]:
                        modes[f"live_{state}"] = run_live(
                            case, policy, tmp, truth, args.stream_interval, state)[0].figures()
                for mode, figures in modes.items():
                    per_seed[policy].setdefault(mode, []).append(figures)
                sides[policy].append(side)
                print(f"[{scenario} seed {seed} {policy}] sim EEL {sim['eel_mean_s']:.3f} s, "
                      f"live {live['eel_mean_s']:.3f} s; served {live['served_fraction']:.3f}"
                      f"; {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        out["scenarios"].append(_summarise(scenario, seeds, per_seed, sides))
    print(table(out))
    if args.json:
        write_results(args.json, out, seeds)
        print(f"wrote {args.json}")


def _summarise(name: str, seeds: Sequence[int],
               per_seed: dict[str, dict[str, list[dict[str, float]]]],
               sides: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    policies: dict[str, Any] = {}
    for p, modes in per_seed.items():
        entry: dict[str, Any] = {}
        for mode, runs in modes.items():
            entry[mode] = {k: spread([r[k] for r in runs])[0] for k in runs[0]}
            entry[mode]["per_seed"] = runs
        entry["live_side"] = sides[p]
        policies[p] = entry
    goals: dict[str, Any] = {}
    if "round_robin" in per_seed:
        rr = per_seed["round_robin"]
        ratio = [lv["eel_mean_s"] / sm["eel_mean_s"] - 1.0
                 for sm, lv in zip(rr["sim"], rr["live"], strict=True)]
        goals["rr_live_vs_sim"] = {"per_seed": ratio, "mean": spread(ratio)[0],
                                   "met": all(abs(x) <= GOAL_RR for x in ratio)}
        if "bid_price" in per_seed:
            bp = per_seed["bid_price"]
            g_sim = [gain(b, r) for b, r in zip(bp["sim"], rr["sim"], strict=True)]
            g_live = [gain(b, r) for b, r in zip(bp["live"], rr["live"], strict=True)]
            met = all(gl <= (1 - GOAL_GAIN) * gs for gs, gl in zip(g_sim, g_live, strict=True))
            goals["bid_price_gain"] = {"sim": g_sim, "live": g_live, "met": met}
    return {"name": name, "seeds": list(seeds), "policies": policies, "goals": goals}


def table(out: dict[str, Any]) -> str:
    cols = ("eel_mean_s", "eel_p95_s", "ttft_mean_s", "ttft_attainment", "served_fraction",
            "tokens_per_s")
    lines = []
    for sc in out["scenarios"]:
        lines.append(f"\n{sc['name']} (seeds {','.join(map(str, sc['seeds']))}; mean "
                     "[min-max] over seeds)")
        head = f"{'policy':<18} {'mode':<33} " + " ".join(f"{c:>22}" for c in cols)
        lines += [head, "-" * len(head)]
        for p, entry in sc["policies"].items():
            for mode in [m for m in entry if m != "live_side"]:
                runs = entry[mode]["per_seed"]
                cells = [fmt_spread([r[c] for r in runs], "{:.3f}" if "tokens" not in c
                                    else "{:.0f}") for c in cols]
                lines.append(f"{p:<18} {mode:<33} " + " ".join(f"{c:>22}" for c in cells))
        g = sc["goals"]
        if "rr_live_vs_sim" in g:
            x = g["rr_live_vs_sim"]
            lines.append(f"round robin live vs sim, mean EEL: "
                         f"{fmt_spread(x['per_seed'], '{:+.1%}')} (goal within "
                         f"{GOAL_RR:.0%}: {'met' if x['met'] else 'MISSED'})")
        if "bid_price_gain" in g:
            x = g["bid_price_gain"]
            lines.append(f"bid_price vs round robin, mean EEL: sim "
                         f"{fmt_spread(x['sim'], '{:+.1%}')}, live "
                         f"{fmt_spread(x['live'], '{:+.1%}')} (goal live within "
                         f"{GOAL_GAIN:.0%} of sim: {'met' if x['met'] else 'MISSED'})")
        for p, entry in sc["policies"].items():
            for side in entry["live_side"]:
                lines.append(f"  live {p}: CPU {side['cpu_busy']:.0%} of the machine, "
                             f"client late p99 {side['client_late_p99_s'] * 1e3:.1f} ms, "
                             f"decision mean {side['decision_us']['mean']:.0f} us, "
                             f"loop lag p99 (worst {LAG_WINDOW_S:g} s) "
                             f"{side['loop_lag_p99_ms']:.1f} ms, "
                             f"finish {side['finish_reasons']}, not served "
                             f"{side['not_served'] or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
