"""Driver-side proxies that make Ray actors look like engines to the loop.

``RayRolloutEngine`` is a ``RolloutEngine`` whose every method awaits the replica's actor; a
dead actor surfaces as ``ReplicaFailure``, which the rollout manager already handles
(redirect in-flight trajectories, carry on). ``RayTrainerGroup`` is the ``TrainerGroup`` of
rank actors: each call runs on every rank at once (FSDP's collectives need them all) and
answers with rank 0's result.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray

from laminar_core.interfaces import (
    ReplicaFailure,
    RolloutEngine,
    TensorWeights,
    TrainerFailure,
    WeightsRef,
)
from laminar_core.relay.push import Export, Outgoing, Push
from laminar_core.relay.tier import PublishResult, RelayTier
from laminar_core.runtime.ray_calls import ACTOR_GONE, RayTaskError, engine_error
from laminar_core.types import (
    EngineStats,
    GenerationRequest,
    PartialTrajectory,
    TrainBatch,
    Trajectory,
    WeightManifest,
    manifest_from_json,
)


class RayRolloutEngine(RolloutEngine):
    """A replica actor as a ``RolloutEngine``. ``shm_files`` lists the shared-memory files
    its engine mapped once started (the runtime removes them if the actor dies without a
    goodbye). ``score`` is forwarded as is: the config checked that the actor's engine has
    it (``algorithm.teacher``)."""

    scores_tokens = True

    def __init__(self, replica_id: str, handle: Any) -> None:
        self.replica_id = replica_id
        self.handle = handle
        self.shm_files: list[str] = []
        self._starting: asyncio.Future | None = None

    async def _remote(self, call: Any) -> Any:
        try:
            return await call
        except ACTOR_GONE as e:
            raise ReplicaFailure(f"replica {self.replica_id}: actor gone ({e})") from e
        except RayTaskError as e:
            raise engine_error(e) from None

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._remote(self.handle.call.remote(method, *args))

    async def start(self) -> None:
        """Start the engine; once: the runtime starts it early (concurrently with the
        trainer's set-up), the rollout manager's call then waits for that same start."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
            # a start whose awaiters were all cancelled (a restart the run's close stopped,
            # then its actor killed) fails with no one to read it: read here, not logged as
            # "Task exception was never retrieved"; awaiters still get the exception
            self._starting.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        await self._remote(self.handle.start.remote())
        self.shm_files = await self._remote(self.handle.shm_files.remote())

    async def generate(self, request: GenerationRequest) -> Trajectory:
        return await self._call("generate", request)

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        return await self._call("abort", list(traj_ids))

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        return await self._call("partials", traj_ids)

    async def update_weights(self, weights: WeightsRef) -> None:
        if isinstance(weights, TensorWeights):
            # Relays in the driver: one object in Ray's shared-memory store per version and
            # replica; the actor maps it.
            ref = ray.put(list(weights))
            await self._remote(self.handle.load.remote(weights.version, ref))
            return
        # a node relay's shared memory (a few bytes: the replica maps the weights on its
        # own node), or a version without tensors
        await self._call("update_weights", weights)

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return await self._call("score", list(prompt_ids), list(response_ids))

    async def stats(self) -> EngineStats:
        return await self._call("stats")

    async def stop(self) -> None:
        with contextlib.suppress(ReplicaFailure):
            await self._call("stop")


_COLLECTIVE_ERRORS = ("gloo", "nccl", "connection closed", "connection reset", "timed out")


def _collective_error(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, RuntimeError | ConnectionError) and any(
        m in text for m in _COLLECTIVE_ERRORS
    )


class RayTrainerGroup:
    """All ranks of one trainer group (``loop.trainer_group.TrainerGroup``). A rank whose
    actor is gone fails the call with ``TrainerFailure`` (the controller restarts the group);
    an engine's own exception surfaces as itself."""

    def __init__(self, handles: list[Any], init_method: str, options: dict) -> None:
        self.handles = handles
        self.init_method = init_method
        self.options = options

    async def _all(self, calls: list[Any]) -> list[Any]:
        try:
            return await asyncio.gather(*calls)
        except ACTOR_GONE as e:
            raise TrainerFailure(f"a trainer rank is gone: {e}") from e
        except RayTaskError as e:
            cause = engine_error(e)
            # A rank that died takes its peers' collectives down with it, often before Ray
            # reports the death: a failed call with a dead rank, or a collective's own error
            # (a peer's connection closed, a timeout), is the group's failure.
            if not await self._all_alive() or _collective_error(cause):
                raise TrainerFailure(f"the trainer group broke: {cause}") from cause
            raise cause from None

    async def _all_alive(self, timeout_s: float = 10.0) -> bool:
        try:
            await asyncio.wait_for(
                asyncio.gather(*(h.ping.remote() for h in self.handles)), timeout_s
            )
            return True
        except Exception:
            return False

    async def _call(self, method: str, *args: Any) -> list[Any]:
        return await self._all([h.call.remote(method, *args) for h in self.handles])

    async def setup(self) -> None:
        await self._all([h.setup.remote(self.init_method, self.options) for h in self.handles])

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        ref = ray.put(batch)
        per_rank = await self._call("compute_logprobs", ref)
        # each rank fills the trajectories it owns; the rest are empty lists
        return [next((r[i] for r in per_rank if r[i]), []) for i in range(len(per_rank[0]))]

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        ref = ray.put(batch)  # one copy in the object store, read by every rank
        return (await self._call("train_step", ref))[0]

    async def publish(self, version: int, tier: RelayTier) -> PublishResult:
        if isinstance(tier.push, RemotePush):
            # Rank 0 hosts the trainer's endpoint: it exports and pushes to the master
            # relay itself; the other ranks take part in the collective export meanwhile.
            drains = asyncio.ensure_future(
                self._all([h.export_drain.remote() for h in self.handles[1:]])
            )
            try:
                result = await tier.publish(version, None)
            finally:
                await drains
            return result
        # Rank 0's export reaches the driver through Ray's object store and the driver
        # pushes it; a list, so a master relay that dies mid-push gets it replayed.
        exported = (await self._all([h.export.remote() for h in self.handles]))[0]
        return await tier.publish(version, lambda: exported)

    async def save_checkpoint(self, directory: str) -> None:
        await self._call("save_checkpoint", directory)

    async def load_checkpoint(self, directory: str) -> None:
        await self._call("load_checkpoint", directory)

    async def close(self) -> None:
        await self._call("close")


class RemoteOutgoing(Outgoing):
    """A version rank 0 prepared: its buckets leave from rank 0's actor. Its manifest is
    known (and offered to the relays) once rank 0 has sent every bucket."""

    def __init__(
        self, group: RayTrainerGroup, version: int, nbytes: int, chunk: int, staged: bool
    ) -> None:
        super().__init__(version, nbytes, chunk, transport=None)
        self._group, self._remote_staged = group, staged
        self._manifest_json: str | None = None

    @property
    def staged(self) -> bool:
        return self._remote_staged

    @property
    def manifest(self) -> WeightManifest:
        assert self._manifest_json is not None, "the manifest is known once sent"
        return manifest_from_json(self._manifest_json)

    async def send(self, master_rank: int) -> None:
        rank0 = self._group.handles[0]
        self._manifest_json = (
            await self._group._all([rank0.push_send.remote(self.version, master_rank)])
        )[0]
        self.manifest_ready.set()

    async def abort(self, master_rank: int) -> None:
        await self._group._all(
            [self._group.handles[0].push_abort.remote(self.version, master_rank)]
        )


class RemotePush(Push):
    """The relay tier's trainer endpoint hosted in trainer rank 0's actor: the weights go
    rank 0 -> master relay -> chain, never through the driver (one copy of the model fewer
    per version than exporting to the driver). The driver's tier drives it like its own."""

    def __init__(self, group: RayTrainerGroup) -> None:
        super().__init__()
        self.group = group

    async def _rank0(self, call: Any) -> Any:
        return (await self.group._all([call]))[0]

    async def open(self) -> Any:
        return await self._rank0(self.group.handles[0].push_open.remote())

    async def connect(self, peers: dict[int, Any]) -> None:
        await self._rank0(self.group.handles[0].push_connect.remote(peers))

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # rank 0 is gone: so is its endpoint
            await self._rank0(self.group.handles[0].push_close.remote())

    async def send_probe(self, rank: int, size: int, reps: int) -> None:
        await self._rank0(self.group.handles[0].push_probe.remote(rank, size, reps))

    async def prepare(
        self,
        version: int,
        export: Export | None,
        endpoints: int,
        model_bytes: int | None = None,
        stage: bool | None = None,
    ) -> Outgoing:
        settings = {
            "configure": {
                "bucket_bytes": self.bucket_bytes,
                "chunks": self.chunks,
                "link": self.link,
                "max_chunks": self.max_chunks,
                "stage": self.stage,
            },
            "model_bytes": model_bytes if model_bytes is not None else self.model_bytes,
            "stage": self.stage if stage is None else stage,
        }
        call = self.group.handles[0].push_prepare.remote(version, endpoints, settings)
        nbytes, chunk, staged = await self._rank0(call)
        return RemoteOutgoing(self.group, version, nbytes, chunk, staged)
