"""``trainer.fsdp`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class FSDPOptions:
    """Optimiser, schedule and batching of one FSDP2 trainer group.

    ``lr_schedule`` decays from ``lr`` (after ``warmup_steps`` of linear warm-up) to
    ``lr * min_lr_ratio`` over ``run.steps`` optimiser steps. ``micro_batch_tokens`` bounds the
    tokens (prompt + response, padded) of one forward/backward; gradients accumulate over
    micro-batches. ``backend``: ``auto`` is NCCL when CUDA is available, else gloo.
    ``param_dtype``: ``auto`` trains in float32 on CPU and in ``model.dtype`` (mixed precision,
    float32 master weights and gradient reduction) on GPU.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    backend: str = "auto"
    param_dtype: str = "auto"
    gradient_checkpointing: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule: unknown {self.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend: unknown {self.backend!r}; known: auto, gloo, nccl")
        if self.micro_batch_tokens < 1 or self.lr <= 0:
            raise ValueError("micro_batch_tokens must be >= 1 and lr > 0")
