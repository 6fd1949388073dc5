"""Held-out evaluation of a predictor against per-task means, and the train-then-
evaluate entry point."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.predict.predictor import Predictor
from olproute.predict.training import (
    PromptMatrix,
    TrainConfig,
    TrainingData,
    featurize_prompts,
    split_prompts,
    train_predictor,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _ranks(x: FloatArray) -> FloatArray:
    """1-based ranks, ties sharing their average rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return np.asarray((ends - (counts - 1) / 2.0)[inverse], dtype=np.float64)


def spearman(a: FloatArray, b: FloatArray) -> float:
    """Spearman rank correlation (NaN when either side is constant)."""
    ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def decode_errors(true: FloatArray, pred: FloatArray) -> tuple[float, float, float]:
    """MAE (tokens), MAPE (fraction of the true length) and R^2 of decode predictions."""
    err = pred - true
    ss_tot = float(((true - true.mean()) ** 2).sum())
    r2 = 1.0 - float((err**2).sum()) / ss_tot if ss_tot > 0 else math.nan
    return float(np.abs(err).mean()), float((np.abs(err) / true).mean()), r2


@dataclass(frozen=True, slots=True, eq=False)
class Evaluation:
    """Held-out figures. ``decode`` maps a label (the predictor and the mean baselines) to
    (MAE tokens, MAPE, R^2); arrays are per held-out row, for plots."""

    num_train_rows: int
    num_test_rows: int
    num_test_prompts: int
    decode: Mapping[str, tuple[float, float, float]]
    quality_spearman: float
    quality_spearman_within: float
    quality_mae: float
    p90_coverage: float | None
    true_decode: FloatArray = field(repr=False)
    pred_decode: FloatArray = field(repr=False)
    true_quality: FloatArray = field(repr=False)
    pred_quality: FloatArray = field(repr=False)
    groups: tuple[str, ...] = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"num_train_rows": self.num_train_rows, "num_test_rows": self.num_test_rows,
                "num_test_prompts": self.num_test_prompts,
                "decode": {k: {"mae_tokens": v[0], "mape": v[1], "r2": v[2]}
                           for k, v in self.decode.items()},
                "quality": {"spearman": self.quality_spearman,
                            "spearman_within_task_model": self.quality_spearman_within,
                            "mae": self.quality_mae},
                "decode_p90_coverage": self.p90_coverage}

    def table(self) -> str:
        lines = [f"held out: {self.num_test_rows:,} rows ({self.num_test_prompts:,} prompts); "
                 f"trained on {self.num_train_rows:,} rows",
                 f"{'decode tokens':<26}{'MAE':>9}{'MAPE':>9}{'R2':>8}",
                 f"{'-' * 26}{'-' * 9:>9}{'-' * 9:>9}{'-' * 8:>8}"]
        for label, (mae, mape, r2) in self.decode.items():
            lines.append(f"{label:<26}{mae:>9.1f}{mape:>9.3f}{r2:>8.3f}")
        lines += ["", f"{'quality':<26}{'value':>9}", f"{'-' * 26}{'-' * 9:>9}",
                  f"{'Spearman, all rows':<26}{self.quality_spearman:>9.3f}",
                  f"{'Spearman, within group':<26}{self.quality_spearman_within:>9.3f}",
                  f"{'MAE':<26}{self.quality_mae:>9.3f}"]
        if self.p90_coverage is not None:
            lines.append(f"{'decode P90 coverage':<26}{self.p90_coverage:>9.3f}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], max_points: int = 4000) -> None:
        """Predicted vs true decode tokens (log-log) and quality, coloured by group."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keep = np.random.default_rng(0).permutation(len(self.true_decode))[:max_points]
        groups = np.asarray(self.groups, dtype=object)[keep]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), constrained_layout=True)
        panels = ((self.true_decode, self.pred_decode, "decode tokens", True),
                  (self.true_quality, self.pred_quality, "quality", False))
        for ax, (true, pred, label, log) in zip(axes, panels, strict=True):
            for g in sorted(set(groups)):
                sel = keep[groups == g]
                ax.scatter(true[sel], pred[sel], s=4, alpha=0.35, label=g)
            lo, hi = float(min(true.min(), pred.min())), float(max(true.max(), pred.max()))
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            if log:
                ax.set_xscale("log")
                ax.set_yscale("log")
            ax.set_xlabel(f"true {label}")
            ax.set_ylabel(f"predicted {label}")
            ax.grid(True, which="both", alpha=0.3)
        mae = self.decode["predictor"][0]
        axes[0].set_title(f"held-out decode length (MAE {mae:.0f} tokens)")
        axes[1].set_title(f"held-out quality (Spearman {self.quality_spearman:.2f})")
        axes[0].legend(loc="upper left", markerscale=3, fontsize=8)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _group_means(keys_train: Sequence[str], y_train: FloatArray,
                 keys_test: Sequence[str], fallback: float) -> FloatArray:
    sums: dict[str, list[float]] = {}
    for k, y in zip(keys_train, y_train.tolist(), strict=True):
        acc = sums.setdefault(k, [0.0, 0.0])
        acc[0] += y
        acc[1] += 1.0
    return np.array([sums[k][0] / sums[k][1] if k in sums else fallback for k in keys_test])


def evaluate(predictor: Predictor, data: TrainingData, features: PromptMatrix,
             train_prompts: IntArray, test_prompts: IntArray) -> Evaluation:
    """Held-out decode MAE / MAPE / R^2 against per-task (and per-task-and-model) means of
    the training rows, and quality Spearman, on all rows and within (task, model)."""
    prompt_feats = np.hstack([features.stats, predictor.pca.project(features.hashed)])
    train = np.flatnonzero(np.isin(data.prompt_index, train_prompts))
    test = np.flatnonzero(np.isin(data.prompt_index, test_prompts))
    ids = predictor.model_ids([data.models[r] for r in test])
    x = predictor.rows(prompt_feats[data.prompt_index[test]], ids)
    decode, quality, upper = predictor.predict_matrix(x, p90=True)

    true_o, true_q = data.output_tokens[test], data.quality[test]
    task_tr = [data.tasks[p] or "all" for p in data.prompt_index[train].tolist()]
    task_te = [data.tasks[p] or "all" for p in data.prompt_index[test].tolist()]
    pair_tr = [f"{t}/{data.models[r]}" for t, r in zip(task_tr, train.tolist(), strict=True)]
    pair_te = [f"{t}/{data.models[r]}" for t, r in zip(task_te, test.tolist(), strict=True)]
    overall = float(data.output_tokens[train].mean())
    base_task = _group_means(task_tr, data.output_tokens[train], task_te, overall)
    base_pair = _group_means(pair_tr, data.output_tokens[train], pair_te, overall)
    within = [spearman(true_q[idx], quality[idx]) for g in sorted(set(pair_te))
              if len(idx := np.flatnonzero(np.asarray(pair_te) == g)) >= 10]
    within = [w for w in within if not math.isnan(w)]
    return Evaluation(
        num_train_rows=len(train), num_test_rows=len(test), num_test_prompts=len(test_prompts),
        decode={"predictor": decode_errors(true_o, decode),
                "per-task mean": decode_errors(true_o, base_task),
                "per-task-and-model mean": decode_errors(true_o, base_pair)},
        quality_spearman=spearman(true_q, quality),
        quality_spearman_within=float(np.mean(within)) if within else math.nan,
        quality_mae=float(np.abs(quality - true_q).mean()),
        p90_coverage=None if upper is None else float((true_o <= upper).mean()),
        true_decode=true_o, pred_decode=decode, true_quality=true_q, pred_quality=quality,
        groups=tuple(task_te))


def train_and_evaluate(data: TrainingData, traits: Mapping[str, tuple[float, int]],
                       holdout: float = 0.2, config: TrainConfig | None = None,
                       progress: bool = False) -> tuple[Predictor, Evaluation]:
    """Split by prompt, fit features and heads on the training prompts, evaluate on the
    held-out ones. The returned predictor is the one evaluated (trained without them)."""
    config = config or TrainConfig()
    train_p, test_p = split_prompts(len(data.prompts), holdout, config.seed)
    features = featurize_prompts(data.prompts, progress)
    predictor = train_predictor(data, features, train_p, traits, config, progress)
    return predictor, evaluate(predictor, data, features, train_p, test_p)
