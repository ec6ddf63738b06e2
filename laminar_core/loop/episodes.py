"""Multi-turn rollouts: a trajectory that alternates model turns and tool calls.

With an environment configured (``env.name``), every trajectory has an ``Episode``. A
model turn is one ``generate`` call that ends at the parser's stop string (a tool call) or
at the end of the answer; ``Episodes.after_turn`` hands the turn's text to the episode and
gets back the tool's observation, which is appended to the trajectory **as tokens** (the
model's own tokens are never re-tokenised: what the trainer scores is token for token what
the engine generated) with loss mask 0. The observation is untrusted text, tokenised with
special-token strings as plain text (``encode_untrusted``), except the spans the parser
names as its markup (``StepResult.markup``: a chat template's turn tokens). The next turn is
a resumed ``generate`` from prompt + everything so far. While the tool runs the trajectory
is on no replica: it holds no batch slot, and the replica may take other work or load a new
version (a turn records the version that generated it; the trajectory's ``versions`` lists
them).

What the manager keeps per trajectory (``InFlight.episode``): the episode, the loss mask of
the response so far up to the last observation (every token after it was generated), the
turn and tool-call counts and the tool latencies, which end up in ``Trajectory.metadata``
(``env``) and the step's metrics.

The tool is bounded in time twice: by the environment (``env.timeout_s`` per call: a timeout
is an observation) and here (a step that does not return within twice that is answered with
an observation saying so). A step that raises is an observation too, except
``EnvFailure`` (the environment itself is broken): that trajectory starts over from its
prompt with a new episode. Nothing is lost either way.

Without a tokenizer (simulated engines) observations are counted, not encoded: an
environment then reports ``info["observation_tokens"]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from laminar_core.interfaces.environment import EnvFailure, Environment, Episode, StepResult
from laminar_core.text import encode_untrusted
from laminar_core.types import PartialTrajectory, Trajectory

log = logging.getLogger(__name__)


@dataclass
class EpisodeState:
    """A trajectory's progress through its episode (see module docstring)."""

    episode: Episode
    mask: list[int] = field(default_factory=list)  # response tokens up to the last observation
    length: int = 0  # response tokens up to the last observation (== len(mask) with tokens)
    turns: int = 0  # model turns ended so far
    tool_calls: int = 0
    observation_tokens: int = 0  # appended with loss mask 0, all turns
    tool_seconds: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    reward: float | None = None  # the environment's score, when it gives one


class EpisodeRestart(Exception):
    """The environment failed under this trajectory: start it over from its prompt."""


