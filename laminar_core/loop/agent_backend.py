"""The gateway's calls placed by the rollout manager: ``ManagerTurnBackend``.

Every model call of an agent session (``laminar_core.gateway``) is one ``generate`` on a
replica the manager's supervisor has open, so agent calls live by the same rules as the
loop's own rollouts:

* **placement**: a call goes to an open replica with room (``rollout.max_concurrent``) and a
  recent enough version (the schedule's ``min_version`` for the session's batch tag);
  among those the newest version, then the replica that served the session's last call
  (its KV cache holds the session's prefix), then the least loaded: the one rule of
  ``loop.placement.choose_call_replica``, which the loop's multi-turn turns (and so the
  simulator's agent workload) are placed by too. Nothing open with room: the call waits
  for the manager's next dispatch (``Placement.changed``: a call or trajectory ended, a
  replica opened, pulled, failed or came back), bounded by the session's wall clock;
  every replica dead: ``BackendUnavailable`` (503 with ``Retry-After``).
* **weight pulls at call boundaries**: a call is in its replica's ``inflight`` while it
  generates, so the replica's driver pulls a newer version only between calls (a DRAINING
  replica takes no new call; a session's next call goes to a replica that is open).
* **version policy** ``pin``: a session's first call pins its replica
  (``ReplicaSupervisor.pin``): it starts no pull until the session closes, and the
  session's calls all go there, on one version. That is what ``pin`` costs: a pinned
  replica lags the trainer for as long as its longest session lasts (the staleness of
  what it generates grows with it) and the sessions' calls queue on it. If the pinned
  replica fails, the session is re-pinned on the newest open replica (its tokens then
  record two versions).
* **eval rounds** (``loop.evaluation``): an eval session's calls go only to replicas holding
  the round's version (the trainer waits for the round, so none moves past it).
* **failover**: a replica that fails under a call (``ReplicaFailure``, or the heartbeat or
  another call declaring it dead) is failed in the manager (its restart follows) and the
  call generated again from the same prompt ids on another replica, up to ``retries``
  times; then ``BackendUnavailable``. A call cut off by a partial-rollout interrupt is
  generated again as well. A turn is always one version's, whole: nothing of a failed
  attempt reaches the session, so the captured tokens stay what one engine sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any, Protocol

from laminar_core.gateway import BackendUnavailable, TurnBackend, TurnRequest, TurnResult
from laminar_core.interfaces import ReplicaFailure
from laminar_core.loop.placement import choose_call_replica
from laminar_core.loop.supervisor import RESTARTING, Pin, ReplicaSlot
from laminar_core.types import FinishReason, GenerationRequest

log = logging.getLogger(__name__)

__all__ = ["ManagerTurnBackend"]

_WATCH_S = 0.5  # how often a running call looks at its replica (declared dead meanwhile?)


class Manager(Protocol):
    """What the backend needs of the rollout manager (``loop.manager.RolloutManager``)."""

    supervisor: Any  # ReplicaSupervisor: the open replicas, pins
    slots: list[ReplicaSlot]
    admission: Any  # the schedule's admission rule: min_version per batch tag
    opt: Any  # ManagerOptions: max_concurrent
    placement: Any  # kick(): dispatch again; changed: set on every dispatch
    tasks: Any  # ManagerTasks: stopping

    def fail_replica(self, slot: ReplicaSlot, reason: str) -> None: ...


class _Retry(Exception):
    """This attempt produced nothing usable; generate the call again elsewhere.
    ``failure``: it counts against ``retries`` (a replica failed; an interrupt for a
    weight update or a repack does not)."""

    def __init__(self, message: str, failure: bool = True) -> None:
        super().__init__(message)
        self.failure = failure


class ManagerTurnBackend(TurnBackend):
    """Places the gateway's calls through ``manager`` (module docstring)."""

    def __init__(self, manager: Manager, version_policy: str = "latest", retries: int = 2):
        if version_policy not in ("latest", "pin"):
            raise ValueError(f"version_policy must be latest or pin, got {version_policy!r}")
        self.manager = manager
        self.policy = version_policy
        self.retries = retries
        self._home: dict[str, str] = {}  # session -> replica of its last call
        self._pins: dict[str, Pin] = {}  # session -> its pinned replica (policy pin)
        self._ids = itertools.count()
        self.calls = 0  # served
        self.retried = 0  # attempts generated again (replica failed, call cut off)
        self.unavailable = 0  # answered BackendUnavailable
        # a session's later calls: on the replica of its previous call (whose KV cache may
        # hold the session's prefix) or elsewhere (its whole context is prefilled again)
        self.stayed = 0
        self.moved = 0

    # -- placement ---------------------------------------------------------------------------
    def _need(self, request: TurnRequest) -> int | None:
        tag = request.metadata.get("batch_tag")
        return None if tag is None else self.manager.admission.min_version(int(tag))

    def _choose(self, request: TurnRequest) -> ReplicaSlot | None:
        """The replica for this call now, or None (none has room: wait)."""
        sup = self.manager.supervisor
        limit = self.manager.opt.max_concurrent
        pin = self._pins.get(request.session_id)
        if pin is not None:
            slot = pin.slot
            if slot.alive and slot.incarnation == pin.incarnation:
                return slot if len(slot.inflight) < limit else None
            # its replica failed: the version went with it; pin the session anew
            sup.unpin(self._pins.pop(request.session_id))
        best = choose_call_replica(
            sup.open.values(),
            limit,
            home=self._home.get(request.session_id),
            min_version=self._need(request),
            version=request.metadata.get("eval_version"),  # an eval round's: that one only
        )
        exact = request.metadata.get("eval_version")
        if best is not None and self.policy == "pin" and exact is None:
            self._pins[request.session_id] = sup.pin(best)
        return best

    async def _place(self, request: TurnRequest) -> ReplicaSlot:
        changed = self.manager.placement.changed
        while True:
            # cleared before looking, set by the manager's next dispatch: nothing between the
            # look and the wait can change the replicas (no await), so no change is missed
            changed.clear()
            slot = self._choose(request)
            if slot is not None:
                return slot
            if self.manager.tasks.stopping:
                raise BackendUnavailable("the run is stopping", retry_after_s=5.0)
            if not any(s.alive or s.phase is RESTARTING for s in self.manager.slots):
                raise BackendUnavailable("every replica has failed", retry_after_s=5.0)
            await changed.wait()

    # -- a call ------------------------------------------------------------------------------
    async def generate_turn(self, request: TurnRequest) -> TurnResult:
        attempt = 0
        while True:
            slot = await self._place(request)
            try:
                result = await self._run(slot, request)
            except _Retry as e:
                if e.failure:
                    attempt += 1
                if attempt > self.retries:
                    self.unavailable += 1
                    raise BackendUnavailable(
                        f"the call failed on {attempt} replica(s), the last {e}", retry_after_s=2.0
                    ) from None
                self.retried += 1
                log.warning(
                    "gateway call %s#%d: %s; generating it again",
                    request.sample_id,
                    request.call_index,
                    e,
                )
                continue
            self.calls += 1
            home = self._home.get(request.session_id)
            if home is not None:
                if home == result.replica:
                    self.stayed += 1
                else:
                    self.moved += 1
            self._home[request.session_id] = result.replica
            return result

    async def _run(self, slot: ReplicaSlot, request: TurnRequest) -> TurnResult:
        """One attempt on ``slot``; ``_Retry`` when it yields no whole turn."""
        rid, incarnation = slot.replica_id, slot.incarnation
        call_id = f"agent:{request.sample_id}#{request.call_index}:{next(self._ids)}"
        req = GenerationRequest(
            traj_id=call_id,
            group_id=request.group_id,
            prompt_ids=list(request.prompt_ids),
            num_prompt_tokens=len(request.prompt_ids),
            sampling=request.sampling,
            metadata=dict(request.metadata),
        )
        slot.inflight.add(call_id)
        task = asyncio.ensure_future(slot.engine.generate(req))
        try:
            # the heartbeat (or another call) may declare the replica dead while this call
            # waits on it: then the call is not waited for any longer
            while not task.done():
                await asyncio.wait({task}, timeout=_WATCH_S)
                if not task.done() and (not slot.alive or slot.incarnation != incarnation):
                    task.cancel()
                    raise _Retry(f"replica {rid} failed under it")
            try:
                traj = task.result()
            except ReplicaFailure as e:
                if slot.incarnation == incarnation:
                    self.manager.fail_replica(slot, str(e))
                raise _Retry(f"replica {rid} failed: {e}") from None
            except asyncio.CancelledError:
                raise _Retry(f"replica {rid} cancelled it") from None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            slot.inflight.discard(call_id)
            if not slot.inflight:
                slot.wake.set()  # it may pull a newer version now
            self.manager.placement.kick()
        if traj.finish_reason is FinishReason.ABORTED:  # a partial-rollout interrupt
            raise _Retry(f"replica {rid} interrupted it", failure=False)
        if traj.finish_reason is FinishReason.FAILED:
            raise _Retry(f"replica {rid} failed it ({traj.error})")
        versions = traj.versions or [traj.version]
        if len(set(versions)) > 1:  # a turn is one version's (module docstring)
            raise _Retry(f"replica {rid} generated it with versions {versions}")
        return TurnResult(
            list(traj.response_ids),
            list(traj.logprobs),
            traj.finish_reason,
            versions[-1],
            rid,
        )

    async def session_closed(self, session_id: str) -> None:
        self._home.pop(session_id, None)
        pin = self._pins.pop(session_id, None)
        if pin is not None:
            self.manager.supervisor.unpin(pin)
            pin.slot.wake.set()  # a pull it held back may go ahead
