"""Tests for olproute.config.loader: loading, derived KV capacity, error messages, workloads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from olproute.config.loader import (
    DEFAULT_CONFIG,
    ConfigError,
    InstanceConfig,
    kv_capacity_tokens,
    load_config,
    load_profiles,
    load_workload,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES = REPO_ROOT / "configs" / "profiles.yaml"
GIB = 1024**3

POISSON = {"kind": "poisson", "rate_per_s": 1.0, "num_requests": 5,
           "prompt_tokens": 10, "decode_tokens": 10}
LLAMA = {"name": "a", "model": "llama-2-7b", "gpu": "a100-80gb"}
BASELINES = ("least_outstanding", "power_of_two", "random", "round_robin")


def _config(**sections: Any) -> dict[str, Any]:
    """A valid config mapping (one Llama-2-7B instance, fixed-length Poisson workload)."""
    data: dict[str, Any] = {"profiles": str(PROFILES), "instances": [dict(LLAMA)],
                            "workload": dict(POISSON)}
    data.update(sections)
    return data


def _write(path: Path, content: Any) -> Path:
    """Write raw text, or a mapping/list dumped as YAML."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def _load_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


# -- the default config and derived KV capacity ----------------------------------------
def test_default_config_expands_replicas() -> None:
    loaded = load_config(DEFAULT_CONFIG)
    assert [s.name for s in loaded.specs] == [f"llama7b-a100-{i}" for i in range(4)]
    for spec in loaded.specs:
        assert (spec.model, spec.gpu, spec.tensor_parallel) == ("llama-2-7b", "a100-80gb", 1)
        assert (spec.max_num_seqs, spec.max_num_batched_tokens, spec.block_size) == (
            256, 2048, 16)
    assert loaded.path == DEFAULT_CONFIG
    assert loaded.base_dir == DEFAULT_CONFIG.parent


