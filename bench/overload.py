"""Overload: streamed load at twice the rate the default router sustains, against
``olproute serve`` on the embedded default (configs/default.yaml: bid_price in front of
four emulated Llama-2-7B / A100 engines), and what the router does about it.

    python bench/overload.py [--minutes N] [--json PATH] [--step-s S] [--seed S]

1. Start ``olproute serve`` in a process of its own on a free port (configs/default.yaml
   with ``server.emulator_exact_lengths``: every request generates its ``max_tokens``),
   and measure the idle TTFT of a small probe request.
2. Ramp: Poisson arrivals of streamed completions with splitwise_conv lengths (prompts
   sent as token ids, ``max_tokens`` the trace's output length, which exact lengths make
   the length generated), at 4, 8, 12, ... req/s, ``--step-s`` seconds each. The
   sustainable rate is the last one where at most 1% of requests are refused, none
   fails, and the served requests' P99 TTFT is within the default TTFT target (2 s).
3. Overload: twice that rate for ``--minutes`` (default 10). Every request's status,
   TTFT and whether its stream completed are recorded; every 10 s the server's RSS, its
   loop lag (``olproute_loop_lag_seconds``), which backends it holds down and its failed
   health probes.
4. Recovery: from the last arrival, the probe request every 0.25 s; ``recover_s`` is the
   time until three probes in a row have a normal TTFT: within the served P90 TTFT of the
   last sustained ramp step (what a request sees at the sustainable load), and at least
   2x the idle TTFT + 50 ms.
5. SIGTERM, and how long the server takes to exit.

The goals (issue 20): errors + connection failures = 0; every 200 stream complete;
backends never marked down by the router's own lag; recover_s <= 5; RSS growth <= 10%
after the first minute. The client shares this machine's cores with the server; its
own timing is in every TTFT it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import (
    add_harness_args,
    begin,
    free_port,
    stop_process,
    wait_healthy,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
TTFT_TARGET_S = 2.0      # configs/default.yaml: server.default_ttft_ms
MAX_OUTPUT = 1024        # cap on a request's max_tokens (the trace's tail is long)
CONTEXT_TOKENS = 4096    # Llama-2-7B's context: longer trace rows are left out


@dataclass
class Result:
    status: int            # HTTP status; 0 when the connection failed
    ttft_s: float | None   # to the first token-bearing chunk
    complete: bool         # a 200 stream that ended with [DONE] and no error event
    error_event: bool      # an error event inside a 200 stream


@dataclass
class Phase:
    rate: float
    results: list[Result] = field(default_factory=list)

    def count(self, status: int) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def shed_fraction(self) -> float:
        return self.count(429) / max(len(self.results), 1)

    @property
    def failures(self) -> int:
        return sum(r.status == 0 or r.status >= 500 or r.error_event for r in self.results)

    def ttft(self, q: float) -> float:
        xs = [r.ttft_s for r in self.results if r.status == 200 and r.ttft_s is not None]
        return float(np.percentile(xs, q)) if xs else math.nan


def _lengths(seed: int) -> tuple[np.ndarray, np.ndarray]:
    sys.path.insert(0, str(REPO))
    from olproute.sim.workloads import read_lengths_csv

    prompt, decode = read_lengths_csv(TRACE)
    decode = np.minimum(decode, MAX_OUTPUT)
    fits = prompt + decode <= CONTEXT_TOKENS   # what Llama-2-7B (and its emulator) takes
    prompt, decode = prompt[fits], decode[fits]
    order = np.random.default_rng(seed).permutation(len(prompt))
    return prompt[order], decode[order]


async def one(session: aiohttp.ClientSession, url: str, prompt_tokens: int,
              max_tokens: int) -> Result:
    body = {"prompt": list(range(1, prompt_tokens + 1)), "max_tokens": int(max_tokens),
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return Result(resp.status, None, False, False)
            done = error = False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data:"):
                    if b'"error"' in line:
                        error = True
                    elif ttft is None:
                        ttft = time.perf_counter() - t0
            return Result(200, ttft, done and not error, error)
    except (aiohttp.ClientError, TimeoutError, ConnectionError):
        return Result(0, ttft, False, False)


async def load(session: aiohttp.ClientSession, url: str, rate: float, duration_s: float,
               lengths: tuple[np.ndarray, np.ndarray], rng: np.random.Generator,
               cursor: list[int]) -> Phase:
    """Open-loop Poisson arrivals at ``rate`` for ``duration_s``; waits for every reply."""
    phase, replies = await arrivals(session, url, rate, duration_s, lengths, rng, cursor)
    phase.results = list(await replies)
    return phase


async def arrivals(session: aiohttp.ClientSession, url: str, rate: float, duration_s: float,
                   lengths: tuple[np.ndarray, np.ndarray], rng: np.random.Generator,
                   cursor: list[int]) -> tuple[Phase, asyncio.Future[list[Result]]]:
    """Send the arrivals; returns when the last is sent, with the replies still to come."""
    phase = Phase(rate)
    tasks: list[asyncio.Task[Result]] = []
    prompt, decode = lengths
    start = time.perf_counter()
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            break
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        i = cursor[0] % len(prompt)
        cursor[0] += 1
        tasks.append(asyncio.create_task(one(session, url, int(prompt[i]), int(decode[i]))))
    return phase, asyncio.gather(*tasks)


async def probe_ttft(session: aiohttp.ClientSession, url: str) -> float:
    r = await one(session, url, 64, 4)
    return r.ttft_s if r.status == 200 and r.ttft_s is not None else math.inf


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return math.nan


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """Loop-lag histogram buckets, backends held down, failed and inconclusive probes."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, Any] = {"lag_buckets": {}, "down": 0, "probe_failed": 0.0,
                           "probe_inconclusive": 0.0, "held": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "olproute_loop_lag_seconds_bucket":
                out["lag_buckets"][float(s.labels["le"])] = s.value
            elif s.name == "olproute_backend_up" and s.value == 0:
                out["down"] += 1
            elif s.name == "olproute_health_probes_total":
                key = f"probe_{s.labels['result']}"
                if key in out:
                    out[key] += s.value
            elif s.name == "olproute_held_requests":
                out["held"] = s.value
    return out


