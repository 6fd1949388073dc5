"""Per-instance calibration from batch logs: the 4-term batch-time model by non-negative
least squares, prefill throughput, time per output token and LPS parameters; and an
online recalibrator over a rolling window of streamed batch records.

A batch record is the row the simulator's batch log writes (and the server will stream):
duration and the batch sums ``num_tokens``, ``sum_decode_context``,
``sum_prefill_attention`` (plus counts), see ``olproute.types.BATCH_LOG_COLUMNS``.
"""

from __future__ import annotations

import csv
import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import yaml

from olproute.types import BATCH_LOG_COLUMNS

FloatArray = npt.NDArray[np.float64]
Beta = tuple[float, float, float, float]

_COL = {name: i for i, name in enumerate(BATCH_LOG_COLUMNS)}
# the 4-term model's regressors, by batch-log column
_FEATURES = ("num_tokens", "sum_decode_context", "sum_prefill_attention")


class CalibrationError(ValueError):
    """A batch log or calibration file is unusable; the message says where and why."""


@dataclass(frozen=True, slots=True)
class InstanceCalibration:
    """What the estimators know about one instance, all fitted from its logs.

    ``beta`` (s, s/token, s/context token, s/attention pair): batch time model.
    ``prefill_tokens_per_s``: prefill tokens over the time of batches holding a prefill.
    ``tpot_s``: mean time of batches holding decodes (one token per decoder per batch).
    ``mean_batch_seqs``: time-average requests per batch while busy (LPS concurrency k).
    ``service_rate_per_s``: requests completed per busy second (LPS mu), if known.
    ``service_scv``: squared coefficient of variation of per-request service (decode
    tokens), if known.
    """

    beta: Beta
    prefill_tokens_per_s: float
    tpot_s: float
    mean_batch_seqs: float
    service_rate_per_s: float | None = None
    service_scv: float | None = None

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["beta"] = list(self.beta)
        return d


def design_matrix(log: FloatArray) -> FloatArray:
    """(n, 4) regressors of the 4-term model: 1, tokens, decode context, prefill attention."""
    cols = [log[:, _COL[c]] for c in _FEATURES]
    return np.column_stack([np.ones(log.shape[0]), *cols])


def fit_beta(x: FloatArray, y: FloatArray, relative: bool = True) -> Beta:
    """beta >= 0 minimising squared (relative, by default) error of x @ beta against y.

    Columns are scaled to unit norm before NNLS so that coefficients spanning ten orders
    of magnitude are fitted with equal care; relative weighting (rows divided by y) aims
    the fit at percentage error, which is what TTFT accuracy is judged on.
    """
    if x.ndim != 2 or x.shape[1] != 4 or x.shape[0] != y.shape[0]:
        raise CalibrationError("fit_beta needs x of shape (n, 4) and y of length n")
    b = fit_nonnegative(x, y, relative)
    return (float(b[0]), float(b[1]), float(b[2]), float(b[3]))


def fit_nonnegative(x: FloatArray, y: FloatArray, relative: bool = True) -> FloatArray:
    """``fit_beta`` for any number of columns (at least as many rows): coefficients >= 0
    of x @ b against durations y, columns scaled to unit norm, rows weighted by 1 / y
    when ``relative``."""
    from scipy.optimize import nnls

    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise CalibrationError("need x of shape (n, k) and y of length n")
    if x.shape[0] < x.shape[1]:
        raise CalibrationError(f"need at least {x.shape[1]} rows to fit {x.shape[1]} "
                               f"coefficients, got {x.shape[0]}")
    if np.any(y <= 0):
        raise CalibrationError("batch durations must be > 0")
    w = 1.0 / y if relative else np.ones_like(y)
    xw = x * w[:, None]
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(xw / scale, y * w)
    out: FloatArray = coef / scale
    return out


def predict_batch_time(beta: Sequence[float], log: FloatArray) -> FloatArray:
    return design_matrix(log) @ np.asarray(beta, dtype=np.float64)


def calibrate_instance(log: FloatArray, completions: int | None = None,
                       decode_tokens: FloatArray | None = None) -> InstanceCalibration:
    """Fit one instance from its batch-log rows (columns BATCH_LOG_COLUMNS)."""
    dur = log[:, _COL["duration_s"]]
    beta = fit_beta(design_matrix(log), dur)
    pre = log[:, _COL["num_prefill_tokens"]]
    has_pre = pre > 0
    has_dec = log[:, _COL["num_decode_tokens"]] > 0
    busy = float(dur.sum())
    prefill_tps = float(pre.sum() / dur[has_pre].sum()) if has_pre.any() else float("nan")
    tpot = float(dur[has_dec].mean()) if has_dec.any() else float("nan")
    k = float((log[:, _COL["num_seqs"]] * dur).sum() / busy)
    mu = completions / busy if completions else None
    scv = None
    if decode_tokens is not None and decode_tokens.size > 1 and decode_tokens.mean() > 0:
        scv = float(decode_tokens.var() / decode_tokens.mean() ** 2)
    return InstanceCalibration(beta=beta, prefill_tokens_per_s=prefill_tps, tpot_s=tpot,
                               mean_batch_seqs=k, service_rate_per_s=mu, service_scv=scv)


