"""Bad input, as an attacker or a careless client sends it, against a real router on
127.0.0.1: each case answers a 4xx in OpenAI's error shape naming the field,
echoes nothing of a file it pointed at, leaves the running router as it was, and the
router still answers /healthz afterwards.

(/healthz is checked with a timeout that catches a hang, not one that measures
latency: these tests share the machine with benchmarks.)
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import random
import socket
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from olproute.config.loader import MAX_YAML_BYTES, load_config
from olproute.server import proxy
from olproute.server.app import public_url
from olproute.server.schema import ONE_COMPLETION, parse_json
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, TOKEN, _config

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "S3CRET-b7f1c2"   # in every file a case points the router at
TIMEOUT_S = 10.0           # catches a hang; not a latency bound
BODY_TIMEOUT_S = 0.5


def call(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; header values may be bytes (sent as they are)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.putrequest(method, path)
        hdrs: dict[str, Any] = {"Content-Type": "application/json",
                                "Content-Length": str(len(data or b"")), **(headers or {})}
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def error_of(raw: bytes) -> dict[str, Any]:
    """The error of an answer in OpenAI's shape (asserting the shape)."""
    doc = json.loads(raw)
    assert isinstance(doc, dict) and set(doc) == {"error"}, doc
    err = doc["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err  # type: ignore[no-any-return]


def assert_error(answer: tuple[int, dict[str, str], bytes], status: int,
                 param: str | None = None) -> dict[str, Any]:
    code, headers, raw = answer
    assert code == status, (code, raw[:300])
    assert headers["content-type"].startswith("application/json"), headers
    err = error_of(raw)
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    return err


def assert_healthy(stack: Stack) -> None:
    code, _, raw = call(stack.url, "GET", "/healthz")
    assert code == 200 and json.loads(raw)["status"] == "ok", raw


def _stack(tmp: Path, **server: Any) -> Stack:
    path = _config(tmp, server={"health_period_s": 0.1, "scrape_period_s": 0.2,
                                "admin_token": TOKEN, **server})
    loaded = load_config(path)
    return Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = _stack(tmp_path_factory.mktemp("abuse"), body_timeout_s=BODY_TIMEOUT_S)
    try:
        yield s
    finally:
        s.close()


# -- bodies ---------------------------------------------------------------------------------
ENDPOINTS = ("/route", "/v1/completions", "/v1/chat/completions")
VALID: dict[str, dict[str, Any]] = {
    "/route": {"prompt": "hello there", "max_tokens": 4},
    "/v1/completions": {"prompt": "hello there", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4},
}
NESTED = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
RAW_CASES = [  # (id, body): each 400 with no field to name
    ("nested-100k", NESTED),
    # deep enough to overflow the C stack of a parser that recurses without a limit
    ("nested-500k", b'{"prompt": "x", "extra": ' + b"[" * 500_000 + b"]" * 500_000 + b"}"),
    ("nested-200k-after-brackets-in-a-string", b'{"prompt": "' + b"]" * 200_000 + b'", "extra": '
     + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    ("nested-65", b'{"prompt": "x", "extra": ' + b"[" * 65 + b"]" * 65 + b"}"),
    ("unclosed-100k", b"[" * 100_000),
    ("huge-int-max_tokens", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("huge-int-extra", b'{"prompt": "x", "n": -' + b"1" * 5000 + b"}"),
    ("nan", b'{"prompt": "x", "max_tokens": NaN}'),
    ("infinity", b'{"prompt": "x", "ttft_target_ms": Infinity}'),
    ("not-utf8", b'{"prompt": "\xff\xfe"}'),
    ("not-json", b"{prompt: x"),
    ("empty", b""),
    ("array", b"[1, 2]"),
    ("string", b'"prompt"'),
]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(("case", "raw"), RAW_CASES, ids=[c for c, _ in RAW_CASES])
def test_malformed_bodies_are_400(stack: Stack, path: str, case: str, raw: bytes) -> None:
    err = assert_error(call(stack.url, "POST", path, raw=raw), 400)
    assert err["param"] is None and len(err["message"]) < 300, err
    assert_healthy(stack)


INTS = ["abc", "5", True, False, 1.5, 5.0, 1e12, -1, 0, 10**12, [], {}]  # wrong for 1..1e6
NUMBERS = ["fast", True, 0, -1, 1e12, [], {}]                         # wrong for (0, 1 h]
STRINGS = [5, True, 1.5, [], {}]
BOOLS = ["yes", "true", 1, 0, None, []]
MESSAGES = [5, "hi", [], [5], ["hi"], [{}], [{"content": "hi"}], [{"role": 5}],
            [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}]]
PROMPTS = [5, True, None, {}, [], "", [1.5], [True], [[1, 2]], [1, "a"]]
FIELDS: dict[str, dict[str, list[Any]]] = {  # every field each body's model reads
    "/route": {"prompt": STRINGS, "prompt_tokens": [*INTS, 10**8], "max_tokens": INTS,
               "predicted_tokens": INTS, "ttft_target_ms": NUMBERS,
               "slo_class": [*STRINGS, None], "model": STRINGS, "unknown_key": [1]},
    "/v1/completions": {"prompt": PROMPTS, "max_tokens": INTS,
                        "max_completion_tokens": INTS, "stream": BOOLS, "model": STRINGS,
                        "n": [2, 100, *INTS], "best_of": [2, *INTS]},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": INTS,
                             "max_completion_tokens": INTS, "stream": BOOLS,
                             "model": STRINGS, "n": [2, 100, *INTS]},
}
WRONG = [(path, field, value) for path, fields in FIELDS.items()
         for field, values in fields.items() for value in values]


@pytest.mark.parametrize(("path", "field", "value"), WRONG,
                         ids=[f"{p}-{f}-{v!r}"[:60] for p, f, v in WRONG])
def test_a_wrong_value_in_any_field_is_400_naming_it(stack: Stack, path: str, field: str,
                                                     value: Any) -> None:
    body = {**VALID[path], field: value}
    err = assert_error(call(stack.url, "POST", path, body), 400)
    # the field, or a place inside it (messages[0].role)
    assert err["param"] is not None and err["param"].startswith(field), (value, err)
    assert err["message"].startswith(err["param"] + ":"), err
    assert_healthy(stack)


@pytest.mark.parametrize("value", ["soon", "nan", "inf", "-inf", "-1", "0", "1e400",
                                   "3600001", ""])
def test_a_bad_ttft_header_is_400_naming_it(stack: Stack, value: str) -> None:
    assert_error(call(stack.url, "POST", "/v1/completions", VALID["/v1/completions"],
                      headers={"x-slo-ttft-ms": value}), 400, "x-slo-ttft-ms")
    assert_healthy(stack)


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
@pytest.mark.parametrize(("path", "headers"), [
    *((p, {}) for p in ENDPOINTS), ("/admin/reload", AUTH)])
def test_a_body_that_does_not_decode_is_400(stack: Stack, path: str, encoding: str,
                                            headers: dict[str, str]) -> None:
    junk = bytes(random.Random(7).randrange(256) for _ in range(512))
    err = assert_error(call(stack.url, "POST", path, raw=junk, headers={
        "Content-Encoding": encoding, **headers}), 400)
    assert "does not decode" in err["message"] and err["param"] is None, err
    assert_healthy(stack)


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
def test_a_body_that_decodes_past_the_limit_is_413(stack: Stack, encoding: str) -> None:
    """20 KB that decode to 20 MB: refused once the decoded body passes the limit."""
    raw = b'{"prompt": "' + b"0" * 20_000_000 + b'"}'
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    assert len(packed) < 100_000
    assert_error(call(stack.url, "POST", "/v1/completions", raw=packed,
                      headers={"Content-Encoding": encoding}), 413)
    assert wait_until(lambda: stack.num_connections() == 0)   # its lingering read ended
    assert_healthy(stack)


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
def test_an_encoded_body_still_passes(stack: Stack, encoding: str) -> None:
    raw = json.dumps(VALID["/v1/completions"]).encode()
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    code, _, out = call(stack.url, "POST", "/v1/completions", raw=packed,
                        headers={"Content-Encoding": encoding})
    assert code == 200, out


@pytest.mark.parametrize("prompt", [
    [-5, 99999999999], [1, -1], [1, 2**31], [2**63 - 1], [10**30],   # token ids
    ["one", "two"], ["a", "b", "c"],                                   # several texts
    [[1, 2], [3, 4]], [[1, 2]],                                        # lists of id lists
], ids=lambda p: repr(p)[:30])
def test_out_of_range_ids_and_several_prompts_are_400_naming_prompt(
        stack: Stack, prompt: Any) -> None:
    err = assert_error(call(stack.url, "POST", "/v1/completions",
                            {**VALID["/v1/completions"], "prompt": prompt}), 400)
    assert err["param"] is not None and err["param"].startswith("prompt"), err
    if isinstance(prompt[0], str):
        assert ONE_COMPLETION in err["message"], err
    assert_healthy(stack)


@pytest.mark.parametrize("prompt", [["one text"], [0, 5, 2**31 - 1]])
def test_one_text_in_a_list_or_ids_in_range_pass(stack: Stack, prompt: list[Any]) -> None:
    code, _, raw = call(stack.url, "POST", "/v1/completions",
                        {**VALID["/v1/completions"], "prompt": prompt})
    assert code == 200, raw


def test_a_large_body_is_parsed_off_the_event_loop(stack: Stack,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past proxy.OFF_LOOP_BYTES a body is parsed in the default executor, not on the
    loop's thread (where a maximum-size body took ~100 ms); a small one on the loop."""
    threads: list[int] = []

    def parse(raw: bytes) -> Any:
        threads.append(threading.get_ident())
        return parse_json(raw)

    monkeypatch.setattr(proxy, "parse_json", parse)
    loop_thread = stack.call(threading.get_ident)
    filler = "w" * (stack.app[STATE].loaded.config.server.max_body_bytes - 1000)
    for extra in (filler, "small"):
        code, _, raw = call(stack.url, "POST", "/v1/completions",
                            {**VALID["/v1/completions"], "user": extra})
        assert code == 200, raw[:200]
    assert len(threads) == 2 and threads[0] != loop_thread and threads[1] == loop_thread
    assert len(filler) > proxy.OFF_LOOP_BYTES


@pytest.mark.parametrize("path", ENDPOINTS)
def test_valid_bodies_still_pass(stack: Stack, path: str) -> None:
    code, _, raw = call(stack.url, "POST", path, VALID[path])
    assert code == 200, raw


# -- transport: size, method, partial body ------------------------------------------------
OVERSIZE = b'{"prompt": "' + b"w" * 1_100_000 + b'"}'  # over server.max_body_bytes


@pytest.mark.parametrize(("method", "path", "raw", "status"), [
    ("POST", "/v1/completions", OVERSIZE, 413),
    ("POST", "/route", OVERSIZE, 413),
    ("GET", "/no/such/path", None, 404),
    ("GET", "/route", None, 405),
    ("DELETE", "/v1/completions", None, 405),
], ids=["413-completions", "413-route", "404", "405-get", "405-delete"])
def test_http_errors_use_the_json_shape(stack: Stack, method: str, path: str,
                                        raw: bytes | None, status: int) -> None:
    assert_error(call(stack.url, method, path, raw=raw), status)
    assert_healthy(stack)


@pytest.mark.parametrize(("path", "headers"), [
    ("/v1/completions", {}), ("/v1/chat/completions", {}), ("/route", {}),
    ("/admin/reload", AUTH)])
def test_a_body_shorter_than_its_length_times_out_and_closes(stack: Stack, path: str,
                                                             headers: dict[str, str]) -> None:
    u = urlparse(stack.url)
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT_S) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100\r\n{head}\r\n".encode() + b'{"prompt": ')
        received = b""
        while chunk := sock.recv(65536):  # until the router closes the connection
            received += chunk
    head_raw, _, body = received.partition(b"\r\n\r\n")
    assert head_raw.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"application/json" in head_raw
    assert "did not arrive" in error_of(body)["message"]
    assert_healthy(stack)


# -- admin token ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    "Bearer s3cr\u00e9t".encode("latin-1"),          # not UTF-8
    f"Bearer {TOKEN}\u00e9".encode(),                 # UTF-8, non-ASCII
    "Bearer \u00e9\u00e9\u00e9\u00e9\u00e9\u00e9".encode(),
    b"Bearer \xff\xfe\x80",
    b"\xe9",
    b"",
    f"bearer {TOKEN}".encode(),
    b"Bearer " + b"x" * 4000,
    f"Bearer {TOKEN}".encode() * 2,
])
def test_a_non_ascii_or_wrong_token_is_401(stack: Stack, value: bytes) -> None:
    err = assert_error(call(stack.url, "POST", "/admin/reload", raw=b"",
                            headers={"Authorization": value}), 401)
    assert err["type"] == "unauthorized"
    assert_healthy(stack)


