"""How well BEA predicts a real vLLM's time to first token with beta from three sources:
(i) the profile's guess (``calibration: auto`` of configs/vllm_cpu.yaml: the simulator's
roofline of tiny-llama on cpu-2core, profiled in the simulator), (ii) an offline sweep of
the server over HTTP (``olproute calibrate --backend``'s, ``olproute.estimate.sweep``), (iii) beta
refitted online from the held-out run's own streams (``olproute.estimate.streamcal``, as the
router does for a backend without batch records; prequential: a request's estimate
uses only rows settled before it, starting from (i)).

    python bench/vllm_calibration.py [--json PATH] [--quick] [--seed N] [--url URL]

One vLLM CPU server (``bench/vllm_cpu.py``: the tiny random-weight Llama, max 16 seqs,
512 batched tokens, blocks of 32, eager) is started; it is swept; then a held-out seeded
Poisson run (other prompts; prompts of 16 to 512 tokens, 32 to 96 output tokens with
``ignore_eos``, at ``--load`` of the sweep's saturated service rate) is sent straight to
it while a ``olproute.server.tracker.Tracker`` mirrors the traffic, as the router's does.
At each dispatch BEA estimates the request's TTFT on the tracker's snapshot (as the
server's policies call it, the request's exact output length as its prediction: the
length predictor is not what is measured here) with each beta. The table gives TTFT
MAPE and bias (mean signed relative error) of each, over all requests and split by
whether the server had other requests in flight (idle: the snapshot is exact, the error
is beta's and the dispatch overhead's; busy: what the tracker cannot see of the engine
adds), and each beta with the sweep's dispatch overhead (the time to first token beyond
the engine's steps, fitted beside beta) added to its estimates.

The machine's other tenants time-share its two cores with vLLM's engine, its API server
and this client: every figure moves from run to run; this reports one run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import (
    add_harness_args,
    begin,
    fmt_spread,
    free_port,
    seed_figure,
    write_results,
)
from olproute.config.loader import REPO_ROOT, load_config
from olproute.estimate.bea import BeaEstimator
from olproute.estimate.calibration import Beta, InstanceCalibration
from olproute.estimate.streamcal import StreamCalibrator
from olproute.estimate.sweep import (
    MAX_TOKEN_ID,
    MIN_TOKEN_ID,
    QUICK_PLAN,
    SweepPlan,
    SweepResult,
    backend_model,
    sse_tokens,
    sweep_backend,
)
from olproute.server.tracker import Tracker
from olproute.sim.scenario import CalibrationSource
from olproute.types import InstanceSpec, Request, RoutingContext
from tests.support.vllm_cpu import VllmServer, build_tiny_model

CONFIG = REPO_ROOT / "configs" / "vllm_cpu.yaml"
LAG_S = 0.02   # a client timer this late is a stall of the client
BETAS = ("profile", "sweep", "online")


@dataclass
class Sample:
    """One held-out request: its prompt and output tokens, the requests in flight at its
    dispatch (idle: none), each estimate (s), and its measured TTFT (s, from its send)."""

    prompt_tokens: int
    output_tokens: int
    in_flight: int
    estimates: dict[str, float]
    ttft_s: float = math.nan
    sent_s: float = math.nan

    @property
    def idle(self) -> bool:
        return self.in_flight == 0


@dataclass
class HeldOut:
    """The held-out run as the bench mirrors it."""

    spec: InstanceSpec
    url: str
    model: str
    estimators: dict[str, BeaEstimator]
    online: StreamCalibrator
    overhead_s: float
    tracker: Tracker = field(init=False)
    samples: list[Sample] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    # (start, end) of each time this client's event loop ran a timer LAG_S late or more
    stalls: list[tuple[float, float]] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    refits: list[tuple[int, Beta]] = field(default_factory=list)   # (request, beta)

    def __post_init__(self) -> None:
        self.tracker = Tracker([self.spec], [self.url])

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def watch_lag(self, period_s: float = 0.005) -> None:
        """Record how late this client's event loop runs a timer (its own starvation:
        a stalled client sees tokens late and sends requests late)."""
        while True:
            due = self.now() + period_s
            await asyncio.sleep(period_s)
            late = self.now() - due
            self.lags.append(late)
            if late >= LAG_S:
                self.stalls.append((due, due + late))

    def stalled(self, sample: Sample) -> bool:
        """Did the client stall between the request's send and its first token?"""
        end = sample.sent_s + sample.ttft_s
        return any(a < end and sample.sent_s < b for a, b in self.stalls)

    def estimate(self, req: Request, now: float) -> Sample:
        """Each beta's TTFT of ``req`` on the tracker's snapshot now; (iii)'s beta first
        refitted from the rows settled so far."""
        if self.online.consume(self.tracker.backends[0].recorder.drain()):
            self.estimators["online"].set_beta(0, self.online.beta)
            self.refits.append((req.request_id, self.online.beta))
        ctx = RoutingContext(request=req, now_s=now, instances=self.tracker.loads(now),
                             specs=(self.spec,), snapshots=(self.tracker.snapshot(0, now),))
        est = {name: float(e.estimate(ctx).ttft_s[0]) for name, e in self.estimators.items()}
        return Sample(req.prompt_tokens, req.decode_tokens,
                      len(self.tracker.backends[0].flights), est)

    async def request(self, session: aiohttp.ClientSession, req: Request,
                      prompt: list[int]) -> None:
        sample = self.estimate(req, self.now())
        self.samples.append(sample)
        now = sample.sent_s = self.now()   # the estimates' time is not the server's
        self.tracker.dispatched(0, req, now)
        body = {"model": self.model, "prompt": prompt, "max_tokens": req.decode_tokens,
                "stream": True, "ignore_eos": True, "return_token_ids": True}
        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                pending = b""
                async for chunk in resp.content.iter_any():
                    lines = (pending + chunk).split(b"\n")
                    pending = lines.pop()
                    n = sum(sse_tokens(line)[0] for line in lines if line)
                    if n:
                        t = self.now()
                        if math.isnan(sample.ttft_s):
                            sample.ttft_s = t - now
                        self.tracker.token(0, req.request_id, t, n)
        finally:
            self.tracker.finished(0, req.request_id)


