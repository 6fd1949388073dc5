"""A request's outlook per instance (``routing.outlook``): each instance reads its own
model's predictions, on a pool of one model as on a mixed one."""

from __future__ import annotations

import numpy as np
import pytest

from olproute.config.loader import load_profiles
from olproute.routing.outlook import OutlookSource
from olproute.types import InstanceSpec, Request
from tests.conftest import PROFILES

PROFS = load_profiles(PROFILES)


def _spec(model: str) -> InstanceSpec:
    return InstanceSpec(name=model, model=model, gpu="h100", tensor_parallel=1,
                        max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
                        num_kv_blocks=10_000)


def _request(decode: dict[str, int] | None, quality: dict[str, float] | None) -> Request:
    return Request(request_id=1, arrival_s=0.0, prompt_tokens=500, decode_tokens=100,
                   predicted_decode_tokens=120, ttft_target_s=1.0,
                   predicted_decode_by_model=decode, predicted_quality_by_model=quality)


@pytest.mark.parametrize("models", [["qwen3-8b"] * 3, ["qwen3-8b", "qwen3-32b", "qwen3-8b"]])
@pytest.mark.parametrize(("decode", "quality"), [
    (None, None),
    ({"qwen3-8b": 40, "qwen3-32b": 70}, {"qwen3-8b": 0.25, "qwen3-32b": 0.75}),
    ({"qwen3-32b": 70}, {"qwen3-32b": 0.75}),
])
def test_each_instance_reads_its_models_predictions(models: list[str],
                                                    decode: dict[str, int] | None,
                                                    quality: dict[str, float] | None) -> None:
    """Decode tokens: the model's entry, else ``predicted_decode_tokens``; quality: the
    model's entry, else 0; cost: prompt x input price + decode x output price."""
    out = OutlookSource([_spec(m) for m in models], PROFS)(_request(decode, quality))
    want_decode = [float((decode or {}).get(m, 120)) for m in models]
    want_quality = [(quality or {}).get(m, 0.0) for m in models]
    price_in = [PROFS.models[m].price_input_per_mtok for m in models]
    price_out = [PROFS.models[m].price_output_per_mtok for m in models]
    assert out.decode_tokens.dtype == np.float64 and out.decode_tokens.tolist() == want_decode
    assert out.quality.tolist() == want_quality
    np.testing.assert_array_equal(out.cost_musd, 500 * np.array(price_in)
                                  + np.array(want_decode) * np.array(price_out))