# -- backend URLs ---------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "shown"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("https://user:pa%40ss@host.example:8443/v1?api_key=k#f", "https://host.example:8443/v1"),
    ("http://token@h/", "http://h/"),
    ("http://[::1]:9000/x?k=v", "http://[::1]:9000/x"),
    ("http://u:p@h:notaport", "http://h"),
])
def test_public_url_drops_credentials(url: str, shown: str) -> None:
    assert public_url(url) == shown


def test_instances_show_backend_urls_without_credentials(tmp_path: Path) -> None:
    path = _config(tmp_path)
    loaded = load_config(path)
    urls = [f"http://admin:{SECRET}@127.0.0.1:9" for _ in range(3)]  # nothing listens
    s = Stack(loaded, num_fakes=0, backend_urls=urls,
              calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        code, _, raw = call(s.url, "GET", "/instances")
        assert code == 200 and SECRET not in raw.decode()
        assert [i["url"] for i in json.loads(raw)["instances"]] == ["http://127.0.0.1:9"] * 3
        for path_ in ("/v1/completions", "/dashboard/data", "/metrics", "/prices"):
            answer = call(s.url, "POST" if path_.startswith("/v1") else "GET", path_,
                          VALID["/v1/completions"] if path_.startswith("/v1") else None)
            assert SECRET not in answer[2].decode(errors="replace"), path_
    finally:
        s.close()


# -- reload ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    """A router whose config folder holds files an attacker would point it at."""
    root = tmp_path_factory.mktemp("reload")
    cfg_dir, outside = root / "cfg", root / "outside"
    cfg_dir.mkdir()
    outside.mkdir()
    s = _stack(cfg_dir)
    files = {
        outside / "shadow": f"root:$6${SECRET}:19000:0:99999:7:::\n",
        outside / "secret.yaml": f"reward: {{zeta2: 1.0}}\n# {SECRET}\n",
        cfg_dir / ".env": f"API_KEY={SECRET}\n",
        cfg_dir / "lines.yaml": f"root:$6${SECRET}:19000:0:99999:7:::\nbin:{SECRET}:::\n",
        cfg_dir / "values.yaml": f"reward: {{zeta2: {SECRET}, zeta_{SECRET}: 1}}\n"
                                 f"{SECRET}: {{a: 1}}\nadmission: {{mode: {SECRET}}}\n",
        cfg_dir / "broken.yaml": f"reward: {{zeta2: '{SECRET}\n",
        cfg_dir / "tabs.yaml": f"\t{SECRET}: 1\n",
    }
    for p, text in files.items():
        p.write_text(text)
    (cfg_dir / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff" + SECRET.encode())
    (cfg_dir / "huge.yaml").write_bytes(b"# " + SECRET.encode() + b"\n"
                                        + b"a: 1\n" * (MAX_YAML_BYTES // 5 + 1))
    os.mkfifo(cfg_dir / "fifo.yaml")
    (cfg_dir / "dir.yaml").mkdir()
    (cfg_dir / "link.yaml").symlink_to(outside / "shadow")
    (cfg_dir / "link2.yaml").symlink_to(outside / "secret.yaml")
    try:
        yield s, cfg_dir
    finally:
        s.close()


def _reload(stack: Stack, body: Any = None, raw: bytes | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    return call(stack.url, "POST", "/admin/reload", body, raw=raw, headers=AUTH)


def _running(stack: Stack) -> tuple[Any, Any]:
    return stack.call(lambda: (stack.app[STATE].router, stack.app[STATE].loaded))


def _assert_untouched(stack: Stack, before: tuple[Any, Any], answer: tuple[int, Any, bytes],
                      *contents: str) -> None:
    text = answer[2].decode(errors="replace")
    assert SECRET not in text, text
    for content in contents:
        for line in filter(None, (x.strip() for x in content.splitlines())):
            assert line not in text, (line, text)
    after = _running(stack)
    assert after[0] is before[0] and after[1] is before[1]  # the same router and config
    assert_healthy(stack)


BAD_WEIGHTS = [  # (id, the weights in the body, the param of the 400: None if opened)
    ("outside-file", ["../outside/shadow"], "weights[0]"),
    ("outside-yaml", ["../outside/secret.yaml"], "weights[0]"),
    ("etc-shadow", ["/etc/shadow"], "weights[0]"),
    ("etc-passwd", ["/etc/passwd"], "weights[0]"),
    ("proc", ["/proc/self/environ"], "weights[0]"),
    ("dev", ["/dev/zero"], "weights[0]"),
    ("symlink-out", ["link.yaml"], "weights[0]"),
    ("symlink-out-yaml", ["link2.yaml"], "weights[0]"),
    ("not-yaml-in-dir", [".env"], "weights[0]"),
    ("second-of-two", ["values.yaml", "/etc/hostname"], "weights[1]"),
    ("one-path", "../outside/secret.yaml", "weights"),
    ("no-such-name", "no_such_profile", "weights"),
    ("lines-in-dir", "lines.yaml", None),
    ("values-in-dir", "values.yaml", None),
    ("broken-yaml", "broken.yaml", None),
    ("tab-yaml", "tabs.yaml", None),
    ("binary", "binary.yaml", None),
    ("huge", "huge.yaml", None),
    ("fifo", "fifo.yaml", None),
    ("directory", "dir.yaml", None),
]


@pytest.mark.parametrize(("case", "weights", "param"), BAD_WEIGHTS,
                         ids=[c for c, _, _ in BAD_WEIGHTS])
def test_reload_refuses_profiles_it_may_not_read_and_quotes_none(
        admin: tuple[Stack, Path], case: str, weights: str | list[str],
        param: str | None) -> None:
    stack, cfg_dir = admin
    before = _running(stack)

    def absolute(w: str) -> str:  # a file in the config's folder, or a shipped name
        return w if w.startswith("/") or "." not in w else str(cfg_dir / w)

    answer = _reload(stack, {"weights": absolute(weights) if isinstance(weights, str)
                             else [absolute(w) for w in weights]})
    err = assert_error(answer, 400)
    if param is not None:  # refused before anything was opened
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    else:                  # opened (or refused as a special file), its errors name it
        assert isinstance(weights, str)
        named = str((cfg_dir / weights).resolve())
        assert err["type"] == "invalid_config" and err["message"].startswith(named), err
    contents = [Path("/etc/passwd").read_text()] if Path("/etc/passwd").exists() else []
    _assert_untouched(stack, before, answer, *contents)


def _rewrite(path: Path, change: dict[str, Any]) -> None:
    doc = yaml.safe_load(path.read_text())
    for dotted, value in change.items():
        *parents, last = dotted.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path.write_text(yaml.safe_dump(doc))


BACKENDS = [{"name": f"q-{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(3)]
BAD_CONFIGS = [  # (id, keys changed in the config, the params the 400 names)
    ("bogus-policy-params", {"router.policy_params": {"bid_price": {"backend": "bogus"}}},
     ["router.policy_params.bid_price.backend"]),
    ("unknown-policy-param", {"router.policy_params": {"bid_price": {"nope": 1}}},
     ["router.policy_params.bid_price"]),
    ("port", {"server.port": 9999}, ["server.port"]),
    ("host-port-backends", {"server.host": "0.0.0.0", "server.port": 1,
                            "server.backends": BACKENDS},
     ["server.host", "server.port", "server.backends"]),
    ("health-period", {"server.health_period_s": 5.0}, ["server.health_period_s"]),
    ("instances", {"instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100",
                                  "replicas": 2}]}, ["instances"]),
    ("bad-value", {"server.max_body_bytes": "big"}, ["server.max_body_bytes"]),
]


@pytest.mark.parametrize(("case", "change", "params"), BAD_CONFIGS,
                         ids=[c for c, _, _ in BAD_CONFIGS])
def test_reload_refuses_a_config_it_cannot_apply_by_name(
        admin: tuple[Stack, Path], case: str, change: dict[str, Any],
        params: list[str]) -> None:
    stack, cfg_dir = admin
    path = cfg_dir / "router.yaml"
    good = path.read_text()
    before = _running(stack)
    try:
        _rewrite(path, change)
        answer = _reload(stack)
    finally:
        path.write_text(good)
    err = assert_error(answer, 400)
    assert err["param"] == params[0] and err["type"] == "invalid_config", err
    for key in params:
        assert f"{path}: {key}: " in err["message"], err
    _assert_untouched(stack, before, answer)


@pytest.mark.parametrize("case", ["binary", "fifo", "directory", "huge", "broken-secret"])
def test_reload_of_an_unreadable_config_names_the_file(admin: tuple[Stack, Path],
                                                       case: str) -> None:
    stack, cfg_dir = admin
    path = cfg_dir / "router.yaml"
    good = path.read_text()
    before = _running(stack)
    path.unlink()
    try:
        if case == "binary":
            path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + SECRET.encode())
        elif case == "fifo":
            os.mkfifo(path)
        elif case == "directory":
            path.mkdir()
        elif case == "huge":
            path.write_bytes(b"a: 1\n" * (MAX_YAML_BYTES // 5 + 1))
        else:
            path.write_text(good + "\n\t" + SECRET + ": 1\n")
        answer = _reload(stack)
    finally:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()
        path.write_text(good)
    err = assert_error(answer, 400)
    assert err["message"].startswith(f"{path}: ") and err["type"] == "invalid_config", err
    _assert_untouched(stack, before, answer)


@pytest.mark.parametrize(("case", "raw", "param"), [
    ("not-json", b"{weights", None),
    ("nested", b'{"weights": ' + b"[" * 10_000 + b"}", None),
    ("huge-int", b'{"weights": ' + b"7" * 5000 + b"}", None),
    ("not-an-object", b'["a.yaml"]', None),
    ("unknown-key", b'{"weight": "a.yaml"}', "weight"),
    ("weights-int", b'{"weights": 5}', "weights"),
    ("weights-list-of-int", b'{"weights": [1]}', "weights"),
    ("weights-bool", b'{"weights": true}', "weights"),
])
def test_a_bad_reload_body_is_400(admin: tuple[Stack, Path], case: str, raw: bytes,
                                  param: str | None) -> None:
    stack, _ = admin
    before = _running(stack)
    answer = _reload(stack, raw=raw)
    err = assert_error(answer, 400)
    assert err["param"] == param, err
    _assert_untouched(stack, before, answer)


def test_reload_still_takes_allowed_profiles(admin: tuple[Stack, Path]) -> None:
    stack, cfg_dir = admin
    (cfg_dir / "ok.yaml").write_text("reward: {zeta2: 2.5}\n")
    code, _, raw = _reload(stack, {"weights": str(cfg_dir / "ok.yaml")})
    assert code == 200, raw
    assert stack.call(lambda: stack.app[STATE].loaded.config.reward.zeta2) == 2.5
    code, _, raw = _reload(stack, {"weights": "tail_latency"})  # a shipped profile, by name
    assert code == 200 and json.loads(raw)["weights"][0].endswith("tail_latency.yaml"), raw
    code, _, raw = _reload(stack, {"weights": []})
    assert code == 200 and json.loads(raw)["weights"] == [], raw
    assert_healthy(stack)


def test_reload_weights_dirs_allows_another_folder(tmp_path: Path) -> None:
    cfg_dir, runs = tmp_path / "cfg", tmp_path / "runs"
    cfg_dir.mkdir()
    runs.mkdir()
    (runs / "selected.yaml").write_text("reward: {zeta2: 4.0}\n")
    s = _stack(cfg_dir, reload_weights_dirs=["../runs"])
    try:
        code, _, raw = _reload(s, {"weights": str(runs / "selected.yaml")})
        assert code == 200, raw
        assert s.call(lambda: s.app[STATE].loaded.config.reward.zeta2) == 4.0
    finally:
        s.close()
