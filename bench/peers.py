"""Peers: olproute against the routers a user would pick instead, in front of the same
emulated engines, under the same load.

    python bench/peers.py [--quick] [--json PATH] [--seed S] [--only R,R,..]
                          [--olproute-set KEY=VALUE ...]

The engines: ``--engines`` (4; 2 with ``--quick``) ``olproute emulate`` processes, one
engine each, every one Qwen3-8B on an H100 (configs/profiles.yaml ``qwen3-8b@h100``),
with exact lengths (every request generates its ``max_tokens``, so every router is given
the same work) and vLLM's default stream interval (one SSE event per token). They run for
the whole bench; each router in turn is put in front of them:

* ``olproute``: ``olproute serve`` on configs/default.yaml with the instances made the
  engines (their model and GPU) and ``server.backends`` naming them, once per policy
  (``least_outstanding``, ``round_robin``, ``bid_price``), every other setting shipped
  (``--olproute-set`` changes one, for a diagnosis; the results file records it);
* ``sglang``: SGLang's router (PyPI ``sglang-router``), ``python -m
  sglang_router.launch_router --worker-urls ... --policy P`` as its README starts it, with
  ``round_robin`` and its default ``cache_aware``;
* ``vllm-router``: vLLM's router (PyPI ``vllm-router``), ``vllm-router --worker-urls ...
  --policy P`` as its README starts it, with ``round_robin`` and its default
  ``cache_aware``;
* ``direct``: no router; the client spreads its requests over the engines itself (client
  or arrival k to engine k mod N).

The peers live in virtualenvs of their own (``scripts/install_peers``, under
``$OLPROUTE_PEERS_DIR``, default ~/.cache/olproute/peers); one that is not installed or
does not start is reported skipped, with the reason, and the rest run. Every server binds
127.0.0.1 on a free port (the peers' Prometheus listeners too) and runs in a process
group of its own, stopped at the end of its turn and on any exit, Ctrl-C included.

The load, from this process (aiohttp on one uvloop event loop, seeded): streamed
completions of short distinct prompts (a request number and ``PROMPT_WORDS`` seeded
words; no prompt repeats in the whole bench, so no router gains from prefixes an earlier
one left in the engines' caches), ``max_tokens`` 16, model ``qwen3-8b``.

* ``closed``: ``--clients`` (32; 8 with ``--quick``) clients, each sending its next request
  when its last one ends, for ``--closed-s`` seconds (60; 8);
* ``0.5``, ``0.9``, ``1.5``: Poisson arrivals for ``--open-s`` seconds (30; 6) at that
  fraction of the capacity. **Capacity is the direct closed-loop rate** measured first in
  the same run (``direct`` runs first): what the engines serve to ``--clients`` clients
  with no router between. It is a concurrency-bound rate, not the engines' saturation.

Per run: requests served per second (200 streams that ended with ``[DONE]``, over the time
from the first send to the last reply), TTFT (to the first event with text) and E2E
(to ``[DONE]``) P50 / P99 of those, refusals (429 and other non-200 statuses), failures
(connection errors, timeouts, streams cut short or carrying an error), and the router's
CPU per served request: user + system seconds of the router's process and its
descendants (/proc), over the run, divided by the requests served. The client's CPU per
request and the machine's busy fraction are recorded beside it: on two cores the client,
the engines and the router share the machine, so a rate is what this machine sustains,
not what the router alone would.

The goals are read as ratios, printed after the table: closed-loop olproute throughput
over SGLang's and TTFT P99 over SGLang's, per olproute policy and per SGLang policy; the
refusals at 0.5 and 0.9 of capacity, beside how many times olproute decided to hold a
request there (each slot a request stays held is one hold decision).

``--json PATH``: the results file (``"command", "commit", "seeds", "machine", "started",
"wall_s"``) with, under ``"results"``, ``{"settings", "capacity_per_s", "capacity_from",
"load_avg_start", "load_avg_end", "commands", "ratios", "runs": [{"router", "policy",
"load", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "refused",
"router_cpu_ms_per_request", ...}]}``; a router that did not run has ``"skipped":
"reason"`` in its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
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
    results_document,
    write_json,
)
from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL, GPU = "qwen3-8b", "h100"
MAX_TOKENS = 16
PROMPT_WORDS = 24
LOADS = ("closed", "0.5", "0.9", "1.5")
OLPROUTE_POLICIES = ("least_outstanding", "round_robin", "bid_price")
PEER_POLICIES = {"sglang": ("round_robin", "cache_aware"),
                 "vllm-router": ("round_robin", "cache_aware")}
ROUTERS = ("direct", "olproute", "sglang", "vllm-router")  # direct first: the capacity
REQUEST_TIMEOUT_S = 120.0
START_LIMIT_S = 120.0
REASON_CHARS = 160     # how much of a refusal's body is kept
READY_INDEX = 2**40    # readiness probes' prompt numbers, apart from the loads'
WORDS = ("amber", "basalt", "cedar", "dune", "ember", "fjord", "granite", "harbor",
         "iris", "juniper", "kelp", "lagoon", "meadow", "nectar", "onyx", "prairie",
         "quartz", "reef", "sierra", "tundra", "umber", "valley", "willow", "zephyr")


@dataclass(frozen=True, slots=True)
class Settings:
    """How big a bench run is."""

    engines: int        # emulated engines, one process each
    clients: int        # closed-loop concurrent clients
    closed_s: float     # closed-loop duration, seconds
    open_s: float       # each open-loop load's duration, seconds
    seed: int


FULL = Settings(engines=4, clients=32, closed_s=60.0, open_s=30.0, seed=REPORT_SEEDS[0])
QUICK = Settings(engines=2, clients=8, closed_s=8.0, open_s=6.0, seed=REPORT_SEEDS[0])


@dataclass(frozen=True, slots=True)
class Reply:
    """One request as the client saw it; times in seconds from its send."""

    status: int              # HTTP status; 0 when the connection failed or timed out
    ttft_s: float | None     # to the first event carrying text
    e2e_s: float | None      # to [DONE]
    complete: bool           # a 200 stream that ended with [DONE] and no error event
    sent_s: float            # send time, seconds from the load's start
    end_s: float             # end time, seconds from the load's start
    reason: str = ""         # a refusal's body, its start; a failure's exception type


@dataclass(frozen=True, slots=True)
class Turn:
    """One router configuration: who routes, with which policy, how it is started."""

    router: str
    policy: str
    argv: tuple[str, ...] = ()      # empty for direct
    skipped: str | None = None      # why it cannot run here


# --- pure helpers ---------------------------------------------------------------------------

def prompt(seed: int, index: int) -> str:
    """The index-th request's prompt: distinct per (seed, index), ``PROMPT_WORDS`` words
    after a number, so no two requests share more than their first word."""
    rng = np.random.default_rng([seed, index, 7])
    words = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), PROMPT_WORDS))
    return f"Request {seed}-{index}: {words}"


def poisson_offsets(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start, increasing, all < ``duration_s``) of a Poisson
    process at ``rate_per_s``, seeded."""
    if rate_per_s <= 0 or duration_s <= 0:
        return []
    rng = np.random.default_rng([seed, 91])
    out: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t >= duration_s:
            return out
        out.append(t)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of ``xs``; NaN when empty."""
    return float(np.percentile(xs, q)) if len(xs) else math.nan


def summarise(replies: Sequence[Reply], router_cpu_s: float | None,
              client_cpu_s: float) -> dict[str, Any]:
    """A run's figures from its replies: served rate over first send to last reply,
    latency percentiles of the served, refusals and failures, CPU per served request."""
    ok = [r for r in replies if r.complete]
    span = (max(r.end_s for r in replies) - min(r.sent_s for r in replies)) if replies else 0.0
    n429 = sum(r.status == 429 for r in replies)
    other = sum(r.status not in (0, 200, 429) for r in replies)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    per_ok = 1e3 / len(ok) if ok else math.nan
    return {
        "sent": len(replies), "ok": len(ok),
        "requests_per_s": len(ok) / span if span > 0 else math.nan,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "refused": n429 + other, "refused_429": n429, "refused_other": other,
        "failed": sum(not r.complete and r.status in (0, 200) for r in replies),
        "router_cpu_s": router_cpu_s,
        "router_cpu_ms_per_request": (router_cpu_s * per_ok if router_cpu_s is not None
                                      else None),
        "client_cpu_ms_per_request": client_cpu_s * per_ok,
        "not_served": not_served(replies),
    }


def not_served(replies: Sequence[Reply], top: int = 5) -> dict[str, int]:
    """The commonest reasons requests were not served (``"429 <body start>"``,
    ``"0 TimeoutError"``; digits as N, so that "shed after 2003 ms" and "after 2010 ms"
    count as one), at most ``top``, with their counts."""
    counts: dict[str, int] = {}
    for r in replies:
        if not r.complete:
            key = f"{r.status} {re.sub(r'[0-9]+', 'N', r.reason)}".strip()
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top])


def olproute_samples(text: str) -> dict[str, float]:
    """What a run reads of ``olproute serve``'s /metrics: decisions by action (summed
    over instances), backend errors by kind, refusals for a full buffer, and the
    loop-lag and decision-time histograms, as flat ``name[:label]`` keys."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "olproute_decisions_total":
                add(f"decisions:{s.labels.get('action', '')}", s.value)
            elif s.name == "olproute_backend_errors_total":
                add(f"backend_errors:{s.labels.get('kind', '')}", s.value)
            elif s.name in ("olproute_held_full_total", "olproute_held_dropped_total",
                            "olproute_decision_seconds_sum",
                            "olproute_decision_seconds_count"):
                add(s.name.removeprefix("olproute_"), s.value)
            elif s.name == "olproute_loop_lag_seconds_bucket":
                add(f"loop_lag_le:{s.labels['le']}", s.value)
    return out


