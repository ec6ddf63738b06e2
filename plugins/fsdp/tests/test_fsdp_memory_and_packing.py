"""One FSDP rank (gloo, in this process) under different options on the same batch:

- activation checkpointing really checkpoints: what a forward keeps for backward is a small
  fraction of what it keeps without (the engine used to leave it inert: eval mode);
- the chunked log-prob head keeps no ``[tokens, vocab]`` logits; the full path does;
- packed (padding-free) micro-batches give the log-probs, loss and gradients of padded ones;
- none of these options changes the numbers (activation offload and torch.compile included);
- tokens a trajectory's ``loss_mask`` marks 0 (a tool's output in a multi-turn episode) count
  for nothing: what the rollout reported for them does not move the loss or the gradients.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fsdp_batches import config, long_tail_batch

from laminar_core import TrainerContext
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine
from laminar_fsdp.engine import _decoder_layers

BASE = {"lr": 1e-3, "micro_batch_tokens": 96}
VARIANTS = {
    "packed": {},
    "padded": {"pack": False},
    "checkpointed": {"gradient_checkpointing": True},
    "full_logits": {"logprob_chunk": 0},
    # checkpointed layers' inputs parked on the host between forward and backward
    "offloaded": {"gradient_checkpointing": True, "activation_offload": True},
    # decoder layers and the head's chunk math through torch.compile, rows padded to buckets
    # (aot_eager: the traced graphs without inductor's C++ build, which takes minutes here)
    "compiled": {"compile": "aot_eager", "compile_bucket": 64},
}


def _mask_every_third(batch, garbage: float | None = None):
    """Loss mask 0 on every third response token; ``garbage``: the rollout log-prob reported
    at those tokens (the contract says 0.0; anything must do)."""
    for t in batch.trajectories:
        t.loss_mask = [0 if j % 3 == 2 else 1 for j in range(len(t.response_ids))]
        if garbage is not None:
            t.logprobs = [lp if m else garbage for lp, m in zip(t.logprobs, t.loss_mask)]
    return batch


MASKED = {
    "masked": lambda b: _mask_every_third(b),
    "masked_garbage": lambda b: _mask_every_third(b, -50.0),
}


def _one(model_dir: str, opts: dict, transform=lambda b: b) -> dict:
    cfg = config(model_dir)

    async def main() -> dict:
        eng = FSDPTrainerEngine(cfg, FSDPOptions(**BASE, **opts))
        await eng.setup(TrainerContext(0, 1, eng.opt, cfg.algorithm, {}))
        try:
            vocab = eng.lm.config.vocab_size
            batch = transform(long_tail_batch(vocab, groups=4, prompt=(8, 16), response=(4, 64)))
            layers = _decoder_layers(eng.lm)
            return {
                "vocab": vocab,
                "training": eng.lm.training,
                "checkpointing": [getattr(m, "gradient_checkpointing", False) for m in layers],
                "saved": eng.saved_activation_bytes(batch),
                "logprobs": await eng.compute_logprobs(batch),
                "metrics": await eng.train_step(batch),
                "grads": {n: p.grad.full_tensor().clone() for n, p in eng.lm.named_parameters()},
                "ones": sum(sum(t.response_mask()) for t in batch.trajectories),
            }
        finally:
            await eng.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def runs(narrow_model) -> dict[str, dict]:
    torch.set_num_threads(1)
    out = {name: _one(narrow_model, opts) for name, opts in VARIANTS.items()}
    out.update({name: _one(narrow_model, {}, fn) for name, fn in MASKED.items()})
    return out


def test_checkpointing_is_active_and_cuts_saved_activations(runs):
    on, off = runs["checkpointed"], runs["packed"]
    assert on["training"] and all(on["checkpointing"])  # train mode: transformers checkpoints
    # only each layer's input is kept (plus the head's), not every intermediate of the layer
    assert on["saved"].bytes < 0.25 * off["saved"].bytes, (on["saved"], off["saved"])


def test_chunked_head_keeps_no_vocab_sized_logits(runs):
    vocab = runs["packed"]["vocab"]
    assert not [s for s in runs["packed"]["saved"].shapes if s and s[-1] == vocab]
    assert [s for s in runs["full_logits"]["saved"].shapes if s and s[-1] == vocab]
    assert runs["full_logits"]["saved"].bytes > runs["packed"]["saved"].bytes


@pytest.mark.parametrize(
    "variant", ["padded", "checkpointed", "full_logits", "offloaded", "compiled"]
)
def test_options_do_not_change_the_numbers(runs, variant):
    ref, got = runs["packed"], runs[variant]
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "logprob_abs_diff_mean"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_loss_mask_zero_tokens_count_for_nothing(runs):
    masked, garbage, plain = runs["masked"], runs["masked_garbage"], runs["packed"]
    assert masked["metrics"]["logprob_diff_tokens"] == masked["ones"] < plain["ones"]
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "logprob_abs_diff_mean"):
        assert garbage["metrics"][key] == pytest.approx(masked["metrics"][key], rel=1e-6), key
    assert masked["metrics"]["loss"] != pytest.approx(plain["metrics"]["loss"], rel=1e-3)
    for name, g in masked["grads"].items():
        torch.testing.assert_close(garbage["grads"][name], g, atol=1e-7, rtol=1e-6, msg=name)