def calibrate_log(log: FloatArray, names: Sequence[str],
                  completions: Sequence[int] | None = None,
                  decode_tokens: Sequence[FloatArray] | None = None,
                  ) -> dict[str, InstanceCalibration]:
    """Fit every instance of a batch log whose column 0 indexes ``names``."""
    out = {}
    inst = log[:, 0].astype(np.int64)
    for g, name in enumerate(names):
        rows = log[inst == g]
        if rows.shape[0] == 0:
            raise CalibrationError(f"no batches logged for instance {name!r}")
        out[name] = calibrate_instance(
            rows, None if completions is None else completions[g],
            None if decode_tokens is None else decode_tokens[g])
    return out


def read_batch_log(path: str | os.PathLike[str]) -> tuple[FloatArray, list[str]]:
    """A batch-log CSV as written by ``olproute simulate --out``: the numeric rows (column
    0 re-indexed) and the instance names in order of first appearance."""
    p = Path(path)
    names: list[str] = []
    index: dict[str, int] = {}
    rows: list[list[float]] = []
    try:
        f = p.open(newline="")
    except OSError as exc:
        raise CalibrationError(f"{p}: cannot read: {exc.strerror}") from exc
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header) != BATCH_LOG_COLUMNS:
            raise CalibrationError(
                f"{p}: line 1: expected header {','.join(BATCH_LOG_COLUMNS)}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(BATCH_LOG_COLUMNS):
                raise CalibrationError(
                    f"{p}: line {lineno}: expected {len(BATCH_LOG_COLUMNS)} fields, "
                    f"got {len(row)}")
            name = row[0]
            if name not in index:
                index[name] = len(names)
                names.append(name)
            try:
                values = [float(v) for v in row[1:]]
            except ValueError as exc:
                raise CalibrationError(f"{p}: line {lineno}: {exc}") from exc
            rows.append([float(index[name]), *values])
    if not rows:
        raise CalibrationError(f"{p}: no batches")
    return np.asarray(rows, dtype=np.float64), names


def write_calibration(cal: Mapping[str, InstanceCalibration],
                      path: str | os.PathLike[str]) -> None:
    doc = {"calibration": {name: c.as_dict() for name, c in cal.items()}}
    Path(path).write_text(
        "# Per-instance calibration fitted by `olproute calibrate`"
        " (olproute/estimate/calibration.py)\n"
        + yaml.safe_dump(doc, sort_keys=False))


def read_calibration(path: str | os.PathLike[str]) -> dict[str, InstanceCalibration]:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CalibrationError(f"{p}: cannot read calibration: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("calibration"), dict):
        raise CalibrationError(f"{p}: calibration: expected a mapping of instance names")
    out = {}
    for name, d in doc["calibration"].items():
        try:
            beta = tuple(float(b) for b in d["beta"])
            if len(beta) != 4 or min(beta) < 0:
                raise ValueError("beta must be 4 numbers >= 0")
            out[str(name)] = InstanceCalibration(
                beta=(beta[0], beta[1], beta[2], beta[3]),
                prefill_tokens_per_s=float(d["prefill_tokens_per_s"]),
                tpot_s=float(d["tpot_s"]), mean_batch_seqs=float(d["mean_batch_seqs"]),
                service_rate_per_s=(None if d.get("service_rate_per_s") is None
                                    else float(d["service_rate_per_s"])),
                service_scv=None if d.get("service_scv") is None else float(d["service_scv"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{p}: calibration.{name}: {exc}") from exc
    return out


class OnlineCalibrator:
    """Rolling-window refit of beta from streamed batch records (for the server).

    ``add`` takes one record (duration and the three regressors); every ``refit_every``
    records the window is refitted by NNLS and ``beta`` moves to the new fit. Until
    ``min_batches`` records have arrived, ``beta`` stays at its initial value.
    """

    def __init__(self, initial: Beta, window: int = 4096, refit_every: int = 256,
                 min_batches: int = 64) -> None:
        if window < 4 or refit_every < 1 or min_batches < 4:
            raise ValueError("window and min_batches must be >= 4, refit_every >= 1")
        self.beta = initial
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._since = 0
        self._refit_every = refit_every
        self._min = min_batches
        self.num_refits = 0

    def add(self, duration_s: float, num_tokens: float, sum_decode_context: float,
            sum_prefill_attention: float) -> None:
        self._rows.append((duration_s, num_tokens, sum_decode_context, sum_prefill_attention))
        self._since += 1
        if self._since >= self._refit_every and len(self._rows) >= self._min:
            self.refit()

    def add_many(self, records: Iterable[Sequence[float]]) -> None:
        for r in records:
            self.add(r[0], r[1], r[2], r[3])

    def refit(self) -> Beta:
        arr = np.asarray(self._rows, dtype=np.float64)
        x = np.column_stack([np.ones(arr.shape[0]), arr[:, 1:]])
        self.beta = fit_beta(x, arr[:, 0])
        self._since = 0
        self.num_refits += 1
        return self.beta