class Episodes:
    """Drives the episodes of one run's trajectories (see module docstring)."""

    def __init__(self, env: Environment, tokenizer: Any = None, max_tokens: int = 0) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens  # response budget (model tokens + observations)
        self.step_timeout_s = 2 * env.ctx.timeout_s + 5.0
        self._open: set[Episode] = set()

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.env.stop)

    async def start(self) -> None:
        await self.env.start()

    async def close(self) -> None:
        for ep in list(self._open):
            await self._close(ep)
        await self.env.close()

    async def _close(self, ep: Episode) -> None:
        self._open.discard(ep)
        try:
            await ep.close()
        except Exception as e:  # an episode that cannot close must not stop the run
            log.warning("closing an episode failed: %s: %s", type(e).__name__, e)

    async def forget(self, state: EpisodeState | None) -> None:
        """A trajectory starts over from its prompt (or is dropped): end its episode."""
        if state is not None:
            await self._close(state.episode)

    async def after_turn(
        self, state: EpisodeState | None, row: dict[str, Any], traj: Trajectory
    ) -> tuple[EpisodeState, PartialTrajectory | None]:
        """A model turn ended (``traj``: everything generated so far). Returns the state and
        the resume point of the next turn, or ``None`` when the episode is done (``traj``
        then carries its loss mask, the episode's reward and metadata)."""
        if state is None:
            try:
                episode = await asyncio.wait_for(self.env.reset(row), self.step_timeout_s)
            except (EnvFailure, asyncio.TimeoutError) as e:
                raise EpisodeRestart(f"the environment could not start an episode: {e}") from e
            self._open.add(episode)
            state = EpisodeState(episode)
        new_ids = traj.response_ids[state.length :]
        new_count = traj.num_response_tokens - state.length
        state.turns += 1
        budget_left = self.max_tokens <= 0 or traj.num_response_tokens < self.max_tokens
        if not budget_left or traj.finish_reason.value == "length":
            # The turn was cut by the token budget, not ended by the model: a tool call in it
            # is unfinished and runs nothing (running it paid tool credit for rambling code).
            result = StepResult("", True, info={"finish": "length"})
        else:
            result = await self._step(state, self._text(new_ids))
        if result.done:
            self._finish(state, traj, new_count, result)
            await self._close(state.episode)
            return state, None
        obs_ids = self._encode(result)
        obs_count = (
            len(obs_ids)
            if self.tokenizer is not None
            else int(result.info.get("observation_tokens", 0))
        )
        if traj.response_ids:  # without token ids (simulated engines) only counts are kept
            state.mask += [1] * new_count + [0] * obs_count
        state.observation_tokens += obs_count
        state.length = traj.num_response_tokens + obs_count
        versions = traj.versions or [traj.version]
        resume = PartialTrajectory(
            traj.traj_id,
            versions[-1],
            response_ids=[*traj.response_ids, *obs_ids],
            logprobs=[*traj.logprobs, *([0.0] * len(obs_ids))],
            num_response_tokens=state.length,
            versions=list(versions),
        )
        return state, resume

    async def _step(self, state: EpisodeState, text: str) -> StepResult:
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(state.episode.step(text), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._count(state, "no_answer")
            return StepResult(
                f"[the tool did not answer within {self.step_timeout_s:.0f}s]", done=False
            )
        except EnvFailure as e:
            raise EpisodeRestart(str(e)) from e
        except Exception as e:  # an environment bug is the model's observation, not a crash
            self._count(state, "env_error")
            log.warning("environment step raised %s: %s", type(e).__name__, e)
            return StepResult(f"[tool error: {type(e).__name__}: {e}]", done=False)
        calls = int(result.info.get("tool_calls", 0))
        state.tool_calls += calls
        if calls:
            state.tool_seconds.append(float(result.info.get("tool_seconds", time.monotonic() - t0)))
        if result.info.get("error"):
            self._count(state, str(result.info["error"]))
        if result.reward is not None:
            state.reward = float(result.reward)
        return result

    def _count(self, state: EpisodeState, kind: str) -> None:
        state.errors[kind] = state.errors.get(kind, 0) + 1

    def _finish(
        self, state: EpisodeState, traj: Trajectory, new_count: int, result: StepResult
    ) -> None:
        traj.loss_mask = [*state.mask, *([1] * new_count)] if traj.response_ids else []
        traj.metadata["env"] = {
            "turns": state.turns,
            "tool_calls": state.tool_calls,
            "observation_tokens": state.observation_tokens,
            "tool_seconds": state.tool_seconds,
            "errors": state.errors,
            "finish": result.info.get("finish", "answer" if result.done else "length"),
        }
        if state.reward is not None:
            traj.metadata["env_reward"] = state.reward

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode(self, result: StepResult) -> list[int]:
        """The observation's ids: its markup spans as written, the rest untrusted."""
        text = result.observation
        if self.tokenizer is None or not text:
            return []
        ids: list[int] = []
        at = 0
        for start, end in sorted(result.markup):
            start, end = max(start, at), min(end, len(text))
            if start >= end:
                continue
            ids += encode_untrusted(self.tokenizer, text[at:start])
            ids += self.tokenizer.encode(text[start:end], add_special_tokens=False)
            at = end
        return ids + encode_untrusted(self.tokenizer, text[at:])
