"""The ``Environment`` contract."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from laminar_core.interfaces.environment import (
    EnvContext,
    Environment,
    Episode,
    StepResult,
    ToolCallParser,
)
from laminar_core.testing.loopwatch import LoopWatch
from laminar_core.testing.report import ContractError, require


async def check_environment(
    make_env: Callable[[EnvContext], Environment | Awaitable[Environment]],
    *,
    row: dict[str, Any],
    tool_turn: str,
    answer_turn: str,
    slow_turn: str | None = None,
    bad_turn: str | None = None,
    parser: ToolCallParser | str = "code",
    options: Any = None,
    max_turns: int = 2,
    timeout_s: float = 2.0,
    concurrency: int = 4,
    leftovers: Callable[[], Any] | None = None,
    grace_s: float = 60.0,
    max_block_s: float = 0.5,
) -> None:
    """Drive an environment through its lifecycle and check the contract.

    ``make_env(ctx)`` builds the environment (sync or async); ``row`` is a prompt row;
    ``tool_turn`` a model turn that makes one quick tool call, ``answer_turn`` one that calls
    no tool. Optional: ``slow_turn`` a call that outlasts ``timeout_s`` (checks that a
    timeout is an observation with ``info["error"] == "timeout"`` and the episode goes on),
    ``bad_turn`` a malformed call (an observation naming the error, not an exception), and
    ``leftovers()`` returning what the environment left behind after ``close`` (processes,
    files): it must be empty.

    Checked: observations are strings, non-empty after a tool call and empty when done;
    ``info`` is JSON-able; ``reward`` is ``None`` or a float; the answer ends the episode with
    ``finish == "answer"``; ``max_turns`` tool turns end it at the next tool call with
    ``finish == "max_turns"``; stepping a done episode raises ``RuntimeError``; ``close`` is
    idempotent; ``concurrency`` episodes step at once; the row is not modified; ``close`` of
    the environment ends an episode still open; no call hangs (each within ``timeout_s +
    grace_s``); ``reset`` and ``step`` never hold the event loop longer than ``max_block_s``
    at a time (the rollout manager, heartbeats and every other episode share that loop).
    Raises ``ContractError`` (an ``AssertionError``) naming the broken rule.
    """
    if isinstance(parser, str):
        from laminar_core.envs import make_parser

        parser = make_parser(parser)
    ctx = EnvContext(max_turns=max_turns, timeout_s=timeout_s, parser=parser, options=options)
    env = make_env(ctx)
    if inspect.isawaitable(env):
        env = await env
    require(
        isinstance(env, Environment),
        f"make_env built {type(env).__name__}, not an Environment: subclass "
        "laminar_core.Environment (or build it with make_environment)",
    )
    limit = timeout_s + grace_s
    watch = LoopWatch()

    async def within(aw: Awaitable[Any], what: str, watched: bool = False) -> Any:
        task = asyncio.ensure_future(aw)
        if watched:
            watch.arm()
        done, _ = await asyncio.wait({task}, timeout=limit)
        stall = watch.disarm() if watched else None
        if not done:
            task.cancel()
            raise ContractError(
                f"{what} did not return within {limit:.0f} s (timeout_s + grace_s): bound "
                "every tool call by ctx.timeout_s and answer a timeout with an observation"
            )
        if stall is not None and stall.held_s > max_block_s:
            raise ContractError(
                f"{what} held the event loop for {stall.held_s:.2f} s without yielding (at "
                f"{stall.where}): "
                "the environment blocks the event loop (the rollout manager, heartbeats and "
                "every other episode stop meanwhile); await slow work off the loop "
                "(asyncio.to_thread, an asyncio subprocess, an async HTTP client)"
            )
        return task.result()

    async def step(ep: Episode, text: str, what: str) -> StepResult:
        try:
            result = await within(ep.step(text), what, watched=True)
        except AssertionError:
            raise
        except Exception as e:
            raise ContractError(
                f"{what} raised {type(e).__name__}: {e} (what the model or its tool does must "
                "come back as an observation)"
            ) from e
        _check_result(result, what)
        return result

    await within(env.start(), "start()")
    watch.start()
    try:
        require(
            isinstance(env.stop, tuple) and all(isinstance(s, str) and s for s in env.stop),
            f"Environment.stop is {env.stop!r}: a tuple of non-empty strings (the parser's "
            "stop strings, ctx.parser.stop, are the usual value)",
        )
        specs = env.tool_specs()
        require(
            isinstance(specs, list),
            f"tool_specs() returned {type(specs).__name__}: a list of OpenAI-style tool schemas",
        )
        json.dumps(specs)
        original = copy.deepcopy(row)

        # 1. a tool turn, then the answer
        ep = await within(env.reset(row), "reset(row)", watched=True)
        require(
            isinstance(ep, Episode),
            f"reset() returned {type(ep).__name__}: an Episode (laminar_core.Episode)",
        )
        r = await step(ep, tool_turn, "step(tool_turn)")
        require(
            not r.done and r.observation,
            f"a tool call gave {r}: run the calls ctx.parser.parse finds, and return their "
            "outputs as the observation with done=False",
        )
        require(
            ep.turns == 1,
            f"after one tool turn, Episode.turns is {ep.turns}: count each tool turn",
        )
        r = await step(ep, answer_turn, "step(answer_turn)")
        require(
            r.done and r.info.get("finish") == "answer",
            f"a turn with no tool call gave {r}: a turn the parser finds no call in is the "
            "model's answer: return done=True, info finish='answer'",
        )
        try:
            await within(ep.step(tool_turn), "step() after done")
        except RuntimeError:
            pass
        else:
            raise ContractError(
                "step() on a done episode did not raise RuntimeError (a done or closed "
                "episode refuses steps: the loop never steps one, so a step is a caller bug)"
            )
        await within(ep.close(), "Episode.close()")
        await within(ep.close(), "a second Episode.close()")

        # 2. max_turns tool turns, then the next tool call ends the episode
        ep = await env.reset(row)
        for i in range(max_turns):
            r = await step(ep, tool_turn, f"tool turn {i + 1} of max_turns={max_turns}")
            require(
                not r.done,
                f"tool turn {i + 1} of max_turns={max_turns} ended the episode: {r} (the "
                "episode goes on until Episode.turns == ctx.max_turns)",
            )
        r = await step(ep, tool_turn, "the tool turn after max_turns")
        require(
            r.done and r.info.get("finish") == "max_turns" and ep.turns == max_turns,
            f"the tool call after max_turns={max_turns} did not end the episode with finish "
            f"'max_turns' (it gave {r}, Episode.turns {ep.turns}): once Episode.turns == "
            "ctx.max_turns, the next tool call is not run: return done=True, info "
            "finish='max_turns'",
        )
        await ep.close()

        # 3. a timeout is an observation, and the episode goes on
        if slow_turn is not None:
            ep = await env.reset(row)
            r = await step(ep, slow_turn, f"step(slow_turn) with timeout_s={timeout_s}")
            require(
                not r.done and r.observation and r.info.get("error") == "timeout",
                f"a call that outlasts timeout_s={timeout_s} gave {r}: stop it after "
                "ctx.timeout_s and say so in the observation, with info error='timeout' and "
                "done=False (the episode goes on)",
            )
            r = await step(ep, tool_turn, "step(tool_turn) after a timeout")
            require(
                not r.done and r.observation,
                f"the call after a timeout gave {r}: a timeout must leave the episode usable",
            )
            await ep.close()

        # 4. a malformed call is an observation naming the error
        if bad_turn is not None:
            ep = await env.reset(row)
            r = await step(ep, bad_turn, "step(bad_turn)")
            require(
                not r.done and r.observation and r.info.get("error"),
                f"a malformed call gave {r}: answer it with an observation naming the error "
                "(the model reads it), info error set (e.g. 'parse_error'), done=False",
            )
            await ep.close()

        # 5. concurrent episodes
        eps = [await env.reset(row) for _ in range(concurrency)]
        results = await within(
            asyncio.gather(*(ep.step(tool_turn) for ep in eps)),
            f"{concurrency} concurrent step(tool_turn)",
            watched=True,
        )
        for i, r in enumerate(results):
            _check_result(r, f"concurrent episode {i}")
            require(
                not r.done and r.observation,
                f"concurrent episode {i} gave {r}: episodes step concurrently (keep an "
                "episode's state in the episode, bound shared resources with a semaphore)",
            )
        for ep in eps:
            await ep.close()

        require(
            row == original,
            "the environment modified the prompt row (the row is the prompt's, read by the "
            "reward and the other samples: copy what you change)",
        )
        # 6. an episode left open is ended by the environment's close
        await env.reset(row)
    finally:
        watch.stop()
        await within(env.close(), "Environment.close()")
    if leftovers is not None:
        left = leftovers()
        require(
            not left,
            f"left behind after close(): {left!r}: Environment.close() ends every episode and "
            "releases what start() acquired (processes, files, sockets)",
        )


def _check_result(r: Any, what: str) -> None:
    require(
        isinstance(r, StepResult),
        f"{what} returned {type(r).__name__}: a StepResult(observation, done, reward, info)",
    )
    require(
        isinstance(r.observation, str) and isinstance(r.done, bool),
        f"{what} returned {r!r}: observation a str, done a bool",
    )
    require(
        not r.done or r.observation == "",
        f"{what}: done with a non-empty observation {r.observation!r}: a done step's "
        "observation is '' (nothing follows it)",
    )
    require(
        r.reward is None or isinstance(r.reward, (int, float)),
        f"{what}: reward {r.reward!r}: None (the run's reward.fn scores) or a float",
    )
    require(
        isinstance(r.info, dict),
        f"{what}: info is {type(r.info).__name__}: a JSON-able dict",
    )
    try:
        json.dumps(r.info)
    except (TypeError, ValueError) as e:
        raise ContractError(
            f"{what}: info is not JSON-able ({e}): the loop writes it to the run's events"
        ) from None
