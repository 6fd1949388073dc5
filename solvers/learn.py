"""The online price learner as an LP dual solver, offline (issue 14, item 1).

    python -m solvers.learn [--steps T] [--quick] [--json PATH] [--png PATH]

The exact step bid_price takes online (``olproute.pricing.step_jax``: the JAX steps, or
their NumPy twin, ``olproute.pricing.step_ref``) is run on exactly one LP window
(``solvers.problem``): the window's requests are the samples, each with its LP columns
(every instance, every delay d = 0..max_delay, its first-token slot and prorated reward
exactly as ``column_block`` builds them), N_H = N, the LP's capacities (free capacity
clipped at 0), and no random offsets. Its objective is then the LP dual's D(p) itself
(``step_ref.saa_dual_value`` equals ``solvers.certificate.dual_value``; a test holds them
together), so the learner is a stochastic projected subgradient method on the LP's dual,
and D(p_t)/LP* - 1 says how far it has come.

For each instance and step rule the table gives D(0)/LP* - 1 (where zero prices start),
D(p_T)/LP* - 1 after T steps, and the share of D(0)'s excess the steps closed. The rules:
the old default (constant eta0 = 2.0), inverse_sqrt (2.0 / sqrt(t + 1)), and adagrad
scaled to the window's break-even price (the default now). Instances:
``random_instance(2000, 8, 400)`` at its default load 1.3 and overloaded (load 3), and a
recorded bid_price window (``solvers.compare``'s batch-bound scenario, 16 req/s).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from olproute.pricing.reward import first_token_slot
from olproute.pricing.step_jax import Backend, run_steps
from olproute.pricing.step_ref import Samples, step_sizes
from solvers.certificate import Pricer
from solvers.problem import LpProblem, random_instance, reward_grid

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

REPO = Path(__file__).resolve().parents[1]

RULES: dict[str, tuple[str, float]] = {
    "constant 2.0 (old default)": ("constant", 2.0),
    "inverse_sqrt 2.0": ("inverse_sqrt", 2.0),
    "adagrad 0.5 (default)": ("adagrad", 0.5),
}


def lp_samples(prob: LpProblem) -> Samples:
    """The window's requests as price samples on the LP's absolute grid: per request and
    instance the delay-0 column (first-token slot a_j + k0, decode slots D_jg, the KV
    ramp, the prefill's P slots and share of the budget) and the reward of every delay
    d = 0..max_delay (``reward_grid``; the step prorates it at the grid's end as
    ``column_block`` does)."""
    n, g = prob.num_requests, prob.num_instances
    delays = np.arange(prob.num_delays, dtype=np.int64)
    k0 = first_token_slot(prob.exec_ttft_s, prob.slot_s, prob.horizon)
    start = (prob.arrival_slot[:, None] + k0).astype(np.int64)
    ttft = prob.exec_ttft_s[:, :, None] + delays[None, None, :] * prob.slot_s
    return Samples(
        reward=reward_grid(prob, np.arange(n), ttft), start=start,
        end=(start + prob.duration).astype(np.int64),
        batch_a=np.broadcast_to(prob.batch_a, (n, g)).copy(), kv_a=prob.kv_a.copy(),
        kv_b=prob.kv_b.copy(), pre_lo=prob.prefill_slots.copy(),
        pre_hi=np.zeros((n, g), dtype=np.int64), prefill_work=prob.prefill_work.copy(),
        earliest=prob.arrival_slot.astype(np.int64), delays=delays)


@dataclass
class LearnTrace:
    """D(p_t) every ``every`` steps (``steps[i]`` steps done), and the last prices."""

    rule: str
    step_size: float
    minibatch: int
    steps: list[int] = field(default_factory=list)
    dual: list[float] = field(default_factory=list)
    p: FloatArray | None = None
    seconds: float = 0.0


def learn(prob: LpProblem, steps: int = 2000, minibatch: int = 256,
          schedule: str = "adagrad", step_size: float = 0.5, backend: Backend = "jax",
          seed: int = 0, every: int = 50, pricer: Pricer | None = None) -> LearnTrace:
    """Run the online step on one window (module docstring): ``steps`` steps of
    ``minibatch`` samples (the whole window when it is at least N), evaluating D(p) every
    ``every`` steps (and at 0). No forgetting: the accumulator of adagrad keeps every
    step, as a dual solver on a fixed problem should."""
    n = prob.num_requests
    smp = lp_samples(prob)
    c = prob.capacity
    pricer = pricer or Pricer(prob)
    rng = np.random.default_rng(seed)
    p = np.zeros_like(c)
    acc = np.zeros_like(c)
    s = min(minibatch, n)
    eta0 = step_size * (smp.price_scale(n) if schedule == "adagrad" else 1.0)
    trace = LearnTrace(schedule, step_size, s, [0], [pricer.price(p).dual_value])
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        k = min(every, steps - done)
        idx = (np.tile(np.arange(n), (k, 1)) if s >= n
               else rng.integers(0, n, (k, s))).astype(np.int64)
        mask = np.ones(idx.shape, dtype=bool)
        offset = np.zeros(idx.shape, dtype=np.int64)
        etas = step_sizes(eta0, schedule, done, k)
        p, acc = run_steps(p, acc, c, smp, idx, mask, offset, float(n), etas, schedule, 1.0,
                           backend)
        done += k
        trace.steps.append(done)
        trace.dual.append(pricer.price(p).dual_value)
    trace.seconds = time.perf_counter() - t0
    trace.p = p
    return trace


@dataclass(frozen=True, slots=True)
class Row:
    instance: str
    rule: str
    lp_value: float
    d_zero: float          # D(0) / LP* - 1
    d_final: float         # D(p_T) / LP* - 1
    closed: float          # 1 - (D(p_T) - LP*) / (D(0) - LP*)
    steps: int
    seconds: float

    def as_dict(self) -> dict[str, float | int | str]:
        return {"instance": self.instance, "rule": self.rule, "lp_value": self.lp_value,
                "d_zero_over_lp": self.d_zero, "d_final_over_lp": self.d_final,
                "closed": self.closed, "steps": self.steps, "seconds": self.seconds}


def instances(quick: bool) -> dict[str, LpProblem]:
    """The windows of the table (``--quick``: smaller random ones, no recorded run)."""
    if quick:
        return {"random (500, 4, 200), load 1.3": random_instance(500, 4, 200, seed=0),
                "random (500, 4, 200), load 3": random_instance(500, 4, 200, seed=0,
                                                                load=3.0)}
    from solvers.compare import scenario
    from solvers.record import record_bid_price, window_problem

    rec = record_bid_price(scenario("batch", 1000, 0))
    window, _ = window_problem(rec)
    return {"random (2000, 8, 400), load 1.3": random_instance(2000, 8, 400, seed=0),
            "random (2000, 8, 400), load 3": random_instance(2000, 8, 400, seed=0, load=3.0),
            "recorded bid_price window, 16 req/s": window}


def run(steps: int, quick: bool, backend: Backend = "jax"
        ) -> tuple[list[Row], dict[str, dict[str, LearnTrace]], dict[str, float]]:
    """Every instance x rule: the rows, the traces, and LP* per instance."""
    from solvers.lp import solve

    rows: list[Row] = []
    traces: dict[str, dict[str, LearnTrace]] = {}
    lps: dict[str, float] = {}
    for name, prob in instances(quick).items():
        lp = solve(prob).objective
        lps[name] = lp
        pricer = Pricer(prob)
        traces[name] = {}
        for label, (schedule, eta) in RULES.items():
            tr = learn(prob, steps, schedule=schedule, step_size=eta, backend=backend,
                       pricer=pricer)
            traces[name][label] = tr
            d0, dt = tr.dual[0] / lp - 1.0, tr.dual[-1] / lp - 1.0
            rows.append(Row(name, label, lp, d0, dt, 1.0 - dt / d0 if d0 > 0 else math.nan,
                            tr.steps[-1], tr.seconds))
            print(f"  {name}, {label}: D/LP* - 1 = {dt * 100:+.3f}% "
                  f"({tr.seconds:.1f} s)", flush=True)
    return rows, traces, lps


def table(rows: list[Row]) -> str:
    head = (f"{'window':<38} {'rule':<28} {'D(0)/LP*-1':>11} {'D(p_T)/LP*-1':>13} "
            f"{'closed':>7} {'steps':>6} {'s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.instance:<38} {r.rule:<28} {r.d_zero * 100:>10.3f}% "
                     f"{r.d_final * 100:>12.3f}% {r.closed * 100:>6.1f}% {r.steps:>6} "
                     f"{r.seconds:>6.1f}")
    return "\n".join(lines)


def plot(traces: dict[str, dict[str, LearnTrace]], lps: dict[str, float], path: Path) -> None:
    """D(p_t)/LP* - 1 against steps, one panel per window, one line per rule (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(traces)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8),
                             constrained_layout=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for label, tr in traces[name].items():
            gap = np.maximum(np.array(tr.dual) / lps[name] - 1.0, 1e-6) * 100
            ax.plot(tr.steps, gap, lw=1.2, label=label)
        ax.axhline(1.0, color="grey", ls=":", lw=1, label="goal: 1%")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("dual steps")
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("D(p_t) / LP* - 1  (%)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("the online price step as an LP dual solver on one window (mini-batch 256)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="two small random windows")
    ap.add_argument("--backend", choices=["jax", "numpy"], default="jax")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH", default=str(REPO / "docs" / "price_convergence.png"))
    args = ap.parse_args()
    rows, traces, lps = run(args.steps, args.quick, args.backend)
    print()
    print(table(rows))
    plot(traces, lps, Path(args.png))
    print(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.as_dict() for r in rows]},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
