"""An asyncio event loop on a virtual clock, for tests of code that paces itself with
``asyncio.sleep`` (the emulator's engine): timing assertions become exact, whatever the
machine's load.

The clock (``loop.time()``) stands still while any callback is ready or any I/O is
pending; when every task waits on a timer it jumps to the earliest timer, plus
``lateness_s``: every wake-up comes that much late, as a busy machine's would. Give the
code under test ``loop.time`` as its clock.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any

from tests.conftest import HANG_S


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, lateness_s: float = 0.0) -> None:
        super().__init__()
        self._now = 0.0
        self.lateness_s = lateness_s
        real_select = self._selector.select

        def select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            events = real_select(0)
            if events or timeout == 0:
                return events
            if timeout is None:  # no timer at all: only I/O can wake us, or it hangs
                events = real_select(HANG_S)
                if not events:
                    raise RuntimeError(f"virtual-time loop: nothing to do for {HANG_S} s")
                return events
            self._now += timeout + self.lateness_s
            return []

        self._selector.select = select  # type: ignore[method-assign]

    def time(self) -> float:
        return self._now


def run_virtual(main: Callable[[], Coroutine[Any, Any, Any]], lateness_s: float = 0.0) -> Any:
    """Run ``main()`` to completion on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(lateness_s)) as runner:
        return runner.run(main())
