"""The engine's drain state (backend/drain.py) without a model: refusing while draining, the
deadline aborting exactly what still runs, and the ABORT it causes told apart from others."""

from __future__ import annotations

import asyncio

import pytest

from tito.errors import Unavailable
from tito_engine.request import ChoiceOutput, FinishReason
from tito_engine.backend.drain import ENGINE_DRAINING, Drain


def test_draining_refuses_new_streams_and_aborts_the_rest_at_the_deadline():
    aborted: list[list[str]] = []

    async def main():
        drain = Drain(aborted.append)
        done, running = drain.enter("done"), drain.enter("")
        assert running.request_id.startswith("gen-")  # named, so the deadline can abort it
        assert drain.start(grace_seconds=0.05) == 2 and drain.draining
        with pytest.raises(Unavailable) as refused:
            drain.enter("late")
        assert refused.value.reason == ENGINE_DRAINING
        drain.leave(done)  # finished within the grace period
        abort = ChoiceOutput(0, (), FinishReason.ABORT)
        assert not drain.ended_by_drain(abort)  # an Abort before the deadline is a caller's
        assert not await drain.wait_idle(0.2)
        assert aborted == [[running.request_id]] and drain.ended_by_drain(abort)
        assert not drain.ended_by_drain(ChoiceOutput(0, (1,), FinishReason.LENGTH))
        drain.leave(running)
        assert await drain.wait_idle(0.1)

    asyncio.run(main())


def test_a_second_drain_brings_the_deadline_closer_never_later():
    aborted: list[list[str]] = []

    async def main():
        drain = Drain(aborted.append)
        drain.enter("a")
        drain.start(grace_seconds=30.0)
        drain.start(grace_seconds=0.01)
        await asyncio.sleep(0.1)
        assert aborted == [["a"]]
        drain.start(grace_seconds=60.0)  # no later: already expired
        assert drain.expired

    asyncio.run(main())


def test_draining_with_nothing_in_flight_is_idle_at_once():
    async def main():
        drain = Drain(lambda ids: pytest.fail("nothing to abort"))
        assert drain.start(grace_seconds=5.0) == 0
        assert await drain.wait_idle(0.01)

    asyncio.run(main())
