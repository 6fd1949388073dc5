"""The router over HTTP: decisions per second and the latency the proxy adds.

    python bench/bench_http.py [--seconds S] [--quick] [--prompts counts|text]
                               [--serve-predictions predictor|max_tokens] [--json PATH]

1. ``POST /route`` at concurrency 32 for ``--seconds`` against the router (bid_price,
   8 emulated Qwen3-8B / H100 instances, BEA and the request's predicted length in
   every decision), and the same load against a null aiohttp-on-uvloop handler that
   parses the JSON body and returns a small JSON answer, measured in the same run. The
   bodies give prompt token counts (``--prompts counts``, the default: no text, so the
   router predicts ``max_tokens``) or synthetic prompt texts (``--prompts text``:
   ``olproute.sim.prompts``, the four task families, 6 to 6,092 words, median 32; the
   router runs its predictor on each, unless ``--serve-predictions max_tokens`` sets
   ``prediction.serve`` so; without the flag the config leaves the key out). Figures: rate
   and p50 / p99 latency of each, and the router's share of the null handler's rate
   (``router_over_null``, goal >= 50%). During the router's load, its event loop's lag
   (``GET /debug/loop-lag``: a timer every 10 ms, timed with ``perf_counter``):
   ``loop_lag_p99_ms``, goal <= 1 ms. A loop saturated by 32 concurrent requests runs a
   timer once per turn, after the turn's ready callbacks, so this lag is mostly queueing;
   ``loop_lag_ttft_ms`` is the lag during part 2, one request at a time, where a lag is
   a stall (a callback, a GC pause, a thread holding the GIL).
2. The TTFT the proxy adds: streamed completions (prompt of 100 words, 4 tokens), one at
   a time, alternately through the router, straight to one of its backends, and through
   a null aiohttp proxy in front of that backend (no decision: the cost of the hop
   alone); the p50 and p99 of each, and the router's p99 over the direct one
   (``proxy_ttft_p99_ratio``, goal <= 1.10).

``--quick``: 3 s of load per server and 60 TTFT requests (a before/after check, not the
figures of docs/experiments/performance.md).

Each server runs in a process of its own: the null handler, the router, and the 8
emulated instances (``olproute emulate``, named to the router as ``server.backends``),
so the router is measured alone, as deployed. The load comes from this process (aiohttp
client, 32 concurrent workers); on this 2-core machine the client and the servers share
the CPU alike for the null handler and the router.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, free_port, write_results

REPO = Path(__file__).resolve().parents[1]

NULL_SERVER = """
import sys, uvloop
from aiohttp import web
async def handle(request):
    body = await request.json()
    return web.json_response({"ok": True, "n": len(body)})
