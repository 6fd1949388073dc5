"""Where the router's time goes under load: py-spy samples of the router process while
``bench_http``'s load runs against it, summarised as top frames in plain text.

    python bench/profile_http.py [--seconds S] [--tag before|after] [--out docs]

Starts the 8 emulated instances (``olproute emulate``) and the router (``olproute
serve``, bid_price, the config of ``bench_http``) in processes of their own; once the
router answers, attaches ``py-spy record`` to it (``--nolineno``, raw format) for each of
two loads and writes their summaries:

- ``docs/profile-route-<tag>.txt``: ``POST /route`` at concurrency 32;
- ``docs/profile-proxy-<tag>.txt``: streamed ``/v1/completions`` (100 words, 4 tokens)
  through the router at concurrency 16.

Each file starts with the commands that made it, then the frames with the most samples
on their own (self) and under them (inclusive), as shares of all samples. py-spy leaves
out idle threads (a loop waiting in epoll), so the shares are of the router's busy time.
Needs ``pip install py-spy`` and the right to attach to a process of one's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.bench_http import REPO, emulated_fleet, load, route_bodies, wait_up
from bench.common import add_harness_args, begin, free_port, write_results

TOP = 30


async def stream_load(url: str, seconds: float, concurrency: int) -> int:
    """Streamed completions through ``url`` for ``seconds``; how many finished."""
    body = {"prompt": " ".join(["word"] * 100), "max_tokens": 4, "stream": True}
    stop = time.monotonic() + seconds
    done = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return done


def summarise(raw: str, header: list[str]) -> str:
    """Top frames of py-spy's raw (collapsed) stacks: ``frame;frame;... count`` lines."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    out = [*header, f"samples: {total}", ""]
    for title, counts in (("self (the frame itself running)", own),
                          ("inclusive (the frame or what it called)", under)):
        out += [f"top {TOP} frames by {title}:", f"{'share':>7}  {'samples':>7}  frame"]
        out += [f"{n / max(total, 1):7.1%}  {n:7d}  {f}" for f, n in counts.most_common(TOP)]
        out.append("")
    return "\n".join(out)


def record(pid: int, seconds: float, rate: int, out: Path) -> tuple[str, list[str]]:
    """(the py-spy command as shown in a summary, as run)."""
    cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
           "--rate", str(rate), "--nolineno", "--format", "raw", "-o", str(out)]
    return " ".join([*cmd[:-2], "-o", out.name]), cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=6, help="sampling time per load")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--tag", default="after", help="file name suffix (before, after)")
    ap.add_argument("--out", default=str(REPO / "docs"), help="folder of the summaries")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    written: list[str] = []

    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    emulators, config = emulated_fleet(env)
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                               str(config), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    bodies = route_bodies("counts")
    loads = {"route": ("POST /route at concurrency 32",
                       lambda: load(url, args.seconds + 1, 32, bodies)),
             "proxy": ("streamed POST /v1/completions (100 words, 4 tokens) at concurrency 16",
                       lambda: stream_load(url, args.seconds + 1, 16))}
    try:
        asyncio.run(wait_up(url))
        asyncio.run(load(url, 2, 32, bodies))   # warm: first requests, first ticks
        for name, (what, drive) in loads.items():
            raw = tmp / f"{name}.raw"
            shown, cmd = record(router.pid, args.seconds, args.rate, raw)
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)   # attached before the load starts
            asyncio.run(drive())
            spy.wait(timeout=60)
            header = [f"# python bench/profile_http.py --seconds {args.seconds} "
                      f"--tag {args.tag}",
                      f"# load: {what}, 8 emulated backends in their own process",
                      f"# sampler: {shown}", ""]
            path = Path(args.out) / f"profile-{name}-{args.tag}.txt"
            path.write_text(summarise(raw.read_text(), header) + "\n")
            print(f"wrote {path}")
            written.append(str(path))
    finally:
        for p in (router, emulators):
            p.terminate()
            p.wait(timeout=30)
    write_results(args.json, {"summaries": written, "seconds": args.seconds,
                              "rate": args.rate})


if __name__ == "__main__":
    main()
