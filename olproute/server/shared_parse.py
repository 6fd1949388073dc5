"""What a replica reads from Redis (``olproute.server.shared``), parsed into bounded,
typed shapes: nothing read there is trusted, since anything that can write the keys
(another replica with a bug, another config, a person) can put anything in them.

Each parser takes the raw bytes and the bounds this replica knows from its own config,
and returns what passed and, per reason, how much was dropped; it never raises. The
bounds:

- **sizes**: a ledger at most ``ENTRIES_PER_SEQ`` x ``max_num_seqs`` rows per backend
  (running and queued) of at most ``ROW_BYTES`` each; a demand message at most each
  book's window of samples and ``ARRIVALS_KEPT`` arrival times; a price state exactly
  the books' arrays; the .npz messages stored, not compressed (a compressed member can
  inflate past any cap), holding only the members their writer names;
- **counts**: prompt, output and streamed tokens within the backend's KV capacity in
  tokens, computed tokens within the prompt, whole numbers; at most ``max_num_seqs``
  running per backend and replica, and in the merged view of all replicas;
- **times** (wall-clock seconds): finite, at most ``MAX_FUTURE_S`` ahead of this
  replica's clock and ``MAX_AGE_S`` behind it; a ledger published within its time to
  live (a ledger nobody republishes goes stale);
- **prices**: finite, >= 0 and at most ``price_bound``: ``PRICE_HEADROOM`` times the
  largest reward a request can earn over the smallest share of a resource a request
  can use (one batch slot of ``max_num_seqs``, one KV token of the KV capacity, one
  prefill token of ``max_num_batched_tokens``). An exact LP's dual price on a slot
  never exceeds the largest reward over the usage of a request that uses it, so this
  bound leaves the learner a hundredfold overshoot and refuses only what no reward
  could pay; sample rewards are held to the same headroom over the reward bound, either
  side of 0.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.lib.format as npformat
import numpy.typing as npt
import orjson

from olproute.config.schema import RewardConfig
from olproute.pricing.book import ARRIVALS_KEPT, PriceBook
from olproute.types import Demand, InstanceSpec, PriceState

FloatArray = npt.NDArray[np.float64]

MAX_FUTURE_S = 1.0        # how far ahead of this replica's clock a time may be
MAX_AGE_S = 900.0         # how far behind: a request dispatched longer ago is dropped
ENTRIES_PER_SEQ = 4       # rows per backend and replica, per batch slot (running + queued)
ROW_BYTES = 160           # a ledger row's JSON, at most (six numbers)
LEDGER_BASE_BYTES = 4096  # a ledger's envelope and backend names
NPZ_BASE_BYTES = 65_536   # an .npz's headers and directory
MAX_REPLICAS = 64         # other replicas' ledgers read per sync, the latest seen
MAX_NAME_CHARS = 256      # a replica's name
PRICE_HEADROOM = 100.0    # prices and rewards: this times what the reward scale allows
ACC_BOUND = 1e18          # the step rule's accumulated squared gradients
COUNT_BOUND = 2 ** 53     # updates, steps: exact in a float64
SAMPLE_INT_BOUND = 2 ** 31  # a demand sample's slot indices
SAMPLE_FLOAT_BOUND = 1e9    # a demand sample's usage fractions and prefill work
OFF_LOOP_BYTES = 65_536   # larger reads are parsed in a worker thread, off the loop

Drops = dict[str, int]    # reason -> how many were dropped for it


class Rejected(ValueError):
    """What was read does not fit; ``reason`` is a short word for the metric."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _drop(drops: Drops, reason: str, n: int = 1) -> None:
    if n > 0:
        drops[reason] = drops.get(reason, 0) + n


# -- ledgers -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BackendLimits:
    """What one backend can hold: its batch slots and KV capacity in tokens."""

    name: str
    max_num_seqs: int
    kv_tokens: int

    @staticmethod
    def of(spec: InstanceSpec) -> BackendLimits:
        return BackendLimits(spec.name, spec.max_num_seqs, spec.kv_capacity_tokens)

    @property
    def max_entries(self) -> int:
        """Rows (flights and inbound) one replica may say it has here."""
        return ENTRIES_PER_SEQ * self.max_num_seqs


