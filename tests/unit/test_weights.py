"""Weight profiles: the shipped ones load and document every key; merging; errors that
name the profile file and the key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from olproute.config.loader import DEFAULT_CONFIG, ConfigError, RewardConfig, load_config
from olproute.config.profiles import (
    SECTIONS,
    WEIGHTS_DIR,
    apply_profiles,
    profile_names,
    profile_yaml,
    read_profile,
    resolve_profile,
)
from olproute.config.schema import key_docs

SHIPPED = ("balanced", "goodput", "mean_latency", "quality_first", "tail_latency",
           "throughput")


def _write(path: Path, content: Any) -> Path:
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def test_the_five_profiles_are_shipped() -> None:
    assert tuple(profile_names()) == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_documents_every_key(name: str) -> None:
    path = WEIGHTS_DIR / f"{name}.yaml"
    profile = read_profile(path)
    assert set(profile) <= set(SECTIONS) and "reward" in profile
    # every reward key is set, so the profile does not depend on the config's reward
    assert set(profile["reward"]) == set(RewardConfig.model_fields)
    for line in path.read_text().splitlines():
        if re.match(r"^\s+\w+:", line):  # a key inside a section
            key, _, comment = line.partition("#")
            assert comment.strip(), f"{path.name}: undocumented key: {key.strip()}"
    loaded = load_config(DEFAULT_CONFIG, [path])
    assert loaded.weights == (path.resolve(),)
    for section, body in profile.items():
        merged = getattr(loaded.config, section).model_dump()
        assert {k: merged[k] for k in body} == body


def test_profiles_differ_where_their_names_say() -> None:
    r = {n: read_profile(WEIGHTS_DIR / f"{n}.yaml")["reward"] for n in SHIPPED}
    assert r["tail_latency"]["zeta2"] == max(p["zeta2"] for p in r.values())
    assert r["throughput"]["alpha"] == max(p["alpha"] for p in r.values())
    assert r["throughput"]["gamma"] == r["throughput"]["beta"] == 0.0
    assert r["quality_first"]["omega"] == max(p["omega"] for p in r.values()) > 0
    assert r["mean_latency"]["beta"] == max(p["beta"] for p in r.values()) > 0
    assert r["mean_latency"]["zeta1"] == max(p["zeta1"] for p in r.values()) > 0


def test_merge_is_key_by_key_and_later_files_win(tmp_path: Path) -> None:
    base = load_config(DEFAULT_CONFIG).config
    a = _write(tmp_path / "a.yaml", {"reward": {"zeta2": 4.0, "gamma": 0.5},
                                     "admission": {"mode": "shed"}})
    b = _write(tmp_path / "b.yaml", {"reward": {"zeta2": 7.0}})
    merged = apply_profiles(base, [a, b])
    assert merged.reward.zeta2 == 7.0 and merged.reward.gamma == 0.5
    assert merged.reward.beta == base.reward.beta  # untouched keys keep the config's
    assert merged.admission.mode == "shed" and merged.prices == base.prices
    assert merged.instances == base.instances


def test_weights_survive_with_updates(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", {"reward": {"zeta2": 4.0}})
    loaded = load_config(DEFAULT_CONFIG, [a])
    again = loaded.with_updates(sim=loaded.config.sim.model_copy(update={"seed": 3}))
    assert again.weights == loaded.weights and again.config.reward.zeta2 == 4.0


@pytest.mark.parametrize(("content", "key", "message"), [
    ({"reward": {"zeta2": -1}}, "reward.zeta2", "must be >= 0"),
    ({"reward": {"zeta9": 1}}, "reward.zeta9", "unknown key"),
    ({"reward": {"delta": "fast"}}, "reward.delta", "valid number"),
    ({"admission": {"mode": "drop"}}, "admission.mode", "must be one of"),
    ({"prices": {"step_size": 0}}, "prices.step_size", "must be > 0"),
    ({"router": {"policy": "x"}}, "router", "unknown section"),
    ({"reward": [1, 2]}, "reward", "must be a mapping"),
    ("- just\n- a list\n", "", "top level must be a mapping"),
    ("reward: {zeta2: [\n", "", "invalid YAML"),
])
def test_bad_profiles_name_the_file_and_key(tmp_path: Path, content: Any, key: str,
                                            message: str) -> None:
    path = _write(tmp_path / "bad.yaml", content)
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_CONFIG, [path])
    text = str(info.value)
    assert text.startswith(str(path)), text
    assert (f": {key}: " in text) if key else True, text
    assert message in text, text


def test_missing_profile_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(DEFAULT_CONFIG, [tmp_path / "nope.yaml"])
    with pytest.raises(ConfigError, match="not a shipped weight profile"):
        resolve_profile("no_such_profile")
    assert resolve_profile("tail_latency") == WEIGHTS_DIR / "tail_latency.yaml"


def test_profile_yaml_round_trips_with_comments(tmp_path: Path) -> None:
    sections = {"reward": RewardConfig(zeta2=3.5, ttft_threshold_s=None).model_dump(),
                "admission": {"mode": "shed", "patience_s": 0.25}}
    text = profile_yaml(sections, ["made by a test", ""])
    assert text.startswith("# made by a test\n#\n")
    docs = key_docs(RewardConfig)  # every reward key is documented in the schema
    for key in sections["reward"]:
        assert any(line.strip().startswith(f"{key}:") and f"# {docs[key]}"
                   in line for line in text.splitlines()), key
    path = _write(tmp_path / "p.yaml", text)
    assert read_profile(path) == sections
