"""Where an emulated request stops (``olproute.emulator.lengths``), without HTTP: draws
that follow the trace's output-length distribution and are a function of the prompt, the
synthetic workload's truth regenerated exactly as the simulator draws it, truth files,
and their errors."""

from __future__ import annotations

import json
import random
import string
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from olproute.config.loader import load_config
from olproute.emulator.lengths import (
    DEFAULT_TRACE,
    OutputLengths,
    TruthFileError,
    body_prompt_key,
    chat_text,
    output_lengths,
    prompt_key,
    read_truth_file,
    synthetic_truth,
    trace_output_tokens,
)
from olproute.sim.prompts import generate_prompts, write_training_file
from olproute.sim.requests import build_requests
from olproute.sim.workloads import WorkloadError, read_lengths_csv
from tests.conftest import PROFILES

MODEL = "llama-2-7b"
NUM_PROMPTS = 2000


def _random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9)))
             for _ in range(4 * n)]
    prompts = {" ".join(rng.sample(words, rng.randint(1, 30))) for _ in range(n)}
    assert len(prompts) == n  # distinct
    return sorted(prompts)


def _ks(sample: np.ndarray, reference: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance between two empirical distributions."""
    xs = np.union1d(sample, reference)
    f = np.searchsorted(np.sort(sample), xs, side="right") / len(sample)
    g = np.searchsorted(np.sort(reference), xs, side="right") / len(reference)
    return float(np.max(np.abs(f - g)))


def test_draws_follow_the_traces_output_lengths_and_are_set_by_the_prompt() -> None:
    lengths = OutputLengths.from_trace(seed=3)
    trace = read_lengths_csv(DEFAULT_TRACE)[1]
    prompts = _random_prompts(NUM_PROMPTS)
    drawn = np.array([lengths.natural(p, MODEL) for p in prompts])
    # the distribution: KS distance well within the 0.1% critical value for n = 2,000
    # (1.95 / sqrt(n) = 0.044; a discrete distribution only lowers it), and quantiles
    assert _ks(drawn, trace) < 1.95 / np.sqrt(NUM_PROMPTS)
    for q in (0.1, 0.5, 0.9):
        assert abs(np.mean(drawn <= np.quantile(trace, q)) - q) < 0.04, q
    assert set(drawn.tolist()) <= set(trace.tolist())  # values of the trace, nothing else
    # a function of the prompt (and the model and the seed) only: greedy decoding
    again = OutputLengths(trace, seed=3)
    assert [again.natural(p, MODEL) for p in prompts] == drawn.tolist()
    assert [lengths.natural(prompt_key(p), MODEL) for p in prompts[:50]] == drawn[:50].tolist()
    # and it differs between prompts, models and seeds
    assert len(set(drawn.tolist())) > 300
    assert np.mean(drawn[1:] == drawn[:-1]) < 0.05
    other_model = [lengths.natural(p, "qwen3-8b") for p in prompts[:200]]
    other_seed = [OutputLengths(trace, seed=4).natural(p, MODEL) for p in prompts[:200]]
    assert np.mean(np.array(other_model) == drawn[:200]) < 0.1
    assert np.mean(np.array(other_seed) == drawn[:200]) < 0.1


def test_max_tokens_caps_a_length_and_says_so() -> None:
    lengths = OutputLengths.from_trace(seed=0)
    cap = 100
    seen = {"stop": 0, "length": 0}
    for p in _random_prompts(300, seed=1):
        natural = lengths.natural(p, MODEL)
        n, reason = lengths.tokens(p, MODEL, cap)
        assert n == min(natural, cap) >= 1
        # vLLM checks the length cap before the EOS: an EOS on the last allowed token
        # is a length finish too
        assert reason == ("length" if natural >= cap else "stop")
        seen[reason] += 1
        assert lengths.tokens(p, MODEL, 10**9) == (natural, "stop")
        assert lengths.tokens(p, MODEL, 1) == (1, "length")
    assert seen["stop"] > 50 and seen["length"] > 50
    with pytest.raises(ValueError, match="max_tokens"):
        lengths.tokens("x", MODEL, 0)
    exact = OutputLengths([5], exact=True)
    assert exact.tokens("anything", MODEL, 37) == (37, "length")
    assert exact.tokens_of_body({"prompt": "x"}, MODEL, 2) == (2, "length")


def test_the_uniform_is_blake2b_of_prompt_key_and_model_keyed_by_the_seed() -> None:
    """The documented seeding, computed here by hand: a benchmark may rely on it."""
    from hashlib import blake2b

    lengths = OutputLengths([1, 2, 3, 4], seed=12)
    key = prompt_key("hello there")
    assert key == blake2b(b"hello there", digest_size=16, person=b"olproute-text").digest()
    digest = blake2b(key + b"\0" + MODEL.encode(), digest_size=8,
                     key=(12).to_bytes(8, "little")).digest()
    u = (int.from_bytes(digest, "little") >> 11) / 2**53
    assert lengths.uniform(key, MODEL) == u
    assert lengths.natural(key, MODEL) == [1, 2, 3, 4][int(u * 4)]


BODIES = [  # (body, kind, the prompt it is keyed by)
    ({"prompt": "say hi"}, "completion", "say hi"),
    ({"prompt": ["say hi"]}, "completion", "say hi"),
    ({"messages": [{"role": "user", "content": "say hi"}]}, "chat", "say hi"),
    ({"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "say"},
                                                {"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": None}]}, "chat", "be brief\nsay hi\n"),
]


@pytest.mark.parametrize(("body", "kind", "text"), BODIES)
def test_a_body_is_keyed_by_its_prompt_text(body: dict[str, Any], kind: Any,
                                            text: str) -> None:
    assert body_prompt_key(body, kind) == prompt_key(text)
    assert body_prompt_key(body) == prompt_key(text)  # the kind inferred
    if kind == "chat":
        assert chat_text(body["messages"]) == text


def test_token_ids_have_keys_of_their_own() -> None:
    ids = [101, 2023, 7]
    assert body_prompt_key({"prompt": ids}) == prompt_key(ids)
    assert body_prompt_key({"prompt": [ids]}) == prompt_key(ids)
    assert prompt_key(ids) != prompt_key("101,2023,7") != prompt_key("101 2023 7")
    assert prompt_key([2**70, 1]) != prompt_key([1, 2**70])  # beyond 64 bits: still keyed


def _synthetic_config(tmp_path: Path) -> Path:
    data = {"profiles": str(PROFILES),
            "instances": [{"name": "small", "model": "qwen3-0.6b", "gpu": "a100-80gb"},
                          {"name": "big", "model": "qwen3-8b", "gpu": "a100-80gb"}],
            "workload": {"kind": "synthetic", "rate_per_s": 4.0, "num_requests": 60},
            "prediction": {"mode": "oracle"}, "sim": {"seed": 5}}
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_synthetic_prompts_get_the_simulators_truth_per_model(tmp_path: Path) -> None:
    loaded = load_config(_synthetic_config(tmp_path))
    lengths = output_lengths(loaded)  # seed: sim.seed, as the simulation's
    sim = build_requests(loaded)
    assert len(lengths.truth) == len(sim) == 60
    stops = 0
    for r in sim:
        assert r.text is not None and r.decode_tokens_by_model is not None
        for model, truth in r.decode_tokens_by_model.items():
            assert lengths.natural(r.text, model) == truth
            n, reason = lengths.tokens(r.text, model, 2048)
            assert n == truth and reason == ("stop" if truth < 2048 else "length")
            stops += reason == "stop"
        # the two models' lengths differ for most prompts: each model has its own truth
    assert stops > 100
    assert sum(r.decode_tokens_by_model["qwen3-0.6b"] != r.decode_tokens_by_model["qwen3-8b"]
               for r in sim if r.decode_tokens_by_model) > 40
    # another seed: other prompts, as the simulator would draw them on that seed
    other = synthetic_truth(loaded, seed=6)
    assert other.keys().isdisjoint(lengths.truth.keys())
    assert other == synthetic_truth(loaded, seed=6)
    # a prompt not generated falls back to the trace; a model not in its truth too
    assert lengths.natural("not a generated prompt", "qwen3-8b") in set(
        trace_output_tokens())
    key = prompt_key(sim[0].text or "")
    assert lengths.natural(key, "llama-2-7b") == OutputLengths.from_trace(
        seed=5).natural(key, "llama-2-7b")
    # a workload that is not synthetic has no truth
    assert synthetic_truth(load_config()) == {}


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_truth_file_as_train_predictors_writes_it(tmp_path: Path, suffix: str) -> None:
    prompts = generate_prompts(40, ["qwen3-8b", "llama-2-7b"], np.random.default_rng(2))
    path = tmp_path / f"truth{suffix}"
    assert write_training_file(path, prompts) == 80
    index = read_truth_file(path)
    assert index == {prompt_key(p.text): dict(p.decode_tokens) for p in prompts}
    lengths = output_lengths(truth_path=path, seed=1)
    for p in prompts:  # texts with newlines and quotes survive the CSV round trip
        for model, truth in p.decode_tokens.items():
            assert lengths.tokens(p.text, model, 10_000) == (truth, "stop")
            assert lengths.tokens_of_body(
                {"messages": [{"role": "user", "content": p.text}]}, model, 10_000,
                "chat") == (truth, "stop")
    # a file's row wins over the synthetic workload's
    override = tmp_path / "override.csv"
    override.write_text('prompt,model,output_tokens\n"only this",qwen3-8b,7\n')
    both = output_lengths(truth_path=override)
    assert both.natural("only this", "qwen3-8b") == 7


BAD = [  # (file name, content, the message's start after the path)
    ("t.csv", "", "line 1: empty file"),
    ("t.csv", "prompt,model\nhi,m\n", "line 1: header lacks column(s) output_tokens"),
    ("t.csv", "prompt,model,output_tokens\nhi,m,3\nho,m,many\n",
     "line 3: output_tokens: expected an integer >= 1, got 'many'"),
    ("t.csv", "prompt,model,output_tokens\nhi,m,0\n", "line 2: output_tokens"),
    ("t.csv", "prompt,model,output_tokens\nhi,m,2.5\n", "line 2: output_tokens"),
    ("t.csv", "prompt,model,output_tokens\n,m,3\n", "line 2: prompt: expected non-empty"),
    ("t.csv", "prompt,model,output_tokens\nhi, ,3\n", "line 2: model: expected a model"),
    ("t.csv", "prompt,model,output_tokens\nhi,m\n", "line 2: expected 3 fields, got 2"),
    ("t.csv", 'prompt,model,output_tokens\n"a\nb",m,3\nhi,m,3\n"a\nb",m,4\n',
     "line 5: output_tokens: 4 for a prompt and model given 3 on line 2"),
    ("t.csv", "prompt,model,output_tokens\n", "no truth rows"),
    ("t.jsonl", '{"prompt": "a", "model": "m", "output_tokens": 3}\n{"prompt": "b", "mod',
     "line 2: column 17: invalid JSON: Unterminated string"),
    ("t.jsonl", '[1, 2]\n', "line 1: expected a JSON object"),
    ("t.jsonl", '\n{"prompt": "a", "model": "m", "output_tokens": true}\n',
     "line 2: output_tokens: expected an integer >= 1, got True"),
    ("t.jsonl", '{"prompt": "a", "model": 3, "output_tokens": 1}\n', "line 1: model"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD)
def test_a_bad_truth_file_names_file_line_and_column(tmp_path: Path, name: str, content: str,
                                                     message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TruthFileError) as info:
        read_truth_file(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_a_truth_file_that_is_not_there_or_not_text(tmp_path: Path) -> None:
    with pytest.raises(TruthFileError, match="no such file"):
        read_truth_file(tmp_path / "missing.csv")
    path = tmp_path / "binary.csv"
    path.write_bytes(b"prompt,model,output_tokens\n\xff\xfe,m,3\n")
    with pytest.raises(TruthFileError, match=f"{path}: not UTF-8"):
        read_truth_file(path)


def test_lengths_need_a_usable_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        OutputLengths([])
    with pytest.raises(ValueError, match=">= 1"):
        OutputLengths([0, 3])
    with pytest.raises(ValueError, match="seed"):
        OutputLengths([1], seed=-1)
    with pytest.raises(WorkloadError, match=r"missing\.csv: cannot read"):
        OutputLengths.from_trace(tmp_path / "missing.csv")
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("num_prefill_tokens,num_decode_tokens\n10,7\n")
    assert OutputLengths.from_trace(tiny).natural("anything", MODEL) == 7
    assert json.dumps(OutputLengths.from_trace(tiny).trace_tokens) == "[7]"


def test_a_prompt_drawn_twice_keeps_its_first_lengths(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A model answers a prompt one way: when the generator drew one text twice with
    different hidden noise, the text's lengths are the first draw's."""
    import olproute.emulator.lengths as lengths_module

    loaded = load_config(_synthetic_config(tmp_path))
    sim = build_requests(loaded)[:3]
    twice = [sim[0], sim[1], replace(sim[2], text=sim[0].text, decode_tokens_by_model={
        m: v + 7 for m, v in (sim[0].decode_tokens_by_model or {}).items()})]
    monkeypatch.setattr(lengths_module, "synthetic_prompts", lambda loaded, seed: twice)
    index = synthetic_truth(loaded)
    assert len(index) == 2
    assert index[prompt_key(sim[0].text or "")] == dict(sim[0].decode_tokens_by_model or {})
