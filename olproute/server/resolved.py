"""What a re-solve hands the server (``olproute.server.resolving``): the resolver's
result, and its duals waiting for the next tick."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from olproute.routing.live_window import LiveWindow
from olproute.routing.router import Router

FloatArray = npt.NDArray[np.float64]

OK = "ok"   # the resolver's outcome whose duals are taken (``solvers.resolve.OK``)
OUTCOME = "outcome"   # the key of a re-solve's document that says how it ended


class Resolved(Protocol):
    """What a resolver returns (``solvers.resolve.Resolution``): its outcome (ok, slow,
    failed, empty), with ``ok`` the duals ``p`` (G, K, 3), slot k starting at ``t0_s + k
    * slot``, the LP's value, its requests and solve seconds, and why it has no duals."""

    @property
    def outcome(self) -> str: ...
    @property
    def t0_s(self) -> float: ...
    @property
    def p(self) -> FloatArray | None: ...
    @property
    def lp_value(self) -> float: ...
    @property
    def requests(self) -> int: ...
    @property
    def solve_s(self) -> float: ...
    @property
    def error(self) -> str | None: ...


Resolver = Callable[[LiveWindow], Resolved]


@dataclass(frozen=True, slots=True)
class Handover:
    """An ``ok`` re-solve's duals for the next tick of ``router``; ``doc`` is the
    re-solve as ``GET /prices`` shows it (the tick sets its ``applied_s``)."""

    router: Router
    t0_s: float
    p: FloatArray
    doc: dict[str, Any]