def lag_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile (s) of the loop lag between two scrapes, from the histogram: the
    upper bound of the bucket that holds it (inf past the last finite bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= q * total:
            return b
    return math.inf


async def overload(session: aiohttp.ClientSession, url: str, pid: int, rate: float,
                   minutes: float, lengths: tuple[np.ndarray, np.ndarray],
                   rng: np.random.Generator, cursor: list[int],
                   normal_s: float) -> tuple[Phase, dict[str, Any]]:
    samples: dict[str, Any] = {"t_s": [], "rss_mb": [], "down": [], "held": [],
                               "lag_p99_ms": [], "cpu_percent": []}
    first = await scrape(session, url)
    stop = asyncio.Event()

    async def sampler() -> None:
        prev = first
        t0 = time.perf_counter()
        cpu_prev, t_prev = cpu_s(pid), t0
        while not stop.is_set():
            with_timeout = asyncio.create_task(asyncio.wait_for(stop.wait(), 10.0))
            await asyncio.gather(with_timeout, return_exceptions=True)
            now = await scrape(session, url)
            samples["t_s"].append(round(time.perf_counter() - t0, 1))
            samples["rss_mb"].append(round(rss_mb(pid), 1))
            cpu_now, t_now = cpu_s(pid), time.perf_counter()
            samples["cpu_percent"].append(round(100 * (cpu_now - cpu_prev) / (t_now - t_prev)))
            cpu_prev, t_prev = cpu_now, t_now
            samples["down"].append(now["down"])
            samples["held"].append(now["held"])
            samples["lag_p99_ms"].append(
                lag_quantile(prev["lag_buckets"], now["lag_buckets"], 0.99) * 1e3)
            print(f"  overload t={samples['t_s'][-1]:6.1f} s  rss {samples['rss_mb'][-1]:7.1f}"
                  f" MB  cpu {samples['cpu_percent'][-1]:3d}%  held {now['held']:4.0f}  "
                  f"backends down {now['down']}  loop lag p99 "
                  f"<= {samples['lag_p99_ms'][-1]:.0f} ms", file=sys.stderr, flush=True)
            prev = now

    task = asyncio.create_task(sampler())
    phase, replies = await arrivals(session, url, rate, minutes * 60.0, lengths, rng, cursor)
    # recovery counts from the last arrival, while the replies still come in
    samples["recover_s"] = await recover(session, url, normal_s)
    phase.results = list(await replies)
    stop.set()
    await task
    last = await scrape(session, url)
    samples["lag_p99_ms_whole"] = lag_quantile(first["lag_buckets"], last["lag_buckets"],
                                               0.99) * 1e3
    samples["probe_failed"] = last["probe_failed"] - first["probe_failed"]
    samples["probe_inconclusive"] = last["probe_inconclusive"] - first["probe_inconclusive"]
    return phase, samples


async def recover(session: aiohttp.ClientSession, url: str, normal_s: float,
                  limit_s: float = 300.0) -> float:
    t0 = time.perf_counter()
    good: float | None = None
    streak = 0
    while time.perf_counter() - t0 < limit_s:
        sent = time.perf_counter() - t0
        ttft = await probe_ttft(session, url)
        if ttft <= normal_s:
            streak += 1
            good = sent if good is None else good
            if streak == 3:
                return good
        else:
            streak, good = 0, None
        await asyncio.sleep(0.25)
    return math.inf


async def run(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    lengths = _lengths(args.seed)
    rng = np.random.default_rng(args.seed)
    cursor = [0]
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        idle = [await probe_ttft(session, url) for _ in range(20)]
        idle_s = float(np.median(idle))
        print(f"idle probe TTFT p50 {idle_s * 1e3:.1f} ms", file=sys.stderr, flush=True)
        sustainable = 0.0
        normal_s = 2 * idle_s + 0.05
        ramp = []
        rate = 4.0
        while True:
            phase = await load(session, url, rate, args.step_s, lengths, rng, cursor)
            ramp.append({"rate": rate, "sent": len(phase.results),
                         "shed_fraction": phase.shed_fraction, "failures": phase.failures,
                         "ttft_p99_s": phase.ttft(99)})
            ok = (phase.shed_fraction <= 0.01 and phase.failures == 0
                  and phase.ttft(99) <= TTFT_TARGET_S)
            print(f"ramp {rate:5.1f} req/s: {len(phase.results)} sent, shed "
                  f"{phase.shed_fraction:.1%}, failures {phase.failures}, TTFT p99 "
                  f"{phase.ttft(99):.2f} s -> {'sustained' if ok else 'not sustained'}",
                  file=sys.stderr, flush=True)
            if not ok:
                break
            sustainable, normal_s = rate, max(phase.ttft(90), 2 * idle_s + 0.05)
            rate += 4.0
            await recover(session, url, 2 * idle_s + 0.05, 60.0)
        if sustainable == 0.0:
            raise SystemExit("not even 4 req/s was sustained: is the machine busy?")
        await recover(session, url, 2 * idle_s + 0.05, 60.0)
        target = 2.0 * sustainable
        print(f"overload: {target:g} req/s for {args.minutes:g} min", file=sys.stderr,
              flush=True)
        phase, samples = await overload(session, url, pid, target, args.minutes, lengths,
                                        rng, cursor, normal_s)
        recover_s = samples["recover_s"]
    rss = samples["rss_mb"]
    after_first = [r for t, r in zip(samples["t_s"], rss, strict=True) if t >= 60.0]
    growth = (max(after_first) / after_first[0] - 1.0) if len(after_first) > 1 else math.nan
    served = [r for r in phase.results if r.status == 200]
    return {
        "sent": len(phase.results), "ok": len(served), "shed_429": phase.count(429),
        "errors": sum(r.status >= 500 or r.error_event for r in phase.results),
        "conn_failures": sum(r.status == 0 for r in phase.results),
        "other_status": sum(r.status not in (0, 200, 429) and r.status < 500
                            for r in phase.results),
        "complete_streams": sum(r.complete for r in served),
        "rss_mb": rss, "rss_growth_after_first_minute": growth,
        "recover_s": recover_s, "loop_lag_p99_ms": samples["lag_p99_ms_whole"],
        "loop_lag_p99_ms_per_10s": samples["lag_p99_ms"],
        "backends_down_samples": sum(d > 0 for d in samples["down"]),
        "health_probes_failed": samples["probe_failed"],
        "health_probes_inconclusive": samples["probe_inconclusive"],
        "held_samples": samples["held"], "server_cpu_percent": samples["cpu_percent"],
        "served_per_s": len(served) / (args.minutes * 60.0),
        "ttft_p50_s": phase.ttft(50), "ttft_p99_s": phase.ttft(99),
        "rate_sustainable": sustainable, "rate_overload": target, "idle_ttft_s": idle_s,
        "normal_ttft_s": normal_s,
        "ramp": ramp, "minutes": args.minutes,
    }


def table(r: dict[str, Any]) -> str:
    def goal(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rss = r["rss_mb"]
    lines = [
        f"{'measure':<44}{'value':>16}  goal",
        "-" * 72,
        f"{'sustainable rate (ramp), req/s':<44}{r['rate_sustainable']:>16g}",
        f"{'overload rate, req/s, minutes':<44}{r['rate_overload']:>11g}, {r['minutes']:g}",
        f"{'sent':<44}{r['sent']:>16,}",
        f"{'200':<44}{r['ok']:>16,}",
        f"{'served per second (200 / load time)':<44}{r['served_per_s']:>16.1f}",
        f"{'429 (shed, with Retry-After)':<44}{r['shed_429']:>16,}",
        f"{'other 4xx':<44}{r['other_status']:>16,}",
        f"{'errors (5xx, error events)':<44}{r['errors']:>16,}  = 0",
        f"{'connection failures':<44}{r['conn_failures']:>16,}  = 0  "
        f"({goal(r['errors'] + r['conn_failures'] == 0)})",
        f"{'200 streams complete':<44}{r['complete_streams']:>10,} / {r['ok']:,}  all "
        f"({goal(r['complete_streams'] == r['ok'])})",
        f"{'TTFT of the served p50 / p99, s':<44}{r['ttft_p50_s']:>8.2f} / {r['ttft_p99_s']:.2f}",
        f"{'loop lag p99 over the overload, ms':<44}{r['loop_lag_p99_ms']:>16.0f}",
        f"{'10 s samples with a backend held down':<44}{r['backends_down_samples']:>16}  = 0 "
        f"({goal(r['backends_down_samples'] == 0)})",
        f"{'health probes failed / inconclusive':<44}"
        f"{r['health_probes_failed']:>9.0f} / {r['health_probes_inconclusive']:.0f}",
        f"{'normal TTFT (served P90 at the sustainable rate), s':<44}"
        f"{r['normal_ttft_s']:>16.3f}",
        f"{'recover_s (probe TTFT back to normal)':<44}{r['recover_s']:>16.2f}  <= 5 "
        f"({goal(r['recover_s'] <= 5.0)})",
        f"{'RSS first / last, MB':<44}{rss[0]:>8.0f} / {rss[-1]:.0f}",
        f"{'RSS growth after the first minute':<44}"
        f"{r['rss_growth_after_first_minute'] * 100:>15.1f}%  <= 10% "
        f"({goal(r['rss_growth_after_first_minute'] <= 0.10)})",
    ]
    if "shutdown_s" in r:
        lines.append(f"{'SIGTERM to exit, s':<44}{r['shutdown_s']:>16.2f}")
    return "\n".join(lines)


def _exact_lengths_config(path: Path) -> Path:
    """configs/default.yaml, its paths made absolute, with exact emulated lengths: each
    request generates the trace's output length it asks for as ``max_tokens``, not the
    length its (token-id) prompt would draw."""
    src = REPO / "configs" / "default.yaml"
    cfg: dict[str, Any] = yaml.safe_load(src.read_text())
    cfg["profiles"] = str(src.parent / cfg["profiles"])
    if cfg.get("workload", {}).get("path"):
        cfg["workload"]["path"] = str((src.parent / cfg["workload"]["path"]).resolve())
    cfg.setdefault("server", {})["emulator_exact_lengths"] = True
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="overload duration")
    ap.add_argument("--step-s", type=float, default=20.0, help="seconds per ramp step")
    ap.add_argument("--seed", type=int, default=0, help="arrivals and lengths")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+b", prefix="olproute-serve-", suffix=".log",
                                     delete=False) as log:
        config = _exact_lengths_config(Path(log.name).with_suffix(".yaml"))
        server = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--port",
                                   str(port), "--config", str(config)], stdout=log, stderr=log,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(f"olproute serve on {url} (pid {server.pid}, log {log.name})", file=sys.stderr)
        try:
            wait_healthy(url, server, Path(log.name))
            result = asyncio.run(run(args, url, server.pid))
        finally:
            t = time.perf_counter()
            stop_process(server, 120.0)
            shutdown_s = time.perf_counter() - t
    result["shutdown_s"] = shutdown_s
    print(table(result))
    if args.json:
        write_results(args.json, result, [args.seed])
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
