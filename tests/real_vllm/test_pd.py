"""olproute's disaggregated dispatch in front of two real vLLM CPU servers: a prefill
server (``kv_role: kv_producer``) and a decode server (``kv_consumer``) joined by a KV
connector, and ``olproute serve`` with a prefill and a decode instance in front of them.

Each connector is a module-scoped pair of servers (started once, always stopped):

- ``example``: vLLM's ExampleConnector (the old SharedStorageConnector), which needs no
  package beyond vLLM: the prefill writes each prompt's KV to a shared folder, the decode
  loads the prompt's whole blocks but the last token's from there, keyed by the prompt's
  tokens. Its prefill answer has no ``kv_transfer_params``: the router sends the decode
  its own ``{"do_remote_prefill": true, ...}``, which this connector ignores.
- ``nixl``: the NixlConnector, as vLLM's disaggregated proxy uses it, with
  ``kv_buffer_device: cpu``. Its prefill answer carries the ``kv_transfer_params`` the
  decode pulls the blocks with (engine id, block ids, host and side-channel port), which
  the router relays. It runs only when asked for (``OLPROUTE_TEST_NIXL=1``) and the vLLM
  virtualenv imports ``nixl`` (``pip install nixl``: its CUDA-12 wheel brings its own
  UCX, which moves DRAM between two processes of one host without RDMA or a GPU): on our
  shared 2-core machines it works but slowly and unevenly. The first decode's handshake
  with the prefill (a fixed 5 s timeout in vLLM) failed when the machine was busy; one
  read of a prompt's 0.75 MB of KV took from 1 ms to 64 s, so a test took 5 s to 85 s,
  and an idle NIXL server keeps a thread busy at half a core.

What the tests measure: the decode server's ``vllm:prompt_tokens_by_source`` counter says
how many prompt tokens it computed (``local_compute``) and how many it loaded through
the connector (``external_kv_transfer``); a decode that recomputed the prompt would count
them all as computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from olproute.server.proxy import decode_body, decode_kv_params, prefill_body
from tests.conftest import HANG_S
from tests.support import vllm_cpu
from tests.support.processes import free_port, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.real_vllm

SERVED = "tiny"          # the model name both vLLM servers answer to
PROMPT_TOKENS = 300      # several KV blocks, well inside the tiny model's 1024
START_LIMIT_S = 900.0    # hang guards for start-ups on a busy 2-core machine
WARM_UP_TRIES = 5
NIXL_ENV = "OLPROUTE_TEST_NIXL"
# a hang guard on each HTTP request: a NIXL decode waited up to its prefill's lease
CLIENT_TIMEOUT_S = 900.0
# the NIXL prefill holds a prompt's blocks for the decode this long before it frees them
# (vLLM's default is 30 s: on a loaded machine a decode started later read freed blocks,
# "Potentially invalid KV blocks ... They may have expired" in the prefill's log)
NIXL_LEASE_S = 300
CONNECTORS = ("example", "nixl")


@dataclass(frozen=True, slots=True)
class Pair:
    """The two vLLM servers of one connector and the router in front of them."""

    connector: str
    prefill: vllm_cpu.VllmServer
    decode: vllm_cpu.VllmServer
    router_url: str


def nixl_installed() -> bool:
    """Whether the vLLM virtualenv imports ``nixl`` (with this process's environment,
    which the servers inherit)."""
    probe = subprocess.run([str(vllm_cpu.python()), "-c", "import nixl._api"],
                           capture_output=True, timeout=HANG_S * 5)
    return probe.returncode == 0


def kv_transfer_config(connector: str, role: str, root: Path) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one side (``kv_producer`` or ``kv_consumer``)."""
    if connector == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(root / "kv")}}
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": NIXL_LEASE_S}}


