"""The Ray runtime (``runtime.kind: ray``): trainer ranks, rollout replicas and node relays
as Ray actors.

With no ``runtime.address`` a local cluster starts in this process (``ray.init()``: the
embedded default, one laptop or CI); ``auto`` or ``ray://host:port`` joins a running one.
One placement group reserves a bundle per trainer rank and per replica: CPUs from
``runtime.cpus_per_*``; with ``runtime.device`` cuda (``auto``: when the cluster has GPUs)
one GPU per trainer rank and ``cluster.gpus_per_replica`` per replica. The driver runs the
controller, the rollout manager and the buffers, and talks to the actors through the
proxies in ``runtime.proxies``: the loop code is the same one the local runtime and the
simulator run.

Relays: with a real ``relay.transport`` (``nccl``, ``rdma``) each Ray node that hosts
replicas gets a relay actor (``runtime.relay_actor``, ``num_cpus=0``, pinned to the node)
that receives every version over the transport, chains it on to the next node's relay, and
writes it into the node's shared memory (``relay.shm_dir``, one subdirectory per run), where
the node's replicas load it (``SharedWeights``): weights never cross the object store. The
trainer's push endpoint is in trainer rank 0's actor (``relay.push_from_rank0``): rank 0
stages its export and pushes it to the master relay, never through the driver. With
``inprocess`` or ``sim`` the relays stay in the driver and each replica's weights travel
through Ray's object store: fine on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, cast

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from laminar_core.config.loader import ResolvedConfig
from laminar_core.interfaces import RolloutEngine, TrainerFailure, WeightTransport, build
from laminar_core.loop.trainer_group import TrainerGroup
from laminar_core.models import model_dir
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.shm import run_dir_name, sweep_orphans
from laminar_core.relay.tier import RelayTier
from laminar_core.runtime.hosts import RolloutHost, TrainerHost
from laminar_core.runtime.proxies import RayRolloutEngine, RayTrainerGroup, RemotePush
from laminar_core.runtime.ray_head import lean_head
from laminar_core.runtime.relay_actor import RayRelay, relay_actor, spawn_relay
from laminar_core.runtime.run import Run, Started
from laminar_core.runtime.wiring import RunSpec, assemble, relay_tier_options
from laminar_core.runtime.zygote import Zygote, start_zygote
from laminar_core.tasks import build_prompts, build_reward

log = logging.getLogger(__name__)

# Transports whose endpoints only work inside one process: their relays stay in the driver.
DRIVER_TRANSPORTS = ("inprocess", "sim")
_runs = itertools.count()
# How long a replica actor whose start is cut short gets to stop its engine before it is
# killed (``RayRuntime._retire``)
_RETIRE_S = 60.0

# Threads per actor process: two engines sharing a core each must not spawn a pool per core.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


class RuntimeStartError(RuntimeError):
    """The cluster could not host the run (resources, an actor that failed to start)."""


def init_ray(resolved: ResolvedConfig, needed_cpus: float) -> bool:
    """Join ``runtime.address`` or start a local cluster sized for the run (idempotent);
    True if this call started a local cluster (the run then shuts it down at the end)."""
    if ray.is_initialized():
        return False
    rt = resolved.cfg.runtime
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    kwargs: dict[str, Any] = {
        "logging_level": logging.WARNING,
        # engine output goes to RUN_DIR/logs/ (the actors write there), not the terminal
        "log_to_driver": resolved.cfg.telemetry.engine_logs == "terminal",
    }
    if rt.address:
        ray.init(address=rt.address, runtime_env={"env_vars": env}, **kwargs)
        return False
    cpus = rt.num_cpus or max(int(needed_cpus + 0.999), os.cpu_count() or 1)
    # A cluster of our own has token authentication on (Ray's default for a new local
    # cluster); Ray says so in a warning, which is noise here. Not by setting RAY_AUTH_MODE:
    # Ray reads it when it is imported, so setting it now would leave this driver without
    # the token its own cluster then asks for.
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        # address="local": a cluster of its own, even if another one on this machine left
        # its address in /tmp/ray (ray.init() would try to join that one); without the
        # daemons the run never talks to (``runtime.ray_head``)
        with lean_head(log_monitor=kwargs["log_to_driver"], worker_env=env) as lean:
            if not lean:  # the workers get the variables through a runtime env instead
                kwargs["runtime_env"] = {"env_vars": env}
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                # Ray starts idle workers for tasks when a driver connects; a run starts
                # only actors, each in a worker of its own, so those idle workers would just
                # take CPU from start-up (~0.7 s of it on the 2-core machine) and be killed
                _system_config={"prestart_worker_first_driver": False},
                **kwargs,
            )
    finally:
        notice.setLevel(level)
    return True


def load_tokenizer(resolved: ResolvedConfig):
    """The model's tokenizer (prompts are tokenised and rewards decoded in the driver)."""
    path = model_dir(resolved.cfg.model.path, "tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


async def _with_timeout(aw, seconds: float):
    try:
        return await asyncio.wait_for(aw, seconds)
    except asyncio.TimeoutError as e:
        raise TimeoutError(str(e)) from e


class RayRuntime:
    """Starts a run's parts as Ray actors (``runtime.run.Runtime``); one object per run.

    It owns what it started: ``actors`` (trainer ranks, replicas, relays), the placement
    group ``pg``, the relay proxies ``relays`` and the run's shared-memory directory
    ``shm_root``; ``close`` kills the actors, frees the group and deletes the directory.
    """

    recovers = True  # a failed replica, relay or trainer group is started again

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.config_yaml = spec.resolved.to_yaml()
        self.actors: list[Any] = []
        self.pg: Any = None
        self.relays: list[RayRelay] = []
        self.shm_root: str | None = None
        self.gpu = False  # whether bundles reserve GPUs (runtime.device)
        self.trainer_handles: list[Any] = []
        self.replica_handles: list[Any] = []
        self.replica_engines: list[RayRolloutEngine] = []  # the proxies, per replica
        self.replica_nodes: list[str] = []  # Ray node id per replica
        self.teacher_engines: list[RayRolloutEngine] = []  # algorithm.teacher's replicas
        self.teacher_nodes: list[str] = []
        self.relay_nodes: list[str] = []  # Ray node id per relay
        self.own_cluster = False  # this run started the local Ray cluster: it ends with it
        self._known_nodes: set[str] = set()  # runtime.elastic: nodes already considered
        self._follow: asyncio.Future | None = None
        self.startup: dict[str, float] = {}  # part -> seconds it took to start
        # replica restarts in flight, and the actors of cut-short ones being stopped: a
        # close cancels the first and waits for both (``close``)
        self._restarts: set[asyncio.Future] = set()
        self._retiring: set[asyncio.Future] = set()
        self._closing = False
        self.zygote: Zygote | None = None  # runtime.zygote: this node's, while the run lasts
        self.zygote_node = ""  # the Ray node it serves (the driver's)

    # --- the zygote (runtime.zygote) -------------------------------------------------------------

    def _start_zygote(self) -> None:
        """Start the driver node's zygote now, while Ray starts, if the run may use it:
        ``true``; ``auto`` unless the actors take GPUs (``runtime.device`` cuda, or auto on
        a cluster with GPUs: then ``_keep_zygote`` closes it) or the cluster is reached
        through Ray's client (the driver is on none of its nodes)."""
        resolved = self.spec.resolved
        rt = resolved.cfg.runtime
        mode = rt.zygote
        if mode == "false" or (
            mode == "auto" and (rt.device == "cuda" or rt.address.startswith("ray://"))
        ):
            return
        engines = {
            ("rollout", resolved.cfg.rollout.engine),
            ("trainer", resolved.cfg.trainer.engine),
        }
        if resolved.teacher is not None:
            engines.add(("rollout", resolved.teacher.cfg.rollout.engine))
        env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
        self.zygote = start_zygote(sorted(engines), env)

    def _keep_zygote(self) -> None:
        """Once Ray is up: the zygote serves the driver's node; ``auto`` drops it when the
        actors take GPUs."""
        if self.zygote is None:
            return
        if self.spec.resolved.cfg.runtime.zygote == "auto" and self.gpu:
            self._close_zygote()
            return
        self.zygote_node = ray.get_runtime_context().get_node_id()

    def _zygote_for(self, engine: str) -> tuple[str, str, str] | None:
        """What a host actor gets to fork its engine's process from the zygote."""
        if self.zygote is None or not self.zygote_node:
            return None
        return (self.zygote.path, self.zygote_node, engine)

    def _close_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    # --- start ---------------------------------------------------------------------------------

    def _bundles(self) -> tuple[list[dict[str, float]], float, float]:
        cfg = self.spec.resolved.cfg
        rt, place = cfg.runtime, self.spec.placement
        device = rt.device
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        self.gpu = device == "cuda"
        trainer = {"CPU": rt.cpus_per_trainer, **({"GPU": 1.0} if self.gpu else {})}
        replica = {"CPU": rt.cpus_per_replica}
        if self.gpu:
            replica["GPU"] = float(cfg.cluster.gpus_per_replica)
        bundles = [trainer] * place.trainer_gpus + [replica] * (place.replicas + self._teachers())
        cpus = sum(b["CPU"] for b in bundles)
        gpus = sum(b.get("GPU", 0.0) for b in bundles)
        return bundles, cpus, gpus

    def _teachers(self) -> int:
        """Teacher replicas (``algorithm.teacher``): each a rollout replica's bundle."""
        resolved = self.spec.resolved
        return resolved.cfg.algorithm.teacher.replicas if resolved.teacher is not None else 0

    async def _reserve(self) -> None:
        rt = self.spec.resolved.cfg.runtime
        place = self.spec.placement
        bundles, cpus, gpus = self._bundles()
        self.pg = placement_group(bundles, strategy=rt.placement_strategy)
        try:
            await _with_timeout(self.pg.ready(), rt.start_timeout_s)
        except TimeoutError as e:
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeStartError(
                f"the Ray cluster cannot place {place.trainer_gpus} trainer rank(s) and "
                f"{place.replicas} replica(s) ({cpus:g} CPUs, {gpus:g} GPUs) within "
                f"{rt.start_timeout_s:g}s; available: {ray.available_resources()}. "
                "Lower cluster.gpus / runtime.cpus_per_* or add nodes."
            ) from e

    def _log(self, name: str) -> str | None:
        """Where actor ``name`` writes its output (``telemetry.engine_logs``)."""
        run_dir = self.spec.run_dir
        if run_dir is None or self.spec.resolved.cfg.telemetry.engine_logs != "run_dir":
            return None
        return str(Path(run_dir).resolve() / "logs" / f"{name}.log")

    def _at(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

    def _replica_actor(self, index: int) -> Any:
        """Replica ``index``'s actor: in its placement-group bundle, or (a replica added on
        a node that joined) pinned to that node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        world = self.spec.placement.trainer_gpus
        if index < self.spec.placement.replicas:
            where: Any = self._at(world + index)
        else:
            where = NodeAffinitySchedulingStrategy(self.replica_nodes[index], soft=False)
        engine = self.spec.resolved.cfg.rollout.engine
        return self._rollout_host(self.config_yaml, index, f"r{index}", where, "replica", engine)

    def _rollout_host(
        self, config_yaml: str, index: int, name: str, where: Any, kind: str, engine: str
    ):
        """A ``RolloutHost`` actor serving ``config_yaml`` (a replica's or a teacher's)."""
        cfg = self.spec.resolved.cfg
        actor = (
            ray.remote(RolloutHost)
            .options(
                num_cpus=cfg.runtime.cpus_per_replica,
                num_gpus=float(cfg.cluster.gpus_per_replica) if self.gpu else 0,
                scheduling_strategy=where,
                max_concurrency=1 << 16,  # one call per trajectory in flight (or scored)
            )
            .remote(
                config_yaml,
                index,
                name,
                cfg.cluster.gpus_per_replica,
                self._log(f"{kind}-{name}"),
                self._zygote_for(engine),
            )
        )
        self.actors.append(actor)
        return actor

    def _teacher_actor(self, index: int) -> Any:
        """Teacher replica ``index``'s actor (``algorithm.teacher``): a rollout replica's
        host serving the teacher's config, in a bundle after the replicas'."""
        teacher = self.spec.resolved.teacher
        assert teacher is not None
        bundle = self.spec.placement.trainer_gpus + self.spec.placement.replicas + index
        where = self._at(bundle)
        engine = teacher.cfg.rollout.engine
        return self._rollout_host(teacher.to_yaml(), index, f"t{index}", where, "teacher", engine)

    def _trainer_actors(self) -> list[Any]:
        rt = self.spec.resolved.cfg.runtime
        rt_engine = self.spec.resolved.cfg.trainer.engine
        world = self.spec.placement.trainer_gpus
        actors = [
            ray.remote(TrainerHost)
            .options(
                num_cpus=rt.cpus_per_trainer,
                num_gpus=1 if self.gpu else 0,
                scheduling_strategy=self._at(rank),
            )
            .remote(
                self.config_yaml,
                rank,
                world,
                int(self.gpu),
                self._log(f"trainer-rank{rank}"),
                self._zygote_for(rt_engine),
            )
            for rank in range(world)
        ]
        self.actors += actors
        self.trainer_handles = actors
        return actors

    async def start(self) -> Run:
        """Start the actors, the trainer group, the replicas' engines and the relay tier
        (all at once: they are independent), and wire the loop around them. How long each
        part took is in ``startup`` (seconds)."""
        spec = self.spec
        resolved, cfg = spec.resolved, spec.resolved.cfg
        rt, place = cfg.runtime, spec.placement
        loop = asyncio.get_running_loop()

        def prepare() -> tuple:
            tokenizer = load_tokenizer(resolved)
            dataset, report = build_prompts(resolved, tokenizer, spec.pm)
            reward_fn = spec.reward_fn or build_reward(resolved, tokenizer, spec.pm)
            return tokenizer, dataset, report, reward_fn

        # the tokenizer (transformers' import: ~3 s here) and the prompts load on a thread
        # while Ray and the actors start: the driver mostly waits for other processes then
        data = loop.run_in_executor(None, prepare)
        needed = place.trainer_gpus * rt.cpus_per_trainer
        needed += (place.replicas + self._teachers()) * rt.cpus_per_replica
        t0 = loop.time()
        try:
            self._start_zygote()  # it imports the engines' modules while Ray starts
            self.own_cluster = init_ray(resolved, needed)
        except BaseException:
            self._close_zygote()
            await asyncio.gather(data, return_exceptions=True)
            raise
        self.startup["ray"] = loop.time() - t0
        try:
            t0 = loop.time()
            await self._reserve()
            self._keep_zygote()
            ranks = self._trainer_actors()
            replicas = self.replica_handles = [
                self._replica_actor(i) for i in range(place.replicas)
            ]
            teachers = [self._teacher_actor(i) for i in range(self._teachers())]
            # The actors' processes start (imports: seconds of CPU each) while the data
            # thread finishes, rather than after it. A bad data file or reward fails here;
            # the actors started so far are released below, as for any start-up failure.
            tokenizer, dataset, report, reward_fn = await data
            spec = dataclasses.replace(spec, reward_fn=reward_fn)
            try:
                nodes = await _with_timeout(
                    asyncio.gather(*(h.node_id.remote() for h in replicas)), rt.start_timeout_s
                )
                self.teacher_nodes = await _with_timeout(
                    asyncio.gather(*(h.node_id.remote() for h in teachers)), rt.start_timeout_s
                )
                init = await ranks[0].rendezvous.remote()
            except Exception as e:
                raise RuntimeStartError(f"an actor failed to start: {e}") from e
            self.startup["actors"] = loop.time() - t0
            self.replica_nodes = list(nodes)
            place = place.on_nodes(nodes)
            trainer = RayTrainerGroup(ranks, init, {"seed": cfg.run.seed})
            tier, relays = self._relay_tier(list(dict.fromkeys(nodes)), trainer)
            engines = self.replica_engines = [
                RayRolloutEngine(f"r{i}", h) for i, h in enumerate(replicas)
            ]
            self.teacher_engines = [RayRolloutEngine(f"t{i}", h) for i, h in enumerate(teachers)]
            phases = [
                self._timed("trainer", trainer.setup()),
                self._timed("replicas", asyncio.gather(*(e.start() for e in engines))),
                self._timed("relays", self._relays_up(tier)),
            ]
            if self.teacher_engines:  # a phase of the start-up line only with a teacher
                starts = (e.start() for e in self.teacher_engines)
                phases.append(self._timed("teachers", asyncio.gather(*starts)))
            try:
                await _with_timeout(asyncio.gather(*phases), rt.start_timeout_s)
            except Exception as e:
                raise RuntimeStartError(
                    f"the trainer group, a replica or a relay failed to start: {e}"
                ) from e
        except BaseException:
            self._release()
            if self.own_cluster:
                ray.shutdown()
            await asyncio.gather(data, return_exceptions=True)  # no thread left running
            raise
        # the proxies stand in for engines (the same coroutine API, over Ray)
        started = Started(
            trainer,
            cast(list[RolloutEngine], engines),
            tier,
            relays,
            place,
            dataset,
            report,
            tokenizer,
            teachers=cast(list[RolloutEngine], self.teacher_engines),
        )
        run = assemble(spec, started, self)
        if cfg.runtime.elastic:
            self._known_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            self._follow = asyncio.ensure_future(self._follow_cluster(run))
        return run

    async def _timed(self, part: str, aw: Any) -> Any:
        t0 = asyncio.get_running_loop().time()
        try:
            return await aw
        finally:
            self.startup[part] = asyncio.get_running_loop().time() - t0

    async def _relays_up(self, tier: RelayTier) -> None:
        """The relay actors are up and the tier's chain is connected (and calibrated);
        waits for the trainer's rank 0 when it hosts the trainer's endpoint."""
        if self.relays:
            calls = (r.handle.node_id.remote() for r in self.relays)
            await asyncio.gather(*calls)
            await tier.open()

    def _relay_tier(
        self, node_ids: list[str], trainer: RayTrainerGroup
    ) -> tuple[RelayTier, list[Any]]:
        """The tier and one node relay per node (in ``node_ids`` order): relay actors on a
        real transport, else relays in the driver."""
        spec = self.spec
        cfg = spec.resolved.cfg
        transport = spec.pm.get("transport", cfg.relay.transport)
        options = relay_tier_options(spec.resolved)
        if cfg.relay.transport in DRIVER_TRANSPORTS:
            relays = [NodeRelay(n, n) for n in range(len(node_ids))]
            shared: dict[str, Any] = {}
            tier = RelayTier.in_process(
                relays,
                lambda rank: build(transport, spec.context("relay", rank, f"ep{rank}", 1, shared)),
                **options,
            )
            return tier, relays
        # run-unique, so two runs on one node never share (or delete) each other's versions
        for orphan in sweep_orphans(cfg.relay.shm_dir):
            log.info("removed %s/%s: a dead run's shared weights", cfg.relay.shm_dir, orphan)
        name = run_dir_name(cfg.run.name, os.getpid(), next(_runs), uuid.uuid4().hex[:6])
        self.shm_root = str(Path(cfg.relay.shm_dir) / name)
        for i, node_id in enumerate(node_ids):  # relay i is chain rank i + 1
            relay = spawn_relay(
                self.config_yaml,
                i,
                i,
                i + 1,
                self.shm_root,
                node_id,
                log_path=self._log(f"relay{i}"),
            )
            self.actors.append(relay.handle)
            self.relays.append(relay)
            self.relay_nodes.append(node_id)
        endpoint: WeightTransport | RemotePush
        if cfg.relay.push_from_rank0:
            endpoint = RemotePush(trainer)
        else:
            endpoint = build(transport, spec.context("relay", 0, "trainer", 1, {}))
        tier = RelayTier(list(self.relays), endpoint, calibrate=cfg.relay.calibrate, **options)
        return tier, list(self.relays)

    # --- stop ----------------------------------------------------------------------------------

    async def close(self, run: Run) -> None:
        # no replica restart starts from here on; one in flight is cancelled, and its actor
        # stopped and killed, before the actors go (none outlives the run)
        self._closing = True
        restarts = list(self._restarts)
        if restarts:
            log.info("closing the run: %d replica restart(s) in flight cancelled", len(restarts))
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        await asyncio.gather(*list(self._retiring), return_exceptions=True)
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        with contextlib.suppress(Exception):  # a dead or broken group: the actors go anyway
            await run.trainer.close()
        self._release()
        if self.own_cluster:  # its workers, raylet and GCS go with the run
            ray.shutdown()
            self.own_cluster = False

    def _release(self) -> None:
        """Kill the run's actors, free its placement group, and delete what its relays
        shared on this node and what its replicas' engines left in shared memory (an engine
        or relay that closes deletes its own; one that was killed cannot)."""
        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a)
        self.actors.clear()
        for index in range(len(self.replica_engines)):
            self._remove_shm(index)
        for engine, node in zip(self.teacher_engines, self.teacher_nodes, strict=False):
            self._remove_files(engine.shm_files, node)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        self._close_zygote()  # and what its children still run
        if self.shm_root:
            shutil.rmtree(self.shm_root, ignore_errors=True)
            # and the root (relay.shm_dir) once no run uses it: tmpfs is RAM, and an empty
            # directory left behind by every run looks like a leak. A run still using it
            # keeps it (rmdir refuses a non-empty directory).
            with contextlib.suppress(OSError):
                Path(self.shm_root).parent.rmdir()

    # --- elastic nodes -------------------------------------------------------------------------

    async def _follow_cluster(self, run: Run, every_s: float = 2.0) -> None:
        """``runtime.elastic``: a node that joins the cluster gets a relay and as many
        replicas as its resources allow, which load the newest version and take prompts.
        (A node that leaves loses its replicas and relay: they fail and are evicted.)"""
        while True:
            await asyncio.sleep(every_s)
            for node in ray.nodes():
                node_id = node["NodeID"]
                if not node["Alive"] or node_id in self._known_nodes:
                    continue
                self._known_nodes.add(node_id)
                try:
                    await self._grow(run, node_id, node.get("Resources", {}))
                except Exception as e:  # the node left again, or cannot host an engine
                    log.warning("node %s joined but could not be used: %s", node_id[:8], e)

    async def _grow(self, run: Run, node_id: str, resources: dict[str, float]) -> None:
        cfg = self.spec.resolved.cfg
        fits = int(resources.get("CPU", 0) // max(cfg.runtime.cpus_per_replica, 1e-9))
        if self.gpu:
            fits = min(fits, int(resources.get("GPU", 0) // cfg.cluster.gpus_per_replica))
        if fits < 1:
            return
        log.warning("node %s joined: adding a relay and %d replica(s)", node_id[:8], fits)
        relay = None
        if self.shm_root is not None:  # relays on the nodes: this node gets its own
            rid = len(self.relays)
            relay = spawn_relay(
                self.config_yaml,
                rid,
                rid,
                rid + 1,
                self.shm_root,
                node_id,
                log_path=self._log(f"relay{rid}"),
            )
            self.actors.append(relay.handle)
            self.relays.append(relay)
            self.relay_nodes.append(node_id)
            await run.tier.add_relay(relay)
        for _ in range(fits):
            index = len(self.replica_handles)
            self.replica_nodes.append(node_id)
            handle = self._replica_actor(index)
            self.replica_handles.append(handle)
            engine = RayRolloutEngine(f"r{index}", handle)
            self.replica_engines.append(engine)
            await _with_timeout(engine.start(), cfg.runtime.start_timeout_s)
            node_relay = relay if relay is not None else run.relays[0]
            run.manager.add_replica(engine, node_relay, (await engine.stats()).version)

    # --- recovery ------------------------------------------------------------------------------

    def _kill(self, *handles: Any) -> None:
        for h in handles:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h, no_restart=True)
        self.actors = [a for a in self.actors if all(a is not h for h in handles)]

    def _remove_shm(self, index: int) -> None:
        """Remove the shared-memory files replica ``index``'s engine left (on its node)."""
        files = self.replica_engines[index].shm_files if index < len(self.replica_engines) else []
        self._remove_files(files, self.replica_nodes[index] if files else "")

    def _remove_files(self, files: list[str], node: str) -> None:
        """Remove ``files`` on Ray node ``node`` (an actor's shared-memory leftovers)."""
        if not files:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from laminar_core.runtime.hosts import remove_files

        with contextlib.suppress(Exception):  # the node is gone: so is its /dev/shm
            task = ray.remote(num_cpus=0)(remove_files).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            )
            ray.get(task.remote(files), timeout=30)

    async def restart_replica(self, run: Run, index: int) -> RolloutEngine:
        """A new replica actor in the same placement-group bundle (the same node), started;
        the old one is killed first (it may be hung, not dead) and what it left in shared
        memory removed. Refused once the run is closing; ``close`` cancels one in flight."""
        if self._closing:
            raise RuntimeStartError(f"replica r{index} is not restarted: the run is closing")
        task = asyncio.ensure_future(self._restart_replica(run, index))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        return await task  # a cancelled caller cancels the restart too

    async def _restart_replica(self, run: Run, index: int) -> RolloutEngine:
        rt = self.spec.resolved.cfg.runtime
        self._kill(self.replica_handles[index])
        if not _node_alive(self.replica_nodes[index]):
            raise RuntimeStartError(f"replica r{index}'s node is gone")
        await asyncio.to_thread(self._remove_shm, index)
        handle = self.replica_handles[index] = self._replica_actor(index)
        engine = self.replica_engines[index] = RayRolloutEngine(f"r{index}", handle)
        try:
            node = await _with_timeout(handle.node_id.remote(), rt.start_timeout_s)
            if node != self.replica_nodes[index]:
                raise RuntimeStartError(
                    f"its bundle moved to another node ({node}): its node is gone"
                )
            await _with_timeout(engine.start(), rt.start_timeout_s)
        except BaseException:
            retire = asyncio.ensure_future(self._retire(handle))
            self._retiring.add(retire)
            retire.add_done_callback(self._retiring.discard)
            with contextlib.suppress(BaseException):  # cancelled again: close waits for it
                await asyncio.shield(retire)
            raise
        return engine

    async def _retire(self, handle: Any) -> None:
        """Stop the engine of a replica actor whose start was cut short (cancelled, timed
        out), then kill the actor. Killed while it starts, its engine could not remove what
        it had made so far (SGLang's load snapshot in /dev/shm, which outlives the
        processes that made it) and the driver does not know those files yet; asked to
        stop, the engine does. A hung actor is killed after ``_RETIRE_S`` all the same."""
        log.info("a replica restart was cut short: its engine is stopped, then its actor killed")
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.call.remote("stop"), _RETIRE_S)
        finally:
            self._kill(handle)

    async def restart_relay(self, run: Run, relay_id: int) -> None:
        """A new relay actor on the dead one's node, in its place in the chain, caught up to
        the newest version (``RelayTier.rejoin``)."""
        if self.shm_root is None:
            raise RuntimeError("relays in the driver are not restarted")
        relay = self.relays[relay_id]
        if not _node_alive(self.relay_nodes[relay_id]):
            raise RuntimeStartError(f"relay {relay_id}'s node is gone")
        self._kill(relay.handle)
        handle = relay_actor(
            self.config_yaml,
            relay_id,
            relay.node,
            relay_id + 1,
            self.shm_root,
            self.relay_nodes[relay_id],
            log_path=self._log(f"relay{relay_id}"),
        )
        self.actors.append(handle)
        try:
            await _with_timeout(
                handle.node_id.remote(), self.spec.resolved.cfg.runtime.start_timeout_s
            )
        except BaseException:
            self._kill(handle)
            raise
        relay.rebind(handle)
        try:
            await run.tier.rejoin(relay)
        except TrainerFailure as e:
            # the push endpoint lives on trainer rank 0 and died with it: the relay itself
            # is up, and the restarted trainer reconnects to the chain (``reopen_push``)
            # and publishes its restored weights as a new version, which reaches it then
            log.warning(
                "relay %s: rejoined without catch-up, the trainer is down (%s)", relay_id, e
            )

    async def restart_trainer(self, run: Run) -> TrainerGroup:
        """Every rank killed and started again in its bundle, set up (not restored)."""
        rt = self.spec.resolved.cfg.runtime
        self._kill(*self.trainer_handles)
        ranks = self._trainer_actors()
        try:
            init = await _with_timeout(ranks[0].rendezvous.remote(), rt.start_timeout_s)
            group = RayTrainerGroup(ranks, init, {"seed": self.spec.resolved.cfg.run.seed})
            await _with_timeout(group.setup(), rt.start_timeout_s)
            if isinstance(run.tier.push, RemotePush):  # the new rank 0 hosts the endpoint
                run.tier.push.group = group
                await run.tier.reopen_push()
        except BaseException:
            self._kill(*ranks)
            raise
        return group
