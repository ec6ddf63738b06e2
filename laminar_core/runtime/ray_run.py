"""The Ray runtime (``runtime.kind: ray``): trainer ranks, rollout replicas and node relays
as Ray actors.

With no ``runtime.address`` a local cluster starts in this process (``ray.init()``: the
embedded default, one laptop or CI); ``auto`` or ``ray://host:port`` joins a running one.
One placement group reserves a bundle per trainer rank and per replica (CPUs/GPUs from
``runtime.*``). The driver runs the controller, the rollout manager and the buffers, and
talks to the actors through the proxies in ``runtime.proxies``: the loop code is the same one
the local runtime and the simulator run.

Relays: with a real ``relay.transport`` (``nccl``, ``rdma``) each Ray node that hosts
replicas gets a relay actor (``runtime.relay_actor``, ``num_cpus=0``, pinned to the node)
that receives every version over the transport, chains it on to the next node's relay, and
writes it into the node's shared memory (``relay.shm_dir``, one subdirectory per run), where
the node's replicas load it (``SharedWeights``): weights never cross the object store. The
trainer's push endpoint is in the driver (rank 0 exports to the driver through Ray, the
driver pushes to the master relay). With ``inprocess`` or ``sim`` the relays stay in the
driver and each replica's weights travel through Ray's object store: fine on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from laminar_core.config.loader import ResolvedConfig, make_schedule
from laminar_core.interfaces import BuildContext, build
from laminar_core.models import model_dir
from laminar_core.plugins import PluginManager, default_manager
from laminar_core.relay.tier import RelayTier
from laminar_core.relay.view import SharedRelayView
from laminar_core.runtime.hosts import RolloutHost, TrainerHost
from laminar_core.runtime.local import LocalRun, assemble, relay_tier_options
from laminar_core.runtime.placement import Placement, plan_placement
from laminar_core.runtime.proxies import RayRolloutEngine, RayTrainerGroup
from laminar_core.runtime.relay_actor import spawn_relay
from laminar_core.tasks import build_prompts, build_reward

# Transports whose endpoints only work inside one process: their relays stay in the driver.
DRIVER_TRANSPORTS = ("inprocess", "sim")
_runs = itertools.count()

# Threads per actor process: two engines sharing a core each must not spawn a pool per core.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


class RuntimeStartError(RuntimeError):
    """The cluster could not host the run (resources, an actor that failed to start)."""


def init_ray(resolved: ResolvedConfig, needed_cpus: float) -> None:
    """Join ``runtime.address`` or start a local cluster sized for the run (idempotent)."""
    if ray.is_initialized():
        return
    rt = resolved.cfg.runtime
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    kwargs = {"runtime_env": {"env_vars": env}, "logging_level": logging.WARNING}
    if rt.address:
        ray.init(address=rt.address, **kwargs)
    else:
        cpus = rt.num_cpus or max(int(needed_cpus + 0.999), os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, **kwargs)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def load_tokenizer(resolved: ResolvedConfig):
    """The model's tokenizer (prompts are tokenised and rewards decoded in the driver)."""
    path = model_dir(resolved.cfg.model.path, "tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


async def build_ray_run(
    resolved: ResolvedConfig,
    run_dir: Path | None = None,
    pm: PluginManager | None = None,
    schedule_spec: str | None = None,
) -> LocalRun:
    """Start the actors, set the trainer group up, and wire the loop around them.

    Call ``await shutdown_ray_run(run)`` when done (it kills the actors and frees the
    placement group; the cluster itself stays up for the next run).
    """
    pm = pm or default_manager()
    cfg, rt = resolved.cfg, resolved.cfg.runtime
    schedule = make_schedule(schedule_spec or cfg.schedule, cfg, pm)
    # real engines do not offload to time-share a device: every schedule is disaggregated
    place = plan_placement(cfg, schedule, allow_colocate=False)
    world = place.trainer_gpus
    needed = world * rt.cpus_per_trainer + place.replicas * rt.cpus_per_replica
    tokenizer = load_tokenizer(resolved)
    dataset, report = build_prompts(resolved, tokenizer, pm)
    reward_fn = build_reward(resolved, tokenizer, pm)
    init_ray(resolved, needed)

    bundles = [_bundle(rt.cpus_per_trainer, rt.gpus_per_trainer)] * world + [
        _bundle(rt.cpus_per_replica, rt.gpus_per_replica)
    ] * place.replicas
    pg = placement_group(bundles, strategy=rt.placement_strategy)
    try:
        await _with_timeout(pg.ready(), rt.start_timeout_s)
    except TimeoutError as e:
        remove_placement_group(pg)
        gpus = world * rt.gpus_per_trainer + place.replicas * rt.gpus_per_replica
        raise RuntimeStartError(
            f"the Ray cluster cannot place {world} trainer rank(s) and {place.replicas} "
            f"replica(s) ({needed:g} CPUs, {gpus:g} GPUs) within {rt.start_timeout_s:g}s; "
            f"available: {ray.available_resources()}. "
            "Lower cluster.gpus / runtime.cpus_per_* or add nodes."
        ) from e

    def at(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    config_yaml = resolved.to_yaml()
    trainer_actor = ray.remote(TrainerHost)
    trainers = [
        trainer_actor.options(
            num_cpus=rt.cpus_per_trainer, num_gpus=rt.gpus_per_trainer, scheduling_strategy=at(r)
        ).remote(config_yaml, r, world, int(rt.gpus_per_trainer))
        for r in range(world)
    ]
    rollout_actor = ray.remote(RolloutHost)
    replicas = [
        rollout_actor.options(
            num_cpus=rt.cpus_per_replica,
            num_gpus=rt.gpus_per_replica,
            scheduling_strategy=at(world + i),
            max_concurrency=1 << 16,  # one generate call per in-flight trajectory
        ).remote(config_yaml, i, f"r{i}", cfg.cluster.gpus_per_replica)
        for i in range(place.replicas)
    ]
    try:
        nodes = await _with_timeout(
            asyncio.gather(*(h.node_id.remote() for h in replicas)), rt.start_timeout_s
        )
        init = await trainers[0].rendezvous.remote()
    except Exception as e:
        _kill(trainers + replicas, pg)
        raise RuntimeStartError(f"an actor failed to start: {e}") from e
    relay_of = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    place = Placement(
        place.trainer_gpus,
        place.rollout_gpus,
        place.replicas,
        len(relay_of),
        tuple(relay_of[n] for n in nodes),
        place.colocated,
    )
    group = RayTrainerGroup(trainers, init, {"seed": cfg.run.seed})
    engines = [RayRolloutEngine(f"r{i}", h) for i, h in enumerate(replicas)]
    ray_state: dict = {"actors": trainers + replicas, "pg": pg, "relays": [], "shm_root": None}
    tier = views = None
    if cfg.relay.transport not in DRIVER_TRANSPORTS:
        tier, views = _relay_actors(resolved, config_yaml, list(relay_of), ray_state, pm)
    try:
        await asyncio.gather(group.setup(), _relays_ready(ray_state, rt.start_timeout_s))
    except Exception as e:
        _kill(ray_state["actors"], pg)
        _remove_shm(ray_state)
        raise RuntimeStartError(f"the trainer group or a relay failed to start: {e}") from e
    run = assemble(
        resolved,
        schedule,
        place,
        [group],
        engines,
        pm,
        {"ray": ray_state, "data_report": report},
        dataset=dataset,
        run_dir=run_dir,
        reward_fn=reward_fn,
        tier=tier,
        relays=views,
    )
    return run


def _relay_actors(
    resolved: ResolvedConfig,
    config_yaml: str,
    node_ids: list[str],
    ray_state: dict,
    pm: PluginManager,
) -> tuple[RelayTier, list[SharedRelayView]]:
    """One relay actor per node (in ``node_ids`` order: relay ``i`` is chain rank ``i + 1``),
    the driver's trainer endpoint, the tier over them, and one view per relay."""
    cfg = resolved.cfg
    # run-unique, so two runs on one node never share (or delete) each other's versions
    shm_root = str(Path(cfg.relay.shm_dir) / f"{cfg.run.name}-{os.getpid()}-{next(_runs)}")
    shm_root += f"-{uuid.uuid4().hex[:6]}"
    ray_state["shm_root"] = shm_root
    hosts, views = [], []
    for i, node_id in enumerate(node_ids):
        host = spawn_relay(config_yaml, i, i, i + 1, shm_root, node_id)
        ray_state["actors"].append(host.handle)
        view = SharedRelayView(i, i, shm_root, host.is_alive)
        host.on_committed.append(view.committed)  # replicas stop admitting old work
        hosts.append(host)
        views.append(view)
    ray_state["relays"] = hosts
    trainer_transport = build(
        pm.get("transport", cfg.relay.transport),
        BuildContext(cfg, resolved.engine_options.get("relay"), 0, "trainer", 1, {}),
    )
    tier = RelayTier(
        hosts=hosts,
        trainer_transport=trainer_transport,
        calibrate=cfg.relay.calibrate,
        **relay_tier_options(resolved),
    )
    # committed and shared on its node: replicas there may load it
    tier.on_ready.append(lambda rank, version: views[rank - 1].advance(version))
    return tier, views


async def _relays_ready(ray_state: dict, timeout_s: float) -> None:
    hosts = ray_state["relays"]
    if hosts:
        await _with_timeout(asyncio.gather(*(h.handle.node_id.remote() for h in hosts)), timeout_s)


def shutdown_ray_run(run: LocalRun) -> None:
    """Kill the run's actors, free its placement group, and delete what its relays shared
    on this node (a relay that closes deletes its own; one that was killed cannot)."""
    got = run.shared.get("ray")
    if got:
        _kill(got["actors"], got["pg"])
        _remove_shm(got)


def _remove_shm(ray_state: dict) -> None:
    root = ray_state.get("shm_root")
    if root:
        shutil.rmtree(root, ignore_errors=True)


def _kill(actors: list, pg) -> None:
    for a in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(a)
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


async def _with_timeout(aw, seconds: float):
    try:
        return await asyncio.wait_for(aw, seconds)
    except asyncio.TimeoutError as e:
        raise TimeoutError(str(e)) from e
