"""Multi-turn rollouts (``loop.episodes``): a trajectory's turns, its loss mask and the
tokens the trainer scores; and the loss's respect of the mask."""

from __future__ import annotations

import asyncio

import torch

from laminar_core import AlgorithmConfig
from laminar_core.algorithms import policy_loss
from laminar_core.interfaces.environment import (
    EnvContext,
    EnvFailure,
    Environment,
    Episode,
    StepResult,
)
from laminar_core.loop.episodes import EpisodeRestart, Episodes
from laminar_core.types import FinishReason, Trajectory


class CharTokenizer:
    """One token per character (ids are code points): exact round trips."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class Echo(Environment):
    """Answers every turn with '<ok>' until ``max_turns``; the turn 'boom' breaks the
    environment (EnvFailure), 'bug' raises a plain error."""

    async def start(self) -> None:
        self.closed = 0

    async def reset(self, row):
        env = self

        class Ep(Episode):
            async def step(self, text: str) -> StepResult:
                if text == "boom":
                    raise EnvFailure("sandbox pool is gone")
                if text == "bug":
                    raise KeyError("oops")
                self.turns += 1
                if self.turns > env.ctx.max_turns:
                    return StepResult("", True, reward=1.0, info={"finish": "max_turns"})
                return StepResult("<ok>", False, info={"tool_calls": 1, "tool_seconds": 0.1})

            async def close(self) -> None:
                env.closed += 1

        return Ep()

    async def close(self) -> None:
        pass


def _traj(ids: list[int], finish=FinishReason.STOP) -> Trajectory:
    return Trajectory(
        "t0",
        "g0",
        3,
        response_ids=list(ids),
        logprobs=[-0.5] * len(ids),
        num_response_tokens=len(ids),
        finish_reason=finish,
        versions=[3],
    )


def test_observations_are_appended_as_tokens_with_mask_zero() -> None:
    async def main():
        env = Echo(EnvContext(max_turns=2))
        eps = Episodes(env, CharTokenizer(), max_tokens=100)
        await eps.start()
        tok = CharTokenizer()
        turn1 = tok.encode("ab")
        state, resume = await eps.after_turn(None, {"prompt": "x"}, _traj(turn1))
        assert resume is not None
        assert resume.response_ids == tok.encode("ab<ok>")  # the model's tokens, not re-encoded
        assert resume.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
        assert state.mask == [1, 1, 0, 0, 0, 0] and state.length == 6
        # the second turn generated "cd" after the observation (engine returns the whole)
        state, resume = await eps.after_turn(
            state, {}, _traj(resume.response_ids + tok.encode("cd"))
        )
        assert resume is not None and state.mask == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
        final = _traj(resume.response_ids + tok.encode("e"))
        state, resume = await eps.after_turn(state, {}, final)
        assert resume is None  # max_turns reached: done
        assert final.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
        assert final.metadata["env"]["turns"] == 3 and final.metadata["env"]["tool_calls"] == 2
        assert final.metadata["env_reward"] == 1.0 and env.closed == 1

    asyncio.run(main())


def test_a_broken_environment_restarts_the_trajectory_and_a_buggy_one_is_an_observation():
    async def main():
        env = Echo(EnvContext(max_turns=3))
        eps = Episodes(env, CharTokenizer(), max_tokens=100)
        await eps.start()
        tok = CharTokenizer()
        state, resume = await eps.after_turn(None, {}, _traj(tok.encode("bug")))
        assert resume is not None and "[tool error: KeyError" in CharTokenizer().decode(
            resume.response_ids
        )
        assert state.errors == {"env_error": 1}
        try:
            await eps.after_turn(None, {}, _traj(tok.encode("boom")))
            raise AssertionError("an EnvFailure must restart the trajectory")
        except EpisodeRestart as e:
            assert "sandbox pool is gone" in str(e)

    asyncio.run(main())


def test_a_masked_token_gets_no_gradient() -> None:
    cfg = AlgorithmConfig()
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -1.9, -0.6, -1.4]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # tokens 1, 2: a tool's output
    loss, _ = policy_loss(cfg, logprobs, behaviour, torch.tensor([1.0]), mask)
    loss.backward()
    grad = logprobs.grad[0]
    assert grad[1] == 0 and grad[2] == 0
    assert grad[0] != 0 and grad[3] != 0


def test_a_turn_cut_by_the_token_budget_runs_no_tool() -> None:
    """A turn that hit max_tokens ends the episode without a tool call: its code is
    unfinished, and running it would pay tool credit for rambling (a reward hack seen in a
    real run: every trajectory one unclosed, failing call)."""

    async def main():
        tok = CharTokenizer()
        for finish, max_tokens in ((FinishReason.LENGTH, 100), (FinishReason.STOP, 3)):
            env = Echo(EnvContext(max_turns=2))
            eps = Episodes(env, tok, max_tokens=max_tokens)
            await eps.start()
            traj = _traj(tok.encode("abc"), finish)
            state, resume = await eps.after_turn(None, {"prompt": "x"}, traj)
            assert resume is None and state.tool_calls == 0
            assert traj.metadata["env"]["finish"] == "length"
            assert traj.metadata["env"]["tool_calls"] == 0 and traj.loss_mask == [1, 1, 1]
            assert env.closed == 1

    asyncio.run(main())