async def held_out_run(run: HeldOut, num: int, rate_per_s: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    watch = asyncio.create_task(run.watch_lag())
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        due = run.now()
        for rid in range(num):
            due += float(rng.exponential(1.0 / rate_per_s))
            prompt_tokens = int(rng.integers(16, 513))
            output = int(rng.integers(32, 97))
            prompt = rng.integers(MIN_TOKEN_ID, MAX_TOKEN_ID, prompt_tokens).tolist()
            await asyncio.sleep(max(0.0, due - run.now()))
            req = Request(request_id=rid, arrival_s=run.now(), prompt_tokens=prompt_tokens,
                          decode_tokens=output, predicted_decode_tokens=output,
                          ttft_target_s=10.0)
            tasks.append(asyncio.create_task(run.request(session, req, prompt)))
            if rid % 50 == 49:
                print(f"held-out: {rid + 1}/{num} sent", file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
    watch.cancel()


def relative_errors(samples: list[Sample], name: str, add_s: float = 0.0) -> np.ndarray:
    """estimate / measured - 1 of one estimate over the samples."""
    return np.array([(s.estimates[name] + add_s) / s.ttft_s - 1.0 for s in samples
                     if math.isfinite(s.ttft_s) and s.ttft_s > 0])


def errors(samples: list[Sample], name: str, add_s: float = 0.0) -> tuple[float, float]:
    """(MAPE, bias) of one estimate over samples (fractions)."""
    rel = relative_errors(samples, name, add_s)
    if rel.size == 0:
        return math.nan, math.nan
    return float(np.mean(np.abs(rel))), float(np.mean(rel))


def _cal(beta: Beta) -> InstanceCalibration:
    return InstanceCalibration(beta=beta, prefill_tokens_per_s=1.0, tpot_s=1.0,
                               mean_batch_seqs=1.0)


async def sweep(url: str, spec: InstanceSpec, plan: SweepPlan) -> tuple[SweepResult, str]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model, length = await backend_model(session, spec.name, url, spec, "tiny")
        result = await sweep_backend(
            session, spec.name, url, model, spec, length or 1024, plan,
            progress=lambda m: print(m, file=sys.stderr, flush=True))
    return result, model


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'beta':<10} {'beta0 ms':>9} {'beta1 us':>9} {'beta2 ns':>9} {'beta3 ps':>10}"
             f" {'MAPE %':>7} {'bias %':>7} {'MdAPE %':>8} {'idle':>6} {'busy':>6}"
             f" {'quiet':>6} {'+ovh MAPE':>9} {'+ovh bias':>9}"]
    for name in BETAS:
        b = doc["beta"][name]
        lines.append(
            f"{name:<10} {b[0] * 1e3:>9.3f} {b[1] * 1e6:>9.3f} {b[2] * 1e9:>9.3f} "
            f"{b[3] * 1e12:>10.1f} {doc['ttft_mape'][name] * 100:>7.1f} "
            f"{doc['ttft_bias'][name] * 100:>7.1f} {doc['ttft_mdape'][name] * 100:>8.1f} "
            f"{doc['idle_mape'][name] * 100:>6.1f} {doc['busy_mape'][name] * 100:>6.1f} "
            f"{doc['quiet_mape'][name] * 100:>6.1f} "
            f"{doc['ttft_mape'][name + '+overhead'] * 100:>9.1f} "
            f"{doc['ttft_bias'][name + '+overhead'] * 100:>9.1f}")
    lines.append("MAPE, bias: all requests; MdAPE: median; idle / busy: MAPE of the requests "
                 "sent with nothing / something in flight; quiet: MAPE of those during whose "
                 f"wait this client never ran {LAG_S * 1e3:.0f} ms late; +ovh: each estimate "
                 "plus the sweep's dispatch overhead")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_harness_args(ap)
    ap.add_argument("--quick", action="store_true",
                    help="the quick sweep and 100 held-out requests (default: 300)")
    ap.add_argument("--seeds", default="1", help="held-out runs' seeds, comma-separated "
                    "(default: %(default)s; the sweep's prompts are seed 0's), each with a "
                    "sweep of its own on one server")
    ap.add_argument("--url", help="a vLLM server already serving the tiny model as "
                    "'tiny' with the flags above (default: start one)")
    ap.add_argument("--load", type=float, default=0.65,
                    help="held-out arrival rate over the sweep's saturated service rate "
                         "(default: %(default)s)")
    args = ap.parse_args()
    begin(args, ap)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: expected integers separated by commas, got {args.seeds!r}")
    loaded = load_config(CONFIG)
    spec = loaded.specs[0]
    profile = CalibrationSource(loaded)()[0].beta   # (i): calibration: auto
    if args.url:
        docs = [run(args.url.rstrip("/"), spec, profile, args, seed) for seed in seeds]
    else:
        docs = run_started(spec, profile, args, seeds)
    for seed, doc in zip(seeds, docs, strict=True):
        if len(seeds) > 1:
            print(f"seed {seed}:")
        report(doc)
    out: dict[str, Any] = docs[0]
    if len(seeds) > 1:
        out = {"seeds": seeds, "runs": docs}
        for key in ("ttft_mape", "ttft_bias"):
            out[key] = {name: seed_figure([d[key][name] for d in docs])
                        for name in docs[0][key]}
        print(f"over seeds {args.seeds}, mean [min-max] TTFT MAPE % / bias %:")
        for name in docs[0]["ttft_mape"]:
            print(f"  {name:<18} {fmt_spread([d['ttft_mape'][name] for d in docs], '{:.1f}', 100)}"
                  f"  {fmt_spread([d['ttft_bias'][name] for d in docs], '{:+.1f}', 100)}")
    if args.json:
        write_results(args.json, out, seeds)
    return 0


