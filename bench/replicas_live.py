"""Router replicas sharing state on Redis, live: several ``olproute serve --state`` processes
in front of one emulated fleet, under load, through a leader's death and Redis's.

    python bench/replicas_live.py [--replicas N] [--clients C] [--seconds S] [--json PATH]

1. Start ``redis-server`` on a free port, ``olproute emulate`` (the default's four emulated
   Llama-2-7B / A100 instances) and N replicas of ``olproute serve`` (bid_price, the
   config's ``state`` at its defaults: sync 50 ms, lease 1 s) on free ports.
2. View: C clients send completions round robin over the replicas for S seconds; every
   0.1 s each replica's ``/instances`` is read: the share of its in-flight count that is
   the other replicas' (``in_flight_other_replicas``; (N-1)/N when every replica counts
   every request) and the spread of the replicas' fleet-wide in-flight counts.
3. Leader: the replica holding the lease is SIGKILLed under load (it gives nothing up);
   ``takeover_s`` is the time until another one's ``/healthz`` says it leads.
4. Redis: ``redis-server`` is SIGKILLed under load, restarted 3 s later on its port;
   ``alone_s`` the time until every replica says ``local``, ``rejoin_s`` from the restart
   (the process started, then answering PING) until every one says ``shared`` with all
   replicas seen and one leader.

Every request of phases 3 and 4 sent to a live replica must be answered 200 (a request
to the killed replica is counted apart, as a load balancer would stop sending there).
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (
    RedisServer,
    add_harness_args,
    begin,
    free_port,
    stop_process,
    wait_healthy,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]
BODY = json.dumps({"prompt": "tell me a story " * 40, "max_tokens": 64}).encode()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


class Load:
    """C client threads sending completions round robin over the replicas still up."""

    def __init__(self, urls: list[str], clients: int) -> None:
        self.urls = list(urls)
        self.up = set(urls)
        self.status: Counter[str] = Counter()
        self.to_dead: Counter[str] = Counter()   # statuses of requests to a killed replica
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            with self._lock:
                up = [u for u in self.urls if u in self.up]
            url = up[i % len(up)]
            i += 1
            req = urllib.request.Request(url + "/v1/completions", BODY,
                                         {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                    code = str(r.status)
            except urllib.error.HTTPError as e:
                code = str(e.code)
            except OSError as e:
                code = type(e).__name__
            with self._lock:
                if url in self.up:
                    self.status[code] += 1
                else:
                    self.to_dead[code] += 1

    def drop(self, url: str) -> None:
        with self._lock:
            self.up.discard(url)

    def take(self) -> Counter[str]:
        """The statuses since the last call."""
        with self._lock:
            out, self.status = self.status, Counter()
        return out

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def start_fleet(tmp: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """``olproute emulate`` on free ports; its URLs from what it prints."""
    log = (tmp / "emulate.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "olproute.cli", "emulate"],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    assert proc.stdout is not None
    urls: list[str] = []
    for line in proc.stdout:
        urls.extend(w for w in line.split() if w.startswith("http://"))
        if "serving" in line:
            break
    if len(urls) != 4:
        raise SystemExit(f"olproute emulate printed {urls}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, urls


def until(cond: Any, limit_s: float = 60.0, poll_s: float = 0.01) -> float:
    """Seconds until ``cond()`` holds (SystemExit past ``limit_s``)."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"not within {limit_s:g} s: {cond.__doc__ or cond}")
        time.sleep(poll_s)
    return time.perf_counter() - t0