app = web.Application()
app.router.add_post("/route", handle)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# the floor of any aiohttp proxy: read the body, post it to one backend, relay its answer
# chunk by chunk; no decision, no bookkeeping
NULL_PROXY = """
import sys, aiohttp, uvloop
from aiohttp import web
async def session(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app["s"].close()
async def handle(request):
    raw = await request.read()
    async with request.app["s"].post(sys.argv[2] + request.path, data=raw,
                                     headers={"Content-Type": "application/json"}) as up:
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "text/event-stream")})
        await resp.prepare(request)
        while chunk := await up.content.readany():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
app = web.Application()
app.cleanup_ctx.append(session)
app.router.add_post("/v1/completions", handle)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


async def wait_up(url: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.post(url + "/route", json={"prompt_tokens": 10}) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not come up")


def route_bodies(prompts: str) -> list[dict[str, Any]]:
    """256 ``/route`` bodies: prompt token counts, or synthetic prompt texts (``text``),
    with the same output limits."""
    limits = np.random.default_rng(1).integers(10, 600, 256)
    if prompts == "text":
        from olproute.sim.prompts import generate_prompts

        texts = [p.text for p in generate_prompts(256, ["qwen3-8b"],
                                                  np.random.default_rng(2))]
        return [{"prompt": t, "max_tokens": int(o), "ttft_target_ms": 1000}
                for t, o in zip(texts, limits, strict=True)]
    return [{"prompt_tokens": int(p), "max_tokens": int(o), "ttft_target_ms": 1000}
            for p, o in zip(np.random.default_rng(0).integers(50, 3000, 256), limits,
                            strict=True)]


async def load(url: str, seconds: float, concurrency: int,
               bodies: list[dict[str, Any]]) -> dict[str, float]:
    lat: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds

    async def worker(k: int, s: aiohttp.ClientSession) -> None:
        nonlocal errors
        i = k
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            async with s.post(url + "/route", json=bodies[i % len(bodies)]) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            lat.append(time.perf_counter() - t0)
            i += concurrency

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(k, s) for k in range(concurrency)))
        elapsed = time.monotonic() - t0
    arr = np.array(lat) * 1e3
    return {"rate_per_s": len(lat) / elapsed, "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)), "errors": float(errors),
            "requests": float(len(lat))}


async def ttft(url: str, n: int) -> list[float]:
    body = {"prompt": " ".join(["word"] * 100), "max_tokens": 4, "stream": True}
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        out.append(time.perf_counter() - t0)
                        break
                await r.read()
    return out


def start_emulators(config: Path, env: dict[str, str]
                    ) -> tuple[subprocess.Popen[str], list[dict[str, str]]]:
    """``olproute emulate`` in a process of its own: the process and the backends it
    serves (``server.backends`` entries), read from the lines it prints. Exact lengths:
    every streamed request generates its ``max_tokens`` (4), as in the runs this
    benchmark has reported, whatever the length the prompt would draw."""
    proc = subprocess.Popen([sys.executable, "-m", "olproute.cli", "emulate", "--config",
                             str(config), "--exact-lengths"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    backends = []
    for line in proc.stdout:
        if "emulated instance(s) serving" in line:
            return proc, backends
        name, url = line.split()[:2]
        backends.append({"name": name, "url": url})
    proc.wait()
    raise RuntimeError(f"olproute emulate exited ({proc.returncode}) before serving")


def emulated_fleet(env: dict[str, str], serve_predictions: str | None = None
                   ) -> tuple[subprocess.Popen[str], Path]:
    """The benchmark's fleet: 8 emulated Qwen3-8B / H100 instances in a process of their
    own (``start_emulators``), and the router's config naming them as its backends
    (bid_price, noisy lengths in the simulator; ``prediction.serve`` when given)."""
    tmp = Path(tempfile.mkdtemp())
    cfg: dict[str, Any] = {
        "profiles": str(REPO / "configs" / "profiles.yaml"),
        "instances": [{"name": "q8", "model": "qwen3-8b", "gpu": "h100", "replicas": 8}],
        "workload": {"kind": "poisson", "rate_per_s": 20, "num_requests": 2000,
                     "lengths_path": str(REPO / "data" / "traces" / "splitwise_conv.csv")},
        "router": {"policy": "bid_price"}, "prediction": {"mode": "noisy"}}
    (tmp / "emulate.yaml").write_text(yaml.safe_dump(cfg))
    emulators, backends = start_emulators(tmp / "emulate.yaml", env)
    cfg["server"] = {"backends": backends}
    if serve_predictions is not None:
        cfg["prediction"] = {**cfg["prediction"], "serve": serve_predictions}
    (tmp / "bench.yaml").write_text(yaml.safe_dump(cfg))
    return emulators, tmp / "bench.yaml"


async def loop_lag(url: str, seconds: float) -> dict[str, float] | None:
    """The router's event-loop lag over the last ``seconds`` (None from a router without
    ``/debug/loop-lag``)."""
    async with aiohttp.ClientSession() as s, s.get(
            f"{url}/debug/loop-lag", params={"seconds": str(seconds)}) as r:
        return dict(await r.json()) if r.status == 200 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="load duration per server")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--ttft-requests", type=int, default=200)
    ap.add_argument("--quick", action="store_true",
                    help="3 s of load per server and 60 TTFT requests")
    ap.add_argument("--prompts", choices=("counts", "text"), default="counts",
                    help="/route bodies: prompt token counts or synthetic prompt texts "
                         "(default: %(default)s)")
    ap.add_argument("--serve-predictions", choices=("predictor", "max_tokens"),
                    help="the router's prediction.serve (default: the config's default)")
    add_harness_args(ap)
    ap.add_argument("--router-log", metavar="PATH",
                    help="write the router's stderr here (e.g. with JAX_LOG_COMPILES=1)")
    args = ap.parse_args()
    begin(args, ap)
    if args.quick:
        args.seconds, args.ttft_requests = 3.0, 60

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    emulators, config = emulated_fleet(env, args.serve_predictions)
    bodies = route_bodies(args.prompts)
    rport, nport = free_port(), free_port()
    log = open(args.router_log, "w") if args.router_log else subprocess.DEVNULL  # noqa: SIM115
    router = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                               str(config), "--port", str(rport)],
                              stdout=subprocess.DEVNULL, stderr=log, env=env)
    null = subprocess.Popen([sys.executable, "-c", NULL_SERVER, str(nport)], env=env)
    results: dict[str, Any] = {"prompts": args.prompts,
                               "serve_predictions": args.serve_predictions}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        rurl, nurl = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{nport}"
        asyncio.run(wait_up(nurl))
        asyncio.run(wait_up(rurl))
        results["null"] = asyncio.run(load(nurl, args.seconds, args.concurrency, bodies))
        results["router"] = asyncio.run(load(rurl, args.seconds, args.concurrency, bodies))
        results["loop_lag_ms"] = asyncio.run(loop_lag(rurl, args.seconds))

        async def backend_url() -> str:
            async with aiohttp.ClientSession() as s, s.get(rurl + "/instances") as r:
                return str((await r.json())["instances"][0]["url"])
        direct = asyncio.run(backend_url())
        pport = free_port()
        procs.append(subprocess.Popen([sys.executable, "-c", NULL_PROXY, str(pport), direct],
                                      env=env))
        purl = f"http://127.0.0.1:{pport}"
        asyncio.run(wait_up(purl))
        via, straight, floor = [], [], []
        t_ttft = time.monotonic()
        for _ in range(args.ttft_requests // 20):
            via += asyncio.run(ttft(rurl, 10))
            straight += asyncio.run(ttft(direct, 10))
            floor += asyncio.run(ttft(purl, 10))
        results["loop_lag_ttft_ms"] = asyncio.run(loop_lag(rurl, time.monotonic() - t_ttft))
        v, d = np.array(via) * 1e3, np.array(straight) * 1e3
        f = np.array(floor) * 1e3
        results["ttft_ms"] = {
            "router_p50": float(np.percentile(v, 50)), "router_p99": float(np.percentile(v, 99)),
            "direct_p50": float(np.percentile(d, 50)), "direct_p99": float(np.percentile(d, 99)),
            "null_proxy_p50": float(np.percentile(f, 50)),
            "null_proxy_p99": float(np.percentile(f, 99))}
    finally:
        for p in (router, null, emulators, *procs):
            p.terminate()
            p.wait(timeout=30)
    n, r, t = results["null"], results["router"], results["ttft_ms"]
    lag, lag1 = results["loop_lag_ms"], results["loop_lag_ttft_ms"]
    results["router_over_null"] = r["rate_per_s"] / n["rate_per_s"]
    results["proxy_ttft_p99_ratio"] = t["router_p99"] / t["direct_p99"]
    results["loop_lag_p99_ms"] = None if lag is None else lag["p99_ms"]
    rows = [
        ("null handler: requests/s", f"{n['rate_per_s']:,.0f}"),
        ("null handler: p50 / p99 ms", f"{n['p50_ms']:.2f} / {n['p99_ms']:.2f}"),
        ("router /route: requests/s", f"{r['rate_per_s']:,.0f}"),
        ("router /route: p50 / p99 ms", f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}"),
        ("router / null rate", f"{results['router_over_null']:.0%}   (goal >= 50%: "
                               f"{_met(results['router_over_null'] >= 0.5)})"),
        ("router errors", f"{r['errors']:.0f}"),
        ("TTFT via router p50 / p99 ms", f"{t['router_p50']:.2f} / {t['router_p99']:.2f}"),
        ("TTFT direct p50 / p99 ms", f"{t['direct_p50']:.2f} / {t['direct_p99']:.2f}"),
        ("TTFT via a null aiohttp proxy p50 / p99", f"{t['null_proxy_p50']:.2f} / "
                                                   f"{t['null_proxy_p99']:.2f}   (the hop alone)"),
        ("TTFT added p50 / p99 ms", f"{t['router_p50'] - t['direct_p50']:.2f} / "
                                    f"{t['router_p99'] - t['direct_p99']:.2f}"),
        ("TTFT p99 via router / direct", f"{results['proxy_ttft_p99_ratio']:.2f}   (goal <= "
                                         f"1.10: {_met(results['proxy_ttft_p99_ratio'] <= 1.1)})"),
        ("router loop lag p50 / p99 / max ms", "n/a (no /debug/loop-lag)" if lag is None else
         f"{lag['p50_ms']:.2f} / {lag['p99_ms']:.2f} / {lag['max_ms']:.2f}   (goal p99 <= 1: "
         f"{_met(lag['p99_ms'] <= 1.0)}; {lag['samples']:.0f} samples)"),
        ("  same, one TTFT request at a time", "n/a" if lag1 is None else
         f"{lag1['p50_ms']:.2f} / {lag1['p99_ms']:.2f} / {lag1['max_ms']:.2f}   "
         f"({lag1['samples']:.0f} samples)"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 24}")
    for k, val in rows:
        print(f"{k:<{width}}  {val}")
    if args.json:
        write_results(args.json, results)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
