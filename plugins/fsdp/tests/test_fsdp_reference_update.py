"""The engine's updates against an independent reference: several on-policy GRPO steps
written out in plain torch on the transformers model, the way TRL's ``GRPOTrainer`` takes
them (``scale_rewards="group"``, ``loss_type="dapo"``: one token mean over the batch, ratio
against the sampling policy, no KL, AdamW whose state carries over steps).

``benchmarks/grpo_vs_trl.py`` compares learning per step with TRL; this pins the trainer's
side of that comparison: same batch in, same weights out, step after step (micro-batches
split the batch, so the token-mean scaling over micro-batches is in the check too).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fsdp_batches import config, long_tail_batch
from transformers import AutoModelForCausalLM

from laminar_core import TrainerContext
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

# CLIP is far above these gradients' norms: a clipped gradient would hide a scale error
LR, STEPS, CLIP = 1e-3, 3, 100.0


def _logprobs(model, trajs) -> list[torch.Tensor]:
    """Each response's token log-probs under ``model`` (one sequence at a time, no packing)."""
    out = []
    for t in trajs:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1 : -1]
        targets = torch.tensor(t.response_ids)[:, None]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, targets)[:, 0])
    return out


def _reference_step(model, optim, trajs, groups: int, algo) -> tuple[float, dict]:
    rewards = torch.tensor([t.reward for t in trajs]).view(groups, -1)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + algo.adv_eps)
    lps = _logprobs(model, trajs)
    tokens = sum(len(lp) for lp in lps)
    loss = torch.zeros(())
    for a, lp, t in zip(adv.view(-1), lps, trajs, strict=True):
        ratio = torch.exp(lp - torch.tensor(t.logprobs))
        clipped = torch.clamp(ratio, 1 - algo.clip_low, 1 + algo.clip_high)
        loss = loss - torch.minimum(ratio * a, clipped * a).sum()
    loss = loss / tokens
    optim.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optim.step()
    return loss.item(), grads


def test_updates_match_a_plain_torch_grpo_reference(tiny_model):
    torch.manual_seed(0)
    cfg = config(tiny_model, "algorithm.advantage=grpo")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref.train()
    optim = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    groups = 4

    async def main() -> tuple[list[tuple[float, dict, float, dict]], dict]:
        # a small micro-batch budget: every step is several micro-batches
        eng = FSDPTrainerEngine(cfg, FSDPOptions(lr=LR, grad_clip=CLIP, micro_batch_tokens=160))
        await eng.setup(TrainerContext(0, 1, eng.opt, cfg.algorithm, {}))
        out = []
        try:
            for step in range(STEPS):
                batch = long_tail_batch(
                    ref.config.vocab_size, groups, 4, (4, 8), (2, 40), seed=step, version=step
                )
                trajs = [t for g in batch.groups for t in g.trajectories]
                gen = torch.Generator().manual_seed(step)
                with torch.no_grad():  # sampled by the current policy: on-policy, as in TRL
                    for t, lp in zip(trajs, _logprobs(ref, trajs), strict=True):
                        t.logprobs = lp.tolist()
                        t.reward = float(torch.rand((), generator=gen))  # graded rewards
                want, want_grads = _reference_step(ref, optim, trajs, groups, cfg.algorithm)
                got = await eng.train_step(batch)
                named = eng.lm.named_parameters()  # host copies: the engine may be on a GPU
                grads = {n: p.grad.full_tensor().to("cpu", copy=True) for n, p in named}
                out.append((want, want_grads, got["loss"], grads))
            named = eng.lm.named_parameters()
            params = {n: p.full_tensor().detach().to("cpu", copy=True) for n, p in named}
        finally:
            await eng.close()
        return out, params

    steps, params = asyncio.run(main())
    for step, (want, want_grads, got, grads) in enumerate(steps):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
        # the gradients before Adam: a loss scaled wrongly shows here (Adam's
        # update would hide it: it is invariant to the gradient's scale)
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            where = f"step {step}, {name}"
            torch.testing.assert_close(
                g, want_grads[name], atol=1e-6, rtol=1e-3, msg=lambda m, w=where: f"{w}: {m}"
            )
    final = dict(ref.named_parameters())
    for name, p in params.items():
        moved = final[name].detach() - start[name]
        assert moved.abs().max() > 0.5 * LR, name  # every parameter learned something
        # Adam divides by the gradient's running scale, so where a gradient is ~0 the last
        # float bits decide the step (up to LR each): a tolerance of a few % of LR
        torch.testing.assert_close(p - start[name], moved, atol=0.05 * LR, rtol=0, msg=name)
        cos = torch.nn.functional.cosine_similarity((p - start[name]).flatten(), moved.flatten(), 0)
        assert cos > 0.999, (name, float(cos))
