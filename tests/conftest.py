"""Shared fixtures: small in-memory configurations built on the repo's profiles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from olproute.config import DEFAULT_CONFIG, Config, LoadedConfig, load_profiles

REPO = Path(__file__).resolve().parents[1]
CONV_TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
PROFILES = REPO / "configs" / "profiles.yaml"

MakeConfig = Callable[..., LoadedConfig]


def make_config(**sections: Any) -> LoadedConfig:
    """A LoadedConfig from plain dicts, relative paths resolving as in configs/."""
    data: dict[str, Any] = {
        "instances": [{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 4}],
        "workload": {"kind": "trace", "path": str(CONV_TRACE), "duration_s": 120},
    }
    data.update(sections)
    return LoadedConfig(DEFAULT_CONFIG, Config.model_validate(data), load_profiles(PROFILES))


@pytest.fixture
def small_config() -> MakeConfig:
    return make_config


@pytest.fixture
def anyio_backend() -> str:
    """The event loop of the async tests (the emulator's): asyncio, as in production."""
    return "asyncio"
