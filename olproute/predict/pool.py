"""The predictor on the request path of one pool: what a live request carries, the same
fields ``apply_predictor`` gives a simulated one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from olproute.predict.predictor import Predictor, decode_prediction, quality_prediction


@dataclass(frozen=True, slots=True)
class RequestPredictions:
    """One request's predictions, as ``Request`` fields: ``decode_tokens`` (its
    ``predicted_decode_tokens``, what a model without its own entry reads),
    ``decode_by_model`` (output tokens) and ``quality_by_model`` (in [0, 1])."""

    decode_tokens: int
    decode_by_model: Mapping[str, int]
    quality_by_model: Mapping[str, float]


class PoolPredictor:
    """A predictor bound to a pool's models, for one request at a time.

    ``predict(text, max_tokens)`` gives a request's predictions on each model of the pool
    the predictor was trained for (``known``, pool order), rounded and clipped as
    ``apply_predictor`` gives them to simulated requests, and capped at ``max_tokens``
    (the backend generates no more). ``decode_tokens`` is the first model's length, as
    there, unless a model of the pool is ``unknown`` to the predictor: that model has no
    entry and reads ``decode_tokens``, which is then ``max_tokens``. One featurisation of
    the prompt and one row per known model (``Predictor.predict``)."""

    __slots__ = ("_first", "known", "predictor", "unknown")

    def __init__(self, predictor: Predictor, models: Sequence[str]) -> None:
        distinct = tuple(dict.fromkeys(models))
        trained = set(predictor.models)
        self.predictor = predictor
        self.known = tuple(m for m in distinct if m in trained)
        self.unknown = tuple(m for m in distinct if m not in trained)
        self._first = distinct[0] if distinct and not self.unknown else None

    def predict(self, text: str, max_tokens: int) -> RequestPredictions | None:
        """The predictions for a request with this prompt text; None when the predictor
        knows no model of the pool."""
        if not self.known:
            return None
        pred = self.predictor.predict(text, self.known)
        decode = {m: decode_prediction(d, max_tokens)
                  for m, d in zip(self.known, pred.decode_tokens, strict=True)}
        quality = {m: quality_prediction(q)
                   for m, q in zip(self.known, pred.quality, strict=True)}
        first = max_tokens if self._first is None else decode[self._first]
        return RequestPredictions(first, decode, quality)

    def warm(self) -> None:
        """Pay the first call's costs now (about 5 ms: the pool's row plan, LightGBM's
        first single-row call), not at the first request."""
        if self.known:
            self.predictor.predict("warm up the predictor", self.known)
