"""Per-request records and summary metrics of a simulation run."""

from __future__ import annotations

import csv
import functools
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.config.loader import Profiles
from olproute.sim.cluster import SimResult
from olproute.sim.engine import BATCH_LOG_COLUMNS

FloatArray = npt.NDArray[np.float64]

RECORD_COLUMNS = (
    "request_id", "arrival_s", "instance", "dispatch_s", "first_token_s", "finish_s",
    "ttft_s", "eel_s", "tpot_s", "prompt_tokens", "decode_tokens", "predicted_decode_tokens",
    "ttft_target_s", "tpot_target_s", "slo_class", "num_preemptions", "shed", "ttft_met",
    "slo_met", "cached_prompt_tokens",
)


@dataclass(frozen=True, slots=True)
class Summary:
    """Summary of one run. Latencies in seconds; NaN where no request qualifies.

    ``ttft_*`` / ``eel_*`` / ``tpot_*`` are over the requests served (finished); when a
    policy refuses requests they are over another set than a policy that serves all, so
    they stand beside ``served_fraction`` and the ``*_all_s`` tails, which are over every
    request with a refused (or unfinished) one counted as infinitely late: inf when the
    quantile falls on one.

    ``throughput_*`` are over the arrival window, from the first arrival to the last
    (``window_s``): tokens delivered in it (a request's prompt at its first token, its
    output tokens spread evenly from the first token to the last) over its length.
    That is the rate a fleet sustains while the load is on; ``makespan_tokens_per_s``
    (every served token over first arrival to last finish) mostly measures how long the
    last requests take to drain, and is given only under that name.
    """

    num_requests: int
    num_served: int
    num_shed: int
    duration_s: float                 # first arrival to the last event (makespan)
    window_s: float                   # first arrival to the last arrival
    served_fraction: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    eel_mean_s: float
    eel_p50_s: float
    eel_p95_s: float
    eel_p99_s: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    tpot_p99_s: float
    throughput_tokens_per_s: float    # over the arrival window
    throughput_requests_per_s: float  # finishes in the arrival window over its length
    slo_attainment: float
    goodput: float
    num_preemptions: int
    ttft_p90_all_s: float = float("nan")
    ttft_p99_all_s: float = float("nan")
    eel_p95_all_s: float = float("nan")
    eel_p99_all_s: float = float("nan")
    makespan_tokens_per_s: float = float("nan")
    # BEAR eq. 6: mean over all requests of (quality - lambda * cost) when the TTFT target
    # is met, else 0; NaN when the requests carry no per-model quality
    on_time_utility: float = float("nan")

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def as_json(self) -> dict[str, float | int | None]:
        """``as_dict`` with NaN and inf as None (JSON has neither)."""
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in asdict(self).items()}


def ttft_s(res: SimResult) -> FloatArray:
    return res.first_token_s - _arrivals(res)


def eel_s(res: SimResult) -> FloatArray:
    return res.finish_s - _arrivals(res)


def _arrivals(res: SimResult) -> FloatArray:
    return np.array([r.arrival_s for r in res.requests], dtype=np.float64)


def tpot_s(res: SimResult) -> FloatArray:
    """Mean time per output token after the first; 0 for single-token outputs."""
    decode = res.decode_tokens.astype(np.float64)
    span = res.finish_s - res.first_token_s
    return np.where(decode > 1, span / np.maximum(decode - 1.0, 1.0), 0.0)


def slo_flags(res: SimResult) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """(TTFT met, TTFT and TPOT met) per request; shed requests meet neither. A request
    without a TPOT target is judged on TTFT alone."""
    ttft = ttft_s(res)
    target = np.array([r.ttft_target_s for r in res.requests], dtype=np.float64)
    tpot_target = np.array([np.inf if r.tpot_target_s is None else r.tpot_target_s
                            for r in res.requests], dtype=np.float64)
    served = ~res.shed & np.isfinite(res.finish_s)
    ttft_met = served & (ttft <= target)
    both = ttft_met & (tpot_s(res) <= tpot_target)
    return ttft_met, both


def hit_rate(res: SimResult) -> float:
    """The run's prefix-cache hit rate: prompt tokens found in the prefix cache over all
    prompt tokens, both summed over the served requests (finished, not shed: the engines
    record a request's cached tokens, vLLM's ``num_cached_tokens`` at its first
    admission, when it finishes). 0 for requests without block hashes; NaN when nothing
    was served or the result holds no record of cached tokens (built without a run)."""
    served = ~res.shed & np.isfinite(res.finish_s)
    prompt = np.array([r.prompt_tokens for r in res.requests], dtype=np.int64)[served]
    if res.cached_prompt_tokens is None or not prompt.size:
        return float("nan")
    return float(res.cached_prompt_tokens[served].sum() / prompt.sum())


