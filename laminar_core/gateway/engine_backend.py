"""A ``TurnBackend`` that calls rollout engines directly (no rollout manager).

Each call is one ``RolloutEngine.generate`` of the call's context. A session sticks to the
replica that served its last call (its KV cache holds the session's prefix there), unless
that replica is gone; a new session goes to the replica with the fewest calls running.
A replica that raises ``ReplicaFailure`` is set aside and the call answered 503 (the agent
may retry it: nothing was recorded); with the rollout manager's backend such a call is
resumed on another replica instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from laminar_core.gateway.backend import BackendUnavailable, TurnBackend, TurnRequest, TurnResult
from laminar_core.interfaces.rollout import ReplicaFailure, RolloutEngine
from laminar_core.types import FinishReason, GenerationRequest

__all__ = ["EngineTurnBackend"]


class EngineTurnBackend(TurnBackend):
    """Serves calls on ``engines`` (started; the caller stops them)."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        if not engines:
            raise ValueError("EngineTurnBackend needs at least one rollout engine")
        self.engines = {e.replica_id: e for e in engines}
        self.running = dict.fromkeys(self.engines, 0)
        self.dead: set[str] = set()
        self._home: dict[str, str] = {}  # session -> replica of its last call

    def _pick(self, session_id: str) -> RolloutEngine:
        live = [r for r in self.engines if r not in self.dead]
        if not live:
            raise BackendUnavailable("every replica has failed", retry_after_s=5)
        home = self._home.get(session_id)
        replica = home if home in live else min(live, key=lambda r: self.running[r])
        return self.engines[replica]

    async def generate_turn(self, request: TurnRequest) -> TurnResult:
        engine = self._pick(request.session_id)
        rid = engine.replica_id
        self.running[rid] += 1
        try:
            traj = await engine.generate(
                GenerationRequest(
                    traj_id=f"{request.sample_id}#{request.call_index}",
                    group_id=request.group_id,
                    prompt_ids=list(request.prompt_ids),
                    sampling=request.sampling,
                    metadata=dict(request.metadata),
                )
            )
        except ReplicaFailure as e:
            self.dead.add(rid)
            raise BackendUnavailable(f"replica {rid} failed: {e}") from e
        finally:
            self.running[rid] -= 1
        if traj.finish_reason in (FinishReason.ABORTED, FinishReason.FAILED):
            raise BackendUnavailable(f"replica {rid} cut the call off ({traj.finish_reason.value})")
        self._home[request.session_id] = rid
        versions = traj.versions or [traj.version]
        return TurnResult(
            list(traj.response_ids), list(traj.logprobs), traj.finish_reason, versions[-1], rid
        )

    async def session_closed(self, session_id: str) -> None:
        self._home.pop(session_id, None)
