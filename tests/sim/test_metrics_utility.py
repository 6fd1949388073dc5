"""OnTimeUtility (BEAR eq. 6) on a hand-built run: realised utility of the model that
served each request, counted only when its TTFT target is met, averaged over all."""

from __future__ import annotations

import math

import numpy as np
import pytest

from olproute.config.loader import DEFAULT_CONFIG, ModelProfile, Profiles, load_profiles
from olproute.sim import metrics
from olproute.sim.cluster import SimResult
from olproute.types import InstanceSpec, Request

SPECS = tuple(InstanceSpec(name=m, model=m, gpu="h100", tensor_parallel=1, max_num_seqs=8,
                           max_num_batched_tokens=512, block_size=16, num_kv_blocks=100)
              for m in ("qwen3-0.6b", "qwen3-32b"))


def _profile(price_in: float, price_out: float) -> ModelProfile:
    return ModelProfile(num_layers=1, hidden_size=1, num_attention_heads=1, num_kv_heads=1,
                        head_dim=1, num_params=1.0, max_context_tokens=4096,
                        price_input_per_mtok=price_in, price_output_per_mtok=price_out)


PROFILES = Profiles(models={"qwen3-0.6b": _profile(1.0, 2.0), "qwen3-32b": _profile(3.0, 4.0)},
                    gpus={})
QUALITY = {"qwen3-0.6b": 0.5, "qwen3-32b": 0.9}


def _request(i: int, prompt: int, with_quality: bool = True) -> Request:
    return Request(request_id=i, arrival_s=float(i), prompt_tokens=prompt, decode_tokens=999,
                   predicted_decode_tokens=999, ttft_target_s=0.2,
                   quality_by_model=dict(QUALITY) if with_quality else None)


def _result(with_quality: bool = True) -> SimResult:
    # 0: on 0.6b, on time; 1: on 32b, on time; 2: on 32b, late; 3: shed
    reqs = tuple(_request(i, p, with_quality) for i, p in enumerate((100, 200, 200, 50)))
    arrival = np.arange(4.0)
    first = arrival + np.array([0.1, 0.2, 0.5, np.nan])
    return SimResult(
        specs=SPECS, requests=reqs, instance=np.array([0, 1, 1, -1]),
        dispatch_s=arrival + np.array([0.0, 0.0, 0.0, np.nan]), first_token_s=first,
        finish_s=first + np.array([1.0, 1.0, 1.0, np.nan]),
        num_preemptions=np.zeros(4, dtype=np.int64),
        # generated tokens on the serving model, not Request.decode_tokens (999)
        decode_tokens=np.array([50, 100, 100, 0]), decode_instance=np.full(4, -1),
        prefill_end_s=np.full(4, np.nan), kv_arrival_s=np.full(4, np.nan),
        shed=np.array([False, False, False, True]),
        batch_log=np.zeros((0, 9)), in_system_t=np.zeros(1), in_system_n=np.zeros(1, np.int64),
        end_s=5.0, num_events=0)


def test_on_time_utility_by_hand() -> None:
    res = _result()
    lam = 1e-3
    # cost (micro-USD) = prompt x price_in + generated x price_out
    u0 = 0.5 - lam * (100 * 1.0 + 50 * 2.0)    # 0.3, on time
    u1 = 0.9 - lam * (200 * 3.0 + 100 * 4.0)   # -0.1, on time: negative utility counts
    u2 = 0.9 - lam * (200 * 3.0 + 100 * 4.0)   # late: counts 0
    realised = metrics.realised_utility(res, PROFILES, lam)
    assert realised.tolist() == pytest.approx([u0, u1, u2, 0.0])
    assert metrics.on_time_utility(res, PROFILES, lam) == pytest.approx((u0 + u1) / 4)
    s = metrics.summarize(res, PROFILES, lam)
    assert s.on_time_utility == pytest.approx(0.05)
    assert s.slo_attainment == 0.5


def test_default_profiles_and_lambda_are_the_repo_prices() -> None:
    res = _result()
    repo = load_profiles(DEFAULT_CONFIG.parent / "profiles.yaml")
    assert metrics.summarize(res).on_time_utility == pytest.approx(
        metrics.on_time_utility(res, repo, 5e-4))
    # Table 1 prices: 100 x 0.044 + 50 x 0.173 micro-USD on Qwen3-0.6B
    assert metrics.realised_utility(res)[0] == pytest.approx(0.5 - 5e-4 * (4.4 + 8.65))


def test_without_quality_it_is_nan() -> None:
    res = _result(with_quality=False)
    assert math.isnan(metrics.summarize(res, PROFILES).on_time_utility)
    assert np.isnan(metrics.realised_utility(res, PROFILES)).all()


def test_an_unpriced_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="qwen3-32b"):
        metrics.realised_utility(_result(), Profiles(models={"qwen3-0.6b": _profile(1, 1)},
                                                     gpus={}))