def realised_utility(res: SimResult, profiles: Profiles | None = None,
                     cost_lambda: float = 5e-4) -> FloatArray:
    """Per request, the accuracy-cost utility it realised (BEAR eq. 4 on the truth):
    the quality of the model that served it (``Request.quality_by_model``) minus
    ``cost_lambda`` x its cost in micro-USD (prompt tokens x input price + generated
    tokens x output price, USD per million tokens from ``profiles``; the repo's
    ``configs/profiles.yaml`` when None). 0 for a shed or unfinished request; NaN for a
    request without ``quality_by_model``."""
    if profiles is None:
        profiles = _default_profiles()
    models = [s.model for s in res.specs]
    missing = sorted({m for m in models if m not in profiles.models})
    if missing:
        raise ValueError(f"no profile for model(s) {', '.join(missing)}: cannot price them")
    price_in = np.array([profiles.models[m].price_input_per_mtok for m in models])
    price_out = np.array([profiles.models[m].price_output_per_mtok for m in models])
    served = ~res.shed & np.isfinite(res.finish_s) & (res.instance >= 0)
    out = np.zeros(len(res.requests))
    for i, r in enumerate(res.requests):
        if r.quality_by_model is None:
            out[i] = np.nan
        elif served[i]:
            g = int(res.instance[i])
            cost_musd = (r.prompt_tokens * price_in[g]
                         + float(res.decode_tokens[i]) * price_out[g])
            out[i] = r.quality_by_model[models[g]] - cost_lambda * cost_musd
    return out


def on_time_utility(res: SimResult, profiles: Profiles | None = None,
                    cost_lambda: float = 5e-4) -> float:
    """BEAR eq. 6: the realised utility of each request whose TTFT met its target, 0 for
    the others (shed, or late), averaged over all requests. NaN when any request has no
    ``quality_by_model`` (or there are no requests)."""
    u = realised_utility(res, profiles, cost_lambda)
    if u.size == 0 or np.isnan(u).any():
        return float("nan")
    ttft_met, _ = slo_flags(res)
    return float(np.where(ttft_met, u, 0.0).mean())


@functools.cache
def _default_profiles() -> Profiles:
    from olproute.config.loader import REPO_ROOT, load_profiles

    return load_profiles(REPO_ROOT / "configs" / "profiles.yaml")


def pct_all(x: FloatArray, served: npt.NDArray[np.bool_], q: float) -> float:
    """The ``q``-th percentile of ``x`` over every request, an unserved one counting as
    infinitely late: inf when the percentile reaches into them (NaN with no requests).
    Interpolated as numpy's default (linear), so when every request is served it equals
    the percentile over the served."""
    if x.size == 0:
        return float("nan")
    ordered = np.sort(np.where(served, x, np.inf))
    pos = (ordered.size - 1) * q / 100.0
    lo, hi = int(np.floor(pos)), int(np.ceil(pos))
    frac = pos - lo
    if np.isinf(ordered[lo]) or (frac > 0 and np.isinf(ordered[hi])):
        return float("inf")
    return float(ordered[lo] + frac * (ordered[hi] - ordered[lo]))


def window_tokens(res: SimResult, start_s: float, end_s: float) -> tuple[float, int]:
    """Tokens delivered in [start_s, end_s] and requests finished in it: each served
    request's prompt at its first token, its first output token then, and the rest
    spread evenly up to its finish."""
    served = ~res.shed & np.isfinite(res.finish_s) & np.isfinite(res.first_token_s)
    first, finish = res.first_token_s[served], res.finish_s[served]
    prompt = np.array([r.prompt_tokens for r in res.requests], dtype=np.float64)[served]
    out = res.decode_tokens[served].astype(np.float64)
    at_first = (first >= start_s) & (first <= end_s)
    span = finish - first
    overlap = np.clip(np.minimum(finish, end_s) - np.maximum(first, start_s), 0.0, None)
    rest = np.where(span > 0, overlap / np.where(span > 0, span, 1.0),
                    ((finish >= start_s) & (finish <= end_s)).astype(np.float64))
    tokens = float(((prompt + 1.0) * at_first).sum() + ((out - 1.0) * rest).sum())
    done = int(((finish >= start_s) & (finish <= end_s)).sum())
    return tokens, done


