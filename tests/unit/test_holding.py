"""The server's central buffer (olproute.server.holding) on a virtual clock: the budget
bounds each slot's re-scoring, every held request still gets its turn, expired requests
are always decided, abandoned ones are dropped unscored, and the cap is kept."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from olproute.server.holding import HoldQueue
from olproute.types import Decision, Request


def _request(rid: int, arrival: float = 0.0) -> Request:
    return Request(request_id=rid, arrival_s=arrival, prompt_tokens=10, decode_tokens=10,
                   predicted_decode_tokens=10, ttft_target_s=1.0)


class Clock:
    """Virtual time: each decision costs ``cost_s`` of loop time."""

    def __init__(self, cost_s: float) -> None:
        self.t = 0.0
        self.cost_s = cost_s
        self.now_s = 0.0   # the server clock (patience)
        self.decided: Counter[int] = Counter()
        self.release: set[int] = set()

    def queue(self, max_held: int, budget_s: float) -> HoldQueue:
        """A buffer on this clock; its own slot task never runs (slots of an hour), the
        tests call ``rescore`` themselves."""
        return HoldQueue(max_held=max_held, slot_s=3600.0, budget_s=budget_s,
                         now=lambda: self.now_s, clock=lambda: self.t)

    def decide(self, req: Request, exclude: frozenset[int]) -> Decision:
        self.t += self.cost_s
        self.decided[req.request_id] += 1
        if req.request_id in self.release:
            return Decision(req.request_id, "dispatch", 0, "released")
        if self.now_s >= 5.0:
            return Decision(req.request_id, "shed", None, "patience")
        return Decision(req.request_id, "hold", None, "held")


async def _fill(q: HoldQueue, clock: Clock, n: int, gone: set[int] | None = None,
                patience_s: float = 5.0) -> list[asyncio.Task[Decision | None]]:
    gone = gone if gone is not None else set()
    tasks = [asyncio.create_task(q.wait(_request(i), frozenset(), patience_s, clock.decide,
                                        lambda i=i: i in gone))  # type: ignore[misc]
             for i in range(n)]
    await asyncio.sleep(0)
    return tasks


def test_the_budget_bounds_a_slot_and_every_request_gets_its_turn() -> None:
    async def main() -> None:
        clock = Clock(cost_s=0.004)
        q = clock.queue(max_held=100, budget_s=0.010)
        tasks = await _fill(q, clock, 10)
        for _ in range(4):
            await q.rescore(clock.decide)
        # 4 ms a decision, 10 ms a slot: three decisions per slot, never more
        assert sum(clock.decided.values()) == 12
        assert q.stats.slot_seconds == pytest.approx([0.012] * 4)
        assert set(clock.decided) == set(range(10))   # round robin: everyone re-scored
        assert q.stats.deferred == 4 * 7
        await q.close()
        await asyncio.gather(*tasks)
    asyncio.run(main())


def test_expired_requests_are_decided_whatever_the_budget() -> None:
    async def main() -> None:
        clock = Clock(cost_s=0.004)
        q = clock.queue(max_held=100, budget_s=0.010)
        tasks = await _fill(q, clock, 10)
        clock.now_s = 5.0                # every patience has run out
        await q.rescore(clock.decide)
        results = await asyncio.gather(*tasks)
        assert [d.action for d in results if d is not None] == ["shed"] * 10
        assert len(q) == 0
    asyncio.run(main())


def test_a_dispatch_leaves_the_buffer_and_an_abandoned_request_is_never_scored() -> None:
    async def main() -> None:
        clock = Clock(cost_s=0.0)
        gone = {3}
        q = clock.queue(max_held=100, budget_s=1.0)
        tasks = await _fill(q, clock, 5, gone)
        clock.release.add(1)
        await q.rescore(clock.decide)
        await asyncio.sleep(0)
        assert tasks[1].done() and tasks[1].result().action == "dispatch"  # type: ignore[union-attr]
        assert tasks[3].done() and tasks[3].result() is None
        assert clock.decided[3] == 0 and q.stats.dropped == 1
        assert len(q) == 3
        await q.close()
        await asyncio.gather(*tasks)
    asyncio.run(main())


def test_full_is_the_cap() -> None:
    async def main() -> None:
        clock = Clock(cost_s=0.0)
        q = clock.queue(max_held=2, budget_s=1.0)
        assert not q.full()
        tasks = await _fill(q, clock, 2)
        assert q.full() and len(q) == 2
        await q.close()
        assert await asyncio.gather(*tasks) == [None, None]
        assert len(q) == 0
    asyncio.run(main())


def test_a_joint_pass_gets_every_live_request_at_once_the_expired_first() -> None:
    """For a policy that decides the held requests together: one call per slot with every
    request still waiting (the abandoned dropped unscored, the expired first), whatever
    the budget; its dispatches and sheds leave the buffer, its holds stay."""
    async def main() -> None:
        clock = Clock(cost_s=0.004)
        q = clock.queue(max_held=100, budget_s=0.001)
        gone = {2}
        tasks = [asyncio.create_task(q.wait(_request(i), frozenset({i % 2}),
                                            10.0 if i != 4 else 0.5, clock.decide,
                                            lambda i=i: i in gone))  # type: ignore[misc]
                 for i in range(6)]
        await asyncio.sleep(0)
        calls: list[list[tuple[int, frozenset[int]]]] = []

        def together(held):  # type: ignore[no-untyped-def]
            calls.append([(r.request_id, ex) for r, ex in held])
            for r, _ in held:
                if r.request_id == 1:
                    yield Decision(1, "dispatch", 0, "released")
                elif r.request_id == 4:
                    yield Decision(4, "shed", None, "patience")
                else:
                    yield Decision(r.request_id, "hold", None, "held")

        clock.now_s = 1.0                       # request 4's patience (0.5 s) has run out
        await q.rescore_together(together)
        await asyncio.sleep(0)
        assert calls == [[(4, frozenset({0})), (0, frozenset({0})), (1, frozenset({1})),
                          (3, frozenset({1})), (5, frozenset({1}))]]
        assert clock.decided == Counter()       # nothing went through the one-by-one path
        assert tasks[1].result().action == "dispatch"  # type: ignore[union-attr]
        assert tasks[4].result().action == "shed"  # type: ignore[union-attr]
        assert tasks[2].result() is None and q.stats.dropped == 1
        assert len(q) == 3 and q.stats.rescored == 5
        await q.close()
        await asyncio.gather(*tasks)
    asyncio.run(main())
