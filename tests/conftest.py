"""Shared fixtures: small in-memory configurations built on the repo's profiles."""

from __future__ import annotations

import os

# One BLAS / OpenMP thread, set before numpy loads (the caller's setting wins). The tests'
# matrices are small, and OpenBLAS's threads spin against each other on a busy 2-core
# machine: an SVD of 160 x 512 took 4.5 s with its default threads at a load of 6 and
# 13 ms with one.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from olproute.config.loader import DEFAULT_CONFIG, Config, LoadedConfig, load_profiles  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONV_TRACE = REPO / "data" / "traces" / "splitwise_conv.csv"
PROFILES = REPO / "configs" / "profiles.yaml"

MakeConfig = Callable[..., LoadedConfig]


def serve_config_data() -> dict[str, Any]:
    """The small config the tests that start ``olproute serve`` as a process write: two
    emulated Qwen3-0.6B / H100 instances, bid_price, predictions from ``max_tokens``."""
    return {"profiles": str(PROFILES),
            "instances": [{"name": "q", "model": "qwen3-0.6b", "gpu": "h100", "replicas": 2}],
            "router": {"policy": "bid_price", "slot_ms": 20},
            "prices": {"period_slots": 5, "window": 200, "minibatch": 32},
            "prediction": {"serve": "max_tokens"}, "calibration": "auto",
            "server": {"health_period_s": 0.1},
            "workload": {"kind": "poisson", "rate_per_s": 1, "num_requests": 10,
                         "prompt_tokens": 10, "decode_tokens": 10}}
# Real seconds after which a wait in a test is a hang. Timeouts in the tests only catch
# hangs: none bounds how long a correct run takes, which a loaded machine stretches.
HANG_S = 60.0
_JAX_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


# Hypothesis: no per-example deadline and no health check that times example generation
# (both wall-clock bounds); each test sets its examples and derandomize=True itself.
settings.register_profile("olproute", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("olproute")


def pytest_configure(config: pytest.Config) -> None:
    """One JAX compilation cache for the whole run (this process and the CLIs it starts):
    every price book jits its own step function, so each bid_price run would compile the
    same program again (about 1 s of CPU a book). A fresh directory per run, so a run
    never reads what another one compiled; a cache directory set by the caller wins."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or "jax" in sys.modules:
        return
    cache = tempfile.mkdtemp(prefix="olproute-tests-jax-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache, **_JAX_CACHE_ENV)
    # removed at exit, after the interpreter joined the executor threads: a router's tick
    # can still be compiling in one when its test has ended
    atexit.register(shutil.rmtree, cache, ignore_errors=True)


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
