"""A short supervised warm start of a local model on a task's synthetic demonstrations.

RL from a random init only learns what the model samples now and then. A tool-calling
format (``<code>print(x)</code>``, then the tool's output, then the answer) is never sampled
by chance, so a task that needs it ships demonstrations and ``laminar tiny-model DIR
--warmup TASK`` fits the model to them first: ReTool's own recipe (a cold-start SFT, then
RL). The demonstrations are synthetic (their own random stream, never a run's prompts) and
the loss skips what the model does not write (the prompt, the tool's output), as RL does.

Plain torch and transformers, one thread: seconds to a minute of CPU for the tiny model.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar_core.tasks.tool_calling import Demonstration
from laminar_core.tasks.tool_calling import demonstrations as tool_calling_demonstrations


def repeat_demonstrations(
    seed: int, exact_share: float, holdout: float = 0.0
) -> Iterator[Demonstration]:
    """Endless ``repeat`` demonstrations that know the format (the prompt's letter, then
    end-of-sequence) but not the count: a share ``exact_share`` repeats it the asked number
    of times, the rest a count off by a factor in [0.5, 1.5]. A base model for LoRA runs
    (``examples/lora.yaml``): RL then has the counting to learn. ``holdout`` > 0 skips the
    ``(letter, count)`` pairs a ``repeat`` task with that ``holdout`` reserves for eval, so a
    model warmed on them is still evaluated on pairs it never saw."""
    from laminar_core.tasks.repeat import RepeatTask, held_out

    if not 0.0 <= exact_share <= 1.0:
        raise ValueError(f"exact_share must be in [0, 1] (got {exact_share})")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1) (got {holdout})")
    task = RepeatTask(seed=seed)
    rng = random.Random(f"repeat-demonstrations-{seed}")  # never a task row's stream
    while True:
        row = task[rng.randrange(len(task))]
        if held_out(row["letter"], row["count"], holdout):
            continue
        count = row["count"]
        if rng.random() >= exact_share:
            count = max(1, round(count * rng.uniform(0.5, 1.5)))
        yield Demonstration(row["prompt"], ((row["letter"] * count, True),), False)


#: Warm-ups by task name: ``(seed, share) -> demonstrations``; ``share`` is the task's
#: knob (``tool_calling``: the share of demonstrations that call the tool; ``repeat``: the
#: share that repeat the letter exactly as often as asked).
WARMUPS: dict[str, Callable[[int, float], Iterator[Demonstration]]] = {
    "tool_calling": tool_calling_demonstrations,
    "repeat": repeat_demonstrations,
}


@dataclass
class WarmupReport:
    """What a warm start did: ``steps`` optimiser steps on ``examples`` demonstrations in
    ``seconds``; ``loss`` the mean loss (per trained token) of the first and last 10 steps."""

    task: str
    steps: int
    examples: int
    seconds: float
    loss_start: float
    loss_end: float

    def summary(self) -> str:
        return (
            f"warm-up {self.task}: {self.steps} steps on {self.examples} demonstrations in "
            f"{self.seconds:.1f} s, loss {self.loss_start:.3f} -> {self.loss_end:.3f}"
        )


def encode_demonstration(demo: Demonstration, tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(ids, trained)``: prompt + response + end-of-sequence, and per id whether the loss
    counts it (the response's trained segments and the end-of-sequence token)."""
    ids = list(tokenizer.encode(demo.prompt, add_special_tokens=False))
    trained = [0] * len(ids)
    for text, train in demo.segments:
        seg = list(tokenizer.encode(text, add_special_tokens=False))
        ids += seg
        trained += [int(train)] * len(seg)
    ids.append(tokenizer.eos_token_id)
    trained.append(1)
    return ids, trained


def warm_start(
    model_dir: str | Path,
    task: str = "tool_calling",
    *,
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 3e-3,
    share: float = 0.5,
    seed: int = 0,
    demos: Iterable[Demonstration] | None = None,
    log: Callable[[str], None] | None = None,
) -> WarmupReport:
    """Fit the model in ``model_dir`` to ``task``'s demonstrations; save it in place.

    ``steps`` AdamW steps of ``batch_size`` demonstrations (cosine-decayed ``lr``, grad-norm
    clip 1); ``share`` is the task's knob (see :data:`WARMUPS`); ``demos`` replaces the
    task's own demonstrations. Deterministic for given arguments. Raises ``ValueError`` for
    an unknown task or bad sizes.
    """
    if demos is None and task not in WARMUPS:
        raise ValueError(f"unknown warm-up task {task!r}; known: {', '.join(sorted(WARMUPS))}")
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"need steps >= 1, batch_size >= 1, lr > 0 (got {steps}, {batch_size}, {lr})"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laminar_core.models.tiny import save_model

    out = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.train()
    stream = iter(demos) if demos is not None else WARMUPS[task](seed, share)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    t0 = time.monotonic()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        for step in range(steps):
            for group in opt.param_groups:  # cosine decay to 10% of lr
                group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            demos_now = itertools.islice(stream, batch_size)
            batch = [encode_demonstration(d, tokenizer) for d in demos_now]
            loss = _loss(model, batch, tokenizer.pad_token_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if log is not None and (step + 1) % 50 == 0:
                log(f"warm-up step {step + 1}/{steps}: loss {sum(losses[-50:]) / 50:.3f}")
    model.eval()
    save_model(model, out)
    head, tail = losses[:10], losses[-10:]
    return WarmupReport(
        task,
        steps,
        steps * batch_size,
        time.monotonic() - t0,
        sum(head) / len(head),
        sum(tail) / len(tail),
    )


def _loss(model: Any, batch: list[tuple[list[int], list[int]]], pad_id: int) -> Any:
    """Mean next-token cross-entropy over the trained tokens of a right-padded batch."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    weight = torch.zeros((len(batch), width))
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        weight[i, : len(seq)] = torch.tensor(trained, dtype=torch.float32)
        attn[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target, w = ids[:, 1:], weight[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    ).view_as(w)
    return (nll * w).sum() / w.sum().clamp(min=1.0)