def vllm_server(connector: str, role: str, root: Path, model: Path) -> vllm_cpu.VllmServer:
    config = json.dumps(kv_transfer_config(connector, role, root))
    env = ({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if connector == "nixl" else {})
    return vllm_cpu.VllmServer(SERVED, free_port(), model, root / f"{role}.log",
                               args=("--kv-transfer-config", config),
                               env=tuple(env.items()))


def router_config(path: Path, prefill: vllm_cpu.VllmServer,
                  decode: vllm_cpu.VllmServer) -> Path:
    """``configs/vllm_cpu.yaml`` made into a prefill and a decode pool of one instance
    each, round robin (a pair per request, nothing held or refused), written to ``path``;
    the router waits for a backend's first byte as long as the tests' clients do (the
    default 60 s ended NIXL decodes that were still waiting for their KV)."""
    doc = yaml.safe_load((REPO / "configs" / "vllm_cpu.yaml").read_text())
    doc["profiles"] = str(REPO / "configs" / "profiles.yaml")
    template = doc["instances"][0]
    doc["instances"] = [{**template, "name": "prefill", "role": "prefill"},
                        {**template, "name": "decode", "role": "decode"}]
    doc["router"] = {"policy": "round_robin"}
    doc["prices"] = {"certify_period_s": None}
    doc["server"] = {**doc["server"], "health_period_s": 0.5, "scrape_period_s": 0.5,
                     "health_timeout_s": 10.0,   # a busy machine answers probes late
                     "connect_timeout_s": 10.0,  # and accepts connections late
                     "first_byte_timeout_s": CLIENT_TIMEOUT_S,
                     "request_timeout_s": CLIENT_TIMEOUT_S,
                     "backends": [
                         {"name": "prefill", "role": "prefill", "url": prefill.url,
                          "served_model": SERVED},
                         {"name": "decode", "role": "decode", "url": decode.url,
                          "served_model": SERVED}]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
        return json.loads(r.read())


def direct_pair(prefill: vllm_cpu.VllmServer, decode: vllm_cpu.VllmServer,
                data: dict[str, Any]) -> tuple[Any, Any]:
    """The router's two requests, sent straight to the servers: the prefill answer and the
    decode answer of a completion ``data``."""
    answer = post_json(prefill.url + "/v1/completions", prefill_body(data, SERVED))
    body = decode_body(data, SERVED, decode_kv_params(answer, "prefill"))
    return answer, post_json(decode.url + "/v1/completions", body)


def warm_up(prefill: vllm_cpu.VllmServer, decode: vllm_cpu.VllmServer) -> None:
    """One disaggregated completion straight to the servers, tried until it succeeds: the
    NIXL decode's first request makes its handshake with the prefill, which gives up
    after 5 s (vLLM's fixed timeout) and fails the request when the machine is busy."""
    for attempt in range(WARM_UP_TRIES):
        try:
            direct_pair(prefill, decode, {"prompt": vllm_cpu.prompt(40, salt=900 + attempt),
                                          "max_tokens": 2})
            return
        except OSError as exc:
            failure = exc
    raise RuntimeError(f"no disaggregated completion in {WARM_UP_TRIES} tries: {failure}\n"
                       f"{decode.tail()}")


@pytest.fixture(scope="module", params=CONNECTORS)
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    connector = request.param
    if connector == "nixl" and os.environ.get(NIXL_ENV) != "1":
        pytest.skip(f"NIXL on CPU is slow and uneven here: {NIXL_ENV}=1 runs it")
    if connector == "nixl" and not nixl_installed():
        pytest.skip("the vLLM virtualenv has no nixl package (pip install nixl)")
    root = tmp_path_factory.mktemp(f"pd-{connector}")
    model = vllm_cpu.build_tiny_model(root / "model")
    prefill = vllm_server(connector, "kv_producer", root, model)
    decode = vllm_server(connector, "kv_consumer", root, model)
    router: subprocess.Popen[Any] | None = None
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            s.wait_ready(START_LIMIT_S)
        warm_up(prefill, decode)
        config = router_config(root / "router.yaml", prefill, decode)
        port = free_port()
        log = root / "router.log"
        with log.open("ab") as out:
            router = subprocess.Popen(
                [sys.executable, "-m", "olproute.cli", "serve", "--config", str(config),
                 "--host", "127.0.0.1", "--port", str(port)],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router, log, limit_s=START_LIMIT_S)
        yield Pair(connector, prefill, decode, url)
    finally:
        if router is not None:
            stop_process(router)
        for s in (prefill, decode):
            s.stop()


# -- what the servers count ---------------------------------------------------------------

def samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` in a Prometheus text page, by their label string."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in samples(text, name).items() if all(w in key for w in want))


def scrape(server: vllm_cpu.VllmServer) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=HANG_S) as r:
        text: str = r.read().decode()
    return text


@dataclass(frozen=True, slots=True)
class Counts:
    """What one server counted: prompt tokens by source and tokens generated."""

    prompt: float
    computed: float
    transferred: float
    cached: float
    generated: float

    @staticmethod
    def of(server: vllm_cpu.VllmServer) -> Counts:
        text = scrape(server)
        name = "vllm:prompt_tokens_by_source_total"
        return Counts(prompt=counter(text, "vllm:prompt_tokens_total"),
                      computed=counter(text, name, source="local_compute"),
                      transferred=counter(text, name, source="external_kv_transfer"),
                      cached=counter(text, name, source="local_cache_hit"),
                      generated=counter(text, "vllm:generation_tokens_total"))

    def minus(self, before: Counts) -> Counts:
        return Counts(self.prompt - before.prompt, self.computed - before.computed,
                      self.transferred - before.transferred, self.cached - before.cached,
                      self.generated - before.generated)


def counted(server: vllm_cpu.VllmServer, before: Counts,
            done: Callable[[Counts], bool]) -> Counts:
    """The server's counts since ``before`` once ``done`` holds (the engine publishes its
    counters a moment after the answer)."""
    t0 = time.monotonic()
    while True:
        delta = Counts.of(server).minus(before)
        if done(delta) or time.monotonic() - t0 > HANG_S:
            return delta
        time.sleep(0.2)


def block_size(server: vllm_cpu.VllmServer) -> int:
    """The server's KV block size, from its ``vllm:cache_config_info`` labels."""
    for key in samples(scrape(server), "vllm:cache_config_info"):
        for label in key.strip("{}").split(","):
            k, _, v = label.partition("=")
            if k == "block_size":
                return int(v.strip('"'))
    raise AssertionError("no block_size in vllm:cache_config_info")


def check_pair_counts(pair: Pair, prefill0: Counts, decode0: Counts, prompt_tokens: int,
                      output_tokens: int) -> None:
    """The prefill server computed the prompt and sampled one token; the decode server
    loaded all of the prompt but at most its last block through the connector, and
    generated the client's tokens."""
    p = counted(pair.prefill, prefill0, lambda d: d.prompt >= prompt_tokens)
    d = counted(pair.decode, decode0,
                lambda d: d.prompt >= prompt_tokens and d.generated >= output_tokens)
    assert (p.prompt, p.generated) == (prompt_tokens, 1)
    assert p.transferred == 0
    assert d.prompt == prompt_tokens
    assert d.generated == output_tokens
    assert d.computed + d.transferred + d.cached == prompt_tokens
    assert d.cached == 0                          # a prompt the decode had not seen
    assert d.transferred >= prompt_tokens - block_size(pair.decode) - 1
    assert d.computed <= block_size(pair.decode) + 1


def client(pair: Pair) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.router_url + "/v1", api_key="none",
                         timeout=CLIENT_TIMEOUT_S, max_retries=0)


def instances(pair: Pair) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(pair.router_url + "/instances", timeout=HANG_S) as r:
        doc = json.loads(r.read())
    return {i["name"]: i for i in doc["instances"]}


# -- the tests ----------------------------------------------------------------------------

def test_prefill_answer_gives_the_decode_what_the_connector_needs(pair: Pair) -> None:
    """The router's prefill body (``max_tokens: 1``, ``do_remote_decode``) is accepted;
    NIXL's answer carries the parameters the decode pulls the blocks with, the
    ExampleConnector's none, so the router sends the decode its own remote-prefill
    parameters; either way the decode answers the client's request from the prefill's KV."""
    prefill0, decode0 = Counts.of(pair.prefill), Counts.of(pair.decode)
    data = {"prompt": vllm_cpu.prompt(PROMPT_TOKENS, salt=1), "max_tokens": 4,
            "ignore_eos": True}
    answer, decoded = direct_pair(pair.prefill, pair.decode, data)
    assert answer["usage"]["completion_tokens"] == 1
    params = answer.get("kv_transfer_params")
    if pair.connector == "nixl":
        assert params["do_remote_prefill"] is True
        assert params["remote_engine_id"]
        assert params["remote_block_ids"]
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0
        assert decode_kv_params(answer, "prefill") == params
    else:
        assert params is None
        assert decode_kv_params(answer, "prefill") == {"do_remote_prefill": True,
                                                       "remote_engine_id": "prefill"}
    assert decoded["usage"] == {**decoded["usage"], "prompt_tokens": PROMPT_TOKENS,
                                "completion_tokens": 4}
    check_pair_counts(pair, prefill0, decode0, PROMPT_TOKENS, 4)


def test_completion_through_the_pair(pair: Pair) -> None:
    """A completion through the router goes to the prefill then the decode server: both
    named in the headers, the usage of the client's request (not the prefill's one
    token), and the decode did not compute the prompt again."""
    prefill0, decode0 = Counts.of(pair.prefill), Counts.of(pair.decode)
    raw = client(pair).completions.with_raw_response.create(
        model=SERVED, prompt=vllm_cpu.prompt(PROMPT_TOKENS, salt=2), max_tokens=8,
        extra_body={"ignore_eos": True})
    assert raw.headers["x-olproute-instance"] == "prefill"
    assert raw.headers["x-olproute-decode-instance"] == "decode"
    completion = raw.parse()
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        PROMPT_TOKENS, 8)
    assert completion.choices[0].finish_reason == "length"
    check_pair_counts(pair, prefill0, decode0, PROMPT_TOKENS, 8)


def test_streamed_chat_through_the_pair(pair: Pair) -> None:
    """A streamed chat completion through the pair: the decode's stream relayed to the
    end with its usage, the router's decode instance counts one handoff (prefill answer
    to first streamed token), and nothing is left in flight."""
    handoffs0 = instances(pair)["decode"]["handoffs"]
    prefill0, decode0 = Counts.of(pair.prefill), Counts.of(pair.decode)
    raw = client(pair).chat.completions.with_raw_response.create(
        model=SERVED, messages=[{"role": "user",
                                 "content": vllm_cpu.prompt(PROMPT_TOKENS, salt=3)}],
        max_tokens=6, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    assert raw.headers["x-olproute-instance"] == "prefill"
    assert raw.headers["x-olproute-decode-instance"] == "decode"
    chunks = list(raw.parse())
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    # the chat template's "user:" and "assistant:" are 4 more tokens around the prompt
    assert usage.prompt_tokens > PROMPT_TOKENS
    check_pair_counts(pair, prefill0, decode0, usage.prompt_tokens, 6)
    after = instances(pair)
    assert after["decode"]["handoffs"] == handoffs0 + 1
    assert after["prefill"]["in_flight"] == after["decode"]["in_flight"] == 0


def test_decode_from_transferred_kv_matches_a_local_run(pair: Pair) -> None:
    """The pair's greedy tokens equal the prefill server's own greedy tokens for the same
    prompt computed there alone: the decode attended over the KV the prefill computed
    (random weights make a wrong cache show at once)."""
    text = vllm_cpu.prompt(PROMPT_TOKENS, salt=4)
    local = post_json(pair.prefill.url + "/v1/completions",
                      {"model": SERVED, "prompt": text, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True})
    decode0 = Counts.of(pair.decode)
    completion = client(pair).completions.create(
        model=SERVED, prompt=text, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    d = counted(pair.decode, decode0, lambda d: d.prompt >= PROMPT_TOKENS)
    assert d.transferred > 0 and d.cached == 0
    assert completion.choices[0].text == local["choices"][0]["text"]
