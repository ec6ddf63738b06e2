"""On-policy distillation vs SFT on the teacher's outputs on the tiny CPU model, in plain torch.

No Laminar runtime: the student samples with ``model.generate`` (temperature 1), the teacher
scores the same tokens with a transformers forward, one AdamW step per batch (on-policy, so
PPO's ratio is 1 and its clip inactive), greedy eval on the run's 32 held-out prompts. Three
objectives on the same prompts, at the same lr and step count:

* ``sampled``: Laminar's term, core's ``distill_advantages`` (``teacher - student`` on the
  sampled tokens, the Thinking Machines estimator) with REINFORCE, token-mean;
* ``full``: the exact per-position reverse KL over the whole vocabulary (the teacher's
  full distribution; no sampling noise in the per-token term): what a better estimator of
  the same objective could at best do;
* ``sft``: cross-entropy on the teacher's greedy outputs for the same prompts (off-policy
  distillation, forward KL): the strongest signal the teacher can give per prompt.

If ``sft`` does not close the gap in N steps either, the budget (steps, prompts, lr schedule)
is the limit on this model, not the distillation estimator.

    python benchmarks/distill_reference.py --teacher T --student S --objectives sampled,full,sft
"""

from __future__ import annotations

import argparse
import math
import random
import time

import _sampling
import torch

from laminar_core.algorithms.distill import distill_advantages
from laminar_core.tasks.repeat import RepeatTask, repeat_reward


def greedy_eval(model, tok, rows: list[dict], max_tokens: int) -> float:
    prompts = [list(tok.encode(r["prompt"], add_special_tokens=False)) for r in rows]
    _, _, resp, mask = _sampling.sample(model, tok, prompts, 1.0, max_tokens, greedy=True)
    got = _sampling.texts(tok, resp, mask)
    return sum(repeat_reward(t, r) for t, r in zip(got, rows, strict=True)) / len(rows)


def response_logits(model, ids, attn, resp, mask):
    """Log-softmax over the vocabulary at each response position (with gradients)."""
    full = torch.cat([ids, resp], 1)
    full_mask = torch.cat([attn, mask.long()], 1)
    pos = (full_mask.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits
    return torch.log_softmax(logits[:, ids.shape[1] - 1 : -1].float(), -1)


def run(objective: str, a: argparse.Namespace, log) -> list[tuple[int, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.teacher)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32)
    train = RepeatTask(seed=a.seed, holdout=0.1)
    held = RepeatTask(seed=a.seed, holdout=0.1, split=a.eval_split)
    # eval: the rows benchmarks/distill.py evaluates on; train: the split's last rows
    order = range(a.eval_size) if a.eval_split == "eval" else range(-1, -a.eval_size - 1, -1)
    eval_rows = [held[i] for i in order]
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr, weight_decay=0.0)
    rng = random.Random(a.seed)
    log(f"teacher eval {greedy_eval(teacher, tok, eval_rows, a.max_tokens):.3f} ({a.eval_split})")
    curve = [(0, greedy_eval(student, tok, eval_rows, a.max_tokens))]
    for step in range(1, a.steps + 1):
        if a.cosine:
            for group in opt.param_groups:
                group["lr"] = a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - 1) / a.steps)))
        rows = [train[rng.randrange(len(train))] for _ in range(a.prompts)]
        rows = [r for r in rows for _ in range(a.samples)]
        prompts = [list(tok.encode(r["prompt"], add_special_tokens=False)) for r in rows]
        # sft learns from the teacher's outputs; the others from the student's own samples
        sampler = teacher if objective == "sft" else student
        greedy = objective == "sft"
        ids, attn, resp, mask = _sampling.sample(sampler, tok, prompts, 1.0, a.max_tokens, greedy)
        m = mask.float()
        with torch.no_grad():
            t_lsm = response_logits(teacher, ids, attn, resp, mask)
        student.train()
        s_lsm = response_logits(student, ids, attn, resp, mask)
        s_tok = s_lsm.gather(-1, resp[..., None])[..., 0]
        if objective == "sampled":
            t_tok = t_lsm.gather(-1, resp[..., None])[..., 0]
            adv = distill_advantages(torch.zeros(len(rows)), s_tok, t_tok, m, a.coef)
            per_token = -adv * s_tok
        elif objective == "full":
            per_token = (s_lsm.exp() * (s_lsm - t_lsm)).sum(-1)
        else:
            per_token = -s_tok
        loss = (per_token * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            curve.append((step, greedy_eval(student, tok, eval_rows, a.max_tokens)))
            log(f"{objective:>8} step {step}: eval {curve[-1][1]:.3f}")
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--objectives", default="sampled,full,sft")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument(
        "--cosine", action="store_true", help="decay lr to 10%% by the last step (the warm-up's)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eval-size", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument(
        "--eval-split",
        default="eval",
        help="eval: the held-out (letter, count) pairs (never trained on); train: pairs the "
        "distillation prompts also draw from",
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for objective in a.objectives.split(","):
        if objective not in ("sampled", "full", "sft"):
            raise SystemExit(f"unknown objective {objective!r}; known: sampled, full, sft")
        t0 = time.monotonic()
        curve = run(objective, a, lambda s: print(s, flush=True))
        print(
            f"{objective:>8}: eval {curve[0][1]:.3f} -> {curve[-1][1]:.3f} (best "
            f"{max(e for _, e in curve):.3f}) in {a.steps} steps, {time.monotonic() - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
