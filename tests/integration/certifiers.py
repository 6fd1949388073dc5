"""Certifiers that misbehave, for the live certificate's tests. They run in the
server's spawned worker process, which imports them by name: they live in a module of
their own (not a test module, which would import pytest and the harness again)."""

from __future__ import annotations

import os
import time
from typing import Any

from olproute.routing.live_window import LiveWindow


def boom(window: LiveWindow) -> dict[str, Any]:
    raise ValueError(f"no LP today ({window.num_requests} requests)")


def crash(window: LiveWindow) -> dict[str, Any]:
    os._exit(3)   # the worker dies: the pool breaks


def hang(window: LiveWindow) -> dict[str, Any]:
    time.sleep(3600)   # stopped by the server, never waited for
    return {}
