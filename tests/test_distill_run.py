"""On-policy distillation end to end on CPU: a fresh tiny student trained reward-free
(``algorithm.advantage: none``: the task's reward is logged, never learned from) on a tiny
teacher's scores.

Real parts: Ray actors, the FSDP2 trainer, a vLLM student replica and a vLLM teacher replica
(another model: its own weights, its own actor) scoring every finished trajectory
(``RolloutEngine.score``). Checked: every trained trajectory carries the teacher's log-prob
of each of its tokens, equal to a transformers forward of the teacher (not the student);
every step trains on them and reports the reverse KL and the scoring. Whether distillation
closes the held-out eval gap to a teacher fitted to ``repeat`` is ``benchmarks/distill.py``'s
question: on this tiny model it did not (docs/benchmarks.md).

Needs laminar-fsdp and laminar-vllm (scripts/install.sh installs both); without them the
module is skipped, unless LAMINAR_REQUIRE_REAL=1 (CI) makes that a failure.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from laminar_core import load_config
from laminar_core.testing import require_modules

require_modules("laminar_fsdp", "laminar_vllm", "vllm", what="real-engine tests")

pytest.importorskip("ray")

from laminar_core.models import build_tiny_model
from laminar_core.models.warmup import warm_start
from laminar_core.runtime.train import close_run, make_run_dir, start_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


@pytest.fixture(scope="module")
def distilled(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    teacher = build_tiny_model(root / "teacher", seed=0)
    # a few steps on repeat demonstrations: a teacher whose distribution is not the random
    # student's (two random tiny models are both near-uniform)
    warm_start(teacher, "repeat", steps=30, share=1.0, lr=5e-3)
    student = build_tiny_model(root / "student", seed=1)
    resolved = load_config(
        ROOT / "examples" / "quickstart.yaml",
        [
            f"model.path={student}",
            f"run.out_dir={root / 'runs'}",
            f"run.steps={STEPS}",
            "run.checkpoint_every=-1",
            "cluster.gpus=2",
            "cluster.trainer_gpus=1",
            "cluster.gpus_per_node=2",
            "telemetry.progress=false",
            f"algorithm.teacher.model={teacher}",
            "algorithm.distill_coef=1.0",
            "algorithm.advantage=none",
        ],
    )

    async def go():
        run_dir = make_run_dir(resolved)
        run = await start_run(resolved, run_dir)
        run.controller.keep_batches = True
        try:
            await run.controller.run(STEPS)
        finally:
            await close_run(run)
        return run, run_dir

    run, run_dir = asyncio.run(go())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return teacher, run, rows


def test_every_step_trains_on_the_teachers_scores_without_a_reward(distilled):
    _, _, rows = distilled
    assert len(rows) == STEPS
    # two different models: the student's samples are far from the teacher's (a KL of
    # several nats); with advantage none it is the only signal, and every step trained
    assert all(r["distill_reverse_kl"] > 0.1 for r in rows), rows
    assert all(r["trained_trajectories"] > 0 for r in rows)
    assert all(r.get("teacher_score_s_mean", 0) > 0 for r in rows)
    assert all(r.get("teacher_tokens", 0) > 0 for r in rows)


def test_every_trained_token_carries_the_teachers_log_prob(distilled):
    teacher, run, _ = distilled
    from transformers import AutoModelForCausalLM

    # every trained trajectory carries the teacher's log-prob of each token: a transformers
    # forward of the teacher on the same ids
    trajs = [t for b in run.controller.batches for t in b.trajectories]
    assert trajs and all(len(t.teacher_logprobs) == len(t.response_ids) for t in trajs)
    lm = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    for t in trajs[:: max(1, len(trajs) // 8)]:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(lm(ids).logits[0].double(), -1)
        n = len(t.prompt_ids)
        want = lp[n - 1 : -1].gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        got = torch.tensor(t.teacher_logprobs).double()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # ... and not the student's own
    gaps = [max(abs(a - b) for a, b in zip(t.teacher_logprobs, t.logprobs)) for t in trajs]
    assert max(gaps) > 0.5, gaps
