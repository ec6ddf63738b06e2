"""The algorithms of issue 35 on the long-tail task: eval reward and wall time side by side,
several seeds.

Two modes. The default, ``loop``, is a pure-torch GRPO loop like ``task_learnability.py`` (no
Ray, no vLLM: minutes, not hours, on a shared 2-core machine) that uses core's advantages,
losses, rollout corrections and group filter exactly as the trainer does: the tiny Qwen2-style
model, the ``longtail`` task (counts up to ``--counts``), 8 prompts x 8 samples per step, two
passes over each batch (so the ratio is not 1 on the second), generation by the weights of
``lag`` steps ago (the behaviour policy; its log-probs are the "rollout engine's", the
trainer's recompute is the "old"), held-out eval prompts sampled at temperature 1. Arms:

- ``grpo`` vs ``grpo_ds``: GRPO (PPO loss) without and with dynamic sampling (zero-variance
  groups dropped, new prompts generated until the step has its 8 groups);
- ``grpo`` (``loss: ppo``) vs ``gspo`` (GSPO's clip 3e-4 / 4e-4, ``seq_mean_token_mean``);
- ``tis_stale`` vs ``mis_stale``: behaviour policy 8 steps old (``--stale-lag``), token TIS
  (cap 2) vs the same with tokens outside ``[0.5, 2]`` masked.

``--real`` runs the same pairs as ``laminar train examples/longtail.yaml`` (``small`` model,
2 FSDP ranks, 2 vLLM-CPU replicas under Ray; ``stale:8`` for the stale arms), each in its
own process group:

- ``grpo`` vs ``grpo_ds``: GRPO (PPO clip) without and with ``algorithm.dynamic_sampling``;
- ``grpo`` (``loss: ppo``) vs ``gspo`` (``loss: gspo``, the paper's clip 3e-4 / 4e-4 and
  ``seq_mean_token_mean``);
- ``tis_stale`` vs ``mis_stale``: under ``schedule=stale:8`` (a high staleness bound),
  token-level truncated IS (``off_policy: tis``) vs the same plus masking tokens whose
  trainer/rollout ratio leaves ``[0.5, 2]`` (``is_mask: token``).

Arms run one after another (never concurrently). Per arm:
the last eval round's reward (held-out prompts, sampled at temperature 1, ``data.eval_*``),
the process wall time (start-up included) and the loop time (``wall_seconds``: engines up,
eval rounds left out), samples trained and sampled (dynamic sampling's extra rollouts), and
the mean of the algorithm's own metrics: ``filter_rate``, ``is_masked_fraction``,
``clip_fraction``. With several seeds: means, eval reward with its min-max.

    OMP_NUM_THREADS=1 python benchmarks/algorithms.py [--steps 40] [--seeds 0,1,2]
        [--arms grpo,grpo_ds,...] [--json FILE]
    laminar tiny-model runs/small-qwen2 --preset small
    python benchmarks/algorithms.py --real [--steps 30] [--seeds 0,1] [--eval-every 15]
        [--eval-size 64] [--set KEY=VALUE ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _sampling
import torch
from _common import ROOT, say, table

from laminar_core.algorithms import AlgorithmConfig, compute_advantages, policy_loss, zero_variance
from laminar_core.models import build_tiny_model
from laminar_core.tasks.longtail import LongTailTask

# the loop mode's arms: AlgorithmConfig fields, plus dynamic sampling and the behaviour lag
LOOP_ARMS: dict[str, dict] = {
    "grpo": {},
    "grpo_ds": {"ds": True},
    "gspo": {
        "loss": "gspo",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "loss_agg": "seq_mean_token_mean",
    },
    "tis_stale": {"off_policy": "tis", "stale": True},
    "mis_stale": {"off_policy": "tis", "is_mask": "token", "stale": True},
}

ARMS: dict[str, list[str]] = {
    "grpo": [],
    "grpo_ds": ["algorithm.dynamic_sampling=true"],
    "gspo": [
        "algorithm.loss=gspo",
        "algorithm.clip_low=3e-4",
        "algorithm.clip_high=4e-4",
        "algorithm.loss_agg=seq_mean_token_mean",
    ],
    "tis_stale": ["schedule=stale:8", "algorithm.off_policy=tis"],
    "mis_stale": ["schedule=stale:8", "algorithm.off_policy=tis", "algorithm.is_mask=token"],
}


class Policy:
    """The tiny model and what the loop needs of it: sampling, response log-probs."""

    def __init__(self, path: str, lr: float, temperature: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.t = temperature

    def sample(self, model, prompts: list[list[int]], max_tokens: int):
        """Sampled responses ``[N, T]``, their mask, and the prompt batch."""
        return _sampling.sample(model, self.tok, prompts, self.t, max_tokens)

    def logprobs(self, model, ids, attn, resp, mask):
        return _sampling.logprobs(model, ids, attn, resp, mask, self.t)

    def texts(self, resp, mask) -> list[str]:
        return _sampling.texts(self.tok, resp, mask)


def loop_arm(arm: str, seed: int, a: argparse.Namespace) -> dict:
    """One arm of the pure-torch loop (module docstring); per-step rows and the eval."""
    spec = dict(LOOP_ARMS[arm])
    ds, stale = spec.pop("ds", False), spec.pop("stale", False)
    lag = a.stale_lag if stale else 0
    cfg = AlgorithmConfig(**spec)
    torch.manual_seed(seed)
    tmp = tempfile.mkdtemp(prefix="laminar-alg-")
    build_tiny_model(tmp, seed=seed, hidden_size=128, layers=2, heads=2, kv_heads=1)
    pol = Policy(tmp, a.lr, 1.0)
    behaviour_model = None
    if lag:
        from transformers import AutoModelForCausalLM

        behaviour_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    history = [{k: v.clone() for k, v in pol.model.state_dict().items()}]
    counts = tuple(int(c) for c in a.counts.split(","))
    weights = LongTailTask.Options().weights[: len(counts)]
    train = LongTailTask(seed=seed, counts=counts, weights=weights)
    held = LongTailTask(seed=seed, counts=counts, weights=weights, split="eval")
    rng = random.Random(seed)
    enc = lambda r: pol.tok.encode(r["prompt"], add_special_tokens=False)  # noqa: E731
    rows, t0, sampled_total = [], time.perf_counter(), 0
    for step in range(a.steps):
        gen = pol.model
        if behaviour_model is not None:  # the weights of ``lag`` steps ago generate
            behaviour_model.load_state_dict(history[max(0, len(history) - 1 - lag)])
            gen = behaviour_model
        kept: list[tuple] = []  # (rows, ids, attn, resp, mask, rewards) per group batch
        groups_kept = dropped = rounds = 0
        while groups_kept < a.prompts and rounds < a.max_rounds:
            rounds += 1
            need = a.prompts - groups_kept
            batch = [train[rng.randrange(len(train))] for _ in range(need)]
            prompts = [enc(r) for r in batch for _ in range(a.samples)]
            ids, attn, resp, mask = pol.sample(gen, prompts, a.max_tokens)
            texts = pol.texts(resp, mask)
            rewards = [LongTailTask.reward(t, batch[i // a.samples]) for i, t in enumerate(texts)]
            sampled_total += len(prompts)
            keep = []
            for g in range(need):
                rs = rewards[g * a.samples : (g + 1) * a.samples]
                if ds and zero_variance(rs):
                    dropped += 1
                else:
                    keep.append(g)
            if not keep:
                continue
            rows_idx = [g * a.samples + j for g in keep for j in range(a.samples)]
            kept.append((ids[rows_idx], attn[rows_idx], resp[rows_idx], mask[rows_idx],
                         [rewards[i] for i in rows_idx]))  # fmt: skip
            groups_kept += len(keep)
        # one batch, padded to the longest response
        width = max(k[2].shape[1] for k in kept)
        plen = max(k[0].shape[1] for k in kept)
        pad = pol.tok.pad_token_id

        def padto(x, n, left, value):
            extra = torch.full((x.shape[0], n - x.shape[1]), value, dtype=x.dtype)
            return torch.cat([extra, x] if left else [x, extra], 1)

        ids = torch.cat([padto(k[0], plen, True, pad) for k in kept])
        attn = torch.cat([padto(k[1], plen, True, 0) for k in kept])
        resp = torch.cat([padto(k[2], width, False, pad) for k in kept])
        mask = torch.cat([padto(k[3], width, False, False) for k in kept])
        rewards = torch.tensor([r for k in kept for r in k[4]])
        groups = torch.arange(len(rewards)) // a.samples
        adv = compute_advantages("grpo", rewards, groups)
        with torch.no_grad():
            behaviour = pol.logprobs(gen, ids, attn, resp, mask)
            old = pol.logprobs(pol.model, ids, attn, resp, mask) if lag else behaviour
        metrics: dict = {}
        pol.model.train()
        for _ in range(a.epochs):
            logp = pol.logprobs(pol.model, ids, attn, resp, mask)
            loss, metrics = policy_loss(cfg, logp, behaviour, adv, mask, old_logprobs=old)
            pol.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(pol.model.parameters(), 1.0)
            pol.opt.step()
        history = [*history[-lag:], {k: v.clone() for k, v in pol.model.state_dict().items()}]
        row = {
            "step": step,
            "reward_mean": rewards.mean().item(),
            "groups_filtered": dropped,
            "filter_rate": dropped / (dropped + groups_kept),
            "wall_s": time.perf_counter() - t0,
            **{k: v for k, v in metrics.items() if k in ("clip_fraction", "is_masked_fraction")},
        }
        rows.append(row)
    wall = time.perf_counter() - t0
    # held-out eval: sampled at temperature 1, as the policy is trained
    evals = [held[i] for i in range(a.eval_size)]
    _, _, resp, mask = pol.sample(pol.model, [enc(r) for r in evals], a.max_tokens)
    texts = pol.texts(resp, mask)
    ev = sum(LongTailTask.reward(t, r) for t, r in zip(texts, evals, strict=True)) / len(evals)
    rows[-1]["eval_reward"] = ev
    return {
        "arm": arm,
        "seed": seed,
        "rows": [{**r, "trajectories": a.prompts * a.samples} for r in rows],
        "wall_seconds": wall,
        "loop_seconds": wall,
        "sampled": sampled_total,
    }


def _cli() -> list[str]:
    found = shutil.which("laminar")
    return [found] if found else [sys.executable, "-m", "laminar_core.cli"]


def run_arm(arm: str, seed: int, a: argparse.Namespace, work: Path) -> dict:
    """One ``laminar train`` run; its metrics rows and wall time."""
    name = f"{arm}-s{seed}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.setdefault("RAY_ADDRESS", "local")  # a cluster of its own
    cmd = [
        *_cli(),
        "train",
        a.config,
        f"model.path={a.model}",
        f"run.steps={a.steps}",
        f"run.seed={seed}",
        f"run.eval_every={a.eval_every}",
        f"data.eval_size={a.eval_size}",
        f"run.out_dir={work}",
        f"run.name={name}",
        "run.checkpoint_every=-1",
        "telemetry.progress=false",
        *(a.set or []),
        *ARMS[arm],
    ]
    t0 = time.monotonic()
    log = work / f"{name}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(a.cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # as a Ctrl-C: the run shuts down cleanly
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - t0
    text = log.read_text()
    run_dir = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in text.splitlines()
            if ln.startswith("run directory:")
        ),
        None,
    )
    rows = []
    if run_dir and (ROOT / run_dir / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (ROOT / run_dir / "metrics.jsonl").read_text().splitlines()]
    if proc.returncode != 0:
        say(f"    {name} exited with {proc.returncode}; last lines of {log}:")
        for line in text.splitlines()[-8:]:
            say(f"      {line}")
    return {"arm": arm, "seed": seed, "rows": rows, "wall_seconds": wall, "rc": proc.returncode}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summary(runs: list[dict]) -> dict:
    """An arm's figures over its seeds."""
    evals, loops, walls, trained, sampled, metrics = [], [], [], [], [], {}
    for r in runs:
        rows = r["rows"]
        ev = [x["eval_reward"] for x in rows if x.get("eval_reward") is not None]
        if ev:
            evals.append(ev[-1])
        if rows:
            loops.append(r.get("loop_seconds") or rows[-1]["wall_seconds"])
            trained.append(sum(x["trajectories"] for x in rows))
            sampled.append(
                r.get("sampled")
                or sum(x.get("sampled_trajectories", x["trajectories"]) for x in rows)
            )
        walls.append(r["wall_seconds"])
        for k in ("filter_rate", "is_masked_fraction", "clip_fraction", "is_weight_mean"):
            vals = [x[k] for x in rows if k in x]
            if vals:
                metrics.setdefault(k, []).append(sum(vals) / len(vals))
    return {
        "eval_reward": _mean(evals),
        "eval_min": min(evals, default=None),
        "eval_max": max(evals, default=None),
        "loop_seconds": _mean(loops),
        "wall_seconds": _mean(walls),
        "trained": _mean(trained),
        "sampled": _mean(sampled),
        **{k: _mean(v) for k, v in metrics.items()},
        "seeds": len(runs),
        "steps": _mean([float(len(r["rows"])) for r in runs]),
    }


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="laminar train runs (module doc)")
    ap.add_argument("--config", default="examples/longtail.yaml")
    ap.add_argument("--model", default="runs/small-qwen2")
    ap.add_argument("--steps", type=int, default=None, help="default: 40 (loop), 30 (--real)")
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--cap", type=float, default=420.0, help="--real: wall s per run at most")
    ap.add_argument("--set", action="append", help="--real: KEY=VALUE for every arm")
    ap.add_argument("--work", default="runs/algorithms")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--counts", default="2,4,8,16,32", help="loop: the task's count classes")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--epochs", type=int, default=2, help="loop: passes over each batch")
    ap.add_argument("--stale-lag", type=int, default=8)
    ap.add_argument("--max-rounds", type=int, default=4, help="loop: generation rounds/step")
    ap.add_argument("--json", help="write every run and the summaries here")
    a = ap.parse_args()
    a.steps = a.steps or (30 if a.real else 40)
    torch.set_num_threads(1)
    work = ROOT / a.work
    if a.real:
        if not (ROOT / a.model).exists():
            sys.exit(f"{a.model} does not exist: laminar tiny-model {a.model} --preset small")
        work.mkdir(parents=True, exist_ok=True)
    arms = a.arms.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:  # seed-major: a slow stretch of a shared machine hits every arm
        for arm in arms:
            say(f"  {arm} seed {seed} ...")
            r = run_arm(arm, seed, a, work) if a.real else loop_arm(arm, seed, a)
            runs[arm].append(r)
            ev = [x["eval_reward"] for x in r["rows"] if x.get("eval_reward") is not None]
            say(f"    eval {fmt(ev[-1] if ev else None)}  {r['wall_seconds']:.0f} s")
    sums = {arm: summary(rs) for arm, rs in runs.items()}
    header = [
        "arm", "final eval (min-max)", "wall s", "loop s", "trained", "sampled",
        "filter rate", "masked", "clip frac",
    ]  # fmt: skip
    rows = [
        [
            arm,
            f"{fmt(s['eval_reward'])} ({fmt(s['eval_min'])}-{fmt(s['eval_max'])})",
            fmt(s["wall_seconds"], ".0f"),
            fmt(s["loop_seconds"], ".0f"),
            fmt(s["trained"], ".0f"),
            fmt(s["sampled"], ".0f"),
            fmt(s.get("filter_rate")),
            fmt(s.get("is_masked_fraction"), ".4f"),
            fmt(s.get("clip_fraction")),
        ]
        for arm, s in sums.items()
    ]
    what = f"{a.config} ({a.model})" if a.real else "pure-torch loop, tiny model"
    say(f"\n{a.steps} steps, seeds {seeds}, {what}; the machine may be shared")
    say(table(rows, header))
    if a.json:
        Path(a.json).write_text(json.dumps({"summaries": sums, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
