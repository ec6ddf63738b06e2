"""Every shipped example config loads and validates; the paper setups model the paper."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar_core import load_config
from laminar_core.plugins import default_manager
from laminar_core.runtime.placement import plan_placement
from laminar_core.runtime.resolve import schedule_of
from laminar_core.sim.study import sweep_points

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIGS = sorted(p for p in EXAMPLES.rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    resolved = load_config(path)
    for _, point in sweep_points(resolved, default_manager()):
        for spec in point.cfg.study.schedules:
            place = plan_placement(point.cfg, schedule_of(point, spec))
            assert place.replicas >= 1


@pytest.mark.parametrize(
    ("name", "gpus", "tp"),
    [("paper_7b_256gpu", 256, 1), ("paper_32b_512gpu", 512, 4), ("paper_72b_1024gpu", 1024, 8)],
)
def test_paper_setups_use_the_paper_workload(name: str, gpus: int, tp: int) -> None:
    cfg = load_config(EXAMPLES / "sim" / f"{name}.yaml").cfg
    assert cfg.cluster.gpus == gpus and cfg.cluster.gpus_per_replica == tp
    assert (cfg.data.prompts_per_step, cfg.data.samples_per_prompt) == (512, 16)
    assert cfg.rollout.max_tokens == 16384 and cfg.rollout.temperature == 1.0
    assert cfg.rollout.max_concurrent == 1024


@pytest.mark.parametrize(
    ("model", "low", "high"), [("7b", 16, 256), ("32b", 32, 512), ("72b", 64, 1024)]
)
def test_sweeps_cover_the_paper_range(model: str, low: int, high: int) -> None:
    resolved = load_config(EXAMPLES / "sim" / f"sweep_{model}.yaml")
    gpus = [p.cfg.cluster.gpus for _, p in sweep_points(resolved, default_manager())]
    assert gpus[0] == low and gpus[-1] == high and gpus == sorted(gpus)
    batch = {
        (p.cfg.data.prompts_per_step, p.cfg.data.samples_per_prompt)
        for _, p in sweep_points(resolved, default_manager())
    }
    assert batch == {(512, 16)}, "strong scaling keeps the global batch fixed"
