"""What a re-solve hands the server (``olproute.server.resolving``): the resolver
(``solvers.resolve.resolve_live``, whose ``Resolution`` is the routing layer's message),
and its duals waiting for the next tick."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from olproute.routing.live_window import LiveWindow, Resolution
from olproute.routing.router import Router

FloatArray = npt.NDArray[np.float64]

OUTCOME = "outcome"   # the key of a re-solve's document that says how it ended

Resolver = Callable[[LiveWindow], Resolution]


@dataclass(frozen=True, slots=True)
class Handover:
    """An ``ok`` re-solve's duals for the next tick of ``router``; ``doc`` is the
    re-solve as ``GET /prices`` shows it (the tick sets its ``applied_s``)."""

    router: Router
    t0_s: float
    p: FloatArray
    doc: dict[str, Any]
