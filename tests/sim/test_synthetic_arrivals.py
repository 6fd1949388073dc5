"""The synthetic workload's arrival process: Poisson by default, MMPP-2 on request."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from olproute.config.loader import WorkloadConfig
from olproute.sim import workloads as wl
from olproute.sim.scenario import build_requests, streams
from tests.conftest import make_config

POOL = [{"name": "q0.6b", "model": "qwen3-0.6b", "gpu": "h100"},
        {"name": "q8b", "model": "qwen3-8b", "gpu": "h100"}]


def _arrivals(**workload: object) -> np.ndarray:
    loaded = make_config(instances=POOL, workload={"kind": "synthetic", "rate_per_s": 20.0,
                                                   "num_requests": 200, **workload})
    return np.array([r.arrival_s for r in build_requests(loaded, seed=5)])


@pytest.mark.parametrize(("workload", "expected"), [
    ({}, lambda rng: wl.poisson_arrivals(20.0, 200, rng)),
    ({"arrivals": "poisson"}, lambda rng: wl.poisson_arrivals(20.0, 200, rng)),
    ({"arrivals": "mmpp2", "ratio": 6.0},
     lambda rng: wl.mmpp2_arrivals(20.0, 6.0, 200, rng).arrival_s),
])
def test_synthetic_arrivals_come_from_the_named_process(workload: dict[str, object],
                                                        expected: object) -> None:
    want = expected(streams(5, len(POOL)).workload)  # type: ignore[operator]
    assert np.array_equal(_arrivals(**workload), want)


def test_unknown_arrival_process_is_rejected() -> None:
    with pytest.raises(ValidationError):
        WorkloadConfig(kind="synthetic", rate_per_s=1.0, num_requests=3,
                       arrivals="hawkes")
