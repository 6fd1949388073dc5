"""Sealed messages between replicas (``olproute.server.shared_auth``), without Redis: a
message opens only with the secret and the context it was sealed for, whole; another
wire format, a missing or unexpected signature, and an older (or, for what is only ever
added, the same) sequence are dropped with their reasons; the secret comes from a file
or the environment, and a shared state without one refuses to start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from olproute.config.loader import load_config
from olproute.config.read import ConfigError
from olproute.server.shared_auth import (
    HEADER,
    MAC_BYTES,
    SECRET_ENV,
    SEQ,
    Opener,
    Sealer,
    open_sealed,
    seal,
    state_secret,
)
from olproute.server.shared_parse import Rejected

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = b"0123456789abcdef0123456789abcdef"
BODY = orjson.dumps({"r": "a", "t": 1.0, "b": {}})


def _reason(raw: bytes, context: bytes = b"ledger", secret: bytes | None = SECRET) -> str:
    with pytest.raises(Rejected) as info:
        open_sealed(raw, context, secret)
    return info.value.reason


def test_a_sealed_message_opens_whole_with_its_secret_and_context() -> None:
    for secret in (SECRET, None):
        msg = open_sealed(seal(secret, b"ledger", "rép-1", 42, BODY), b"ledger", secret)
        assert (msg.replica, msg.seq, msg.body) == ("rép-1", 42, BODY)


def _flipped(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]


NAME_AT = HEADER.size                       # the writer's name ("a")
SEQ_AT = HEADER.size + 1
MAC_AT = SEQ_AT + SEQ.size
BODY_AT = MAC_AT + MAC_BYTES


@pytest.mark.parametrize("at", [NAME_AT, SEQ_AT + 7, MAC_AT, MAC_AT + 31, BODY_AT,
                                BODY_AT + len(BODY) - 1])
def test_a_bit_changed_anywhere_it_is_signed_is_forged(at: int) -> None:
    raw = seal(SECRET, b"ledger", "a", 7, BODY)
    assert _reason(_flipped(raw, at)) == "forged"


@pytest.mark.parametrize(("raw", "context", "secret", "reason"), [
    (seal(SECRET, b"ledger", "a", 1, BODY), b"demand", SECRET, "forged"),   # moved key
    (seal(SECRET, b"prices:3", "a", 1, BODY), b"prices:4", SECRET, "forged"),  # other head
    (seal(b"another secret, as long as ours", b"ledger", "a", 1, BODY), b"ledger",
     SECRET, "forged"),
    (seal(SECRET, b"ledger", "a", 1, BODY)[:-1], b"ledger", SECRET, "forged"),  # cut
    (BODY, b"ledger", SECRET, "version"),            # an older olproute's plain JSON
    (b"OLPS\x02" + seal(SECRET, b"ledger", "a", 1, BODY)[5:], b"ledger", SECRET,
     "version"),                                     # a later wire format
    (b"OLP", b"ledger", SECRET, "version"),
    (seal(None, b"ledger", "a", 1, BODY), b"ledger", SECRET, "unsigned"),
    (seal(SECRET, b"ledger", "a", 1, BODY), b"ledger", None, "signed"),
    (seal(SECRET, b"ledger", "a", 1, BODY)[:HEADER.size + 4], b"ledger", SECRET, "format"),
])
def test_what_does_not_open_says_why(raw: bytes, context: bytes, secret: bytes | None,
                                     reason: str) -> None:
    assert _reason(raw, context, secret) == reason


def _open(opener: Opener, seq: int, kind: str = "ledger", writer: str = "a",
          body: bytes = BODY, again: bool = True) -> str:
    try:
        opener.open(seal(SECRET, kind.encode(), writer, seq, body), kind, kind.encode(),
                    again)
    except Rejected as exc:
        return exc.reason
    return "ok"


def test_an_older_sequence_is_replayed_per_writer_and_kind() -> None:
    opener = Opener(SECRET)
    assert _open(opener, 5) == "ok"
    assert _open(opener, 4) == "replayed"
    assert _open(opener, 5) == "ok"                       # the same ledger, read again
    assert _open(opener, 5, body=BODY + b" ") == "replayed"   # same sequence, other body
    assert _open(opener, 3, writer="b") == "ok"           # each writer its own
    assert _open(opener, 3, kind="demand") == "ok"        # each kind its own
    assert _open(opener, 3, kind="demand", again=False) == "replayed"
    assert _open(opener, 6) == "ok"
    assert _open(opener, 5) == "replayed"


def test_an_unchecked_message_leaves_no_sequence_behind() -> None:
    opener = Opener(SECRET)
    forged = seal(b"another secret, as long as ours", b"ledger", "a", 10 ** 18, BODY)
    with pytest.raises(Rejected):
        opener.open(forged, "ledger", b"ledger", True)
    assert _open(opener, 1) == "ok"   # a forged huge sequence did not shut the writer out


def test_a_message_read_under_another_writers_name_is_dropped_and_not_kept() -> None:
    opener = Opener(SECRET)
    copied = seal(SECRET, b"demand", "a", 5, BODY)   # a's entry, its field naming "b"
    with pytest.raises(Rejected) as info:
        opener.open(copied, "demand", b"demand", False, writer="b")
    assert info.value.reason == "replica"
    # a's own entry of that sequence is still new to the reader
    assert opener.open(copied, "demand", b"demand", False, writer="a").seq == 5


def test_a_sealer_numbers_every_message_above_the_last_and_the_clock() -> None:
    import time

    before = time.time_ns()
    sealer = Sealer(SECRET, "a")
    seqs = [open_sealed(sealer.seal(b"ledger", BODY), b"ledger", SECRET).seq
            for _ in range(1000)]
    assert seqs == sorted(set(seqs)) and seqs[0] >= before


def _loaded(tmp_path: Path, **state: Any) -> Any:
    data = {"profiles": str(REPO_ROOT / "configs" / "profiles.yaml"),
            "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100"}],
            "state": {"url": "redis://127.0.0.1:6379/0", **state}}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_the_secret_comes_from_its_file_before_the_environment(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    loaded = _loaded(tmp_path, secret_file="secret")   # relative to the config file
    assert state_secret(loaded, {SECRET_ENV: "x" * 20}) == SECRET
    assert state_secret(_loaded(tmp_path), {SECRET_ENV: " " + "y" * 20}) == b"y" * 20


def test_a_shared_state_without_a_secret_refuses_naming_how_to_give_one(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        state_secret(_loaded(tmp_path), {})
    msg = str(info.value)
    assert "router.yaml: state: redis:// without a state secret" in msg
    for option in ("--state-secret-file", "state.secret_file", SECRET_ENV,
                   "--state-insecure", "state.insecure"):
        assert option in msg
    assert state_secret(_loaded(tmp_path, insecure=True), {}) is None


@pytest.mark.parametrize(("secret", "env", "key"), [
    (b"short\n", {}, "state.secret_file"),
    (None, {SECRET_ENV: "short"}, "state"),
])
def test_a_short_secret_refuses(tmp_path: Path, secret: bytes | None, env: dict[str, str],
                                key: str) -> None:
    state: dict[str, Any] = {}
    if secret is not None:
        (tmp_path / "secret").write_bytes(secret)
        state["secret_file"] = "secret"
    with pytest.raises(ConfigError) as info:
        state_secret(_loaded(tmp_path, **state), env)
    assert f"router.yaml: {key}: the state secret" in str(info.value)
    assert "must be 16 to 4096 bytes, has 5" in str(info.value)


def test_a_secret_file_that_does_not_read_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        state_secret(_loaded(tmp_path, secret_file="missing"), {SECRET_ENV: "x" * 20})
    assert "router.yaml: state.secret_file: " in str(info.value)
    assert "missing" in str(info.value)