def ledger_cap(backends: Sequence[BackendLimits]) -> int:
    """The largest ledger, in bytes, a replica of this config publishes."""
    return LEDGER_BASE_BYTES + ROW_BYTES * sum(b.max_entries for b in backends)


@dataclass(frozen=True, slots=True)
class Ledger:
    """One replica's ledger as parsed: per backend name, its flights (n, 6): prompt,
    predicted output, tokens, computed, running (0/1), dispatch time; and its inbound
    rows (n, 3): prompt, predicted decode, dispatch time; times wall-clock seconds."""

    replica: str
    flights: dict[str, FloatArray] = field(default_factory=dict)
    inbound: dict[str, FloatArray] = field(default_factory=dict)


def parse_ledger(raw: bytes, replica: str, backends: Sequence[BackendLimits], wall_s: float,
                 ttl_s: float) -> tuple[Ledger | None, Drops]:
    """The ledger ``raw`` read from ``replica``'s key, its bad rows and backends dropped
    (None: all of it); ``wall_s`` this replica's wall-clock time, ``ttl_s`` a ledger's
    time to live."""
    drops: Drops = {}
    try:
        return _ledger(raw, replica, backends, wall_s, ttl_s, drops), drops
    except Rejected as exc:
        _drop(drops, exc.reason)
    except Exception:   # whatever else a malformed document raises
        _drop(drops, "format")
    return None, drops


def _ledger(raw: bytes, replica: str, backends: Sequence[BackendLimits], wall_s: float,
            ttl_s: float, drops: Drops) -> Ledger:
    if len(raw) > ledger_cap(backends):
        raise Rejected("too_large")
    doc = orjson.loads(raw)
    if not isinstance(doc, dict) or not isinstance(doc.get("b"), dict):
        raise Rejected("format")
    if doc.get("r") != replica:
        raise Rejected("replica")
    published = doc.get("t")
    if isinstance(published, bool) or not isinstance(published, int | float):
        raise Rejected("format")
    if not math.isfinite(published) or published > wall_s + MAX_FUTURE_S:
        raise Rejected("time")
    if published < wall_s - ttl_s:
        raise Rejected("stale")
    known = {b.name: b for b in backends}
    out = Ledger(replica)
    for name, entry in doc["b"].items():
        limits = known.get(name)
        if limits is None:
            _drop(drops, "backend")
            continue
        try:
            flights, inbound = _entry(entry, limits, wall_s, drops)
        except Rejected as exc:
            _drop(drops, exc.reason)
            continue
        out.flights[name], out.inbound[name] = flights, inbound
    return out


