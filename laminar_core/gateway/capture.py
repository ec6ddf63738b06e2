"""A session's samples: the exact token ids the model saw and sampled, as trajectories.

A :class:`Sample` is one training sample: the first call's prompt, then, call after call,
the ids the call added before generating (the template's tail after the model's last
turn, the new messages, the generation prompt: loss mask 0, log-prob 0) and the ids it
sampled (loss mask 1, their sampled log-probs). Nothing is ever re-tokenised: the next
call's prompt is this sample's ids plus the new ones, so what the trainer scores is token
for token what the engine produced and observed. Each token records the weight version
of the call that added it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from laminar_core.gateway.backend import TurnResult
from laminar_core.gateway.messages import Message
from laminar_core.types import FinishReason, Trajectory

__all__ = ["CallRecord", "Sample"]


@dataclass(slots=True)
class CallRecord:
    """One call a sample took: who served it, what it cost, how it ended."""

    call_index: int
    version: int
    replica: str
    prompt_tokens: int
    observed_tokens: int  # ids this call added before generating
    completion_tokens: int
    finish_reason: str
    seconds: float


@dataclass
class Sample:
    """One training sample of a session (see the module docstring).

    ``kind``: ``chat`` (``/v1/chat/completions``; ``messages`` is the conversation the ids
    hold, ending with the model's turn as it was returned, and ``tools_key`` the tools it
    was rendered with) or ``text`` (``/v1/completions``; ``text`` is the prompt plus the
    returned completion, or ``None`` when the prompt came as token ids). ``busy`` while a
    call on it runs: a concurrent call cannot extend it.
    """

    index: int
    kind: str
    prompt_ids: list[int]
    reason: str  # why it started: "first", or why the call did not extend another sample
    messages: list[Message] = field(default_factory=list)
    tools_key: str = ""
    text: str | None = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    busy: bool = False
    start_time: float = field(default_factory=time.monotonic)
    finish_time: float = 0.0
    last_finish: FinishReason = FinishReason.STOP
    last_sampled: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def context(self) -> list[int]:
        """Every id the sample holds: what the next call's prompt starts with."""
        return [*self.prompt_ids, *self.response_ids]

    def commit(self, observed: list[int], result: TurnResult, record: CallRecord) -> None:
        """Append one call: ``observed`` (added before generating; empty on the first
        call, whose prompt is ``prompt_ids``) and the ids ``result`` sampled with their
        log-probs, all stamped with its version."""
        sampled = result.ids
        if len(sampled) != len(result.logprobs):
            raise ValueError(f"{len(sampled)} sampled ids but {len(result.logprobs)} log-probs")
        self.response_ids += [*observed, *sampled]
        self.loss_mask += [0] * len(observed) + [1] * len(sampled)
        self.logprobs += [0.0] * len(observed) + [float(x) for x in result.logprobs]
        self.token_versions += [result.version] * (len(observed) + len(sampled))
        self.calls.append(record)
        self.last_finish = result.finish_reason
        self.last_sampled = list(sampled)
        self.finish_time = time.monotonic()

    def trajectory(self, session_id: str, group_id: str, metadata: dict[str, Any]) -> Trajectory:
        """The sample as the trainer gets it: ``prompt_ids`` the first call's prompt,
        ``response_ids`` everything after, ``loss_mask`` 1 on sampled ids, ``logprobs``
        (0 where masked), ``token_versions``, ``versions`` (distinct, oldest first) and
        ``version`` (the oldest), ``replicas`` (per call). ``metadata`` gets the session's
        and ``gateway`` (session, sample, fork reason, per-call records)."""
        versions = sorted({c.version for c in self.calls})
        meta = dict(metadata)
        meta["gateway"] = {
            "session": session_id,
            "sample": self.index,
            "kind": self.kind,
            "reason": self.reason,
            "calls": [
                {
                    "call": c.call_index,
                    "version": c.version,
                    "replica": c.replica,
                    "prompt_tokens": c.prompt_tokens,
                    "observed_tokens": c.observed_tokens,
                    "completion_tokens": c.completion_tokens,
                    "finish_reason": c.finish_reason,
                    "seconds": c.seconds,
                }
                for c in self.calls
            ],
        }
        return Trajectory(
            traj_id=f"{session_id}.{self.index}",
            group_id=group_id,
            version=versions[0],
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            num_prompt_tokens=len(self.prompt_ids),
            num_response_tokens=len(self.response_ids),
            finish_reason=self.last_finish,
            versions=versions,
            replicas=[c.replica for c in self.calls],
            start_time=self.start_time,
            finish_time=self.finish_time,
            metadata=meta,
            loss_mask=list(self.loss_mask),
            token_versions=list(self.token_versions),
        )
