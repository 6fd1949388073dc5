"""What the router expects of one request on every instance: predicted output tokens,
response quality, and serving cost.

Only predictions are read, never the truth (``Request``'s docstring says which fields are
which), and only the request's own: per model, its entry in ``predicted_decode_by_model``
and ``predicted_quality_by_model``, else its single ``predicted_decode_tokens`` and
quality 0 (every model equal: utility is then minus the cost). Whoever makes a request
predicts it, once: the simulator's workload for every model of the pool (noisy truth
with independent noise per model, the truth itself in ``oracle`` mode, or a trained
predictor's output), the server's router when the request arrives (its predictor on the
prompt text, ``prediction.serve``).
Cost is in micro-USD: prompt x input price + predicted output x output price, with
prices per million tokens from the model profiles (BEAR paper Table 1 for Qwen3).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from olproute.config.schema import Profiles
from olproute.types import InstanceSpec, Request

FloatArray = npt.NDArray[np.float64]


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


class OutlookSource:
    """Builds the Outlook of a request for a fixed list of instances; remembers the last
    ``cache_size`` requests so a held request re-scored every slot costs nothing more."""

    def __init__(self, specs: Sequence[InstanceSpec], profiles: Profiles,
                 cache_size: int = 4096) -> None:
        self._models = [s.model for s in specs]
        self._distinct = list(dict.fromkeys(self._models))
        self._model_of = np.array([self._distinct.index(m) for m in self._models],
                                  dtype=np.int64)
        self._price_in = np.array([profiles.models[m].price_input_per_mtok
                                   for m in self._models])
        self._price_out = np.array([profiles.models[m].price_output_per_mtok
                                    for m in self._models])
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
        # per distinct model, then one row per instance (one model: one fill each)
        if len(self._distinct) == 1:
            m, g = self._distinct[0], len(self._models)
            decode = np.full(g, float(r.predicted_decode_tokens_for(m)))
            quality = np.full(g, float(_or_zero(r.predicted_quality_for(m))))
        else:
            decode = np.array([r.predicted_decode_tokens_for(m) for m in self._distinct],
                              dtype=np.float64)[self._model_of]
            quality = np.array([_or_zero(r.predicted_quality_for(m))
                                for m in self._distinct], dtype=np.float64)[self._model_of]
        cost = r.prompt_tokens * self._price_in + decode * self._price_out
        return Outlook(decode_tokens=decode, quality=quality, cost_musd=cost)


def _or_zero(x: float | None) -> float:
    return 0.0 if x is None else x