def olproute_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A run's olproute figures from two ``olproute_samples``: counts over the run, the
    loop lag's P99 (the upper bound of its histogram bucket; inf past the last bound)
    and the mean decision time."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    lag = sorted((float(k.split(":", 1)[1]), v) for k, v in delta.items()
                 if k.startswith("loop_lag_le:"))
    total = lag[-1][1] if lag else 0.0
    p99 = next((le for le, c in lag if c >= 0.99 * total), math.inf) if total > 0 else None
    n = delta.get("decision_seconds_count", 0.0)
    return {
        "decisions": {k.split(":", 1)[1]: int(v) for k, v in sorted(delta.items())
                      if k.startswith("decisions:") and v},
        "backend_errors": {k.split(":", 1)[1]: int(v) for k, v in sorted(delta.items())
                           if k.startswith("backend_errors:") and v},
        "held_full": int(delta.get("held_full_total", 0.0)),
        "held_dropped": int(delta.get("held_dropped_total", 0.0)),
        "loop_lag_p99_s": p99,
        "decision_mean_s": delta.get("decision_seconds_sum", 0.0) / n if n else None,
    }


def offered_rate(load: str, capacity_per_s: float) -> float | None:
    """Arrivals per second of an open load (``"0.9"``: 0.9 x capacity); None for closed."""
    return None if load == "closed" else float(load) * capacity_per_s