def _pct(x: FloatArray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else float("nan")


def _mean(x: FloatArray) -> float:
    return float(x.mean()) if x.size else float("nan")


def summarize(res: SimResult, profiles: Profiles | None = None,
              cost_lambda: float = 5e-4) -> Summary:
    """Summary of a run; ``profiles`` (prices) and ``cost_lambda`` (lambda, per micro-USD)
    enter only ``on_time_utility``, as in :func:`on_time_utility`."""
    served = ~res.shed & np.isfinite(res.finish_s)
    ttft, eel, tpot = ttft_s(res)[served], eel_s(res)[served], tpot_s(res)[served]
    tpot = tpot[res.decode_tokens[served] > 1]
    n = len(res.requests)
    prompt = np.array([r.prompt_tokens for r in res.requests], dtype=np.int64)
    tokens = int((prompt[served] + res.decode_tokens[served]).sum())
    arrivals = _arrivals(res)
    start = float(arrivals.min()) if n else 0.0
    last = float(arrivals.max()) if n else 0.0
    duration = max(res.end_s - start, 1e-12)
    window = max(last - start, 1e-12)
    window_tok, window_done = window_tokens(res, start, last)
    ttft_met, both = slo_flags(res)
    ttft_all, eel_all = ttft_s(res), eel_s(res)
    return Summary(
        num_requests=n, num_served=int(served.sum()), num_shed=int(res.shed.sum()),
        duration_s=duration, window_s=window,
        served_fraction=float(served.mean()) if n else float("nan"),
        ttft_mean_s=_mean(ttft), ttft_p50_s=_pct(ttft, 50), ttft_p95_s=_pct(ttft, 95),
        ttft_p99_s=_pct(ttft, 99),
        eel_mean_s=_mean(eel), eel_p50_s=_pct(eel, 50), eel_p95_s=_pct(eel, 95),
        eel_p99_s=_pct(eel, 99),
        tpot_mean_s=_mean(tpot), tpot_p50_s=_pct(tpot, 50), tpot_p95_s=_pct(tpot, 95),
        tpot_p99_s=_pct(tpot, 99),
        throughput_tokens_per_s=window_tok / window,
        throughput_requests_per_s=window_done / window,
        slo_attainment=float(ttft_met.mean()) if n else float("nan"),
        goodput=float(both.mean()) if n else float("nan"),
        num_preemptions=int(res.num_preemptions.sum()),
        ttft_p90_all_s=pct_all(ttft_all, served, 90), ttft_p99_all_s=pct_all(ttft_all, served, 99),
        eel_p95_all_s=pct_all(eel_all, served, 95), eel_p99_all_s=pct_all(eel_all, served, 99),
        makespan_tokens_per_s=tokens / duration,
        on_time_utility=(on_time_utility(res, profiles, cost_lambda)
                         if any(r.quality_by_model is not None for r in res.requests)
                         else float("nan")),
    )


def time_average_in_system(res: SimResult, t0: float, t1: float) -> float:
    """Time-average number of requests in the system over [t0, t1], from the simulator's
    own counter (not from the per-request records)."""
    t, n = res.in_system_t, res.in_system_n
    edges = np.clip(np.append(t, max(t1, float(t[-1]))), t0, t1)
    return float(np.sum(n * np.diff(edges)) / (t1 - t0))


def _fmt(x: float) -> str:
    return "" if x != x else repr(float(x))


def write_records(res: SimResult, path: str | os.PathLike[str]) -> None:
    """One CSV row per request (columns RECORD_COLUMNS); floats written with repr so a
    rerun with the same seed gives a byte-identical file."""
    ttft, eel, tpot = ttft_s(res), eel_s(res), tpot_s(res)
    ttft_met, both = slo_flags(res)
    cached = (res.cached_prompt_tokens if res.cached_prompt_tokens is not None
              else np.zeros(len(res.requests), dtype=np.int64))
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(RECORD_COLUMNS)
        for i, r in enumerate(res.requests):
            w.writerow((
                r.request_id, _fmt(r.arrival_s), int(res.instance[i]), _fmt(res.dispatch_s[i]),
                _fmt(res.first_token_s[i]), _fmt(res.finish_s[i]), _fmt(ttft[i]), _fmt(eel[i]),
                _fmt(tpot[i]), r.prompt_tokens, int(res.decode_tokens[i]),
                r.predicted_decode_tokens,
                _fmt(r.ttft_target_s),
                "" if r.tpot_target_s is None else _fmt(r.tpot_target_s), r.slo_class,
                int(res.num_preemptions[i]), int(res.shed[i]), int(ttft_met[i]), int(both[i]),
                int(cached[i]),
            ))


def write_batch_log(res: SimResult, path: str | os.PathLike[str]) -> None:
    """One CSV row per batch: the instance name, start and duration, and the batch sums
    the 4-term batch-time model is fitted on (``olproute calibrate`` reads it)."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(BATCH_LOG_COLUMNS)
        for row in res.batch_log:
            w.writerow([res.specs[int(row[0])].name] + [_fmt(x) for x in row[1:]])
