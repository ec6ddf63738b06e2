"""The simulator's timing and the study metrics, checked against hand-computed numbers."""

from __future__ import annotations

import pytest

from laminar_core import load_config
from laminar_core.plugins import default_manager
from laminar_core.sim.study import simulate_schedule, sweep_points

# One replica (2 of 3 GPUs; sync time-shares all with the trainer), 2 prompts x 2 samples,
# every prompt 10 tokens and every response exactly 100 tokens; decode 0.01 s/step (batch 4 is
# below the roofline batch), no prefill or load cost, training 1.0 s per step (the linear
# trainer model with no per-token cost, no co-location switch), free transfers.
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
    "rollout.max_concurrent=16",
    "rollout.max_tokens=1000",
    "rollout.sim.decode_step_s=0.01",
    "rollout.sim.roofline_batch=16",
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


def test_sync_timeline_matches_hand_computation() -> None:
    row = simulate_schedule(load_config(None, EXACT), "sync")
    # each step: 1.0 s generation (100 tokens x 0.01 s) then 1.0 s training -> 2.0 s period
    assert row["sim_seconds"] == pytest.approx(6.0, rel=1e-6)
    # throughput (paper's definition): batch tokens 4 x (10 + 100) over 2.0 s between updates
    assert row["throughput_tokens_per_s"] == pytest.approx(440 / 2.0, rel=1e-6)
    assert row["trainer_idle_share"] == pytest.approx(0.5, rel=1e-6)
    # 4 of 16 batch slots busy for 3 x 1.0 s of the 6.0 s
    assert row["rollout_utilization"] == pytest.approx(4 / 16 * 3.0 / 6.0, rel=1e-6)
    assert row["staleness_max"] == 0 and row["steps"] == 3


def test_one_step_overlaps_generation_with_training() -> None:
    # disaggregated: generation of batch s+1 (version s) runs while batch s trains, so after
    # warm-up a step takes max(gen, train) = 1.0 s instead of 2.0 s
    row = simulate_schedule(load_config(None, EXACT), "one_step")
    assert row["throughput_tokens_per_s"] == pytest.approx(440 / 1.0, rel=1e-6)
    assert row["staleness_max"] == 1


def test_same_seed_same_numbers() -> None:
    cfg = load_config(
        None, [*EXACT, "rollout.sim.lengths.p99_over_p50=10", "repack.policy=best_fit"]
    )
    a = simulate_schedule(cfg, "laminar")
    b = simulate_schedule(cfg, "laminar")
    a.pop("wall_seconds")
    b.pop("wall_seconds")
    assert a == b
    other = simulate_schedule(
        load_config(None, [*EXACT, "run.seed=7", "rollout.sim.lengths.p99_over_p50=10"]), "laminar"
    )
    assert other["sim_seconds"] != a["sim_seconds"]


def test_sweep_points_apply_overrides() -> None:
    cfg = load_config(None, [*EXACT, "study.sweep=[{cluster.gpus: 4}, {cluster.gpus: 8}]"])
    points = sweep_points(cfg, default_manager())
    assert [p.cfg.cluster.gpus for _, p in points] == [4, 8]
    assert [label for label, _ in points] == ["cluster.gpus=4", "cluster.gpus=8"]
