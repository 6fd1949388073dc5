"""The session's fleet: two real vLLM CPU servers, publishing their KV events, and
``olproute serve`` in front of them (``fleet.py``); every test here is marked
``real_vllm``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet import (
    SERVED,
    START_LIMIT_S,
    Fleet,
    KvEventPorts,
    free_port,
    router_config,
    start_router,
    stop_process,
    vllm_cpu,
    wait_healthy,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.real_vllm)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("real_vllm")
    model = vllm_cpu.build_tiny_model(root / "model")
    # both publish their KV events, which the router subscribes to (its prefix index is
    # exact: test_real_kv_events.py)
    ports = {name: KvEventPorts.free() for name in ("cpu0", "cpu1")}
    servers = [vllm_cpu.VllmServer(name, free_port(), model, root / f"{name}.log",
                                   served_model=SERVED, args=ports[name].args())
               for name in ("cpu0", "cpu1")]
    router: subprocess.Popen[Any] | None = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(START_LIMIT_S)
        config = router_config(root / "router.yaml", servers, ports)
        port = free_port()
        log = root / "router.log"
        router = start_router(config, port, log)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router, log, limit_s=START_LIMIT_S)
        yield Fleet(servers, url, router, log, config, ports)
    finally:
        if router is not None:
            stop_process(router)
        for s in servers:
            s.stop()