def report(doc: dict[str, Any]) -> None:
    """One run's table and its summary line."""
    print(table(doc))
    print(f"sweep: {doc['sweep_s']:.1f} s, {doc['rows']['prefill']} prefill + "
          f"{doc['rows']['decode']} decode rows, fit MAPE {doc['sweep_fit_mape'] * 100:.1f}%,"
          f" dispatch overhead {doc['overhead_s'] * 1e3:.2f} ms, saturated "
          f"{doc['saturated_rate_per_s']:.2f} req/s; held-out: {doc['num_requests']} "
          f"requests at {doc['rate_per_s']:.2f}/s ({doc['num_idle']} idle at dispatch, "
          f"{doc['num_quiet']} quiet; client loop lag p99 {doc['client_lag_ms']['p99']:.0f} "
          f"ms, max {doc['client_lag_ms']['max']:.0f} ms), "
          f"{doc['online_refits']} online refits ({doc['online_rows']['prefill']} prefill +"
          f" {doc['online_rows']['decode']} decode rows at the end)")


def run_started(spec: InstanceSpec, profile: Beta, args: argparse.Namespace,
                seeds: list[int]) -> list[dict[str, Any]]:
    """``run`` for each seed on a vLLM server started here (and stopped after)."""
    with tempfile.TemporaryDirectory(prefix="olproute-vllm-cal-") as tmp:
        server = VllmServer("tiny", free_port(), build_tiny_model(Path(tmp) / "model"),
                            Path(tmp) / "vllm.log")
        t = time.perf_counter()
        server.start()
        try:
            server.wait_ready()
            print(f"vLLM ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            return [run(server.url, spec, profile, args, seed) for seed in seeds]
        finally:
            server.stop()


def run(url: str, spec: InstanceSpec, profile: Beta, args: argparse.Namespace,
        seed: int) -> dict[str, Any]:
    """Sweep the server at ``url``, then the held-out run: the figures."""
    plan = QUICK_PLAN if args.quick else SweepPlan()
    swept, model = asyncio.run(sweep(url, spec, plan))
    mu = swept.calibration.service_rate_per_s or 1.0
    rate = args.load * mu
    betas = {"profile": profile, "sweep": swept.calibration.beta, "online": profile}
    held = HeldOut(spec, url, model,
                   {k: BeaEstimator([spec], [_cal(b)]) for k, b in betas.items()},
                   StreamCalibrator(profile, spec.max_num_batched_tokens, spec.max_num_seqs,
                                    refit_every=32, min_prefill_rows=16, min_decode_rows=16),
                   swept.overhead_s)
    num = 100 if args.quick else 300
    asyncio.run(held_out_run(held, num, rate, seed))
    betas["online"] = held.online.beta
    samples = held.samples
    idle = [s for s in samples if s.idle]
    busy = [s for s in samples if not s.idle]
    quiet = [s for s in samples if not held.stalled(s)]
    doc: dict[str, Any] = {"ttft_mape": {}, "ttft_bias": {}, "ttft_mdape": {},
                           "idle_mape": {}, "busy_mape": {}, "quiet_mape": {},
                           "beta": betas}
    for name in BETAS:
        for suffix, add in (("", 0.0), ("+overhead", swept.overhead_s)):
            doc["ttft_mape"][name + suffix], doc["ttft_bias"][name + suffix] = errors(
                samples, name, add)
        doc["idle_mape"][name] = errors(idle, name)[0]
        doc["busy_mape"][name] = errors(busy, name)[0]
        doc["quiet_mape"][name] = errors(quiet, name)[0]
        doc["ttft_mdape"][name] = float(np.median(np.abs(relative_errors(samples, name))))
    doc.update(
        seed=seed, sweep_s=swept.duration_s, sweep_fit_mape=swept.fit_mape,
        overhead_s=swept.overhead_s,
        rows={"prefill": swept.num_prefill_rows, "decode": swept.num_decode_rows},
        saturated_rate_per_s=mu, rate_per_s=rate, num_requests=len(samples),
        num_idle=len(idle), num_quiet=len(quiet), online_refits=held.online.num_refits,
        client_lag_ms={"p50": float(np.median(held.lags)) * 1e3,
                       "p99": float(np.percentile(held.lags, 99)) * 1e3,
                       "max": float(np.max(held.lags)) * 1e3},
        online_rows={"prefill": held.online.num_prefill_rows,
                     "decode": held.online.num_decode_rows},
        online_overhead_s=held.online.overhead_s,
        online_betas=[{"before_request": i, "beta": b} for i, b in held.refits],
        sweep_calibration=swept.calibration.as_dict(),
        measured_ttft_s={"mean": float(np.nanmean([s.ttft_s for s in samples])),
                         "p50": float(np.nanmedian([s.ttft_s for s in samples]))},
        multi_token_events=swept.num_multi_token_events, sweep_events=swept.num_events,
        samples=[{"prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
                  "in_flight": s.in_flight, "ttft_s": s.ttft_s,
                  "client_stalled": held.stalled(s), **s.estimates}
                 for s in samples])
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
