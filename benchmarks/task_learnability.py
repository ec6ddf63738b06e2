"""Does a tiny random-init model learn the shipped ``repeat`` task with GRPO on a CPU?

A pure-torch GRPO loop (no Laminar runtime): the tiny Qwen2-style model from
``laminar_core.models.build_tiny_model``, sampling with ``model.generate``, core's GRPO
advantages and policy loss, one optimizer step per batch (on-policy). Prints reward mean per
step; the figures in docs/tasks.md come from here.

OMP_NUM_THREADS=1 python benchmarks/task_learnability.py [--steps 60 --lr 3e-3 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import _sampling
import torch
from _common import say

from laminar_core.algorithms import AlgorithmConfig, compute_advantages, policy_loss
from laminar_core.models import build_tiny_model
from laminar_core.tasks.repeat import RepeatTask, repeat_reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=8, help="GRPO groups per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--letters", default="abc")
    ap.add_argument("--median-count", type=float, default=6.0)
    ap.add_argument("--max-count", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the per-step rows here")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tempfile.mkdtemp(prefix="laminar-tiny-")
    build_tiny_model(
        tmp,
        seed=args.seed,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    tok = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    if args.lora_rank:  # trainer.lora's adapters on all seven projections
        from laminar_core.config.schema import LoRAConfig
        from laminar_core.training import LoRASpec, apply_lora

        targets = tuple(LoRAConfig().target_modules)
        apply_lora(model, LoRASpec(args.lora_rank, args.lora_alpha, 0.0, targets))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    task = RepeatTask(
        seed=args.seed,
        letters=args.letters,
        median_count=args.median_count,
        max_count=args.max_count,
    )
    algo = AlgorithmConfig()
    rng = random.Random(args.seed)
    rows, t0 = [], time.perf_counter()
    say(f"model params: {sum(p.numel() for p in model.parameters()):,}; args: {vars(args)}")
    for step in range(args.steps):
        batch = [task[rng.randrange(len(task))] for _ in range(args.prompts)]
        prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in batch]
        prompts = [p for p in prompts for _ in range(args.samples)]
        ids, attn, resp, mask = _sampling.sample(
            model, tok, prompts, args.temperature, args.max_tokens
        )
        texts = _sampling.texts(tok, resp, mask)
        rewards = torch.tensor(
            [repeat_reward(t, batch[i // args.samples]) for i, t in enumerate(texts)]
        )
        groups = torch.arange(len(prompts)) // args.samples
        adv = compute_advantages("grpo", rewards, groups)

        model.train()
        logp = _sampling.logprobs(model, ids, attn, resp, mask, args.temperature)
        loss, _ = policy_loss(algo, logp, logp.detach(), adv, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        lengths = mask.sum(1).float()
        row = {
            "step": step,
            "reward_mean": rewards.mean().item(),
            "exact": (rewards == 1.0).float().mean().item(),
            "len_mean": lengths.mean().item(),
            "len_p50": lengths.median().item(),
            "len_max": lengths.max().item(),
            "stopped": (resp == tok.eos_token_id).any(1).float().mean().item(),
            "wall_s": time.perf_counter() - t0,
        }
        rows.append(row)
        say(
            f"step {step:>3}  reward {row['reward_mean']:.3f}  exact {row['exact']:.3f}  "
            f"len mean {row['len_mean']:5.1f} p50 {row['len_p50']:4.0f} max {row['len_max']:3.0f}  "
            f"stopped {row['stopped']:.2f}  {row['wall_s']:6.1f} s  e.g. {texts[0][:24]!r}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
