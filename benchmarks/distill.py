"""On-policy distillation on CPU: a tiny student distilled from a tiny teacher on ``repeat``.

The teacher is the tiny model fitted to exact ``repeat`` demonstrations (``laminar
tiny-model --warmup repeat --warmup-share 1``); the student a tiny model of another seed
given a short SFT (``--student-warmup`` steps on exact demonstrations that skip the held-out
``(letter, count)`` pairs: it knows the format, not every count), as the published recipes
distil from an SFT'd student (``--student-warmup 0``: a random init, which collapses; see
docs/benchmarks.md). Each arm is a real ``laminar train`` run of the quickstart (Ray, FSDP2,
vLLM; 1 trainer rank, 1 student replica and, with a teacher, 1 teacher replica) for
``--steps`` steps at ``--lr`` cosine-decayed to 10%:

* ``distill``: ``algorithm.advantage: none`` + ``distill_coef`` (the reward is logged and
  evaluated, never learned from: pure on-policy distillation);
* ``distill+grpo``: GRPO's reward advantage plus the distillation term;
* ``grpo``: GRPO alone (the baseline, no teacher).

Printed side by side: the held-out eval reward (greedy, the run's own eval round on the
``split: eval`` prompts: pairs neither the student's SFT nor the runs train on) of the
teacher, of the student before training (both a greedy transformers decode of the same
prompts) and of each arm after, with the share of the teacher-student gap each arm closed;
wall seconds per step; the teacher's scoring latency per trajectory (from a trajectory's end
to its score).

    python benchmarks/distill.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOLDOUT = 0.1  # the share of (letter, count) pairs held out for eval
ARMS = {
    "distill": ["algorithm.advantage=none", "algorithm.distill_coef={coef}", "TEACHER"],
    "distill+grpo": ["algorithm.distill_coef={coef}", "TEACHER"],
    "grpo": [],
}


def build_models(
    teacher: Path, student: Path, warmup_steps: int, student_warmup: int, holdout: float
) -> None:
    """The teacher (fitted to exact demonstrations) and the student, if missing: a fresh
    random-init model of another seed, warmed for ``student_warmup`` steps on exact
    demonstrations that skip the held-out pairs (a short SFT: the format and some counts)."""
    from laminar_core.models import build_tiny_model
    from laminar_core.models.warmup import repeat_demonstrations, warm_start

    cli = [sys.executable, "-m", "laminar_core.cli", "tiny-model"]
    if not (teacher / "config.json").is_file():
        subprocess.run(
            [*cli, str(teacher), "--warmup", "repeat", "--warmup-share", "1.0",
             "--warmup-steps", str(warmup_steps)],
            check=True,
        )  # fmt: skip
    if not (student / "config.json").is_file():
        build_tiny_model(student, seed=1)
        if student_warmup:
            demos = repeat_demonstrations(0, 1.0, holdout=holdout)
            print(warm_start(student, "repeat", steps=student_warmup, demos=demos).summary())


def overrides(model: Path, out: Path, name: str, steps: int, seed: int, eval_size: int) -> list:
    return [
        f"model.path={model}",
        f"run.name={name}",
        f"run.out_dir={out}",
        f"run.steps={steps}",
        f"run.seed={seed}",
        "run.checkpoint_every=-1",
        "run.eval_every=-1",
        f"data.eval_size={eval_size}",
        f"data.task_options.holdout={HOLDOUT}",
        "data.eval_task_options.split=eval",
        "cluster.gpus=2",
        "cluster.trainer_gpus=1",
        "cluster.gpus_per_node=2",
        "telemetry.progress=false",
    ]


def greedy_eval(model: Path, args: list[str]) -> float:
    """The eval reward of ``model`` on the run's held-out prompts: greedy transformers decode
    (what the run's eval rounds do with vLLM), scored by the task's reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laminar_core import load_config
    from laminar_core.loop.evaluation import build_eval_prompts
    from laminar_core.tasks import build_prompts
    from laminar_core.tasks.repeat import repeat_reward

    resolved = load_config(ROOT / "examples" / "quickstart.yaml", args)
    tok = AutoTokenizer.from_pretrained(str(model))
    train, _ = build_prompts(resolved, tok)
    prompts = build_eval_prompts(resolved, tok, train)
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for p in prompts:
            out = lm.generate(
                input_ids=torch.tensor([p.ids]), do_sample=False,
                max_new_tokens=resolved.cfg.rollout.max_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            text = tok.decode(out[0, len(p.ids) :].tolist(), skip_special_tokens=True)
            scores.append(repeat_reward(text, p.metadata))
    return sum(scores) / len(scores)


def run_arm(arm: str, seed: int, a: argparse.Namespace, base: list[str]) -> dict:
    extra = []
    for item in ARMS[arm]:
        if item == "TEACHER":
            extra.append(f"algorithm.teacher.model={a.teacher}")
        else:
            extra.append(item.format(coef=a.coef))
    out = Path(a.work) / f"{arm}-s{seed}"
    cmd = [sys.executable, "-m", "laminar_core.cli", "train", "examples/quickstart.yaml"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*cmd, *base, f"run.out_dir={out}", f"run.seed={seed}", *extra, *(a.set or [])],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{arm} seed {seed} failed")
    rows = [json.loads(x) for x in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    walls = [r["wall_seconds"] for r in steps]
    step_s = [b - a for a, b in itertools.pairwise(walls)]
    wait_s = [r["wait_seconds"] for r in steps]
    score_s = [r["teacher_score_s_mean"] for r in steps if "teacher_score_s_mean" in r]
    rkl = [r["distill_reverse_kl"] for r in steps if "distill_reverse_kl" in r]
    return {
        "arm": arm,
        "seed": seed,
        "eval_reward": evals[-1] if evals else None,
        "wall_s": wall,
        "step_s": statistics.median(step_s) if step_s else None,
        "wait_s": statistics.median(wait_s) if wait_s else None,
        "teacher_score_s": statistics.median(score_s) if score_s else None,
        "reverse_kl_first": rkl[0] if rkl else None,
        "reverse_kl_last": sum(rkl[-5:]) / len(rkl[-5:]) if rkl else None,
    }


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="runs/distill-teacher")
    ap.add_argument("--student", help="default runs/distill-student-wN (N: --student-warmup)")
    ap.add_argument("--warmup-steps", type=int, default=300, help="the teacher's warm-up")
    ap.add_argument(
        "--student-warmup",
        type=int,
        default=60,
        help="the student's SFT steps on exact demonstrations without the held-out pairs "
        "(0: a random-init student)",
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="every arm's trainer.fsdp.lr")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--eval-size", type=int, default=32)
    ap.add_argument("--work", default="runs/distill-bench")
    ap.add_argument("--set", action="append", help="KEY=VALUE for every arm")
    ap.add_argument("--json", help="write every run and the baselines here")
    a = ap.parse_args()
    os.chdir(ROOT)
    teacher = Path(a.teacher)
    student = Path(a.student or f"runs/distill-student-w{a.student_warmup}")
    build_models(teacher, student, a.warmup_steps, a.student_warmup, HOLDOUT)
    base = overrides(student, Path(a.work), "distill", a.steps, 0, a.eval_size)
    # lr decayed to 10% by the last step (cosine), as the warm-ups do: at a constant lr the
    # late steps undid early gains on one seed in three (docs/benchmarks.md)
    base += [
        f"trainer.fsdp.lr={a.lr}",
        "trainer.fsdp.lr_schedule=cosine",
        "trainer.fsdp.min_lr_ratio=0.1",
    ]
    t_eval = greedy_eval(teacher, base)
    s_eval = greedy_eval(student, base)
    print(f"teacher eval {t_eval:.3f}   student before {s_eval:.3f}   ({a.eval_size} held-out)")
    runs = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for arm in a.arms.split(","):
            r = run_arm(arm, seed, a, base)
            gap, got = t_eval - s_eval, r["eval_reward"]
            r["gap_closed"] = (got - s_eval) / gap if gap and got is not None else None
            runs.append(r)
            print(
                f"{arm:>13} seed {seed}: eval {fmt(r['eval_reward'])} (gap closed "
                f"{fmt(r['gap_closed'], '.0%')})  step {fmt(r['step_s'], '.2f')} s (waiting for "
                f"data {fmt(r['wait_s'], '.2f')} s)  "
                f"teacher score {fmt(r['teacher_score_s'], '.3f')} s/traj  reverse KL "
                f"{fmt(r['reverse_kl_first'], '.2f')} -> {fmt(r['reverse_kl_last'], '.2f')}  "
                f"wall {r['wall_s']:.0f} s",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"teacher": t_eval, "student_before": s_eval, "runs": runs}, indent=1)
        )


if __name__ == "__main__":
    main()
