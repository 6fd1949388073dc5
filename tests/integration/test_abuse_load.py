"""The router protects itself under abuse that costs the attacker little: a flood of held
requests whose clients leave, patience asked for in hours, a full buffer, backends that
answer their health checks but hang or stall on requests. Each test ends by checking the
router still answers ``/healthz``."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from olproute.config.loader import load_config
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.conftest import HANG_S, PROFILES
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, backend_errors, request, stream

# a short prompt: with every engine's one batch slot taken (``_fill``) it cannot start
# anywhere, so bid_price holds it until its patience runs out, then refuses it (no_room)
NO_ROOM = "a request with nowhere to start"


def _config(tmp_path: Path, admission: dict[str, Any] | None = None,
            server: dict[str, Any] | None = None, router: dict[str, Any] | None = None
            ) -> Path:
    data: dict[str, Any] = {
        "profiles": str(PROFILES),
        "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2,
                       "kv_capacity_tokens": 2048, "max_num_seqs": 1}],
        "router": {"policy": "bid_price", "slot_ms": 20, **(router or {})},
        "prices": {"period_slots": 5, "window": 200, "minibatch": 32},
        "admission": {"mode": "shed", **(admission or {})},
        "server": {"health_period_s": 0.1, "scrape_period_s": 0.2, **(server or {})},
        "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                     "prompt_tokens": 10, "decode_tokens": 10},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _stack(tmp_path: Path, **sections: dict[str, Any]) -> Stack:
    loaded = load_config(_config(tmp_path, **sections))
    return Stack(loaded, num_fakes=2, calibration=CalibrationSource(loaded, known=[CAL] * 2))


def _fill(s: Stack) -> Callable[[], None]:
    """Take each engine's one batch slot with a stream held after its first token (its
    engine running it, as the router sees): no engine has room for anything more. Returns
    the call that lets them finish."""
    holds = [s.call(asyncio.Event) for _ in s.fakes]
    for fake, hold in zip(s.fakes, holds, strict=True):
        fake.hold, fake.hold_after = hold, 1
    done: list[int] = []

    def one() -> None:
        status, _, _ = stream(s.url, "/v1/completions",
                              {"prompt": "blocker", "max_tokens": 3, "stream": True})
        done.append(status)

    threads = [threading.Thread(target=one, daemon=True) for _ in s.fakes]
    for t in threads:
        t.start()
        # the next blocker goes where there is still room
        assert wait_until(lambda t=t: sum(f.requests for f in s.fakes)
                          == threads.index(t) + 1, timeout=HANG_S)
    tracker = s.app[STATE].tracker
    assert wait_until(lambda: s.call(lambda: all(
        any(f.tokens for f in b.flights.values()) for b in tracker.backends)), timeout=HANG_S)

    def release() -> None:
        for fake, hold in zip(s.fakes, holds, strict=True):
            fake.hold = None
            s.release(hold)
        for t in threads:
            t.join(HANG_S)
        assert done == [200] * len(threads)
    return release


@pytest.fixture
def flood(tmp_path: Path) -> Iterator[Stack]:
    s = _stack(tmp_path, admission={"max_patience_s": 600.0, "max_held": 64})
    release = _fill(s)
    try:
        yield s
    finally:
        release()
        s.close()


def _healthy(stack: Stack) -> None:
    status, _, raw = request(stack.url, "GET", "/healthz")
    assert status == 200 and json.loads(raw)["status"] == "ok"


def _held(stack: Stack) -> int:
    holding = stack.app[STATE].holding
    assert holding is not None
    return int(stack.call(lambda: len(holding)))


def _open_held(url: str, n: int, ttft_ms: str = "3600000") -> list[socket.socket]:
    """``n`` raw connections, each sending a request that is held, then left open."""
    u = urlparse(url)
    body = json.dumps({"prompt": NO_ROOM, "max_tokens": 4, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
            f"Content-Type: application/json\r\nx-slo-ttft-ms: {ttft_ms}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection((u.hostname, u.port), timeout=HANG_S)
        s.sendall(head + body)
        socks.append(s)
    return socks


def test_held_requests_whose_clients_left_are_dropped_at_once(flood: Stack) -> None:
    """40 requests no engine has room for, asking for an hour of patience: held. Their
    clients leave; the buffer empties, no re-scoring goes on for them, and no backend
    ever saw one (only the two streams that fill them)."""
    socks = _open_held(flood.url, 40)
    assert wait_until(lambda: _held(flood) == 40, timeout=HANG_S)
    for s in socks:
        s.close()
    assert wait_until(lambda: _held(flood) == 0, timeout=HANG_S)
    holding = flood.app[STATE].holding
    assert holding is not None
    before = flood.call(lambda: holding.stats.rescored)
    assert not wait_until(lambda: flood.call(lambda: holding.stats.rescored) > before,
                          timeout=0.5)   # nothing left to re-score
    assert sum(f.requests for f in flood.fakes) == 2
    _healthy(flood)


def test_a_full_buffer_refuses_at_once_with_retry_after(tmp_path: Path) -> None:
    s = _stack(tmp_path, admission={"max_patience_s": 600.0, "max_held": 3})
    release = _fill(s)
    try:
        socks = _open_held(s.url, 3)
        assert wait_until(lambda: _held(s) == 3, timeout=HANG_S)
        status, headers, raw = request(s.url, "POST", "/v1/completions",
                                       {"prompt": NO_ROOM, "max_tokens": 4},
                                       headers={"x-slo-ttft-ms": "3600000"})
        assert status == 429 and headers["retry-after"] == "1"
        error = json.loads(raw)["error"]
        assert "buffer is full (3 requests held)" in error["message"]
        assert error["type"] == "rate_limited"
        assert _held(s) == 3    # the three held ones are still there
        for sock in socks:
            sock.close()
        assert wait_until(lambda: _held(s) == 0, timeout=HANG_S)
        _healthy(s)
    finally:
        release()
        s.close()


def test_patience_is_capped_whatever_the_header_asks(tmp_path: Path) -> None:
    """x-slo-ttft-ms asks for an hour; admission.max_patience_s (0.2 s) wins: the request
    no engine has room for is refused instead of being held for an hour, typed
    no_room with each engine's figure, and counted by that reason. Once the engines
    have room the same request is served."""
    s = _stack(tmp_path, admission={"max_patience_s": 0.2})
    release = _fill(s)
    try:
        status, headers, raw = request(s.url, "POST", "/v1/completions",
                                       {"prompt": NO_ROOM, "max_tokens": 4},
                                       headers={"x-slo-ttft-ms": "3600000"})
        assert status == 429 and "retry-after" in headers
        error = json.loads(raw)["error"]
        assert "shed after" in error["message"] and error["code"] == "no_room"
        assert "q-0 1/1 running" in error["message"] and "q-1 1/1 running" in error["message"]
        assert _refused(s) == {"no_room": 1.0}
        release()
        assert wait_until(lambda: s.call(lambda: not any(
            b.flights for b in s.app[STATE].tracker.backends))), "the blockers finished"
        status, _, _ = request(s.url, "POST", "/v1/completions",
                               {"prompt": NO_ROOM, "max_tokens": 4})
        assert status == 200
        _healthy(s)
    finally:
        release()
        s.close()


def test_a_request_no_instance_could_ever_hold_is_a_400_at_once(tmp_path: Path) -> None:
    """Each instance holds 2,048 tokens: a 3,000-word prompt (at least 3,000 tokens) is a
    400 naming the prompt, and 1,000 words asking for 1,500 tokens a 400 naming
    max_tokens, both at once and typed as vLLM types them (never a 429 a client would
    retry forever); no backend sees either."""
    s = _stack(tmp_path, admission={"max_patience_s": 600.0})
    try:
        status, headers, raw = request(s.url, "POST", "/v1/completions",
                                       {"prompt": " ".join(["word"] * 3000), "max_tokens": 4})
        error = json.loads(raw)["error"]
        assert status == 400 and "retry-after" not in headers
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        assert "at least 3000 tokens" in error["message"] and "2048" in error["message"]
        status, _, raw = request(s.url, "POST", "/v1/completions",
                                 {"prompt": " ".join(["word"] * 1000), "max_tokens": 1500})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "max_tokens"
        assert sum(f.requests for f in s.fakes) == 0
        assert _refused(s) == {"context": 2.0}
        status, _, _ = request(s.url, "POST", "/v1/completions",
                               {"prompt": " ".join(["word"] * 1000), "max_tokens": 40})
        assert status == 200
    finally:
        s.close()


def _refused(s: Stack) -> dict[str, float]:
    _, _, body = request(s.url, "GET", "/metrics")
    return {x.labels["reason"]: x.value
            for fam in text_string_to_metric_families(body.decode())
            if fam.name == "olproute_refused" for x in fam.samples
            if x.name == "olproute_refused_total"}


def test_held_requests_decided_together_are_shed_at_patience_and_others_served(
        tmp_path: Path) -> None:
    """bid_price deciding its held requests together (release: density): three requests
    no engine has room for, held at once, are each refused after their patience by the
    joint pass (one call per slot); once the engines have room a request is served; no
    backend saw the three."""
    s = _stack(tmp_path, admission={"max_patience_s": 0.3},
               router={"policy_params": {"bid_price": {"release": "density"}}})
    release = _fill(s)
    try:
        st = s.app[STATE]
        assert st.router.policy.joint_release
        passes: list[int] = []
        inner = st.router.decide_held

        def counted(requests, *args):  # type: ignore[no-untyped-def]
            passes.append(len(requests))
            return inner(requests, *args)

        s.call(lambda: setattr(st.router, "decide_held", counted))
        socks = _open_held(s.url, 3)
        for sock in socks:
            answer = b""
            while b"shed after" not in answer:
                chunk = sock.recv(4096)   # the socket's timeout catches a hang
                assert chunk, f"connection closed after {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 429")
            sock.close()
        holding = st.holding
        assert holding is not None
        assert s.call(lambda: holding.stats.rescored) >= 3
        assert passes and max(passes) >= 2   # the buffer went to the router in one call
        assert sum(f.requests for f in s.fakes) == 2   # the blockers alone
        release()
        status, _, raw = request(s.url, "POST", "/v1/completions",
                                 {"prompt": "hello there", "max_tokens": 4})
        assert status == 200 and json.loads(raw)["choices"]
        _healthy(s)
    finally:
        release()
        s.close()


def test_a_hung_backend_times_out_is_retried_elsewhere_and_backs_off(tmp_path: Path) -> None:
    """Backend 0 answers /health but never a completion. A request sent there gets no
    first byte within first_byte_timeout_s: its connection is closed, it is retried on
    backend 1 (the client gets its answer), and backend 0 is counted as failed before its
    first byte. Streamed requests: the healthy backend sends its headers at once, so the
    timeout (10 s, far above anything but a hang) only ever fires on the hung one."""
    s = _stack(tmp_path, server={"first_byte_timeout_s": 10.0})
    try:
        s.fakes[0].mode = "hang"
        for _ in range(20):   # until one request has been routed to the hung backend
            status, headers, lines = stream(s.url, "/v1/completions",
                                            {"prompt": "a b", "max_tokens": 2, "stream": True})
            assert status == 200 and headers["x-olproute-instance"] == "q-1"
            assert lines[-1] == b"data: [DONE]"
            if s.fakes[0].requests:
                break
        assert s.fakes[0].requests == 1
        assert wait_until(lambda: s.fakes[0].cancelled == 1, timeout=HANG_S)
        assert backend_errors(s.url) == {("q-0", "before_first_byte"): 1.0}
        _healthy(s)
    finally:
        s.close()


def test_a_stalled_stream_ends_with_an_error_event_and_marks_the_backend(
        tmp_path: Path) -> None:
    """Both backends stream two tokens, then nothing (the connection stays open): after
    read_timeout_s the client gets an error event naming the stall and the stream ends."""
    # far above the healthy chunk interval (10 ms): only the stall trips it
    s = _stack(tmp_path, server={"read_timeout_s": 5.0})
    try:
        for fake in s.fakes:
            fake.mode, fake.cut_after, fake.delay_s = "stall", 2, 0.01
        status, headers, lines = stream(s.url, "/v1/completions",
                                        {"prompt": "a", "max_tokens": 8, "stream": True})
        assert status == 200
        victim = int(headers["x-olproute-instance"].split("-")[1])
        event = json.loads(lines[-1].removeprefix(b"data: "))
        assert "no chunk within 5 s" in event["error"]["message"]
        assert len([line for line in lines if b'"text"' in line]) == 2
        assert wait_until(lambda: s.fakes[victim].cancelled == 1, timeout=HANG_S)
        assert backend_errors(s.url) == {(f"q-{victim}", "stalled"): 1.0}
        _healthy(s)
    finally:
        s.close()


def test_a_client_leaving_before_the_first_byte_cancels_the_backend_request(
        tmp_path: Path) -> None:
    """The backend has not answered yet when the client leaves: the router's handler is
    cancelled and closes the backend connection (the backend stops working for nobody),
    and the request leaves the tracker without blaming the backend."""
    s = _stack(tmp_path)
    try:
        for fake in s.fakes:
            fake.mode = "hang"
        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG_S)
        done = threading.Event()

        def client() -> None:
            conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                         body=json.dumps({"prompt": "a", "max_tokens": 2}).encode())
            done.set()

        threading.Thread(target=client, daemon=True).start()
        assert done.wait(HANG_S)
        assert wait_until(lambda: sum(f.requests for f in s.fakes) == 1, timeout=HANG_S)
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert wait_until(lambda: sum(f.cancelled for f in s.fakes) == 1, timeout=HANG_S)
        tracker = s.app[STATE].tracker
        assert wait_until(lambda: s.call(
            lambda: sum(len(b.flights) for b in tracker.backends)) == 0, timeout=HANG_S)
        assert backend_errors(s.url) == {}   # the backend is not blamed for it
        _healthy(s)
    finally:
        s.close()
