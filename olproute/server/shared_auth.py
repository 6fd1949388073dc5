"""Sealed messages: what a replica writes to Redis for the others (ledgers, demand
entries, price states, the lease), authenticated with a secret every replica of a fleet
shares (``olproute.server.shared``).

A sealed message is an envelope around the body the parsers of
``olproute.server.shared_parse`` read::

    b"OLPS" | version (1 byte) | flags (1 byte: 1 signed, 0 not) | name length (2 bytes)
      | the writer's replica name (UTF-8) | sequence (8 bytes) | HMAC-SHA256 (32 bytes)
      | body

all integers big-endian. The MAC covers a domain string, the message's *context* (its
kind, and for a price state the update count its head names), the envelope's header (the
version, the flags, the writer's name and its sequence) and the body: a message moved to
another kind of key, another writer's name or another head fails it. An unsigned message
(``--state-insecure``) carries zeros there. The sequence is per writer and increases with
every message it seals (``Sealer``: the wall clock in nanoseconds, or one more than the
last, so that a replica restarted under the same name goes on above its old messages).

A reader (``Opener``) drops, by reason: what is no envelope of this version
(``version``: another olproute's wire format), a bad MAC (``forged``), an unsigned message
when it has a secret (``unsigned``) or a signed one when it has none (``signed``), and a
message whose sequence is older than the last it accepted from that writer for that kind
(``replayed``; for demand entries, which are added and never replaced, also the same
sequence again). Re-reading a ledger or a price state nobody has replaced since is no
replay. The MAC is checked before the body is parsed, in the same place (off the loop
when the read is large).

The secret comes from a file (``--state-secret-file``, ``state.secret_file``) or the
environment (``OLPROUTE_STATE_SECRET``), never from the config's text; without one a
replica refuses to start unless told ``--state-insecure`` (``state.insecure``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from olproute.config.loader import LoadedConfig
from olproute.config.read import ConfigError
from olproute.server.shared_parse import MAX_NAME_CHARS, Rejected

MAGIC = b"OLPS"
WIRE_VERSION = 1
SIGNED, UNSIGNED = 1, 0
MAC_BYTES = 32
HEADER = struct.Struct(">4sBBH")   # magic, version, flags, the name's length in bytes
SEQ = struct.Struct(">Q")
# an envelope's bytes around its body, at most (a name of MAX_NAME_CHARS characters)
ENVELOPE_BYTES = HEADER.size + 4 * MAX_NAME_CHARS + SEQ.size + MAC_BYTES
DOMAIN = b"olproute shared state\x00"
SECRET_ENV = "OLPROUTE_STATE_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAX_WRITERS = 4096   # (writer, kind) whose last sequence a reader keeps, the latest


@dataclass(frozen=True, slots=True)
class Opened:
    """A message whose envelope passed: its writer, sequence, MAC and body."""

    replica: str
    seq: int
    mac: bytes
    body: bytes


def _mac(secret: bytes, context: bytes, head: bytes, body: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    h.update(DOMAIN + SEQ.pack(len(context)) + context)
    h.update(head)
    h.update(body)
    return h.digest()


def seal(secret: bytes | None, context: bytes, replica: str, seq: int, body: bytes) -> bytes:
    """``body`` in an envelope naming ``replica`` and ``seq``, signed with ``secret``
    (None: unsigned) for ``context``."""
    name = replica.encode()
    head = HEADER.pack(MAGIC, WIRE_VERSION, UNSIGNED if secret is None else SIGNED,
                       len(name)) + name + SEQ.pack(seq)
    mac = bytes(MAC_BYTES) if secret is None else _mac(secret, context, head, body)
    return head + mac + body


def open_sealed(raw: bytes, context: bytes, secret: bytes | None) -> Opened:
    """The envelope of ``raw`` checked for ``context``; ``Rejected`` (``version``,
    ``format``, ``forged``, ``unsigned``, ``signed``) when it does not pass."""
    if len(raw) < HEADER.size or raw[:4] != MAGIC:
        raise Rejected("version", "no envelope (an olproute of another wire format)")
    _, version, flags, n = HEADER.unpack_from(raw)
    if version != WIRE_VERSION:
        raise Rejected("version", f"wire format {version}, this replica's {WIRE_VERSION}")
    end = HEADER.size + n
    if flags not in (SIGNED, UNSIGNED) or len(raw) < end + SEQ.size + MAC_BYTES:
        raise Rejected("format")
    (seq,) = SEQ.unpack_from(raw, end)
    head, mac = raw[:end + SEQ.size], raw[end + SEQ.size:end + SEQ.size + MAC_BYTES]
    body = raw[end + SEQ.size + MAC_BYTES:]
    if secret is None and flags == SIGNED:
        raise Rejected("signed", "signed with a secret this replica does not have")
    if secret is not None:
        if flags == UNSIGNED:
            raise Rejected("unsigned", "written by a replica without the secret")
        if not hmac.compare_digest(mac, _mac(secret, context, head, body)):
            raise Rejected("forged")
    try:
        name = raw[HEADER.size:end].decode()
    except UnicodeDecodeError as exc:
        raise Rejected("format") from exc
    if not name or len(name) > MAX_NAME_CHARS:
        raise Rejected("format")
    return Opened(name, seq, mac, body)


class Sealer:
    """One replica's side: seals what it writes, with a sequence that increases with
    every message (the wall clock in nanoseconds, or one more than the last)."""

    def __init__(self, secret: bytes | None, replica: str) -> None:
        self.secret = secret
        self.replica = replica
        self._seq = 0
        self._lock = threading.Lock()   # sealed on the loop and in the price tick's thread

    def next_seq(self) -> int:
        with self._lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return self._seq

    def seal(self, context: bytes, body: bytes) -> bytes:
        return seal(self.secret, context, self.replica, self.next_seq(), body)


class Opener:
    """A reader's side: opens what others wrote and keeps, per (writer, kind), the last
    sequence and MAC it accepted (at most ``MAX_WRITERS``, the latest), so that an older
    message put back is dropped as ``replayed``. Used by one sync at a time (in a worker
    thread when the read is large)."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self._last: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()

    def open(self, raw: bytes, kind: str, context: bytes, again: bool,
             writer: str | None = None) -> Opened:
        """``raw`` opened and accepted for ``kind``; ``again``: the very message last
        accepted from its writer may be read again (a key not replaced since), else only
        a newer one passes; ``writer``: the name the message must carry (its key's).
        ``Rejected`` as ``open_sealed``, ``replica`` (another writer's: not taken as
        its writer's either) or ``replayed``."""
        msg = open_sealed(raw, context, self.secret)
        if writer is not None and msg.replica != writer:
            raise Rejected("replica", f"sealed by {msg.replica}, read as {writer}'s")
        key = (msg.replica, kind)
        last = self._last.get(key)
        if last is not None and (msg.seq < last[0] or (msg.seq == last[0] and not (
                again and hmac.compare_digest(msg.mac, last[1])))):
            raise Rejected("replayed", f"sequence {msg.seq}, last accepted {last[0]}")
        self._last[key] = (msg.seq, msg.mac)
        self._last.move_to_end(key)
        while len(self._last) > MAX_WRITERS:
            self._last.popitem(last=False)
        return msg


