"""Real vLLM behind olproute (what ``conftest.py``'s ``fleet`` fixture starts): two vLLM
CPU servers (``tests/support/vllm_cpu.py``'s tiny model, built at test time) and ``olproute
serve`` in front of them, each in a process of its own on a free 127.0.0.1 port, started
once per session and always stopped.

vLLM comes from its own virtualenv (``scripts/install_vllm_cpu``, which ``./scripts/test``
runs); without it these tests fail with the command that installs it. Deselect them with
``-m "not real_vllm"``.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import vllm_cpu
from tests.support.processes import free_port, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]

__all__ = ["free_port", "stop_process", "vllm_cpu", "wait_healthy"]

SERVED = "tiny"               # the name both vLLM servers answer to
HEALTH_PERIOD_S = 0.5         # the router's health checks in these tests
START_LIMIT_S = 900.0         # a hang guard for a start-up on a busy machine


@dataclass
class Fleet:
    """The two vLLM servers and the router in front of them."""

    servers: list[vllm_cpu.VllmServer]
    router_url: str
    router: subprocess.Popen[Any]
    router_log: Path
    config: Path

    def server(self, name: str) -> vllm_cpu.VllmServer:
        return next(s for s in self.servers if s.name == name)


def router_config(path: Path, servers: list[vllm_cpu.VllmServer]) -> Path:
    """``configs/vllm_cpu.yaml`` with these servers' ports, written to ``path``."""
    doc = yaml.safe_load((REPO / "configs" / "vllm_cpu.yaml").read_text())
    doc["profiles"] = str(REPO / "configs" / "profiles.yaml")
    doc["server"]["backends"] = [{"name": s.name, "url": s.url, "served_model": SERVED}
                                 for s in servers]
    doc["server"]["health_period_s"] = HEALTH_PERIOD_S
    # a busy 2-core machine (two engines, the router, the tests) may answer a probe late:
    # only a dead server fails one here
    doc["server"]["health_timeout_s"] = 10.0
    # and accept a connection late (one stream's connect to the busy survivor took > 2 s)
    doc["server"]["connect_timeout_s"] = 10.0
    doc["server"]["health_max_backoff_s"] = 2.0   # the restarted server is seen in 2 s
    doc["server"]["scrape_period_s"] = 0.5
    doc["prices"] = {"certify_period_s": None}
    # held requests go at their patience instead of being refused: right after the long
    # streams of the fault test, with half the fleet gone, bid_price's default (shed)
    # refused requests to the idle survivor (its prices, learned under that load, had
    # not come down within the 2 s patience); what is tested here is the proxy's part
    doc["admission"] = {"mode": "defer"}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_router(config: Path, port: int, log: Path) -> subprocess.Popen[Any]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                                 str(config), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
