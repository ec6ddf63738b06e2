"""A rollout engine's record of its in-flight trajectories: what ``abort`` and ``partials``
return and what ``generate`` returns, written once for every engine.

An engine that streams its tokens (vLLM, SGLang, the guide's ``laminar-hfgen``) knows at
every moment what each trajectory has produced so far. ``InFlightTrajectories`` keeps that
record and turns it into the contract's results; the engine does only what is its own --
start a request, stream its tokens into the record, stop requests::

    self.inflight = InFlightTrajectories(replica_id)

    async def generate(self, request):
        with self.inflight.track(request, self.version) as live:
            ...  # decode up to live.remaining tokens after live.input_ids, appending to
            ...  # live.tokens / live.logprobs as they come; set live.finish
        return self.inflight.trajectory(live)

    async def abort(self, traj_ids):
        return await self.inflight.abort(traj_ids, stop=self._stop_requests)

    async def partials(self, traj_ids=None):
        return self.inflight.partials(traj_ids)

    async def update_weights(self, weights):
        self.inflight.require_idle()
        ...

Everything here runs on the engine's event loop, except that a decode thread may append to
``live.tokens`` and ``live.logprobs`` (in either order: a snapshot holds the tokens that
have their log-prob).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from laminar_core.types import FinishReason, GenerationRequest, PartialTrajectory, Trajectory

#: How long ``abort`` waits, by default, for the engine to hand back what the aborted
#: requests produced last (their streams' final pieces).
ABORT_WAIT_S = 30.0


@dataclass(eq=False)
class LiveTrajectory:
    """One in-flight trajectory: everything it has produced so far, a resumed prefix
    included. The engine appends to ``tokens`` and ``logprobs`` and sets ``finish``."""

    request: GenerationRequest
    #: the engine's id of this request (a resumed trajectory is a new request)
    request_id: str
    tokens: list[int]
    logprobs: list[float]
    #: the versions that generated it, oldest first; the last is the version the engine
    #: holds (``update_weights`` waits for an empty record)
    versions: list[int]
    #: tokens of the resumed prefix at the start of ``tokens``
    prefix: int = 0
    start: float = field(default_factory=time.monotonic)
    #: decoding has begun: tokens may still arrive (``abort`` waits for them). An engine
    #: that queues requests itself tracks them with ``started=False`` and sets it.
    started: bool = True
    aborted: bool = False
    #: how the engine says it ended: ``"stop"``, ``"length"`` or ``"abort"`` (or its own
    #: word for a stop: anything but ``"length"`` and ``"abort"`` is ``STOP``)
    finish: str | None = None
    #: an error the engine reported for this request alone
    error: str | None = None
    #: prompt tokens the engine took from its prefix cache instead of computing them (None:
    #: the engine does not say); the trajectory's ``metadata["cached_prompt_tokens"]``
    cached_tokens: int | None = None
    #: set when the request has ended (``track`` sets it on the way out)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def input_ids(self) -> list[int]:
        """What to prefill: the prompt, then the response so far (a resumed prefix)."""
        return list(self.request.prompt_ids) + self.tokens

    @property
    def remaining(self) -> int:
        """Tokens it may still generate: ``max_tokens`` bounds the whole response."""
        return self.request.sampling.max_tokens - len(self.tokens)


class InFlightTrajectories:
    """The in-flight trajectories of one replica, by trajectory id (and by the engine's
    request id); see the module docstring for how an engine uses it."""

    def __init__(self, replica_id: str, abort_wait_s: float = ABORT_WAIT_S) -> None:
        self.replica_id = replica_id
        self.abort_wait_s = abort_wait_s
        self._live: dict[str, LiveTrajectory] = {}
        self._by_request: dict[str, LiveTrajectory] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveTrajectory]:
        return iter(list(self._live.values()))

    def __contains__(self, traj_id: str) -> bool:
        return traj_id in self._live

    def find(self, request_id: str) -> LiveTrajectory | None:
        """The trajectory the engine knows as ``request_id``, while it is in flight."""
        return self._by_request.get(request_id)

    # -- generate ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def track(
        self,
        request: GenerationRequest,
        version: int,
        request_id: str | None = None,
        started: bool = True,
    ) -> Iterator[LiveTrajectory]:
        """Record ``request`` as in flight for the body of the ``with``: ``abort``,
        ``partials`` and ``held_tokens`` see it. ``version``: the version the engine holds;
        a resumed request (``request.resume``) starts from its prefix, log-probs and
        versions, with ``version`` appended when it differs from the prefix's last. On the
        way out, in any case, the trajectory leaves the record and ``live.done`` is set."""
        resume = request.resume
        prefix = list(resume.response_ids) if resume else []
        versions = list(resume.versions or [resume.version]) if resume else [version]
        if versions[-1] != version:
            versions.append(version)
        live = LiveTrajectory(
            request,
            request_id or request.traj_id,
            prefix,
            list(resume.logprobs) if resume else [],
            versions,
            prefix=len(prefix),
            started=started,
        )
        if live.remaining <= 0:
            live.finish = "length"
        self._live[request.traj_id] = live
        self._by_request[live.request_id] = live
        try:
            yield live
        finally:
            if self._live.get(request.traj_id) is live:
                del self._live[request.traj_id]
            self._by_request.pop(live.request_id, None)
            live.done.set()

    def trajectory(self, live: LiveTrajectory) -> Trajectory:
        """The finished trajectory: ``ABORTED`` when aborted (or the engine says
        ``"abort"``), ``LENGTH`` on ``"length"``, else ``STOP``; ``metadata`` is a copy of
        the request's (the reward reads the prompt's row from it), with ``resumed_tokens``
        when it continued a prefix and ``cached_prompt_tokens`` when the engine said how
        many of the prompt's tokens its prefix cache served."""
        request = live.request
        if live.aborted or live.finish == "abort":
            reason = FinishReason.ABORTED
        elif live.finish == "length":
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.STOP
        metadata = dict(request.metadata)
        if live.prefix:
            metadata["resumed_tokens"] = live.prefix
        if live.cached_tokens is not None:
            metadata["cached_prompt_tokens"] = live.cached_tokens
        return Trajectory(
            traj_id=request.traj_id,
            group_id=request.group_id,
            version=live.versions[0],
            prompt_ids=list(request.prompt_ids),
            response_ids=live.tokens,
            logprobs=live.logprobs,
            num_prompt_tokens=len(request.prompt_ids),
            num_response_tokens=len(live.tokens),
            finish_reason=reason,
            versions=list(live.versions),
            replicas=[self.replica_id],
            start_time=live.start,
            finish_time=time.monotonic(),
            metadata=metadata,
        )

    # -- abort and partials ------------------------------------------------------------------
    @staticmethod
    def partial(live: LiveTrajectory) -> PartialTrajectory:
        """A snapshot of what ``live`` has produced; its ``version`` is the one that
        generated its last tokens (the version the engine holds)."""
        n = min(len(live.tokens), len(live.logprobs))
        return PartialTrajectory(
            traj_id=live.request.traj_id,
            version=live.versions[-1],
            response_ids=live.tokens[:n],
            logprobs=live.logprobs[:n],
            num_response_tokens=n,
            versions=list(live.versions),
        )

    def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        """``RolloutEngine.partials``: snapshots of these trajectories (``None``: all),
        skipping ids not in flight."""
        ids = list(self._live) if traj_ids is None else [t for t in traj_ids if t in self._live]
        return [self.partial(self._live[t]) for t in ids]

    async def abort(
        self,
        traj_ids: list[str],
        stop: Callable[[list[LiveTrajectory]], Awaitable[object]] | None = None,
    ) -> list[PartialTrajectory]:
        """``RolloutEngine.abort``: mark these trajectories aborted (ids not in flight are
        skipped), ``await stop(lives)`` (the engine's own abort of those requests; ``None``
        when its decode loop watches ``live.aborted``), wait up to ``abort_wait_s`` for the
        started ones to end -- their last tokens arrive meanwhile -- and return their
        snapshots. Their ``generate`` calls then return ``ABORTED`` (``trajectory``)."""
        lives = [self._live[t] for t in traj_ids if t in self._live]
        if not lives:
            return []
        for live in lives:
            live.aborted = True
        if stop is not None:
            await stop(lives)
        running = [live.done.wait() for live in lives if live.started]
        if running:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*running), self.abort_wait_s)
        return [self.partial(live) for live in lives]

    # -- weights and load --------------------------------------------------------------------
    def require_idle(self) -> None:
        """Raise unless nothing is in flight: a weight update now would mix versions inside
        one trajectory (the rollout manager never does it)."""
        if self._live:
            raise RuntimeError(
                f"replica {self.replica_id}: update_weights with {len(self._live)} "
                "trajectories in flight would mix weight versions inside one trajectory"
            )

    def held_tokens(self, block_size: int = 1) -> int:
        """Prompt + response tokens of the trajectories in flight, each rounded up to whole
        KV blocks of ``block_size`` tokens: what they hold in a KV cache (``stats``)."""
        b = max(1, block_size)
        return b * sum(
            -(-(len(live.request.prompt_ids) + len(live.tokens)) // b)
            for live in self._live.values()
        )
