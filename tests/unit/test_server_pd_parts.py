"""Disaggregated dispatch below HTTP: the prefill and decode bodies, the tracker's
prefill / inbound / decode bookkeeping (``olproute.routing.disagg``'s semantics: the prefill's
token discarded, the decode with all but the last prompt token computed giving every
output token), the router's health rerouting within pools, and
the emulator's ``kv_transfer_params`` parsing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.config.loader import load_config
from olproute.emulator.protocol import (
    ApiError,
    check_role,
    parse_request,
    prefill_kv_params,
    response_body,
)
from olproute.routing.router import Router
from olproute.server.proxy import PREFILL_KV_PARAMS, decode_body, decode_kv_params, prefill_body
from olproute.server.tracker import Tracker, decode_view
from olproute.types import InstanceSpec, Request
from tests.conftest import PROFILES

P = InstanceSpec(name="p", model="m", gpu="g", tensor_parallel=1, max_num_seqs=4,
                 max_num_batched_tokens=64, block_size=16, num_kv_blocks=64, role="prefill")
D = replace(P, name="d", role="decode")


def _request(rid: int = 7, prompt: int = 20, max_tokens: int = 5) -> Request:
    return Request(request_id=rid, arrival_s=0.0, prompt_tokens=prompt,
                   decode_tokens=max_tokens, predicted_decode_tokens=max_tokens,
                   ttft_target_s=1.0)


# -- bodies ---------------------------------------------------------------------------------
def test_prefill_body_asks_for_one_unstreamed_token_kept_for_a_remote_decode() -> None:
    data = {"prompt": "a b", "max_tokens": 9, "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.5, "model": "alias"}
    body = prefill_body(data, "m")
    assert body == {"prompt": "a b", "max_tokens": 1, "max_completion_tokens": 1,
                    "stream": False, "temperature": 0.5, "model": "m",
                    "kv_transfer_params": PREFILL_KV_PARAMS}
    assert data["max_tokens"] == 9 and data["stream"] is True  # the client's body untouched
    assert "max_completion_tokens" not in prefill_body({"prompt": "a"}, "m")


@pytest.mark.parametrize("answer, expected", [
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e"}},
     {"do_remote_prefill": True, "remote_engine_id": "e"}),
    ({"choices": []}, {"do_remote_prefill": True, "remote_engine_id": "p"}),
    ({"kv_transfer_params": None}, {"do_remote_prefill": True, "remote_engine_id": "p"}),
    ({"kv_transfer_params": {}}, {"do_remote_prefill": True, "remote_engine_id": "p"}),
    ([1, 2], {"do_remote_prefill": True, "remote_engine_id": "p"}),
])
def test_decode_kv_params_are_the_prefill_answers_or_name_the_prefill(
        answer: Any, expected: dict[str, Any]) -> None:
    assert decode_kv_params(answer, "p") == expected


def test_decode_body_is_the_clients_with_the_kv_params() -> None:
    data = {"prompt": "a", "max_tokens": 4, "stream": True}
    assert decode_body(data, "m", {"x": 1}) == {**data, "model": "m",
                                                "kv_transfer_params": {"x": 1}}


# -- tracker --------------------------------------------------------------------------------
def test_tracker_follows_a_streamed_pair_through_prefill_handoff_and_decode() -> None:
    t = Tracker([P, D], ["http://p", "http://d"])
    req = _request(prompt=20, max_tokens=5)
    t.dispatched_pair(0, 1, req, 1.0)
    loads = t.loads(1.0)
    # the prefill backend has room: its scheduler took the prompt in
    assert (loads[0].num_running, loads[0].num_waiting, loads[0].num_outstanding) == (1, 0, 1)
    assert (loads[1].num_waiting, loads[1].num_outstanding) == (0, 1)
    rows = t.inbound_rows()
    assert rows[0] is None and rows[1] is not None
    np.testing.assert_array_equal(rows[1], [[20.0, 5.0, 1.0]])  # prompt, decode, dispatch
    # the prefill runs for its prompt and one token, holding the prompt's blocks
    np.testing.assert_array_equal(t.snapshot(0, 1.0).table,
                                  [[20, 0, 1, 0, -(-20 // P.block_size)]])
    assert t.snapshot(1, 1.0).num_resident == 0

    prefill = t.prefilled(0, 1, req.request_id, 2.0)
    assert prefill is not None and prefill.first_token_s is None  # its token is discarded
    assert t.loads(2.0)[0].num_outstanding == 0
    assert t.loads(2.0)[1].num_outstanding == 1
    t.decode_sent(1, req.request_id, 2.1, streamed=True)
    assert t.inbound_rows()[1] is not None  # still inbound: the decode has not started

    t.token(1, req.request_id, 2.5)  # the decode's first token: new, the request's first
    assert t.inbound_rows()[1] is None
    # running, one token out, the whole prompt and that token in context (20 + 1 = 2 blocks)
    np.testing.assert_array_equal(t.snapshot(1, 2.5).table, [[20, 1, 5, 20, 2]])
    t.token(1, req.request_id, 2.6)
    np.testing.assert_array_equal(t.snapshot(1, 2.6).table, [[20, 2, 5, 21, 2]])
    assert t.backends[1].num_handoffs == 1
    assert t.backends[1].handoff_seconds == pytest.approx(0.5)

    prefill, decode, handoff = t.released_pair(0, 1, req.request_id)
    assert prefill is None and decode is not None
    assert (decode.tokens, decode.first_token_s, decode.computed_tokens) == (2, 2.5, 19)
    assert decode.origin is not None and decode.origin.dispatch_s == 1.0
    assert handoff is not None and handoff.handoff_s == pytest.approx(0.5)
    assert (handoff.dispatch_s, handoff.prefill_end_s) == (1.0, 2.0)
    assert [len(b.flights) + len(b.inbound) for b in t.backends] == [0, 0]


def test_a_decode_queued_behind_others_waits_with_all_but_its_last_prompt_token() -> None:
    # a non-streamed decode starts when sent; one past max_num_seqs (4) waits, and its
    # snapshot row says what the decode backend must still compute: one prompt token
    t = Tracker([P, D], ["http://p", "http://d"])
    for rid in range(5):
        req = _request(rid=rid, prompt=20, max_tokens=5)
        t.dispatched_pair(0, 1, req, float(rid))
        t.prefilled(0, 1, rid, 10.0)
        t.decode_sent(1, rid, 10.0 + rid, streamed=False)
    table = t.snapshot(1, 20.0).table
    np.testing.assert_array_equal(table[-1], [20, 0, 5, 19, 0])


def test_decode_view_is_the_request_with_all_but_its_last_prompt_token_computed() -> None:
    req = _request(prompt=20, max_tokens=1)
    view, computed = decode_view(req)
    assert (view, computed) == (req, 19)  # a one-token answer is decoded too


def test_tracker_non_streamed_decode_starts_when_sent_and_counts_no_handoff() -> None:
    t = Tracker([P, D], ["http://p", "http://d"])
    req = _request(max_tokens=6)
    t.dispatched_pair(0, 1, req, 0.0)
    t.prefilled(0, 1, req.request_id, 1.0)
    t.decode_sent(1, req.request_id, 1.2, streamed=False)
    assert t.inbound_rows()[1] is None and t.loads(1.2)[1].num_running == 1
    t.token(1, req.request_id, 3.0, 6)  # the whole answer: six new tokens
    _, decode, handoff = t.released_pair(0, 1, req.request_id)
    assert decode is not None and (decode.tokens, decode.first_token_s) == (6, 3.0)
    assert handoff is not None and handoff.handoff_s is None
    assert t.backends[1].num_handoffs == 0


def test_tracker_releases_a_pair_that_failed_in_prefill() -> None:
    t = Tracker([P, D], ["http://p", "http://d"])
    req = _request()
    t.dispatched_pair(0, 1, req, 0.0)
    prefill, decode, handoff = t.released_pair(0, 1, req.request_id)
    assert prefill is not None and decode is None
    assert handoff is not None and handoff.prefill_end_s is None and handoff.handoff_s is None
    assert t.loads(0.0)[1].num_outstanding == 0 and t.inbound_rows() == (None, None)


# -- router ---------------------------------------------------------------------------------
def _pools_router(tmp_path: Path) -> Router:
    data = {"profiles": str(PROFILES),
            "instances": [{"name": "p", "model": "qwen2.5-3b", "gpu": "a40",
                           "role": "prefill", "replicas": 2},
                          {"name": "d", "model": "qwen2.5-3b", "gpu": "a40",
                           "role": "decode", "replicas": 2}],
            "router": {"policy": "round_robin"},
            "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                         "prompt_tokens": 10, "decode_tokens": 10}}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data))
    return Router(load_config(path))


def test_router_moves_an_unhealthy_pick_within_its_own_pool(tmp_path: Path) -> None:
    router = _pools_router(tmp_path)
    tracker = Tracker(router.specs, ["http://x"] * 4)
    req = router.new_request(0.0, 10, 4, 1.0)
    d = router.decide(req, 0.0, tracker.loads(0.0), None, [True] * 4, tracker.inbound_rows())
    assert (d.instance, d.decode_instance) == (0, 2)
    # the next round-robin pair is (p-1, d-1); both down: moved to p-0 and d-0
    d = router.decide(req, 0.0, tracker.loads(0.0), None, [True, False, True, False],
                      tracker.inbound_rows())
    assert (d.instance, d.decode_instance) == (0, 2)
    assert d.reason.startswith("p-1 unhealthy; moved to p-0; d-1 unhealthy; moved to d-0")
    for healthy, reason in (([False, False, True, True], "no healthy prefill backend"),
                            ([True, True, False, False], "no healthy decode backend")):
        d = router.decide(req, 0.0, tracker.loads(0.0), None, healthy)
        assert d.action == "shed" and d.reason == reason


def test_router_pass_over_held_requests_sheds_those_no_healthy_backend_takes(
        tmp_path: Path) -> None:
    """Router.decide_held: a request with no healthy prefill backend (its own exclusions)
    is shed before the policy sees it, and the policy forgets it; the others are decided
    by the policy's pass and moved off unhealthy backends as in decide."""
    router = _pools_router(tmp_path)
    tracker = Tracker(router.specs, ["http://x"] * 4)
    reqs = [router.new_request(0.0, 10, 4, 1.0) for _ in range(2)]
    seen: list[int] = []
    forgotten: list[int] = []
    inner = router.policy.decide
    router.policy.decide = lambda ctx: (seen.append(ctx.request.request_id),  # type: ignore[method-assign]
                                        inner(ctx))[1]
    router.policy.forget = forgotten.append  # type: ignore[method-assign]
    healthy = {reqs[0].request_id: [False, False, True, True],
               reqs[1].request_id: [True, False, True, True]}
    out = list(router.decide_held(reqs, 0.0, tracker.loads(0.0), None, healthy.__getitem__,
                                  tracker.inbound_rows()))
    assert (out[0].request_id, out[0].action, out[0].reason) == (
        reqs[0].request_id, "shed", "no healthy prefill backend")
    assert forgotten == [reqs[0].request_id] and seen == [reqs[1].request_id]
    assert out[1].action == "dispatch" and out[1].instance == 0   # moved off p-1 if picked