def test_default_config_kv_capacity_matches_hand_computation() -> None:
    # Llama-2-7B on one A100-80GB: 90% of 80 GiB, minus 6.74e9 bf16 weights and a 1 GiB
    # activation reserve, over 2 (K,V) x 32 layers x 32 kv heads x 128 dims x 2 bytes.
    tokens = int((80 * GIB * 0.9 - 6.74e9 * 2 - 1 * GIB) // (2 * 32 * 32 * 128 * 2))
    assert tokens == 119_696
    loaded = load_config(DEFAULT_CONFIG)
    for spec in loaded.specs:
        assert spec.num_kv_blocks == tokens // 16 == 7481
        assert spec.kv_capacity_tokens == spec.num_kv_blocks * 16
    inst = loaded.config.instances[0]
    model = loaded.profiles.models["llama-2-7b"]
    gpu = loaded.profiles.gpus["a100-80gb"]
    assert kv_capacity_tokens(inst, model, gpu) == tokens


def test_default_config_workload_resolves_to_the_trace() -> None:
    loaded = load_config(DEFAULT_CONFIG)
    assert loaded.config.workload.path is not None
    assert loaded.resolve(loaded.config.workload.path).is_file()


def test_tensor_parallel_two_splits_weights_and_kv(tmp_path: Path) -> None:
    inst = {"name": "q32", "model": "qwen3-32b", "gpu": "h100", "tensor_parallel": 2}
    path = _write(tmp_path / "tp2.yaml", _config(instances=[inst]))
    (spec,) = load_config(path).specs
    # Per GPU: 90% of 80 GiB minus half the 32.8e9 bf16 weights minus 1 GiB; each GPU
    # holds half of every token's KV (2 x 64 layers x 8 kv heads x 128 dims x 2 bytes).
    free_per_gpu = 80 * GIB * 0.9 - 32.8e9 * 2 / 2 - 1 * GIB
    tokens = int(free_per_gpu // (2 * 64 * 8 * 128 * 2 / 2))
    assert spec.tensor_parallel == 2
    assert spec.num_kv_blocks == tokens // 16
    # The same model on one H100 keeps all weights there: far less than half the room.
    single = _write(tmp_path / "tp1.yaml",
                    _config(instances=[{**inst, "tensor_parallel": 1}]))
    (spec1,) = load_config(single).specs
    assert 0 < 2 * spec1.num_kv_blocks < spec.num_kv_blocks


@pytest.mark.parametrize(("tokens", "block_size", "blocks"), [
    (60_000, 16, 3750),
    (60_000, 32, 1875),
    (100, 16, 6),
    (16, 16, 1),
])
def test_explicit_kv_capacity_overrides_derivation(
        tmp_path: Path, tokens: int, block_size: int, blocks: int) -> None:
    inst = {**LLAMA, "kv_capacity_tokens": tokens, "block_size": block_size}
    (spec,) = load_config(_write(tmp_path / "c.yaml", _config(instances=[inst]))).specs
    assert spec.num_kv_blocks == blocks
    assert spec.block_size == block_size


def test_replicas_share_settings_and_single_instances_keep_their_name(tmp_path: Path) -> None:
    instances = [{**LLAMA, "name": "x", "replicas": 3, "max_num_seqs": 8},
                 {**LLAMA, "name": "y", "max_num_batched_tokens": 512}]
    specs = load_config(_write(tmp_path / "c.yaml", _config(instances=instances))).specs
    assert [s.name for s in specs] == ["x-0", "x-1", "x-2", "y"]
    assert [s.max_num_seqs for s in specs] == [8, 8, 8, 256]
    assert [s.max_num_batched_tokens for s in specs] == [2048, 2048, 2048, 512]


# -- the profiles the project promises ---------------------------------------------------
PROMISED = [
    ("llama-2-7b", "a100-80gb", 1),
    ("qwen3-0.6b", "h100", 1),
    ("qwen3-8b", "h100", 1),
    ("qwen3-32b", "h100", 2),
    ("qwen2.5-3b", "a40", 1),
    ("qwen2-7b", "a30", 1),
]


@pytest.mark.parametrize(("model", "gpu", "tp"), PROMISED)
def test_promised_pairs_are_profiled_and_fit_a_full_context(
        tmp_path: Path, model: str, gpu: str, tp: int) -> None:
    profiles = load_profiles(PROFILES)
    assert model in profiles.models
    assert gpu in profiles.gpus
    inst = {"name": "x", "model": model, "gpu": gpu, "tensor_parallel": tp}
    (spec,) = load_config(_write(tmp_path / "c.yaml", _config(instances=[inst]))).specs
    expected = kv_capacity_tokens(InstanceConfig.model_validate(inst),
                                  profiles.models[model], profiles.gpus[gpu])
    assert spec.num_kv_blocks == expected // 16 > 0
    # vLLM refuses to start unless one max-length sequence fits in the KV cache.
    assert spec.kv_capacity_tokens >= profiles.models[model].max_context_tokens


# -- errors -------------------------------------------------------------------------------
def _instances(n: int, **last: Any) -> list[dict[str, Any]]:
    out = [{**LLAMA, "name": f"i{i}"} for i in range(n)]
    out[-1].update(last)
    return out


# (id, config mapping or raw text, exact problem lines after "<file>: ")
EXACT_ERRORS: list[tuple[str, Any, list[str]]] = [
    ("bound", _config(instances=_instances(3, max_num_seqs=0)),
     ["instances[2].max_num_seqs: must be >= 1"]),
    ("unknown-key", _config(instances=[{**LLAMA, "max_num_seq": 3}]),
     ["instances[0].max_num_seq: unknown key"]),
    ("missing-key", _config(instances=[{"name": "a", "gpu": "a100-80gb"}]),
     ["instances[0].model: required key is missing"]),
    ("no-instances", _config(instances=[]), ["instances: must have at least 1 item(s)"]),
    ("empty-name", _config(instances=[{**LLAMA, "name": ""}]),
     ["instances[0].name: must not be empty"]),
    ("trace-without-path", _config(workload={"kind": "trace"}),
     ["workload.path: required when kind is 'trace'"]),
    ("poisson-without-rate", _config(workload={k: v for k, v in POISSON.items()
                                               if k != "rate_per_s"}),
     ["workload.rate_per_s: required when kind is 'poisson'"]),
    ("poisson-without-count", _config(workload={k: v for k, v in POISSON.items()
                                                if k != "num_requests"}),
     ["workload.num_requests: give num_requests or duration_s"]),
    ("duplicate-names", _config(instances=[dict(LLAMA), dict(LLAMA)]),
     ["instances[1].name: duplicate instance name 'a'"]),
    ("replica-name-clash", _config(instances=[{**LLAMA, "replicas": 2},
                                              {**LLAMA, "name": "a-1"}]),
     ["instances[1].name: duplicate instance name 'a-1'"]),
    ("noise", _config(prediction={"noise": 1.5}), ["prediction.noise: must be < 1.0"]),
    ("slo-mode", _config(slo={"mode": "fast"}), ["slo.mode: must be one of 'bear' or 'classes'"]),
    ("negative-seed", _config(sim={"seed": -1}), ["sim.seed: must be >= 0"]),
    ("certify-period", _config(prices={"certify_period_s": 0}),
     ["prices.certify_period_s: must be > 0.0"]),
    ("certify-bounds", _config(prices={"certify_window_s": -1.0, "certify_max_requests": 0,
                                       "certify_time_limit_s": float("inf"),
                                       "certify_gap_tol": -0.1}),
     ["prices.certify_window_s: must be > 0.0", "prices.certify_max_requests: must be >= 1",
      "prices.certify_time_limit_s: must be a finite number",
      "prices.certify_gap_tol: must be >= 0.0"]),
    ("no-kv-room", _config(instances=[{**LLAMA, "model": "qwen3-32b", "gpu": "a30"}]),
     ["instances[0]: no memory left for the KV cache on a30 x1 with qwen3-32b"]),
    ("policy-params", _config(router={"policy_params": {"nosuch": {}}}),
     ["router.policy_params.nosuch: unknown policy"]),
    ("policy-param-value", _config(router={"policy_params": {"bear": {"form": "soft"}}}),
     ["router.policy_params.bear.form: must be one of 'constrained' or 'lagrangian'"]),
    ("policy-param-key", _config(router={"policy_params": {"score": {"w_cost": 1.0,
                                                                     "w_costs": 2.0}}}),
     ["router.policy_params.score.w_costs: unknown key"]),
    ("policy-param-type", _config(router={"policy_params": {"bid_price": {
        "decode_slack": True, "kv_headroom": -0.1}}}),
     ["router.policy_params.bid_price.decode_slack: input should be a valid number, got True",
      "router.policy_params.bid_price.kv_headroom: must be >= 0.0"]),
    ("two-problems", _config(instances=_instances(2, max_num_seqs=0),
                             prediction={"noise": 1.5}),
     ["instances[1].max_num_seqs: must be >= 1", "prediction.noise: must be < 1.0"]),
    ("top-level-list", "- a\n- b\n", ["top level must be a mapping of keys"]),
    ("empty-file", "", ["top level must be a mapping of keys"]),
]


@pytest.mark.parametrize(("content", "lines"), [c[1:] for c in EXACT_ERRORS],
                         ids=[c[0] for c in EXACT_ERRORS])
def test_config_error_names_file_and_key(tmp_path: Path, content: Any, lines: list[str]) -> None:
    path = _write(tmp_path / "bad.yaml", content)
    err = _load_error(path)
    assert str(err).splitlines() == [f"{path}: {line}" for line in lines]
    assert err.path == str(path)
    assert [f"{k}: {m}" if k else m for k, m in err.problems] == lines


# (id, config mapping or raw text, key path, fragments the message must contain)
FRAGMENT_ERRORS: list[tuple[str, Any, str, list[str]]] = [
    ("wrong-type", _config(sim={"seed": "abc"}), "sim.seed", ["integer", "'abc'"]),
    ("unknown-model", _config(instances=[{**LLAMA, "model": "gpt-5"}]), "instances[0].model",
     ["unknown model 'gpt-5'", "llama-2-7b", "qwen3-32b"]),
    ("unknown-gpu", _config(instances=[{**LLAMA, "gpu": "b200"}]), "instances[0].gpu",
     ["unknown gpu 'b200'", "a100-80gb", "h100"]),
    ("unknown-policy", _config(router={"policy": "magic"}), "router.policy",
     ["unknown policy 'magic'", *BASELINES, "cache_aware", "prefix_load"]),
]


@pytest.mark.parametrize(("content", "key", "fragments"), [c[1:] for c in FRAGMENT_ERRORS],
                         ids=[c[0] for c in FRAGMENT_ERRORS])
def test_config_error_message_content(
        tmp_path: Path, content: Any, key: str, fragments: list[str]) -> None:
    path = _write(tmp_path / "bad.yaml", content)
    (line,) = str(_load_error(path)).splitlines()
    assert line.startswith(f"{path}: {key}: ")
    for fragment in fragments:
        assert fragment in line


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", f"profiles: {PROFILES}\ninstances: [\n  - {{name: a\n")
    assert str(_load_error(path)).startswith(f"{path}: line 3: invalid YAML")


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert str(_load_error(path)).startswith(f"{path}: cannot read: ")


def test_missing_profiles_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", _config(profiles="missing_profiles.yaml"))
    assert str(_load_error(path)) == (
        f"{path}: profiles: file not found: {tmp_path / 'missing_profiles.yaml'}")


def test_relative_profiles_path_is_relative_to_the_config(tmp_path: Path) -> None:
    _write(tmp_path / "p" / "profs.yaml", PROFILES.read_text())
    path = _write(tmp_path / "c" / "c.yaml", _config(profiles="../p/profs.yaml"))
    assert load_config(path).profiles == load_profiles(PROFILES)


def test_invalid_profiles_file_names_that_file(tmp_path: Path) -> None:
    profiles = yaml.safe_load(PROFILES.read_text())
    profiles["models"]["llama-2-7b"]["num_layers"] = 0
    prof_path = _write(tmp_path / "profs.yaml", profiles)
    path = _write(tmp_path / "c.yaml", _config(profiles=str(prof_path)))
    assert str(_load_error(path)) == f"{prof_path}: models.llama-2-7b.num_layers: must be >= 1"


# -- separate workload files --------------------------------------------------------------
@pytest.mark.parametrize("wrapped", [True, False], ids=["workload-key", "bare"])
def test_load_workload_resolves_paths_against_its_file(tmp_path: Path, wrapped: bool) -> None:
    section = {"kind": "trace", "path": "../traces/t.csv", "lengths_path": "l.csv",
               "time_scale": 0.5}
    path = _write(tmp_path / "wl" / "w.yaml", {"workload": section} if wrapped else section)
    wl = load_workload(path)
    assert wl.kind == "trace"
    assert wl.time_scale == 0.5
    assert wl.path == str((tmp_path / "traces" / "t.csv").resolve())
    assert wl.lengths_path == str((tmp_path / "wl" / "l.csv").resolve())


def test_load_workload_keeps_absolute_paths(tmp_path: Path) -> None:
    trace = (tmp_path / "abs" / "t.csv").resolve()
    path = _write(tmp_path / "w.yaml", {"kind": "trace", "path": str(trace)})
    assert load_workload(path).path == str(trace)


WORKLOAD_ERRORS: list[tuple[str, Any, list[str]]] = [
    ("bound", {"workload": {**POISSON, "rate_per_s": -1}}, ["workload.rate_per_s: must be > 0.0"]),
    ("unknown-key", {"workload": {**POISSON, "foo": 2}}, ["workload.foo: unknown key"]),
    ("bare-unknown-key", {**POISSON, "rate": 2}, ["workload.rate: unknown key"]),
    ("kind", {"kind": "burst"},
     ["workload.kind: must be one of 'poisson', 'mmpp2', 'trace', 'synthetic' or "
      "'mooncake'"]),
    ("mooncake-block-tokens", {"kind": "mooncake", "path": "m.jsonl", "block_tokens": 24},
     ["workload.block_tokens: must divide 512, the trace's block of tokens (got 24)"]),
    ("prefix-hashes-without-text", {"kind": "trace", "path": "t.csv", "prefix_hashes": True},
     ["workload.prefix_hashes: only kind 'synthetic' has prompt texts to hash, not 'trace'"]),
    ("prefix-hashes-of-mooncake", {"kind": "mooncake", "path": "m.jsonl",
                                   "prefix_hashes": True},
     ["workload.prefix_hashes: only kind 'synthetic' has prompt texts to hash, not "
      "'mooncake' (its rows carry their own hashes)"]),
    ("trace-without-path", {"workload": {"kind": "trace"}},
     ["workload.path: required when kind is 'trace'"]),
    ("poisson-without-lengths", {"kind": "poisson", "rate_per_s": 1, "duration_s": 10},
     ["workload.lengths_path: give lengths_path or both prompt_tokens and decode_tokens"]),
    ("not-a-mapping", {"workload": 3}, ["workload: must be a mapping of keys"]),
    ("list", [1, 2], ["workload: must be a mapping of keys"]),
]


@pytest.mark.parametrize(("content", "lines"), [c[1:] for c in WORKLOAD_ERRORS],
                         ids=[c[0] for c in WORKLOAD_ERRORS])
def test_load_workload_errors(tmp_path: Path, content: Any, lines: list[str]) -> None:
    path = _write(tmp_path / "w.yaml", content)
    with pytest.raises(ConfigError) as info:
        load_workload(path)
    assert str(info.value).splitlines() == [f"{path}: {line}" for line in lines]


# -- immutability ---------------------------------------------------------------------------
@pytest.mark.parametrize(("section", "field", "value"), [
    ("config", "profiles", "other.yaml"),
    ("sim", "seed", 1),
    ("workload", "time_scale", 2.0),
    ("router", "policy", "random"),
    ("instance", "max_num_seqs", 1),
    ("gpu", "memory_gib", 1.0),
])
def test_config_objects_are_frozen(section: str, field: str, value: Any) -> None:
    loaded = load_config(DEFAULT_CONFIG)
    objects = {"config": loaded.config, "sim": loaded.config.sim,
               "workload": loaded.config.workload, "router": loaded.config.router,
               "instance": loaded.config.instances[0],
               "gpu": loaded.profiles.gpus["a100-80gb"]}
    obj = objects[section]
    before = getattr(obj, field)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        setattr(obj, field, value)
    assert getattr(obj, field) == before


def test_instance_specs_are_frozen() -> None:
    spec = load_config(DEFAULT_CONFIG).specs[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_kv_blocks = 1  # type: ignore[misc]


def test_with_updates_returns_a_copy() -> None:
    loaded = load_config(DEFAULT_CONFIG)
    seed = loaded.config.sim.seed
    other = loaded.with_updates(sim=loaded.config.sim.model_copy(update={"seed": seed + 7}))
    assert other.config.sim.seed == seed + 7
    assert loaded.config.sim.seed == seed
    assert other.specs == loaded.specs


def test_with_specs_models_other_instances_and_keeps_the_rest() -> None:
    loaded = load_config(DEFAULT_CONFIG)
    said = dataclasses.replace(loaded.specs[1], block_size=128, num_kv_blocks=700)
    other = loaded.with_specs([loaded.specs[0], said, *loaded.specs[2:]])
    assert other.specs[1] == said and other.specs[0] == loaded.specs[0]
    assert loaded.specs[1].block_size == 16   # the original is untouched
    assert (other.config, other.path, other.weights) == (
        loaded.config, loaded.path, loaded.weights)
    with pytest.raises(ValueError, match="same instances"):
        loaded.with_specs(loaded.specs[:2])
    renamed = dataclasses.replace(said, name="elsewhere")
    with pytest.raises(ValueError, match="same instances"):
        loaded.with_specs([loaded.specs[0], renamed, *loaded.specs[2:]])