def state(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = get(url + "/healthz")["state"]
    return doc


def view(urls: list[str], load: Load, seconds: float) -> dict[str, float]:
    """Phase 2: the other replicas' share of each replica's in-flight count, and how far
    the replicas' fleet-wide counts are apart."""
    others, total, spread = 0, 0, []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        counts = []
        for u in urls:
            inst = get(u + "/instances")["instances"]
            counts.append(sum(i["in_flight"] for i in inst))
            others += sum(i["in_flight_other_replicas"] for i in inst)
        total += sum(counts)
        spread.append((max(counts) - min(counts)) / max(max(counts), 1))
        time.sleep(0.1)
    statuses = load.take()
    return {"others_share": others / max(total, 1), "expected_share": (len(urls) - 1)
            / len(urls), "mean_spread": sum(spread) / len(spread),
            "requests": sum(statuses.values()), "ok": statuses["200"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0, help="phase 2's length")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    tmp = Path(tempfile.mkdtemp(prefix="olproute-replicas-"))
    procs: list[subprocess.Popen[Any]] = []
    try:
        redis = RedisServer()
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    try:
        fleet, backends = start_fleet(tmp)
        procs.append(fleet)
        cfg = yaml.safe_load((ROOT / "configs" / "replicas.yaml").read_text())
        cfg["profiles"] = str(ROOT / "configs" / "profiles.yaml")
        cfg["workload"]["path"] = str(ROOT / "data" / "traces" / "splitwise_conv.csv")
        cfg["server"]["backends"] = [{"name": f"llama7b-a100-{i}", "url": u}
                                     for i, u in enumerate(backends)]
        secret = tmp / "state.secret"   # the replicas sign what they share with it
        secret.write_text(secrets.token_hex(32))
        cfg["state"] = {"url": redis.url, "secret_file": str(secret)}   # the defaults
        (tmp / "replicas.yaml").write_text(yaml.safe_dump(cfg))
        urls, routers = [], {}
        for k in range(args.replicas):
            port = free_port()
            log = tmp / f"serve{k}.log"
            p = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                                  str(tmp / "replicas.yaml"), "--port", str(port)],
                                 stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, p, log)
            urls.append(url)
            routers[url] = p
        until(lambda: all(state(u)["replicas"] == len(urls) for u in urls))
        load = Load(urls, args.clients)
        out: dict[str, Any] = {"replicas": args.replicas, "clients": args.clients}
        out["view"] = view(urls, load, args.seconds)

        leader = next(u for u in urls if state(u)["leader"])
        rest = [u for u in urls if u != leader]
        load.take()
        load.drop(leader)
        routers[leader].kill()
        out["takeover_s"] = until(lambda: any(state(u)["leader"] for u in rest))
        time.sleep(2.0)
        out["leader_phase"] = dict(load.take())

        redis.kill()
        out["alone_s"] = until(lambda: all(state(u)["status"] == "local" for u in rest))
        time.sleep(3.0)
        t_restart = time.perf_counter()
        redis.start()

        def rejoined() -> bool:
            s = [state(u) for u in rest]
            return (all(x["status"] == "shared" and x["replicas"] == len(rest) for x in s)
                    and sum(x["leader"] for x in s) == 1)
        until(rejoined)
        out["rejoin_s"] = time.perf_counter() - t_restart
        time.sleep(2.0)
        out["redis_phase"] = dict(load.take())
        load.stop()
        out["redis_phase"] = dict(Counter(out["redis_phase"]) + load.take())
        out["to_killed_replica"] = dict(load.to_dead)
    finally:
        for p in reversed(procs):
            stop_process(p, grace_s=10)
        redis.close()
    report(out)
    if args.json:
        write_results(args.json, out)


def report(out: dict[str, Any]) -> None:
    v = out["view"]
    print(f"{out['replicas']} replicas, {out['clients']} clients, state: sync 50 ms, "
          "lease 1000 ms")
    print(f"view     others' share of in-flight {v['others_share']:.3f} (all counted: "
          f"{v['expected_share']:.3f}); replicas' fleet counts apart {v['mean_spread']:.1%}"
          f" on average; {v['ok']}/{v['requests']} answered 200")
    lp = out["leader_phase"]
    print(f"leader   SIGKILL: another leads after {out['takeover_s']:.3f} s; "
          f"statuses at the survivors {lp}")
    rp = out["redis_phase"]
    print(f"redis    SIGKILL: all alone after {out['alone_s']:.3f} s; restarted 3 s later, "
          f"all rejoined with one leader after {out['rejoin_s']:.3f} s; statuses {rp}")
    print("requests to the killed replica (in flight there when it died), not counted "
          f"above: {out['to_killed_replica']}")


if __name__ == "__main__":
    main()
