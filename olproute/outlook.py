"""What the router expects of one request on every instance: predicted output tokens,
response quality, and serving cost.

Three sources, chosen by ``prediction.mode``:
- ``predictor``: the trained LightGBM predictor (``olproute.predict``), one batched call
  for all instances of a request;
- ``oracle``: the request's per-model truth where the simulator has it
  (``decode_tokens_by_model``), else its single predicted length;
- ``noisy``: the request's predicted length, scaled per model by that model's truth
  relative to the first model's when the simulator has per-model truth.
Without a predictor, quality is the task table mean for the request's task and the
instance's model (BEAR paper Table 2, ``olproute.sim.prompts.MODELS``), or 0 when the
task is unknown. Cost is in micro-USD: prompt x input price + output x output price, with
prices per million tokens from the model profiles (BEAR paper Table 1 for Qwen3).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from olproute.config import Profiles
from olproute.types import InstanceSpec, Request

FloatArray = npt.NDArray[np.float64]
Mode = Literal["oracle", "noisy", "predictor"]


@dataclass(frozen=True, slots=True)
class Outlook:
    """Per-instance expectations for one request (arrays of length G)."""

    decode_tokens: FloatArray
    quality: FloatArray
    cost_musd: FloatArray

    def utility(self, cost_lambda: float) -> FloatArray:
        """BEAR eq. 4: quality minus lambda times cost (cost in micro-USD)."""
        result: FloatArray = self.quality - cost_lambda * self.cost_musd
        return result


def task_quality(task: str | None, model: str) -> float:
    """Mean quality of ``model`` on ``task`` from the task table (0 if either is unknown)."""
    from olproute.sim.prompts import MODELS, TASKS

    if task is None or task not in TASKS or model not in MODELS:
        return 0.0
    return float(MODELS[model].quality[TASKS.index(task)])


class OutlookSource:
    """Builds the Outlook of a request for a fixed list of instances; remembers the last
    ``cache_size`` requests so a held request re-scored every slot costs nothing more."""

    def __init__(self, specs: Sequence[InstanceSpec], profiles: Profiles, mode: Mode,
                 predictor: Any | None = None, cache_size: int = 4096) -> None:
        if mode == "predictor" and predictor is None:
            raise ValueError("prediction mode 'predictor' needs a loaded predictor")
        self._models = [s.model for s in specs]
        self._price_in = np.array([profiles.models[m].price_input_per_mtok
                                   for m in self._models])
        self._price_out = np.array([profiles.models[m].price_output_per_mtok
                                    for m in self._models])
        self._mode = mode
        self._predictor = predictor
        self._cache: OrderedDict[int, Outlook] = OrderedDict()
        self._cache_size = cache_size

    def __call__(self, request: Request) -> Outlook:
        hit = self._cache.get(request.request_id)
        if hit is not None:
            return hit
        out = self._build(request)
        self._cache[request.request_id] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def _build(self, r: Request) -> Outlook:
        if self._mode == "predictor":
            pred = self._predictor.predict(r, self._models)  # type: ignore[union-attr]
            decode = np.maximum(np.asarray(pred.decode_tokens, dtype=np.float64), 1.0)
            quality = np.asarray(pred.quality, dtype=np.float64)
        else:
            decode = np.array([self._decode(r, m) for m in self._models], dtype=np.float64)
            quality = np.array([task_quality(r.task, m) for m in self._models])
        cost = r.prompt_tokens * self._price_in + decode * self._price_out
        return Outlook(decode_tokens=decode, quality=quality, cost_musd=cost)

    def _decode(self, r: Request, model: str) -> float:
        by_model = r.decode_tokens_by_model
        if self._mode == "oracle" and by_model is not None and model in by_model:
            return float(by_model[model])
        # noisy: the request's prediction error applied to this model's length
        return float(r.predicted_decode_tokens_for(model))
