"""The synthetic prompt generator: determinism, calibration to the BEAR table, lengths that
match the task families, truth that depends on the prompt, and its outputs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from olproute.predict import count_tokens, read_training_file
from olproute.sim import prompts as sp
from olproute.sim.prompts import (
    MODELS,
    TASKS,
    SyntheticPrompt,
    calibrated_mu,
    generate_prompts,
    synthetic_requests,
    write_training_file,
)

QWEN = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
# BEAR paper App. A.1 Table 2, in TASKS order (Alpaca, HotpotQA, GovReport, WritingPrompts)
BEAR_TABLE = {"qwen3-0.6b": (0.5349, 0.4098, 0.2902, 0.1773),
              "qwen3-8b": (0.8267, 0.8828, 0.8662, 0.5747),
              "qwen3-32b": (0.8885, 0.9269, 0.9593, 0.8069)}


@pytest.fixture(scope="module")
def sample() -> list[SyntheticPrompt]:
    return generate_prompts(2400, QWEN, np.random.default_rng(7))


def _by_task(prompts: list[SyntheticPrompt], task: str) -> list[SyntheticPrompt]:
    return [p for p in prompts if p.task == task]


def test_same_seed_same_prompts_and_truth() -> None:
    a = generate_prompts(40, QWEN, np.random.default_rng(3))
    b = generate_prompts(40, QWEN, np.random.default_rng(3))
    c = generate_prompts(40, QWEN, np.random.default_rng(4))
    assert a == b
    assert [p.text for p in a] != [p.text for p in c]


def test_prompt_tokens_come_from_the_documented_tokenizer(sample: list[SyntheticPrompt]) -> None:
    assert all(p.prompt_tokens == count_tokens(p.text) for p in sample[:200])
    assert {p.task for p in sample} == set(TASKS)


def test_table_values_are_the_papers() -> None:
    for model, row in BEAR_TABLE.items():
        assert MODELS[model].quality == row


@pytest.mark.parametrize("target", [0.1773, 0.5, 0.9593])
@pytest.mark.parametrize("slope", [0.7, 1.0])
def test_calibrated_offset_gives_the_target_mean(target: float, slope: float) -> None:
    # Monte Carlo of the generator's quality model at the solved offset
    rng = np.random.default_rng(0)
    n = 100_000
    tier = rng.choice(sp._TIER_LEVELS, size=n)
    complexity = rng.choice(sp._COMPLEXITY_LEVELS, size=n)
    d = sp._W_TIER * tier + sp._W_COMPLEXITY * complexity + sp._W_HIDDEN * rng.normal(size=n)
    z = calibrated_mu(target, slope) - slope * d + sp._B * rng.normal(size=n)
    q = [0.5 * math.erfc(-v / math.sqrt(2.0)) for v in z.tolist()]
    assert float(np.mean(q)) == pytest.approx(target, abs=0.005)


def test_mean_quality_matches_the_bear_table(sample: list[SyntheticPrompt]) -> None:
    for k, task in enumerate(TASKS):
        group = _by_task(sample, task)
        assert len(group) > 450
        for model in QWEN:
            mean = float(np.mean([p.quality[model] for p in group]))
            assert mean == pytest.approx(BEAR_TABLE[model][k], abs=0.04), (task, model)


# task: (prompt tokens median range, decode tokens median range for qwen3-8b)
LENGTHS = {
    "instruction": ((8, 100), (40, 300)),
    "doc_qa": ((600, 2000), (15, 150)),
    "summarization": ((1000, 6000), (200, 900)),
    "creative": ((10, 80), (300, 1200)),
}


@pytest.mark.parametrize("task", TASKS)
def test_lengths_match_the_family(sample: list[SyntheticPrompt], task: str) -> None:
    group = _by_task(sample, task)
    prompt = float(np.median([p.prompt_tokens for p in group]))
    decode = float(np.median([p.decode_tokens["qwen3-8b"] for p in group]))
    (p_lo, p_hi), (d_lo, d_hi) = LENGTHS[task]
    assert p_lo <= prompt <= p_hi
    assert d_lo <= decode <= d_hi
    everything = [o for p in group for o in p.decode_tokens.values()]
    assert min(everything) >= 1 and max(everything) <= 2048
    assert all(0.0 <= q <= 1.0 for p in group for q in p.quality.values())


def test_requested_length_moves_the_truth() -> None:
    prompts = generate_prompts(1500, ["qwen3-32b"], np.random.default_rng(11),
                               task_weights=(0, 0, 1, 0))
    short = [p.decode_tokens["qwen3-32b"] for p in prompts if "in about 150 words" in p.text]
    long = [p.decode_tokens["qwen3-32b"] for p in prompts if "in about 500 words" in p.text]
    assert len(short) > 10 and len(long) > 10
    assert np.median(long) > 2.5 * np.median(short)


def test_a_prompt_beyond_the_context_is_truncated_and_loses_quality() -> None:
    prompts = generate_prompts(400, ["llama-2-7b", "qwen2-7b"], np.random.default_rng(5),
                               task_weights=(0, 0, 1, 0))
    over = [p for p in prompts if p.prompt_tokens + 256 > 4096]
    fits = [p for p in prompts if p.prompt_tokens + 256 <= 4096]
    assert over and fits
    assert all(p.decode_tokens["llama-2-7b"] <= 512 for p in over)
    q_over = np.mean([p.quality["llama-2-7b"] / max(p.quality["qwen2-7b"], 1e-3) for p in over])
    q_fits = np.mean([p.quality["llama-2-7b"] / max(p.quality["qwen2-7b"], 1e-3) for p in fits])
    assert q_over < 0.6 * q_fits


def test_bigger_models_score_higher_on_every_task(sample: list[SyntheticPrompt]) -> None:
    for task in TASKS:
        group = _by_task(sample, task)
        means = [np.mean([p.quality[m] for p in group]) for m in QWEN]
        assert means == sorted(means), task


def test_unknown_model_and_bad_weights_are_rejected() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="gpt-9"):
        generate_prompts(3, ["qwen3-8b", "gpt-9"], rng)
    with pytest.raises(ValueError, match="task_weights"):
        generate_prompts(3, QWEN, rng, task_weights=(1, 0, 0))


def test_synthetic_requests_fill_every_field() -> None:
    arrivals = np.cumsum(np.full(30, 0.25))
    reqs = synthetic_requests(30, arrivals, ["qwen3-8b", "qwen3-0.6b", "qwen3-8b"],
                              np.random.default_rng(2))
    assert [r.request_id for r in reqs] == list(range(30))
    for r, t in zip(reqs, arrivals, strict=True):
        assert r.arrival_s == t
        assert r.text is not None and r.task in TASKS
        assert r.prompt_tokens == count_tokens(r.text)
        assert r.decode_tokens_by_model is not None and r.quality_by_model is not None
        assert set(r.decode_tokens_by_model) == {"qwen3-8b", "qwen3-0.6b"}
        assert r.decode_tokens == r.predicted_decode_tokens == r.decode_tokens_by_model["qwen3-8b"]
        assert r.true_decode_tokens("qwen3-0.6b") == r.decode_tokens_by_model["qwen3-0.6b"]
        assert 0.15 <= r.ttft_target_s <= 1.12
    with pytest.raises(ValueError, match="arrival_s"):
        synthetic_requests(5, arrivals, ["qwen3-8b"], np.random.default_rng(2))


@pytest.mark.parametrize("name", ["rows.csv", "rows.jsonl"])
def test_training_file_round_trips(tmp_path: Path, name: str) -> None:
    prompts = generate_prompts(12, QWEN, np.random.default_rng(9))
    path = tmp_path / name
    assert write_training_file(path, prompts) == 36
    data = read_training_file(path)
    assert data.prompts == tuple(p.text for p in prompts)
    assert data.tasks == tuple(p.task for p in prompts)
    assert len(data) == 36
    for row in range(36):
        p = prompts[int(data.prompt_index[row])]
        model = data.models[row]
        assert data.output_tokens[row] == p.decode_tokens[model]
        assert data.quality[row] == p.quality[model]