def _rows(rows: Any, width: int) -> FloatArray:
    """A list of rows of ``width`` numbers (bools as 0/1) as a float array. NumPy converts
    in C: a ragged or nested row, or what is no number, raises; a huge int becomes a huge
    float and a null NaN, which the bounds then drop."""
    if not isinstance(rows, list):
        raise Rejected("format")
    if not rows:
        return np.zeros((0, width))
    try:
        arr = np.array(rows, dtype=np.float64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise Rejected("format") from exc
    if arr.shape != (len(rows), width):
        raise Rejected("format")
    return arr


def _whole(x: FloatArray, lo: float, hi: FloatArray | float) -> npt.NDArray[np.bool_]:
    """Which entries are whole numbers in [lo, hi]."""
    with np.errstate(invalid="ignore"):
        ok: npt.NDArray[np.bool_] = (np.isfinite(x) & (x == np.floor(x)) & (x >= lo)
                                     & (x <= hi))
    return ok


def _in_window(t: FloatArray, wall_s: float) -> npt.NDArray[np.bool_]:
    """Which times are finite and within [now - MAX_AGE_S, now + MAX_FUTURE_S]."""
    ok: npt.NDArray[np.bool_] = (np.isfinite(t) & (t <= wall_s + MAX_FUTURE_S)
                                 & (t >= wall_s - MAX_AGE_S))
    return ok


def _entry(entry: Any, limits: BackendLimits, wall_s: float, drops: Drops
           ) -> tuple[FloatArray, FloatArray]:
    """One backend's flights and inbound rows, the bad rows dropped."""
    if not isinstance(entry, dict):
        raise Rejected("format")
    f_raw, i_raw = entry.get("f", []), entry.get("i", [])
    if not isinstance(f_raw, list) or not isinstance(i_raw, list):
        raise Rejected("format")
    if len(f_raw) + len(i_raw) > limits.max_entries:
        raise Rejected("entries")
    f, i = _rows(f_raw, 6), _rows(i_raw, 3)
    kv = float(limits.kv_tokens)
    counts = (_whole(f[:, 0], 1, kv) & _whole(f[:, 1], 0, kv) & _whole(f[:, 2], 0, kv)
              & _whole(f[:, 3], 0, f[:, 0]) & (f[:, 0] + f[:, 2] <= kv)
              & ((f[:, 4] == 0) | (f[:, 4] == 1)))
    times = _in_window(f[:, 5], wall_s)
    _drop(drops, "count", int(np.sum(~counts)))
    _drop(drops, "time", int(np.sum(counts & ~times)))
    f = f[counts & times]
    if int(f[:, 4].sum()) > limits.max_num_seqs:
        raise Rejected("running")
    counts_i = _whole(i[:, 0], 1, kv) & _whole(i[:, 1], 0, kv)
    times_i = _in_window(i[:, 2], wall_s)
    _drop(drops, "count", int(np.sum(~counts_i)))
    _drop(drops, "time", int(np.sum(counts_i & ~times_i)))
    return f, i[counts_i & times_i]


def merged_rows(ledgers: Iterable[Ledger], limits: BackendLimits, drops: Drops
                ) -> tuple[FloatArray, FloatArray] | None:
    """Every ledger's flights and inbound rows on one backend, in dispatch order, held to
    what the backend can hold: at most ``max_num_seqs`` running (the earliest
    dispatched) and ``max_entries`` rows (the earliest); None when none names it."""
    fs = [led.flights[limits.name] for led in ledgers if limits.name in led.flights]
    ins = [led.inbound[limits.name] for led in ledgers if limits.name in led.inbound]
    if not fs and not ins:
        return None
    f = np.concatenate(fs) if fs else np.zeros((0, 6))
    i = np.concatenate(ins) if ins else np.zeros((0, 3))
    f = f[np.argsort(f[:, 5], kind="stable")]
    i = i[np.argsort(i[:, 2], kind="stable")]
    running = f[:, 4] == 1
    extra = running & (np.cumsum(running) > limits.max_num_seqs)
    _drop(drops, "running", int(extra.sum()))
    f = f[~extra]
    keep_f = min(len(f), limits.max_entries)
    keep_i = min(len(i), limits.max_entries - keep_f)
    _drop(drops, "entries", len(f) - keep_f + len(i) - keep_i)
    return f[:keep_f], i[:keep_i]


# -- the price books' messages -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BookShape:
    """One price book as the messages must fit it: its prices' shape (G, H, R), its
    window, and per demand row array (``Samples.arrays``' order) the dtype and the shape
    after the first (per sample) axis."""

    prices: tuple[int, ...]
    window: int
    rows: tuple[tuple[np.dtype[Any], tuple[int, ...]], ...]

    @staticmethod
    def of(book: PriceBook) -> BookShape:
        return BookShape(tuple(book.p.shape), book.cfg.window,
                         tuple((a.dtype, tuple(a.shape[1:])) for a in book.samples.arrays))

    def demand_bytes(self) -> int:
        per_sample = sum(dt.itemsize * int(np.prod(shape)) for dt, shape in self.rows)
        return self.window * per_sample + 8 * ARRIVALS_KEPT

    def price_bytes(self) -> int:
        return 3 * 8 * int(np.prod(self.prices)) + 8 * 5


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the books' messages are held to: the largest reward a sample may carry and
    the largest price; ``wall_s`` this replica's wall-clock time."""

    reward: float
    price: float
    wall_s: float


def reward_bound(w: RewardConfig, horizon: int, backends: Sequence[BackendLimits]) -> float:
    """The largest reward r_jg a request can earn (``olproute.pricing.reward``): every
    term at its most, its tokens at most the largest KV capacity, its quality at most 1."""
    tokens = max((b.kv_tokens for b in backends), default=0)
    return (w.sigma + w.alpha * tokens / w.token_norm + (w.beta + w.gamma) * horizon
            + w.zeta1 + w.zeta2 + w.omega)


def price_bound(reward_scale: float, specs: Sequence[InstanceSpec]) -> float:
    """``PRICE_HEADROOM`` x the reward scale over the smallest share of a resource a
    request uses (module docstring)."""
    units = max((max(s.max_num_seqs, s.kv_capacity_tokens, s.max_num_batched_tokens)
                 for s in specs), default=1)
    return PRICE_HEADROOM * reward_scale * units


def _npz(raw: bytes, cap: int, names: set[str]) -> Any:
    """An .npz of at most ``cap`` bytes, stored (not compressed), every member one of
    ``names`` whose header's shape its bytes can hold: its arrays, read without
    pickles."""
    if len(raw) > cap:
        raise Rejected("too_large")
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise Rejected("format") from exc
    with zf:
        infos = zf.infolist()
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(
                    ".npy") or info.filename[:-4] not in names:
                raise Rejected("format")
        if len(infos) > len(names) or sum(i.file_size for i in infos) > cap:
            raise Rejected("too_large")
        for info in infos:
            _npy_header(zf, info)
    return np.load(io.BytesIO(raw), allow_pickle=False)


def _npy_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """A member's .npy header: a plain dtype and a shape its bytes can hold (a header may
    claim any shape; reading it would first allocate that much)."""
    try:
        with zf.open(info) as f:
            version = npformat.read_magic(f)
            read = (npformat.read_array_header_1_0 if version == (1, 0)
                    else npformat.read_array_header_2_0)
            shape, _, dtype = read(f)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise Rejected("format") from exc
    if dtype.hasobject or math.prod(shape) * dtype.itemsize > info.file_size:
        raise Rejected("format")


def _num_books(z: Any, expected: int) -> None:
    n = z["num_books"] if "num_books" in z.files else None
    if n is None or n.shape != (1,) or n.dtype.kind not in "iu" or int(n[0]) != expected:
        raise Rejected("books")


def demand_names(shapes: Sequence[BookShape]) -> set[str]:
    return {"num_books"} | {f"b{i}_a" for i in range(len(shapes))} | {
        f"b{i}_r{k}" for i, s in enumerate(shapes) for k in range(len(s.rows))}


def parse_demand(raw: bytes, shapes: Sequence[BookShape], bounds: Bounds, offset_s: float
                 ) -> tuple[list[Demand | None] | None, Drops]:
    """A demand message (``shared.encode_demand``) for books of ``shapes``: per book its
    demand, arrival times moved into local time (``- offset_s``), a book's that does not
    fit dropped (None); None when the message itself does not fit."""
    drops: Drops = {}
    cap = NPZ_BASE_BYTES + sum(s.demand_bytes() for s in shapes)
    try:
        with _npz(raw, cap, demand_names(shapes)) as z:
            _num_books(z, len(shapes))
            out: list[Demand | None] = []
            for i, shape in enumerate(shapes):
                try:
                    out.append(_book_demand(z, i, shape, bounds, offset_s))
                except Rejected as exc:
                    _drop(drops, exc.reason)
                    out.append(None)
            return out, drops
    except Rejected as exc:
        _drop(drops, exc.reason)
    except Exception:   # whatever else a malformed archive raises
        _drop(drops, "format")
    return None, drops


def _book_demand(z: Any, i: int, shape: BookShape, bounds: Bounds, offset_s: float
                 ) -> Demand | None:
    if f"b{i}_a" not in z.files:
        if any(f"b{i}_r{k}" in z.files for k in range(len(shape.rows))):
            raise Rejected("format")
        return None
    arrivals = z[f"b{i}_a"]
    if arrivals.dtype != np.float64 or arrivals.ndim != 1 or len(arrivals) > ARRIVALS_KEPT:
        raise Rejected("shape")
    if not np.all(_in_window(arrivals, bounds.wall_s)):
        raise Rejected("time")
    rows: list[npt.NDArray[Any]] = []
    for k, (dtype, tail) in enumerate(shape.rows):
        name = f"b{i}_r{k}"
        if name not in z.files:
            raise Rejected("shape")
        a = z[name]
        if a.dtype != dtype or a.shape[1:] != tail or a.shape[0] > shape.window or (
                rows and a.shape[0] != rows[0].shape[0]):
            raise Rejected("shape")
        _sample_values(k, a, bounds)
        rows.append(a)
    return Demand(tuple(rows), arrivals - offset_s)


def _sample_values(k: int, a: npt.NDArray[Any], bounds: Bounds) -> None:
    """Row array k of ``Samples.arrays``: the rewards (0) finite within the bound either
    side (a high serving cost makes the utility term negative) or -inf (no such column),
    slot indices and usage within their bounds."""
    if k == 0:
        ok = (a == -np.inf) | (np.isfinite(a) & (np.abs(a) <= bounds.reward))
        if not np.all(ok):
            raise Rejected("reward")
    elif a.dtype.kind in "iu":
        if a.size and int(np.max(np.abs(a))) > SAMPLE_INT_BOUND:
            raise Rejected("value")
    elif not np.all(np.isfinite(a) & (a >= 0) & (a <= SAMPLE_FLOAT_BOUND)):
        raise Rejected("value")


def price_names(num_books: int) -> set[str]:
    return {"num_books"} | {f"b{i}_{k}" for i in range(num_books)
                            for k in ("p", "it", "acc", "meta")}


def prices_cap(shapes: Sequence[BookShape]) -> int:
    return NPZ_BASE_BYTES + sum(s.price_bytes() for s in shapes)


def parse_prices(raw: bytes, shapes: Sequence[BookShape], bounds: Bounds, offset_s: float
                 ) -> tuple[list[PriceState] | None, str | None]:
    """A leader's price states (``shared.encode_prices``) for books of ``shapes``, slot
    0's time moved into local time: all of them, or None and why (the books adopt
    together or not at all)."""
    try:
        with _npz(raw, prices_cap(shapes), price_names(len(shapes))) as z:
            _num_books(z, len(shapes))
            return [_price_state(z, i, s, bounds, offset_s)
                    for i, s in enumerate(shapes)], None
    except Rejected as exc:
        return None, exc.reason
    except Exception:   # whatever else a malformed archive raises
        return None, "format"


def check_prices(a: npt.NDArray[Any], shape: tuple[int, ...], bound: float) -> None:
    """A price array: float64 of ``shape``, finite, in [0, bound]."""
    if a.dtype != np.float64 or a.shape != shape:
        raise Rejected("shape")
    if not np.all(np.isfinite(a)):
        raise Rejected("nonfinite")
    if a.size and float(a.min()) < 0:
        raise Rejected("negative")
    if a.size and float(a.max()) > bound:
        raise Rejected("bound")


def _price_state(z: Any, i: int, shape: BookShape, bounds: Bounds, offset_s: float
                 ) -> PriceState:
    names = [f"b{i}_{k}" for k in ("p", "it", "acc", "meta")]
    if any(n not in z.files for n in names):
        raise Rejected("shape")
    p, it, acc, meta = (z[n] for n in names)
    check_prices(p, shape.prices, bounds.price)
    check_prices(it, shape.prices, bounds.price)
    check_prices(acc, shape.prices, ACC_BOUND)
    if meta.dtype != np.float64 or meta.shape != (5,):
        raise Rejected("shape")
    origin, n_h, updates, steps, scale = (float(x) for x in meta)
    if not math.isnan(origin) and not _in_window(np.array([origin]), bounds.wall_s)[0]:
        raise Rejected("time")
    if not (math.isfinite(n_h) and 0 <= n_h <= ARRIVALS_KEPT * shape.prices[1]) or \
            not all(_whole(np.array([updates, steps]), 0, COUNT_BOUND)) or \
            not (math.isfinite(scale) and 0 <= scale <= bounds.price):
        raise Rejected("value")
    return PriceState(p, it, acc, None if math.isnan(origin) else origin - offset_s, n_h,
                      int(updates), int(steps), scale)