def state_secret(loaded: LoadedConfig, environ: Mapping[str, str] | None = None
                 ) -> bytes | None:
    """The fleet's secret: the file ``state.secret_file`` names (relative to the config
    file), else ``OLPROUTE_STATE_SECRET``; surrounding whitespace stripped. None with
    ``state.insecure`` and neither. A ``ConfigError`` when the file does not read, the
    secret is shorter than ``MIN_SECRET_BYTES``, or there is none without
    ``state.insecure``."""
    cfg = loaded.config.state
    env = os.environ if environ is None else environ
    secret: bytes | None = None
    if cfg.secret_file is not None:
        path = loaded.resolve(cfg.secret_file)
        try:
            secret = path.read_bytes()[:MAX_SECRET_BYTES + 1].strip()
        except OSError as exc:
            raise ConfigError(loaded.path, [("state.secret_file",
                              f"{path}: {exc.strerror or exc}")]) from None
        where = ("state.secret_file", f"{path}")
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].encode().strip()
        where = ("state", SECRET_ENV)
    if secret is not None:
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise ConfigError(loaded.path, [(where[0], f"the state secret ({where[1]}) "
                              f"must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, "
                              f"has {len(secret)}: e.g. openssl rand -hex 32")])
        return secret
    if cfg.url is not None and not cfg.insecure:
        raise ConfigError(loaded.path, [("state", _NO_SECRET.format(url=cfg.url.split(
            "://", 1)[0]))])
    return None


_NO_SECRET = (
    "{url}:// without a state secret: anything that can write to that Redis could steer "
    "the routers. Give every replica the same secret with --state-secret-file PATH "
    f"(state.secret_file) or the environment variable {SECRET_ENV}, or run the replicas "
    "unauthenticated with --state-insecure (state.insecure: true)")
