"""Chaos in CI: a real run (Ray on two nodes of this machine, FSDP on 2 gloo ranks, 2 vLLM
replicas, a relay actor per node) in which real processes are killed with ``kill -9``: a
replica actor, the vLLM engine process under the other replica, the master relay and a
trainer rank, one after the other. The run reaches its last step; from its events and
checkpoints nothing is lost or trained twice; every failed part came back; and nothing of
the run survives it, in the process table or in /dev/shm.

The full set (a whole node, the same fault twice in a row) with figures is
``benchmarks/chaos.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from laminar_core import load_config
from laminar_core.testing import require_modules

require_modules("laminar_fsdp", "laminar_vllm", "vllm", what="chaos tests")

psutil = pytest.importorskip("psutil")
ray = pytest.importorskip("ray")

from laminar_core.models import build_tiny_model
from laminar_core.runtime.train import make_run_dir
from laminar_core.testing.chaos import Fault, run_with_faults

ROOT = Path(__file__).resolve().parents[2]
FAULTS = [
    Fault("replica", at_step=2, index=0),
    Fault("engine", at_step=4, index=1),
    Fault("master", at_step=6),
    Fault("trainer", at_step=8, index=1),
]


@pytest.fixture(scope="module")
def two_nodes(ray_cluster):
    """A second Ray node on this machine, for the run's replicas to spread over."""
    if ray_cluster is None:
        pytest.skip("Ray was started outside the test session's cluster")
    node = ray_cluster.add_node(num_cpus=4)
    ray_cluster.wait_for_nodes()
    yield ray_cluster
    ray_cluster.remove_node(node)


@pytest.fixture(scope="module")
def chaos_run(two_nodes, tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)
    out = tmp_path_factory.mktemp("runs")
    shm = tmp_path_factory.mktemp("shm")  # the relays' shared memory, private to this test
    resolved = load_config(
        ROOT / "examples" / "quickstart.yaml",
        [
            f"model.path={model}",
            f"run.out_dir={out}",
            "run.steps=11",
            "run.checkpoint_every=2",
            "data.prompts_per_step=4",
            "data.samples_per_prompt=4",
            "rollout.max_tokens=32",
            "rollout.heartbeat_timeout_s=60",
            "runtime.placement_strategy=SPREAD",  # replicas (and relays) on both nodes
            f"relay.shm_dir={shm}",
            "telemetry.progress=false",
            # vLLM's engine core and its worker in processes of their own under each replica
            # actor (on CPU the default runs both inside the actor): the layout where an
            # engine can die under a live actor, and the most a killed replica leaves to
            # clean up (orphaned engine processes, their message queues in /dev/shm)
            "rollout.vllm.engine_core=process",
            "rollout.vllm.worker_in_core=false",
        ],
    )
    run_dir = make_run_dir(resolved)
    before = _multiprocessing_shm()
    result = asyncio.run(run_with_faults(resolved, FAULTS, run_dir))
    return result, shm, before


def _multiprocessing_shm() -> set[Path]:
    """multiprocessing's named semaphores and shared memory in /dev/shm now (vLLM's engine
    processes make both; their resource tracker unlinks them)."""
    return {*Path("/dev/shm").glob("sem.mp-*"), *Path("/dev/shm").glob("psm_*")}


def test_the_run_reaches_its_last_step_with_nothing_lost_or_trained_twice(chaos_run):
    result, *_ = chaos_run
    audit = result.audit
    assert result.steps == 11
    assert audit.ok, audit.problems
    assert audit.trainer_restarts == 1 and audit.replica_restarts >= 2
    assert audit.relay_restarts >= 1 and not audit.evicted


def test_every_fault_was_detected_and_recovered(chaos_run):
    result, *_ = chaos_run
    assert [o.fault.kind for o in result.outcomes] == [f.kind for f in FAULTS]
    for o in result.outcomes:
        assert o.pids, o
        assert o.detected_after_s is not None and o.recovered_after_s is not None, o
        assert o.recovered_after_s >= o.detected_after_s >= 0, o


def test_nothing_of_the_run_is_left_behind(chaos_run):
    import time

    result, shm, before = chaos_run
    assert result.pids and result.shm_files  # what the run had: actors, engines, queues
    # every process the run had is gone (Ray's actor workers, vLLM's engine processes)
    for _ in range(60):
        left = [p for p in result.pids if psutil.pid_exists(p)]
        if not left:
            break
        time.sleep(0.5)
    assert not left, [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
    # nothing of it in shared memory: the relays' versions, the engines' message queues
    # (the run removes relay.shm_dir itself once empty)
    assert not Path(shm).exists() or not any(Path(shm).iterdir()), list(Path(shm).iterdir())
    assert not [f for f in result.shm_files if Path(f).exists()]
    # nor what the killed replicas' engine processes had registered with multiprocessing
    # (Ray killed each actor's process group; the detached resource tracker unlinks them)
    for _ in range(60):
        left = _multiprocessing_shm() - before
        if not left:
            break
        time.sleep(0.5)
    assert not left, sorted(map(str, left))
