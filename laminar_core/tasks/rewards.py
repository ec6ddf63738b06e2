"""Reward functions and the async wrapper the rollout manager awaits.

A reward function is ``fn(response: str, row: dict, **options) -> float``: ``response`` is
what the model wrote, a :class:`~laminar_core.tasks.response.Response` (a ``str`` of the
model's own turns, with the observations and the whole transcript beside it, told apart by
the loss mask: a tool's output is never taken for the model's answer), ``row`` the prompt's
row (its metadata: the dataset row plus the loop's own keys). It runs in a thread under a
timeout, so a slow or hanging reward never blocks the event loop; a raise, a timeout or a
non-finite result becomes :class:`RewardError`, which the manager turns into a failed
trajectory carrying the message while the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from laminar_core.plugins.manager import import_spec
from laminar_core.tasks.response import Response, response_of
from laminar_core.types import Trajectory

RewardCallable = Callable[..., float]
_SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RewardError(RuntimeError):
    """A reward call failed (raised, timed out, returned a non-number); names reward and cause."""


def _normalise(text: str) -> str:
    return " ".join(str(text).split())


def exact_match(response: str, row: dict[str, Any], key: str = "answer") -> float:
    """1.0 when the response equals ``row[key]`` up to surrounding/repeated whitespace."""
    return float(_normalise(response) == _normalise(row[key]))


def contains(response: str, row: dict[str, Any], key: str = "answer") -> float:
    """1.0 when ``row[key]`` occurs in the response (e.g. a final answer inside reasoning)."""
    return float(_normalise(row[key]) in _normalise(response))


def import_reward(spec: str) -> RewardCallable:
    """Import ``"package.module:function"``; raise ``ValueError`` with the cause and the fix."""
    if not _SPEC_RE.match(spec):
        raise ValueError(f"'{spec}' is neither a registered reward nor 'package.module:function'")
    try:
        obj = import_spec(spec)
    except Exception as e:
        raise ValueError(
            f"cannot import '{spec}' ({type(e).__name__}: {e}); check the module is importable "
            "(on PYTHONPATH) and the function name"
        ) from None
    if not callable(obj):
        raise ValueError(f"'{spec}' is not callable")
    return obj


def check_reward_signature(fn: RewardCallable, name: str, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the contract when ``fn`` cannot be called as
    ``fn(response, row, **options)`` (say a function of a ``Trajectory``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        sig.bind(Response(), {}, **options)
    except TypeError as e:
        raise ValueError(
            f"reward {name!r} cannot be called as fn(response, row, **options) ({e}); its "
            f"signature is {name}{sig}. A reward takes the response (the model's text, a "
            "laminar_core.Response with .turns, .observations and .transcript), the prompt's "
            "row and reward.options as keywords; a function of a whole Trajectory is passed "
            "to the run as reward_fn=..., not as reward.fn"
        ) from None


def wrap_reward(
    fn: RewardCallable,
    name: str,
    decode: Callable[[list[int]], str] | None,
    timeout_s: float,
    options: dict[str, Any] | None = None,
    workers: int = 4,
) -> Callable[[Trajectory], Awaitable[float]]:
    """The manager-facing reward: ``async traj -> float``.

    Splits ``traj.response_ids`` along the loss mask into the model's turns and the
    observations, decoding each with ``decode`` (:func:`response_of`; ``decode`` ``None``: an
    empty response, as for simulated engines that produce no ids), then runs
    ``fn(response, traj.metadata, **options)``
    in a daemon thread under ``asyncio.wait_for(timeout_s)``; at most ``workers`` calls run at
    once (waiting for a turn does not count against the timeout). Raises
    :class:`RewardError` naming ``name`` and the cause.

    A timed-out call's thread cannot be killed: it is abandoned (and stops counting against
    ``workers``), so a hanging reward costs a thread, never the run, and -- being a daemon --
    never blocks interpreter exit.
    """
    call = functools.partial(fn, **options) if options else fn
    slots: asyncio.Semaphore | None = None

    def settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
        if not fut.done():  # a timed-out call's result arrives to a cancelled future
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    async def reward(traj: Trajectory) -> float:
        nonlocal slots
        if slots is None:  # created in the running loop
            slots = asyncio.Semaphore(workers)
        text = response_of(traj, decode) if decode is not None else Response()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def work() -> None:
            value: float | Exception
            try:
                ok, value = True, call(text, traj.metadata)
            except Exception as e:
                ok, value = False, e
            with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                loop.call_soon_threadsafe(settle, fut, ok, value)

        async with slots:
            threading.Thread(target=work, name=f"laminar-reward-{name}", daemon=True).start()
            try:
                value = await asyncio.wait_for(fut, timeout_s)
            except TimeoutError:
                raise RewardError(f"reward {name!r} timed out after {timeout_s:g} s") from None
            except Exception as e:
                raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
        try:
            result = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward {name!r} returned {value!r}; it must return a number"
            ) from None
        if not math.isfinite(result):
            raise RewardError(f"reward {name!r} returned {result}; it must be finite")
        return result

    reward.__name__ = f"reward_{name}"
    return reward