def sglang_argv(python: Path, urls: Sequence[str], policy: str, port: int,
                metrics_port: int) -> list[str]:
    """SGLang's router as its README starts it, on 127.0.0.1 (its metrics too)."""
    return [str(python), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


def vllm_router_argv(exe: Path, urls: Sequence[str], policy: str, port: int,
                     metrics_port: int) -> list[str]:
    """vLLM's router as its README starts it, on 127.0.0.1 (its metrics too)."""
    return [str(exe), "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port)]


def olproute_config(engine_urls: Sequence[str], policy: str, port: int,
                    overrides: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
    """configs/default.yaml (paths made absolute) with its instances the engines (their
    model and GPU, the shipped instance settings) and ``server.backends`` naming them;
    ``router.policy`` set, then ``overrides`` (dotted key, value), every other key
    shipped."""
    src = REPO / "configs" / "default.yaml"
    cfg: dict[str, Any] = yaml.safe_load(src.read_text())
    cfg["profiles"] = str((src.parent / cfg["profiles"]).resolve())
    if cfg.get("workload", {}).get("path"):
        cfg["workload"]["path"] = str((src.parent / cfg["workload"]["path"]).resolve())
    name = f"{MODEL}-{GPU}"
    inst = {**cfg["instances"][0], "name": name, "model": MODEL, "gpu": GPU,
            "replicas": len(engine_urls)}
    cfg["instances"] = [inst]
    cfg["router"]["policy"] = policy
    cfg["server"] = {**cfg.get("server", {}), "host": "127.0.0.1", "port": port,
                     "backends": [{"name": f"{name}-{i}", "url": u}
                                  for i, u in enumerate(engine_urls)]}
    for key, value in overrides:
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``--olproute-set admission.max_waiting=4`` (an argparse ``type``): the dotted key
    and its value read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def ratios(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The goals' ratios: per olproute policy and SGLang policy, closed-loop throughput
    and TTFT P99 of olproute over SGLang's; per olproute policy, refusals (count and
    fraction of sent) at 0.5 and 0.9 of capacity."""
    def row(router: str, policy: str, load: str) -> dict[str, Any] | None:
        for r in runs:
            if (r["router"], r["policy"], r["load"]) == (router, policy, load) \
                    and not r.get("skipped"):
                return r
        return None

    def div(a: Any, b: Any) -> float | None:
        ok = isinstance(a, float | int) and isinstance(b, float | int)
        return a / b if ok and b and math.isfinite(a) and math.isfinite(b) else None

    out: dict[str, Any] = {"vs_sglang": [], "refusals": []}
    for pol in OLPROUTE_POLICIES:
        ours = row("olproute", pol, "closed")
        for spol in PEER_POLICIES["sglang"]:
            theirs = row("sglang", spol, "closed")
            if ours is None or theirs is None:
                continue
            out["vs_sglang"].append({
                "olproute_policy": pol, "sglang_policy": spol,
                "throughput_ratio": div(ours["requests_per_s"], theirs["requests_per_s"]),
                "ttft_p99_ratio": div(ours["ttft_p99_s"], theirs["ttft_p99_s"])})
        for load in ("0.5", "0.9"):
            r = row("olproute", pol, load)
            if r is not None:
                held = (r.get("olproute_metrics") or {}).get("decisions", {}).get("hold", 0)
                out["refusals"].append({"olproute_policy": pol, "load": load,
                                        "refused": r["refused"],
                                        "fraction": div(r["refused"], r["sent"]),
                                        "hold_decisions": held})
    return out


def _fmt(x: Any, spec: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x * scale, spec)


def table(runs: Sequence[dict[str, Any]]) -> str:
    """The runs as a fixed-width table; latencies in ms."""
    head = (f"{'router':<12}{'policy':<19}{'load':>6}{'offered':>9}{'req/s':>8}"
            f"{'TTFT p50':>10}{'p99':>8}{'E2E p50':>9}{'p99':>8}{'429':>6}{'other':>6}"
            f"{'failed':>7}{'cpu ms/req':>11}")
    lines = [head, "-" * len(head)]
    for r in runs:
        if r.get("skipped"):
            lines.append(f"{r['router']:<12}{r['policy']:<19}{r['load']:>6}  skipped: "
                         f"{r['skipped']}")
            continue
        lines.append(
            f"{r['router']:<12}{r['policy']:<19}{r['load']:>6}"
            f"{_fmt(r.get('offered_per_s'), '.1f'):>9}{_fmt(r['requests_per_s'], '.1f'):>8}"
            f"{_fmt(r['ttft_p50_s'], '.1f', 1e3):>10}{_fmt(r['ttft_p99_s'], '.1f', 1e3):>8}"
            f"{_fmt(r['e2e_p50_s'], '.1f', 1e3):>9}{_fmt(r['e2e_p99_s'], '.1f', 1e3):>8}"
            f"{r['refused_429']:>6}{r['refused_other']:>6}{r['failed']:>7}"
            f"{_fmt(r['router_cpu_ms_per_request'], '.3f'):>11}")
    return "\n".join(lines)


def ratio_lines(rat: dict[str, Any]) -> str:
    """The ratios as text, one line each."""
    lines = ["closed loop, olproute / SGLang (throughput, TTFT p99):"]
    for v in rat["vs_sglang"]:
        lines.append(f"  olproute {v['olproute_policy']:<18} / sglang {v['sglang_policy']:<12}"
                     f" throughput {_fmt(v['throughput_ratio'], '.3f')}x"
                     f"  TTFT p99 {_fmt(v['ttft_p99_ratio'], '.3f')}x")
    lines.append("olproute refusals at 0.5 and 0.9 of capacity:")
    for v in rat["refusals"]:
        lines.append(f"  {v['olproute_policy']:<18} at {v['load']}: {v['refused']} refused"
                     f" ({_fmt(v['fraction'], '.2%')} of sent),"
                     f" {v.get('hold_decisions', 0)} hold decisions")
    return "\n".join(lines)


# --- processes ------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (/proc)."""
    tck = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        cpu[int(d.name)] = (int(fields[11]) + int(fields[12])) / tck
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += [c for c, pp in parent.items() if pp == p]
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


@dataclass
class Server:
    """A server this bench started, in a process group of its own, logging to a file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        with self.log_path.open("wb") as f:  # the child holds its own copy
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        _signal_group(self.proc.pid, signal.SIGKILL)  # what the leader left behind
        if self.proc.poll() is None:
            self.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextmanager
def servers() -> Iterator[list[Server]]:
    """Every server started into the list is stopped on the way out, whatever the way."""
    started: list[Server] = []
    try:
        yield started
    finally:
        for s in reversed(started):
            s.stop()


def wait_line(srv: Server, marker: str, limit_s: float = START_LIMIT_S) -> str:
    """The server's log once ``marker`` is in it; RuntimeError if it exits first or
    after ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        text = srv.log_path.read_text(errors="replace")
        if marker in text:
            return text
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited with {srv.proc.returncode}: "
                               f"{srv.tail(600)}")
        time.sleep(0.2)
    raise RuntimeError(f"{srv.name}: no {marker!r} within {limit_s:g} s")


def start_engines(started: list[Server], n: int, seed: int, tmp: Path) -> list[str]:
    """``n`` emulated engines, one process each; their base URLs."""
    urls = []
    for i in range(n):
        srv = Server(f"engine-{i}", [sys.executable, "-m", "olproute.cli", "emulate",
                                     "--instances", "1", "--profile", f"{MODEL}@{GPU}",
                                     "--host", "127.0.0.1", "--seed", str(seed + i),
                                     "--exact-lengths"], tmp / f"engine-{i}.log")
        started.append(srv)
    for srv in started[-n:]:
        text = wait_line(srv, "emulated instance(s) serving")
        urls += [p for ln in text.splitlines() for p in ln.split()[1:2]
                 if p.startswith("http://")]
    if len(urls) != n:
        raise RuntimeError(f"expected {n} engine URLs, read {urls}")
    return urls


def turns(engine_urls: Sequence[str], peers_dir: Path, tmp: Path, only: Sequence[str],
          overrides: Sequence[tuple[str, Any]] = ()) -> Iterator[Turn]:
    """Every router configuration in bench order; ports are chosen as each is made."""
    if "direct" in only:
        yield Turn("direct", "-")
    if "olproute" in only:
        for pol in OLPROUTE_POLICIES:
            port = free_port()
            cfg = tmp / f"olproute-{pol}.yaml"
            cfg.write_text(yaml.safe_dump(olproute_config(engine_urls, pol, port, overrides),
                                          sort_keys=False))
            yield Turn("olproute", pol, (sys.executable, "-m", "olproute.cli", "serve",
                                         "--config", str(cfg), "--port", str(port)))
    peers: dict[str, tuple[Path, Callable[..., list[str]]]] = {
        "sglang": (peers_dir / "sglang" / "bin" / "python", sglang_argv),
        "vllm-router": (peers_dir / "vllm-router" / "bin" / "vllm-router", vllm_router_argv)}
    for router, (exe, argv_of) in peers.items():
        if router not in only:
            continue
        for pol in PEER_POLICIES[router]:
            if not exe.exists():
                yield Turn(router, pol, skipped=f"not installed ({exe} missing; run "
                           "scripts/install_peers)")
                continue
            yield Turn(router, pol, tuple(argv_of(exe, engine_urls, pol, free_port(),
                                                  free_port())))


def port_of(argv: Sequence[str]) -> int:
    """The value after ``--port`` in a command line."""
    return int(argv[list(argv).index("--port") + 1])


# --- the load client ------------------------------------------------------------------------

def _body(seed: int, index: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt(seed, index), "max_tokens": MAX_TOKENS,
            "stream": True, "temperature": 0.0}


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
              t_origin: float) -> Reply:
    """One streamed completion; TTFT at the first event with text, E2E at [DONE]."""
    t0 = time.perf_counter()
    ttft: float | None = None
    status = 0

    def reply(complete: bool, reason: str = "") -> Reply:
        t1 = time.perf_counter()
        return Reply(status, ttft, t1 - t0 if complete else None, complete, t0 - t_origin,
                     t1 - t_origin, reason)

    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            status = resp.status
            if status != 200:
                text = (await resp.read())[:REASON_CHARS].decode(errors="replace")
                return reply(False, " ".join(text.split()))
            error = False
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    if error or ttft is None:
                        return reply(False, "error event" if error else "no text")
                    return reply(True)
                if line.startswith(b"data:") and not error:
                    ttft, error = _event(line, ttft, t0)
            return reply(False, "stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        return reply(False, type(exc).__name__)


def _event(line: bytes, ttft: float | None, t0: float) -> tuple[float | None, bool]:
    """(TTFT, error) after one SSE data line; the JSON is parsed only until the first
    text arrives, later lines are checked for an error field alone."""
    if ttft is not None:
        return ttft, b'"error"' in line
    try:
        data = json.loads(line[5:])
    except ValueError:
        return None, True
    if "error" in data:
        return None, True
    choices = data.get("choices") or [{}]
    return (time.perf_counter() - t0 if choices[0].get("text") else None), False


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def closed_loop(urls: Sequence[str], clients: int, duration_s: float, seed: int,
                      first_index: int) -> list[Reply]:
    """``clients`` clients, each sending its next request when its last ends, until
    ``duration_s``; client c talks to ``urls[c % len(urls)]``."""
    counter = [first_index]
    out: list[Reply] = []
    async with _session() as session:
        t_origin = time.perf_counter()

        async def client(c: int) -> None:
            while time.perf_counter() - t_origin < duration_s:
                i = counter[0]
                counter[0] += 1
                out.append(await one(session, urls[c % len(urls)], _body(seed, i),
                                     t_origin))

        await asyncio.gather(*(client(c) for c in range(clients)))
    return out


async def open_loop(urls: Sequence[str], offsets: Sequence[float], seed: int,
                    first_index: int) -> list[Reply]:
    """Arrivals at ``offsets`` (s from the start); arrival k to ``urls[k % len(urls)]``
    with prompt ``first_index + k``; waits for every reply."""
    async with _session() as session:
        t_origin = time.perf_counter()
        tasks = []
        for k, t in enumerate(offsets):
            delay = t_origin + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                one(session, urls[k % len(urls)], _body(seed, first_index + k), t_origin)))
        return list(await asyncio.gather(*tasks))


