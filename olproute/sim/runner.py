"""Running policies on a configured scenario: progress, outputs on disk, tables, plots."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from olproute.config.loader import LoadedConfig
from olproute.sim import metrics
from olproute.sim.cluster import SimResult
from olproute.sim.scenario import PolicyWrap, build_requests, simulate
from olproute.types import Request


@dataclass(frozen=True, slots=True)
class PolicyRun:
    policy: str
    result: SimResult
    summary: metrics.Summary


def run_policy(
    loaded: LoadedConfig,
    name: str,
    requests: Sequence[Request] | None = None,
    progress: bool = True,
    out_dir: Path | None = None,
    wrap: PolicyWrap | None = None,
) -> PolicyRun:
    """Simulate one policy, with a progress bar on stderr, and write its outputs
    (``wrap``: as ``simulate`` takes it)."""
    reqs = list(requests) if requests is not None else build_requests(loaded)
    if progress:
        from tqdm import tqdm

        with tqdm(total=len(reqs), desc=f"{name:>18}", unit="req", file=sys.stderr,
                  mininterval=0.5, leave=True) as bar:
            last = [0]

            def tick(done: int) -> None:
                if done - last[0] >= 200 or done == len(reqs):
                    bar.update(done - last[0])
                    last[0] = done

            result = simulate(loaded, name, reqs, progress=tick, wrap=wrap)
    else:
        result = simulate(loaded, name, reqs, wrap=wrap)
    run = PolicyRun(name, result, metrics.summarize(
        result, loaded.profiles, loaded.config.reward.cost_lambda))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics.write_records(result, out_dir / f"records_{name}.csv")
        metrics.write_batch_log(result, out_dir / f"batches_{name}.csv")
        (out_dir / f"summary_{name}.json").write_text(
            json.dumps(run.summary.as_json(), indent=2) + "\n")
    return run


def compare_policies(
    loaded: LoadedConfig,
    names: Sequence[str],
    progress: bool = True,
    out_dir: Path | None = None,
    wrap: PolicyWrap | None = None,
) -> list[PolicyRun]:
    """Every policy on the same requests and seed; writes compare.csv and cdf.png."""
    if not names:
        raise ValueError("no policies to compare")
    reqs = build_requests(loaded)
    runs = [run_policy(loaded, n, reqs, progress, out_dir, wrap) for n in names]
    if out_dir is not None:
        write_compare_csv(runs, out_dir / "compare.csv")
        from olproute.sim.plots import latency_cdfs

        latency_cdfs([(r.policy, r.result) for r in runs], out_dir / "cdf.png",
                     title=f"{loaded.path.name}: {len(reqs)} requests, seed "
                           f"{loaded.config.sim.seed}")
    return runs


def write_compare_csv(runs: Sequence[PolicyRun], path: Path) -> None:
    cols = list(runs[0].summary.as_dict())
    lines = [",".join(["policy", *cols])]
    for r in runs:
        d = r.summary.as_dict()
        lines.append(",".join([r.policy, *(repr(d[c]) for c in cols)]))
    path.write_text("\n".join(lines) + "\n")


# latency columns over served requests stand beside the served fraction and a tail
# over all requests (refused = inf); tokens/s is over the arrival window
_TABLE = (
    ("served", "num_served", "{:.0f}"), ("shed", "num_shed", "{:.0f}"),
    ("TTFT mean ms", "ttft_mean_s", "ms"), ("TTFT p50", "ttft_p50_s", "ms"),
    ("TTFT p99", "ttft_p99_s", "ms"), ("p99 all", "ttft_p99_all_s", "ms"),
    ("EEL mean s", "eel_mean_s", "{:.2f}"),
    ("EEL p99", "eel_p99_s", "{:.2f}"), ("TPOT p99 ms", "tpot_p99_s", "ms"),
    ("tok/s window", "throughput_tokens_per_s", "{:.0f}"),
    ("SLO att.", "slo_attainment", "{:.3f}"),
    ("goodput", "goodput", "{:.3f}"), ("preempt", "num_preemptions", "{:.0f}"),
)


def summary_table(rows: Sequence[tuple[str, metrics.Summary]]) -> str:
    """A fixed-width table, one row per policy."""
    header = ["policy", *(h for h, _, _ in _TABLE)]
    body = []
    for name, s in rows:
        d = s.as_dict()
        cells = [name]
        for _h, key, fmt in _TABLE:
            v = float(d[key])
            if math.isnan(v):
                cells.append("-")
            elif math.isinf(v):
                cells.append("inf")
            elif fmt == "ms":
                cells.append(f"{v * 1e3:.1f}")
            else:
                cells.append(fmt.format(v))
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    fmt_row = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt_row.format(*header), "  ".join("-" * w for w in widths)]
    lines += [fmt_row.format(*r) for r in body]
    return "\n".join(lines)
