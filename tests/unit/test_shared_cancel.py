"""A replica's shutdown never waits on a background task that swallowed its cancellation
(``olproute.server.shared`` and ``olproute.server.app.stop_tasks``), without Redis: a
sync whose exchange finishes in the very loop iteration its task is cancelled still
ends cancelled (Python 3.11's ``asyncio.wait_for`` returned the result instead, and the
sync task ran on for ever while the server's cleanup waited on it); a task that ignores
one cancellation is cancelled again, one that ignores every one is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from olproute.config.schema import StateConfig
from olproute.server import app as server_app
from olproute.server.app import stop_tasks
from olproute.server.shared import SharedState
from olproute.server.tracker import Tracker
from tests.unit.test_bid_price import SPEC


def _shared() -> SharedState:
    cfg = StateConfig(url="redis://127.0.0.1:1/0", sync_ms=50.0, lease_ms=500.0)
    tracker = Tracker((SPEC,), ["http://a"])
    return SharedState(cfg, "redis://127.0.0.1:1/0", tracker, lambda: (), lambda: 0.0,
                       threading.Lock())


def test_a_sync_cancelled_as_its_exchange_finishes_ends_cancelled() -> None:
    async def main() -> bool:
        shared = _shared()
        task: asyncio.Task[None] | None = None

        async def exchange() -> None:
            # the exchange's last step: its task is cancelled (the server stopping)
            # and the exchange completes in the same step
            assert task is not None
            task.cancel()

        shared._exchange = exchange  # type: ignore[method-assign]
        task = asyncio.create_task(shared.sync())
        await asyncio.wait([task])
        await shared.close()
        return task.cancelled()

    assert asyncio.run(main())


def test_stop_tasks_cancels_again_and_leaves_a_task_that_never_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_app, "STOP_WAIT_S", 0.01)

    async def main() -> tuple[list[str], list[bool]]:
        gate = asyncio.Event()
        release = False

        async def swallows_once() -> None:
            with contextlib.suppress(asyncio.CancelledError):   # as wait_for did: lost
                await gate.wait()
            await asyncio.sleep(3600)   # runs on until cancelled again

        async def never_stops() -> None:
            while not release:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)

        async def fails() -> None:
            raise RuntimeError("boom")

        tasks = [asyncio.create_task(c(), name=n) for n, c in (
            ("once", swallows_once), ("never", never_stops), ("fails", fails))]
        await asyncio.sleep(0)
        left = await stop_tasks(tasks)
        states = [t.done() for t in tasks]
        release = True   # the test's own clean-up: let it end
        for t in left:
            t.cancel()
        await asyncio.wait(left)
        return [t.get_name() for t in left], states

    left, done = asyncio.run(main())
    assert left == ["never"]
    assert done == [True, False, True]


def test_stop_tasks_of_none_and_of_finished_tasks_returns_at_once() -> None:
    async def main() -> list[Any]:
        async def quick() -> int:
            return 1

        t = asyncio.create_task(quick())
        await t
        return [await stop_tasks([]), await stop_tasks([t])]

    assert asyncio.run(main()) == [[], []]