async def ready(url: str, srv: Server, limit_s: float = START_LIMIT_S) -> None:
    """Until one request through ``url`` completes; RuntimeError if ``srv`` exits first
    or after ``limit_s``."""
    t0 = time.monotonic()
    last = ""
    attempt = READY_INDEX
    async with _session() as session:
        while time.monotonic() - t0 < limit_s:
            if srv.proc.poll() is not None:
                raise RuntimeError(f"exited with {srv.proc.returncode}: {srv.tail(600)}")
            attempt += 1
            r = await one(session, url, _body(0, attempt), time.perf_counter())
            if r.complete:
                return
            last = f"status {r.status}"
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no completed request within {limit_s:g} s ({last})")


def metrics_text(url: str) -> str:
    """``GET url/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def run_async(coro: Any) -> Any:
    """``coro`` on a uvloop loop (the router's own loop), asyncio's when uvloop is
    missing."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- the bench ------------------------------------------------------------------------------

@dataclass
class Bench:
    settings: Settings
    engine_urls: list[str]
    capacity_per_s: float | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    next_index: int = 0

    def measure(self, turn: Turn, load: str, urls: Sequence[str],
                router_pid: int | None) -> dict[str, Any]:
        """One load against ``urls``; its row."""
        s = self.settings
        rate = offered_rate(load, self.capacity_per_s or math.nan)
        scrape = turn.router == "olproute"
        m0 = olproute_samples(metrics_text(urls[0])) if scrape else {}
        cpu0 = tree_cpu_s(router_pid) if router_pid else None
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        busy0, total0 = machine_busy()
        first, self.next_index = self.next_index, self.next_index + 1_000_000
        if rate is None:
            replies = run_async(closed_loop(urls, s.clients, s.closed_s, s.seed, first))
        else:
            # the same arrival times for every router: seeded by the seed and the load
            offsets = poisson_offsets(rate, s.open_s, s.seed * 1000 + LOADS.index(load))
            replies = run_async(open_loop(urls, offsets, s.seed, first))
        busy1, total1 = machine_busy()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        router_cpu = tree_cpu_s(router_pid) - cpu0 if router_pid and cpu0 is not None else None
        m1 = olproute_samples(metrics_text(urls[0])) if scrape else {}
        client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        row = {"router": turn.router, "policy": turn.policy, "load": load,
               "offered_per_s": rate,
               "duration_s": s.closed_s if rate is None else s.open_s,
               "clients": s.clients if rate is None else None,
               **summarise(replies, router_cpu, client_cpu),
               "machine_cpu_busy": (busy1 - busy0) / max(total1 - total0, 1e-9)}
        if scrape:
            row["olproute_metrics"] = olproute_figures(m0, m1)
        log(f"  {turn.router} {turn.policy} {load}: {row['ok']}/{row['sent']} served, "
            f"{_fmt(row['requests_per_s'], '.1f')} req/s, TTFT p99 "
            f"{_fmt(row['ttft_p99_s'], '.1f', 1e3)} ms, refused {row['refused']}, "
            f"failed {row['failed']}, router cpu "
            f"{_fmt(row['router_cpu_ms_per_request'], '.3f')} ms/req")
        return row

    def run_turn(self, turn: Turn, tmp: Path) -> None:
        """Every load against one router configuration; skipped rows if it cannot run."""
        if turn.skipped is None and turn.router != "direct" and self.capacity_per_s is None:
            turn = Turn(turn.router, turn.policy, turn.argv,
                        "no capacity measured (direct did not run)")
        if turn.skipped is not None:
            log(f"{turn.router} {turn.policy}: skipped: {turn.skipped}")
            self.runs += [self._skipped(turn, load, turn.skipped) for load in LOADS]
            return
        log(f"{turn.router} {turn.policy}: "
            + (shlex.join(turn.argv) if turn.argv else "clients to the engines directly"))
        with servers() as started:
            urls: Sequence[str] = self.engine_urls
            pid = None
            if turn.argv:
                srv = Server(f"{turn.router}-{turn.policy}", list(turn.argv),
                             tmp / f"{turn.router}-{turn.policy}.log")
                started.append(srv)
                urls = [f"http://127.0.0.1:{port_of(turn.argv)}"]
                try:
                    run_async(ready(urls[0], srv))
                except RuntimeError as exc:
                    why = f"did not start: {' '.join(str(exc).split())[:300]}"
                    log(f"{turn.router} {turn.policy}: skipped: {why}")
                    self.runs += [self._skipped(turn, load, why) for load in LOADS]
                    return
                pid = srv.proc.pid
            for load in LOADS:
                row = self.measure(turn, load, urls, pid)
                row["command"] = shlex.join(turn.argv) if turn.argv else None
                self.runs.append(row)
                if turn.router == "direct" and load == "closed":
                    self.capacity_per_s = row["requests_per_s"]
                    log(f"capacity (direct closed loop, {self.settings.clients} clients): "
                        f"{_fmt(self.capacity_per_s, '.1f')} req/s")

    @staticmethod
    def _skipped(turn: Turn, load: str, why: str) -> dict[str, Any]:
        return {"router": turn.router, "policy": turn.policy, "load": load, "skipped": why,
                "command": shlex.join(turn.argv) if turn.argv else None}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_quick_arg(ap, "2 engines, 8 clients, 8 s closed loop, 6 s per open load")
    ap.add_argument("--seed", type=int, default=REPORT_SEEDS[0],
                    help="prompts, arrivals and the engines' noise (engine i: seed + i)")
    ap.add_argument("--engines", type=int, help="emulated engines (default 4; quick 2)")
    ap.add_argument("--clients", type=int, help="closed-loop clients (default 32; quick 8)")
    ap.add_argument("--closed-s", type=float, help="closed-loop seconds (60; quick 8)")
    ap.add_argument("--open-s", type=float, help="seconds per open load (30; quick 6)")
    ap.add_argument("--only", default=",".join(ROUTERS),
                    help=f"comma-separated routers to run, of {','.join(ROUTERS)} "
                         "(all but direct need direct for the capacity)")
    ap.add_argument("--peers-dir", type=Path,
                    default=Path(os.environ.get("OLPROUTE_PEERS_DIR",
                                                Path.home() / ".cache/olproute/peers")),
                    help="where scripts/install_peers put the peers' virtualenvs")
    ap.add_argument("--olproute-set", metavar="KEY=VALUE", type=parse_override,
                    action="append", default=[],
                    help="set a key of olproute's config (dotted, value as YAML), e.g. "
                         "admission.max_waiting=4; repeatable; default: every key shipped")
    add_harness_args(ap)
    args = ap.parse_args(argv)
    begin(args, ap, argv)
    base = QUICK if args.quick else FULL
    s = Settings(args.engines or base.engines, args.clients or base.clients,
                 args.closed_s or base.closed_s, args.open_s or base.open_s, args.seed)
    only = [x for x in args.only.split(",") if x]
    if unknown := set(only) - set(ROUTERS):
        ap.error(f"--only: unknown router(s) {', '.join(sorted(unknown))}")
    # SIGTERM unwinds like Ctrl-C, so every server is stopped on the way out
    signal.signal(signal.SIGTERM, _interrupt)
    load_start = load_avg()
    log(f"load average at start: {load_start}; {s}")
    with tempfile.TemporaryDirectory(prefix="olproute-peers-") as tmp_name, \
            servers() as engines:
        tmp = Path(tmp_name)
        urls = start_engines(engines, s.engines, s.seed, tmp)
        log(f"{s.engines} engines ({MODEL} on {GPU}): {' '.join(urls)}")
        bench = Bench(s, urls)
        for turn in turns(urls, args.peers_dir, tmp, only, args.olproute_set):
            bench.run_turn(turn, tmp)
        commands: dict[str, Any] = {"engines": [shlex.join(e.argv) for e in engines]}
    load_end = load_avg()
    rat = ratios(bench.runs)
    print(table(bench.runs))
    print(f"\ncapacity = direct closed-loop rate ({s.clients} clients): "
          f"{_fmt(bench.capacity_per_s, '.1f')} req/s; load average start {load_start}, "
          f"end {load_end}")
    print(ratio_lines(rat))
    if args.json:
        commands["routers"] = sorted({r["command"] for r in bench.runs if r.get("command")})
        # what each olproute --config held, but for its router.policy and server.port
        commands["olproute_config"] = olproute_config(urls, "<policy>", 0,
                                                      args.olproute_set)
        write_json(args.json, results_document(
            {"settings": asdict(s), "capacity_per_s": bench.capacity_per_s,
             "capacity_from": f"direct closed loop, {s.clients} clients",
             "load_avg_start": load_start, "load_avg_end": load_end,
             "commands": commands, "ratios": rat, "runs": bench.runs}, [s.seed]))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
