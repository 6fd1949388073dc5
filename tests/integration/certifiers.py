"""Certifiers that misbehave, for the live certificate's tests, and resolvers with
known answers, for the re-solves'. They run in the server's spawned worker process,
which imports them by name: they live in a module of their own (not a test module,
which would import pytest and the harness again)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from olproute.routing.live_window import LiveWindow
from solvers.resolve import OK, SLOW, Resolution


def boom(window: LiveWindow) -> dict[str, Any]:
    raise ValueError(f"no LP today ({window.num_requests} requests)")


def crash(window: LiveWindow) -> dict[str, Any]:
    os._exit(3)   # the worker dies: the pool breaks


def hang(window: LiveWindow) -> dict[str, Any]:
    time.sleep(3600)   # stopped by the server, never waited for
    return {}


def fixed_p(num_instances: int, num_slots: int) -> np.ndarray:
    """The duals ``fixed_duals`` hands over: (G, K, 3), the same in every slot, a
    different value per instance and resource."""
    per = 0.01 * (1 + np.arange(num_instances))[:, None] + 0.001 * np.arange(3)[None, :]
    return np.repeat(per[:, None, :], num_slots, axis=1)


def fixed_duals(window: LiveWindow) -> Resolution:
    """Twice the horizon of slots: every slot of the book's horizon is inside them."""
    return Resolution(OK, window.free_s, fixed_p(window.num_instances, 2 * window.horizon),
                      1.5, window.num_requests, 0.01)


def too_slow(window: LiveWindow) -> Resolution:
    return Resolution(SLOW, window.free_s, None, 0.0, window.num_requests, 5.0,
                      "HiGHS: Time limit reached")


def no_resolve(window: LiveWindow) -> Resolution:
    raise ValueError(f"no re-solve today ({window.num_requests} requests)")
