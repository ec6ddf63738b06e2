"""Shared test set-up: one thread per torch op (2-core machines), small sim configs."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)

# A small cluster with a long-tailed workload: 6 replicas, 8 groups x 4 samples per step.
SMALL = [
    "run.steps=5",
    "cluster.gpus=8",
    "cluster.trainer_gpus=2",
    "cluster.gpus_per_node=2",
    "data.prompts_per_step=8",
    "data.samples_per_prompt=4",
    "data.min_prompt_tokens=16",
    "data.max_prompt_tokens=64",
    "rollout.max_concurrent=64",
    "rollout.max_tokens=2000",
    "rollout.heartbeat_s=1",
    "rollout.partial_sync_s=2",
    "rollout.sim.decode_step_s=0.01",
    "rollout.sim.roofline_batch=16",
    "rollout.sim.prefill_s_per_token=1e-5",
    "rollout.sim.kv_capacity_tokens=40000",
    "rollout.sim.weight_load_s=0.2",
    "rollout.sim.lengths.median=150",
    "rollout.sim.lengths.p99_over_p50=10",
    "trainer.sim.gpu_seconds_per_token=2e-4",
    "trainer.sim.step_overhead_s=0.5",
    "model.params_b=0.5",
    "repack.interval_s=1.0",
    "repack.batch_limit=16",
    "study.warmup_steps=1",
]


@pytest.fixture(scope="session")
def small_overrides() -> list[str]:
    return list(SMALL)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for the whole session (started by the first test that asks for it),
    as a ``ray.cluster_utils.Cluster``: one head node now; tests that need several Ray
    nodes on this machine add them (``cluster.add_node``) and remove them when done. The
    runtime joins it instead of starting its own."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from laminar_core.runtime.ray_run import WORKER_ENV

    if ray.is_initialized():
        yield None
        return
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,  # logical: the e2e run's 2 trainer ranks + 2 replicas (+ relays)
            "include_dashboard": False,
            # Ray's own node health check (3 s x 5, 10 s timeout). A faster one (0.5 s x 4)
            # declared the head raylet dead while the chaos module's second node was being
            # removed on a loaded 2-core machine, and every later test lost its cluster.
            # Nothing here waits on it: killed processes are noticed through their sockets.
        },
    )
    ray.init(
        address=cluster.address,
        runtime_env={"env_vars": dict(WORKER_ENV)},
        logging_level="WARNING",
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()
