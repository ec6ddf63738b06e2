"""Every trainer x rollout combination, for real: the loop (Ray, the relay tier on its relay
actor, rewards) for a few steps on the tiny model, per combination:

* versions advance on every replica;
* the rollout engine's log-probs match the trainer's recompute on trajectories of the
  trainer's current version (float32: < 1e-4);
* the FSDP + SGLang row trains with CISPO and token-masked TIS (its masked-fraction metric
  reported), the Megatron + vLLM row with GSPO and geometric-mean TIS, and both with dynamic
  sampling (a filter that drops every third group): the dropped groups are counted, never
  trained, and the run's audit accounts for every prompt once;
* and, for the two LoRA rows, a run resumed from a checkpoint continues from its step.

``fsdp+vllm+lora`` and ``megatron+sglang+lora`` train ``trainer.lora`` adapters: every
version is an adapter the replicas hot-load, so the log-prob check is the adapter's
agreement (a replica serving the wrong adapter version fails it: core's
``check_lora_versions``, run by ``plugins/vllm/tests/test_vllm_lora.py`` and
``plugins/sglang/tests/test_sglang_lora.py``).

FSDP + vLLM is ``tests/test_real_training.py`` (the quickstart itself, in more depth).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from laminar_core import load_config
from laminar_core.testing import require_modules

require_modules(
    "laminar_fsdp",
    "laminar_vllm",
    "laminar_megatron",
    "laminar_sglang",
    "sglang",
    "vllm",
    what="the engine matrix",
)

pytest.importorskip("ray")

from laminar_core.models import build_tiny_model
from laminar_core.runtime.train import make_run_dir, start_run
from laminar_core.telemetry.events import WeightPull
from laminar_core.testing.audit import audit_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
DYNAMIC = "algorithm.dynamic_sampling={filter: 'laminar_core.testing.filters:every_third'}"
COMBOS = {
    # the trainer-side algorithms (issue 35) ride on the full-model rows: each loss and
    # correction runs through both trainers' loss path and both engines' log-probs
    "fsdp+sglang": [
        "rollout.engine=sglang",
        "trainer.engine=fsdp",
        "algorithm.loss=cispo",
        "algorithm.off_policy=tis",
        "algorithm.is_mask=token",
        DYNAMIC,
    ],
    "megatron+vllm": [
        "trainer.engine=megatron",
        "rollout.engine=vllm",
        "algorithm.loss=gspo",
        "algorithm.clip_low=3e-4",
        "algorithm.clip_high=4e-4",
        "algorithm.off_policy=tis",
        "algorithm.is_level=geometric",
        DYNAMIC,
    ],
    "fsdp+vllm+lora": [
        "trainer.engine=fsdp",
        "rollout.engine=vllm",
        "trainer.lora.rank=8",
        "trainer.fsdp.lr=2e-2",
        # five real processes start at once on a shared 2-core machine (the vLLM import alone
        # took minutes there at load 60-90): more than the default 300 s
        "runtime.start_timeout_s=1200",
    ],
    # the quickstart_megatron_sglang example with TP=2 adapters, each version hot-loaded
    # by SGLang (its full-model path is the two rows above, between them)
    "megatron+sglang+lora": [
        "trainer.lora.rank=8",
        "trainer.megatron.lr=2e-2",
        "runtime.start_timeout_s=1200",
    ],
}
RESUMED = ("megatron+sglang+lora", "fsdp+vllm+lora")
TRAINER_OPTIONS = {  # the trainer's options when the example's engine is swapped
    "megatron": ["trainer.megatron.tp=2", "trainer.megatron.lr=3e-3"],
}
ROLLOUT_OPTIONS = {
    "sglang": ["rollout.sglang.dtype=float32", "rollout.sglang.max_total_tokens=8192"],
}


def _config(model: Path, out: Path, combo: str, *extra: str):
    overrides = list(COMBOS[combo])
    for o in overrides:
        name = o.split("=", 1)[1]
        overrides += TRAINER_OPTIONS.get(name, []) + ROLLOUT_OPTIONS.get(name, [])
    return load_config(
        ROOT / "examples" / "quickstart_megatron_sglang.yaml",
        [
            f"model.path={model}",
            f"run.out_dir={out}",
            f"run.steps={STEPS}",
            "run.checkpoint_every=2",
            "data.prompts_per_step=4",
            "data.samples_per_prompt=4",
            "rollout.max_tokens=32",
            "rollout.heartbeat_timeout_s=300",
            # at most one step's groups in flight: the last step's are admitted only after
            # version 2 exists, so every replica pulls it (the default 4 lets all 3 steps'
            # groups start on version 1, and whether a replica ever pulls 2 is then timing)
            "buffer.max_ahead_batches=1",
            "telemetry.progress=false",
            *overrides,
            *extra,
        ],
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def _train(resolved, steps: int):
    run_dir = make_run_dir(resolved)
    run = await start_run(resolved, run_dir)
    try:
        await run.controller.run(steps)
    finally:
        run.events.write_jsonl(run_dir / "events.jsonl")
        await run.close()
    return run, run_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 4 query heads in 2 KV groups: Megatron's TP=2 splits whole groups
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, heads=4, kv_heads=2)


@pytest.mark.parametrize("combo", list(COMBOS))
def test_combination_trains_and_agrees_on_logprobs(combo, model, ray_cluster, tmp_path):
    resolved = _config(model, tmp_path, combo)
    run, run_dir = asyncio.run(_train(resolved, STEPS))
    rows = _rows(run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    pulls: dict[str, list[int]] = {}
    for e in run.events.of(WeightPull):
        pulls.setdefault(e.actor, []).append(e.version)
    assert set(pulls) == {"r0", "r1"} and all(max(v) >= 2 for v in pulls.values()), pulls
    gaps = [r["logprob_abs_diff_max"] for r in rows if "logprob_abs_diff_max" in r]
    assert gaps, "no trajectory of the trainer's current version was trained on"
    wall = rows[-1]["wall_seconds"]
    # the matrix's figures (pytest -rP shows them): log-prob gap, steps/s after start-up
    print(f"{combo}: logprob gap max {max(gaps):.2e}, {len(rows) / wall:.2f} steps/s")
    assert max(gaps) < 1e-4, gaps
    if DYNAMIC in COMBOS[combo]:  # dropped groups: counted, never trained, audited once
        assert sum(r.get("groups_filtered", 0) for r in rows) > 0, rows[-1].keys()
        report = audit_run(run_dir)
        assert report.ok, report.problems
        assert report.filtered_prompts > 0
    if "algorithm.is_mask=token" in COMBOS[combo]:
        assert any("is_masked_fraction" in r for r in rows), rows[-1].keys()
    if combo in RESUMED:  # a resumed run continues from the checkpoint's step
        step2 = run_dir / "checkpoints" / "step_000002"
        resumed = _config(model, tmp_path, combo, f"run.resume={step2}")
        _, run_dir2 = asyncio.run(_train(resumed, STEPS + 1))
        assert [r["step"] for r in _rows(run_dir2)] == [2, 3]
