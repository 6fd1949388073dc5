"""The /dashboard screenshot of docs/guides/operating.md (docs/dashboard.png): a
router under a streaming load, the page rendered by headless Chromium.

    python bench/dashboard_shot.py --out docs/dashboard.png     # ~2 min

1. ``olproute serve`` in its own process on ``configs/default.yaml`` (bid_price, four
   emulated Llama-2-7B / A100 instances in-process) with ``max_num_seqs: 12`` (batch
   slots scarce enough to be priced), ``prices.certify_period_s`` (default 5 s, so that a
   live LP check has finished before the picture), ``server.emulator_exact_lengths``
   (every request generates its ``max_tokens``) and ``--weights tail_latency``.
2. From this process: streamed ``/v1/completions``, Poisson arrivals at ``--rate`` req/s
   (seeded), prompts of 20-600 words, ``max_tokens`` 20-300, each read to its end.
3. After ``--seconds`` of load, while it goes on: ``/dashboard`` screenshot by Debian's
   ``chromium`` (the browser tests/integration/test_dashboard.py uses) at ``--size``,
   then ``/dashboard/data`` and ``/prices``' certificate printed, so that the text can
   quote what the picture shows. During the load ``/dashboard/data`` is fetched every
   second, as an open page does: the router samples its counters only when asked, so
   without it the page's "last ~5 s" rates would span the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, free_port, write_results

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the", "router", "prices", "batch", "slots", "cache", "blocks", "and", "prefill",
         "tokens", "over", "a", "horizon", "of", "future", "slots", "so", "that", "each",
         "request", "goes", "where", "its", "reward", "beats", "the", "price")


def write_config(tmp: Path, max_num_seqs: int, certify_period_s: float) -> Path:
    """configs/default.yaml with the overrides, paths made absolute."""
    src = REPO / "configs" / "default.yaml"
    cfg: dict[str, Any] = yaml.safe_load(src.read_text())
    cfg["profiles"] = str(src.parent / cfg["profiles"])
    if cfg.get("workload", {}).get("path"):
        cfg["workload"]["path"] = str((src.parent / cfg["workload"]["path"]).resolve())
    for inst in cfg["instances"]:
        inst["max_num_seqs"] = max_num_seqs
    cfg.setdefault("prices", {})["certify_period_s"] = certify_period_s
    # every request generates its max_tokens, as when the docs' picture was taken
    cfg.setdefault("server", {})["emulator_exact_lengths"] = True
    path = tmp / "dashboard.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def wait_up(url: str, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


async def one(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
              status: Counter[str]) -> None:
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                pass
            status[str(r.status)] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        status[type(exc).__name__] += 1


async def load(url: str, rate: float, stop: asyncio.Event, status: Counter[str],
               seed: int) -> None:
    """Poisson arrivals at ``rate`` until ``stop``; each request streamed to its end."""
    rng = np.random.default_rng(seed)
    tasks: set[asyncio.Task[None]] = set()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        nxt = time.monotonic()
        while not stop.is_set():
            nxt += float(rng.exponential(1.0 / rate))
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            words = rng.choice(WORDS, size=int(rng.integers(20, 601)))
            body = {"prompt": " ".join(words), "max_tokens": int(rng.integers(20, 301)),
                    "stream": True}
            t = asyncio.create_task(one(s, url, body, status))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def screenshot(url: str, out: Path, size: str, tmp: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        raise SystemExit("no chromium: apt-get install -y chromium (scripts/test does this)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'chrome'}",
           f"--window-size={size}", "--virtual-time-budget=3000",
           f"--screenshot={out.resolve()}", url + "/dashboard"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed: {done.stderr[-2000:]}")


async def get_json(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.json()


async def watch(url: str, stop: asyncio.Event) -> None:
    """``/dashboard/data`` every second until ``stop`` (an open page's refresh)."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            async with s.get(url + "/dashboard/data") as r:
                await r.read()
            await asyncio.sleep(1.0)


async def run(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    await wait_up(url)
    stop, status = asyncio.Event(), Counter[str]()
    t0 = time.monotonic()
    driver = asyncio.create_task(load(url, args.rate, stop, status, args.seed))
    watcher = asyncio.create_task(watch(url, stop))
    await asyncio.sleep(args.seconds)
    await asyncio.to_thread(screenshot, url, Path(args.out), args.size, tmp)
    data = await get_json(url, "/dashboard/data")
    prices = await get_json(url, "/prices")
    stop.set()
    await asyncio.gather(driver, watcher)
    return {"load_s": time.monotonic() - t0, "status": dict(status), "dashboard": data,
            "certificate": prices.get("certificate"),
            "certificate_message": prices.get("certificate_message")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--seconds", type=float, default=100.0, help="load before the picture")
    ap.add_argument("--rate", type=float, default=14.0, help="requests per second")
    ap.add_argument("--max-num-seqs", type=int, default=12)
    ap.add_argument("--certify-period-s", type=float, default=5.0)
    ap.add_argument("--weights", default="tail_latency")
    ap.add_argument("--size", default="1250,650", help="browser window, W,H pixels")
    ap.add_argument("--seed", type=int, default=0)
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)

    tmp = Path(tempfile.mkdtemp(prefix="dashboard_shot_"))
    config = write_config(tmp, args.max_num_seqs, args.certify_period_s)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                               str(config), "--weights", args.weights, "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        result = asyncio.run(run(args, url, tmp))
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    d = result["dashboard"]
    print(f"wrote {args.out}; load {result['load_s']:.0f} s at {args.rate} req/s, "
          f"responses {result['status']}; server log {tmp / 'serve.log'}")
    print(f"certificate: {json.dumps(result['certificate'])}"
          if result["certificate"] else f"certificate: none ({result['certificate_message']})")
    print(f"decisions total {d['decisions']['total']}, per s {d['decisions']['per_s']}")
    print(f"ttft {d['ttft']}")
    for inst in d["instances"]:
        print(f"  {inst['name']}: bottleneck {inst['bottleneck']}, price sums "
              f"{ {k: round(v, 3) for k, v in inst['price_sum'].items()} }")
    if args.json:
        write_results(args.json, result, [args.seed])


if __name__ == "__main__":
    main()
