"""``runtime.proxies``: a replica actor's start that nobody waits for any more."""

from __future__ import annotations

import asyncio
import gc

import pytest

pytest.importorskip("ray")

from laminar_core.runtime.proxies import RayRolloutEngine


class _Handle:
    """An actor whose start fails after a moment (as one killed while starting)."""

    class start:  # Ray's handle.method.remote() shape
        @staticmethod
        def remote():
            async def fail() -> None:
                await asyncio.sleep(0.05)
                raise RuntimeError("the actor was killed while starting")

            return fail()


def test_a_start_whose_waiters_were_cancelled_fails_without_an_unread_error() -> None:
    async def main() -> list[dict]:
        unread: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unread.append(ctx))
        engine = RayRolloutEngine("r1", _Handle())
        waiter = asyncio.ensure_future(engine.start())
        await asyncio.sleep(0.01)
        waiter.cancel()  # the restart that waited was stopped (the run closing)
        await asyncio.sleep(0.1)  # then the start fails
        del engine, waiter
        gc.collect()
        # a later waiter still gets the error
        other = RayRolloutEngine("r2", _Handle())
        with pytest.raises(RuntimeError, match="killed while starting"):
            await other.start()
        return unread

    unread = asyncio.run(main())
    assert [c for c in unread if "never retrieved" in c.get("message", "")] == []