# -- emulator protocol -------------------------------------------------------------------------
@pytest.mark.parametrize("params, flags", [
    (None, (False, False, None)),
    ({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None},
     (True, False, None)),
    ({"do_remote_prefill": True, "remote_engine_id": "p-0", "remote_block_ids": [1]},
     (False, True, "p-0")),
])
def test_kv_transfer_params_parse(params: Any, flags: tuple[bool, bool, str | None]) -> None:
    body: dict[str, Any] = {"prompt": "a b", "max_tokens": 2}
    if params is not None:
        body["kv_transfer_params"] = params
    gen = parse_request(body, "completion", "m", 100)
    assert (gen.remote_decode, gen.remote_prefill, gen.remote_engine_id) == flags


@pytest.mark.parametrize("params, param", [
    ([], "kv_transfer_params"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params"),
    ({"do_remote_prefill": True, "remote_engine_id": 3}, "kv_transfer_params.remote_engine_id"),
])
def test_bad_kv_transfer_params_name_the_field(params: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request({"prompt": "a", "kv_transfer_params": params}, "completion", "m", 100)
    assert info.value.status == 400 and info.value.param == param


def test_roles_and_the_prefill_answer() -> None:
    remote_prefill = parse_request({"prompt": "a", "kv_transfer_params":
                                    {"do_remote_prefill": True}}, "completion", "m", 100)
    remote_decode = parse_request({"prompt": "a", "max_tokens": 1, "kv_transfer_params":
                                   {"do_remote_decode": True}}, "completion", "m", 100)
    for gen, role in ((remote_prefill, "decode"), (remote_prefill, "mixed"),
                      (remote_decode, "prefill"), (remote_decode, "mixed")):
        check_role(gen, role)
    for gen, role in ((remote_prefill, "prefill"), (remote_decode, "decode"),
                      (replace(remote_decode, stream=True), "prefill")):
        with pytest.raises(ApiError):
            check_role(gen, role)
    params = prefill_kv_params("p-0", "h", 8, 33, 16, 2)
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "p-0", "remote_block_ids": [0, 1, 2],
                      "remote_host": "h", "remote_port": 8, "tp_size": 2}
    body = response_body(remote_decode, "id", 0, 1, params)
    assert body["kv_transfer_params"] == params and body["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" not in response_body(remote_decode, "id", 0, 1)
