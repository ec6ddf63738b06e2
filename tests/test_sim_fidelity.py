"""Simulator fidelity: dispatch that spreads work like the reproduced systems, the version
floor, the cost model (trainer FLOPs, co-location switch, KV reads, moves) and the metrics a
systems paper reports -- on small configs whose virtual-time results are exact."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from laminar_core import load_config
from laminar_core.loop.dispatch import FairShareDispatch, LeastLoadedDispatch, make_dispatch
from laminar_core.runtime import Run, build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.config import SimRolloutConfig, SimTrainerConfig
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.sim.study import (
    RESULT_KEYS,
    StudyTrace,
    run_study,
    schedule_config,
    simulate_schedule,
)
from laminar_core.sim.trainer import SimTrainerEngine
from laminar_core.types import GenerationRequest, SamplingParams

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sim"

# The shape of a paper setup, scaled down: 12 replicas of one GPU (20 train of 32; sync
# time-shares all 32), 48 groups of 4 samples per step (more groups than replicas, as 512 in
# the paper), long-tailed lengths.
PAPER_SHAPED = [
    "run.steps=4",
    "study.warmup_steps=1",
    "cluster.gpus=32",
    "cluster.trainer_gpus=20",
    "cluster.gpus_per_node=8",
    "data.prompts_per_step=48",
    "data.samples_per_prompt=4",
    "data.min_prompt_tokens=16",
    "data.max_prompt_tokens=64",
    "rollout.max_concurrent=1024",
    "rollout.max_tokens=2000",
    "rollout.heartbeat_s=5",
    "rollout.partial_sync_s=0",
    "rollout.sim.decode_step_s=0.01",
    "rollout.sim.kv_read_s_per_token=1e-7",
    "rollout.sim.prefill_s_per_token=1e-5",
    "rollout.sim.kv_capacity_tokens=200000",
    "rollout.sim.weight_load_s=0.2",
    "rollout.sim.lengths.median=120",
    "rollout.sim.lengths.p99_over_p50=10",
    "model.params_b=0.5",
    "trainer.sim.kind=flops",
    "trainer.sim.layers=24",
    "trainer.sim.hidden=1024",
    "trainer.sim.step_overhead_s=0.5",
    "repack.interval_s=1.0",
    "repack.batch_limit=16",
]
LAG_SCHEDULES = ["sync", "one_step", "stale:2", "stale:2+partial"]


def run_kept(overrides: list[str], schedule: str, dispatch: str = "") -> tuple[dict, Run]:
    """A study row and its run for ``schedule``."""
    kept: list[Run] = []
    resolved = load_config(None, overrides)
    row = simulate_schedule(resolved, schedule, keep_run=kept, dispatch=dispatch)
    return row, kept[0]


def first_replicas_by_batch(run: Run) -> list[Counter]:
    """Per trained batch: how many of its trajectories started on each replica."""
    return [Counter(t.replicas[0] for t in b.trajectories) for b in run.controller.batches]


def keep_batches(resolved_overrides: list[str], schedule: str, dispatch: str = ""):
    """Run ``schedule`` with the controller keeping its batches; return (row, run)."""
    resolved = load_config(None, resolved_overrides)
    resolved = schedule_config(resolved, schedule)
    holder: list[Run] = []

    async def main() -> Run:
        run = build_local_run(resolved, schedule)
        run.controller.keep_batches = True
        if dispatch:
            m = run.manager
            m.dispatch = make_dispatch(dispatch, m.slots, m.admission, m.opt.max_concurrent)
        await run.controller.run(resolved.cfg.run.steps)
        holder.append(run)
        return run

    run_virtual(main())
    return holder[0]


# --- dispatch ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", LAG_SCHEDULES)
def test_lag_schedules_split_every_step_evenly_over_the_replicas(schedule: str) -> None:
    run = keep_batches(PAPER_SHAPED, schedule)
    replicas = {s.replica_id for s in run.manager.slots}
    groups, samples = 48, 4
    per = {groups // len(replicas), -(-groups // len(replicas))}  # floor and ceil of G / R
    for counts in first_replicas_by_batch(run):
        assert set(counts) == replicas, "a replica ran none of a step's work"
        assert {n // samples for n in counts.values()} <= per  # the exact even split


def test_sync_colocated_on_many_replicas_uses_them_all() -> None:
    # sync time-shares all 32 GPUs: 32 replicas; 48 groups -> 2 groups on 16, 1 on the others
    run = keep_batches(PAPER_SHAPED, "sync")
    assert run.placement.replicas == 32
    for counts in first_replicas_by_batch(run):
        assert len(counts) == 32 and sorted(Counter(counts.values()).items()) == [(4, 16), (8, 16)]


def test_least_loaded_dispatch_collapses_after_the_first_update() -> None:
    # the previous rule, kept as a reference: after the first weight update the replicas
    # that reopen first take the whole batch (the imbalance this policy was replaced for)
    run = keep_batches(PAPER_SHAPED, "sync", dispatch="least_loaded")
    assert isinstance(run.manager.dispatch, LeastLoadedDispatch)
    used = [len(c) for c in first_replicas_by_batch(run)]
    assert used[0] == 32 and max(used[1:]) < 32


def test_laminar_shares_each_burst_and_every_replica_works_every_step() -> None:
    cap = -(-4 * 48 // 12) * 4  # the window's fair share: ceil(W * G / R) groups of 4 samples
    held: list[int] = []

    class Recording(FairShareDispatch):
        def admitted(self, slot, tag):
            held.append(len(slot.inflight))  # the group just taken included
            super().admitted(slot, tag)

    resolved = load_config(None, [*PAPER_SHAPED, "run.steps=5"])

    async def main() -> None:
        run = build_local_run(resolved, "laminar")
        m = run.manager
        m.dispatch = Recording(m.slots, m.admission, m.opt.max_concurrent)
        await run.controller.run(5)

    run_virtual(main())
    assert held and max(held) <= cap, "a replica took more than its share of the window"
    row, run = run_kept([*PAPER_SHAPED, "run.steps=5"], "laminar")
    assert isinstance(run.manager.dispatch, FairShareDispatch)
    assert row["replicas_busy_min"] == row["replicas"] == 12  # every replica, every step


def test_no_trajectory_starts_on_a_version_older_than_one_a_relay_holds() -> None:
    """Once version v+1 reached the master relay, nothing new starts on version v: a replica
    whose node relay is receiving v+1 waits for it (the version floor)."""

    def violations(run: Run) -> int:
        ends = [r.end for r in run.controller.records]  # version v+1 at the master
        first = {d.traj_id: d.dispatched for d in run.runtime.shared["sim_ledger"].done}
        bad = 0
        for b in run.controller.batches:
            for t in b.trajectories:
                # dispatched at or after the instant version v+1 reached the master relay
                if t.version < len(ends) and first[t.traj_id] >= ends[t.version] - 1e-9:
                    bad += 1
        return bad

    run = keep_batches([*PAPER_SHAPED, "run.steps=5"], "laminar")
    assert violations(run) == 0

    class NoFloor(FairShareDispatch):
        def version_floor(self) -> int:
            return -1

    resolved = load_config(None, [*PAPER_SHAPED, "run.steps=5"])

    async def main() -> Run:
        r = build_local_run(resolved, "laminar")
        r.controller.keep_batches = True
        m = r.manager
        m.dispatch = NoFloor(m.slots, m.admission, m.opt.max_concurrent)
        await r.controller.run(5)
        return r

    assert violations(run_virtual(main())) > 0, "without the floor the check must fail"


# --- the cost model ------------------------------------------------------------------------


def test_trainer_step_from_flops_parallelism_and_optimizer() -> None:
    cfg = SimTrainerConfig(
        kind="flops",
        peak_tflops=100.0,
        mfu=0.5,
        flops_per_param_token=8.0,
        layers=2,
        hidden=100,
        tp=2,
        pp=2,
        micro_batch_tokens=1000,
        grad_bytes_per_param=2.0,
        dp_gbps=8.0,  # 1 GB/s
        comm_overlap=0.5,
        optimizer_bytes_per_param=16.0,
        hbm_tbps=1.0,
        step_overhead_s=1.0,
    )
    n, gpus = 10**9, 8  # 2 pipelines (dp = 8 / (tp * pp) = 2), 2 mini-batches
    eng = SimTrainerEngine(cfg, gpus, n, mini_batches=2)
    b = eng.step_breakdown([1000] * 4)  # 4 sequences of 1000 tokens
    flops = 8 * n * 4000 + 4 * (2 * 2 * 100 * 4 * 1000**2)  # dense + 4 passes of attention
    compute = flops / (8 * 100e12 * 0.5)
    assert b.compute == pytest.approx(compute)
    # 4000 tokens / (2 mini-batches x 2 pipelines) = 1000 tokens: 1 micro-batch -> bubble 1/2
    assert b.bubble == pytest.approx(compute)
    # ring all-reduce of 1e9 * 2 B / 4 GPUs per model: 2 * (1/2) * 0.5 GB / 1 GB/s, twice, half
    assert b.comm == pytest.approx(2 * (2 * 0.5 * 0.5) * 0.5)
    assert b.optimizer == pytest.approx(2 * 2 * n * 16 / 8 / 1e12)
    assert b.overhead == 1.0 and b.switch == 0.0
    assert eng.step_seconds([1000] * 4) == pytest.approx(b.total)


def test_trainer_strong_scaling_is_sublinear() -> None:
    cfg = SimTrainerConfig(kind="flops", layers=28, hidden=3584, step_overhead_s=2.0)
    lengths = [3000] * 8192
    small = SimTrainerEngine(cfg, 10, int(7.6e9), mini_batches=16).step_seconds(lengths)
    large = SimTrainerEngine(cfg, 160, int(7.6e9), mini_batches=16).step_seconds(lengths)
    speedup = small / large
    assert 1 < speedup < 16  # 16x the GPUs: the all-reduce and the overhead do not shrink


def test_colocated_sync_pays_the_switch_and_it_can_be_turned_off() -> None:
    # EXACT's run with the switch on (0.5 s/GiB, weights only) and 2 GiB of bf16 weights
    # (a replica holds them on 2 GPUs)
    changed = ("trainer.sim.switch=", "model.params_b=")
    exact = [o for o in EXACT if not o.startswith(changed)] + [
        "trainer.sim.switch_s_per_gib=0.5",
        "trainer.sim.switch_trainer_state=false",
        "model.params_b=1.073741824",
    ]
    on = simulate_schedule(load_config(None, exact), "sync")
    off = simulate_schedule(load_config(None, [*exact, "trainer.sim.switch=false"]), "sync")
    # per GPU 1 GiB of rollout weights offloaded and back: 2 GiB x 0.5 s/GiB = 1 s per step
    assert on["switch_s"] == pytest.approx(1.0)
    assert off["switch_s"] == 0.0
    assert on["sim_seconds"] == pytest.approx(off["sim_seconds"] + 3 * 1.0, rel=1e-6)
    # disaggregated schedules do not pay it
    assert simulate_schedule(load_config(None, exact), "one_step")["switch_s"] == 0.0


def test_decode_reads_the_kv_cache() -> None:
    cfg = SimRolloutConfig(
        decode_step_s=0.01, kv_read_s_per_token=1e-4, prefill_s_per_token=0.0, weight_load_s=0
    )

    class Fixed:
        def sample(self, key: int) -> int:
            return 100

    eng = SimRolloutEngine("r0", cfg, Fixed())
    req = GenerationRequest(
        "t", "g", num_prompt_tokens=100, sampling=SamplingParams(max_tokens=1000)
    )

    async def main():
        await eng.start()
        return await eng.generate(req)

    traj = run_virtual(main())
    # step at progress P: 0.01 + 1e-4 * (100 + P); 100 steps: 100 * 0.02 + 1e-4 * 100**2 / 2
    assert traj.finish_time == pytest.approx(2.5, rel=1e-9)


def test_a_move_is_prefilled_in_chunks_while_the_destination_decodes() -> None:
    row = simulate_schedule(load_config(None, [*PAPER_SHAPED, "run.steps=6"]), "laminar")
    assert row["repacks"] > 0 and row["repacked_trajectories"] > 0
    assert row["move_seconds"] > 0  # time from a move's resume to its first new token


# --- metrics -------------------------------------------------------------------------------

EXACT = [
    "run.steps=3",
    "study.warmup_steps=1",
    "cluster.gpus=3",
    "cluster.trainer_gpus=1",
    "cluster.gpus_per_replica=2",
    "cluster.gpus_per_node=2",
    "data.prompts_per_step=2",
    "data.samples_per_prompt=2",
    "data.min_prompt_tokens=10",
    "data.max_prompt_tokens=10",
    "rollout.sim.decode_step_s=0.01",
    "rollout.sim.prefill_s_per_token=0",
    "rollout.sim.weight_load_s=0",
    "rollout.sim.lengths.median=100",
    "rollout.sim.lengths.p99_over_p50=1.0",
    "trainer.sim.kind=linear",
    "trainer.sim.gpu_seconds_per_token=0",
    "trainer.sim.step_overhead_s=1.0",
    "trainer.sim.switch=false",
    "relay.sim.start_s=0",
    "relay.sim.link_gbps=1e15",
    "relay.sim.push_gbps=1e15",
    "relay.chunks=1",
    "model.params_b=0.001",
    "repack.policy=none",
]


def test_metrics_of_a_hand_computed_sync_run() -> None:
    row = simulate_schedule(load_config(None, EXACT), "sync")
    assert set(RESULT_KEYS) <= set(row)
    # each 2.0 s step: 1.0 s generating 4 x 100 tokens (one replica), 1.0 s training
    assert row["warmup_steps"] == 1
    assert row["generation_share"] == pytest.approx(0.5)
    assert row["rollout_idle_share"] == pytest.approx(0.5)
    assert row["trainer_idle_share"] == pytest.approx(0.5)
    assert row["generation_tokens_per_s"] == pytest.approx(400 / 2.0)
    assert row["trajectory_latency_mean_s"] == pytest.approx(1.0)
    assert row["trajectory_latency_max_s"] == pytest.approx(1.0)
    # KV: each group's 10-token prompt once, plus 4 growing responses: 20 + 4 * P over the
    # busy second, mean 20 + 200 tokens of the default 1e6
    assert row["kv_use_busy_mean"] == pytest.approx(220 / 1e6)
    assert row["kv_use_mean"] == pytest.approx(0.5 * 220 / 1e6)
    assert row["replicas_busy_min"] == 1 and row["started_per_replica_max"] == 4
    assert [s["replicas_started"] for s in row["per_step"]] == [1, 1, 1]


def test_staleness_is_measured_after_the_warmup() -> None:
    small = [*PAPER_SHAPED, "run.steps=6"]
    with_warmup = simulate_schedule(load_config(None, [*small, "study.warmup_steps=3"]), "laminar")
    without = simulate_schedule(load_config(None, [*small, "study.warmup_steps=0"]), "laminar")
    # the ramp-up steps (staleness 0, 1, 2 by construction) pull the whole-run mean down
    assert with_warmup["warmup_steps"] == 3 and without["warmup_steps"] == 0
    assert with_warmup["staleness_mean"] > without["staleness_mean"]
    assert with_warmup["staleness_max"] >= with_warmup["staleness_p99"]


def test_the_study_runs_baselines_without_repack_as_the_yaml_says() -> None:
    resolved = load_config(EXAMPLES / "paper_7b_256gpu.yaml")
    assert resolved.cfg.study.repack_schedules == ["laminar"]
    assert schedule_config(resolved, "laminar").cfg.repack.policy == "best_fit"
    for spec in ("sync", "one_step", "stale:4", "stale:4+partial"):
        assert schedule_config(resolved, spec).cfg.repack.policy == "none"
    listed = load_config(EXAMPLES / "paper_7b_256gpu.yaml", ["study.repack_schedules=[stale]"])
    assert schedule_config(listed, "stale:4+partial").cfg.repack.policy == "best_fit"


def test_a_traced_study_writes_the_new_metrics(tmp_path: Path) -> None:
    resolved = load_config(None, [*EXACT, "study.schedules=[sync]"])
    trace = StudyTrace(tmp_path / "trace.json")
    (row,) = run_study(resolved, trace=trace)
    info = json.loads((tmp_path / "trace_info.json").read_text())
    for key in ("generation_share", "kv_use_busy_mean", "trajectory_latency_p99_s", "per_step"):
        assert info["row"][key] == row[key]
    untraced = simulate_schedule(resolved, "sync")
    assert {k: v for k, v in untraced.items() if k != "wall_seconds"} == {
        k: v for k, v in row.items() if k != "wall_seconds"
    }


def test_dispatch_names_are_checked() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'.*balanced"):
        make_dispatch("fastest", [], type("A", (), {"groups_per_step": 1})(), 1)


def test_preemptions_are_counted_in_a_study() -> None:
    tight = [*PAPER_SHAPED, "rollout.sim.kv_capacity_tokens=800", "run.steps=3"]
    row = simulate_schedule(load_config(None, tight), "one_step")
    assert row["preemptions"] > 0
    assert row["kv_use_busy_mean"] <= 1.0
