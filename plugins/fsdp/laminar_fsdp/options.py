"""``trainer.fsdp`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass

LR_SCHEDULES = ("constant", "linear", "cosine")
ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
PACKED_KERNELS = ("auto", "flash", "flex", "sdpa")
COMPILE = ("none", "inductor", "aot_eager")


@dataclass
class FSDPOptions:
    """Optimiser, schedule, batching, memory and export settings of one FSDP2 trainer group.

    Optimiser: AdamW (``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``), gradient
    clipping at ``grad_clip``; ``lr_schedule`` decays from ``lr`` (after ``warmup_steps`` of
    linear warm-up) to ``lr * min_lr_ratio`` over ``run.steps`` optimiser steps.

    Batching: ``pack`` (default) concatenates trajectories into one padding-free row per
    micro-batch, holding up to ``micro_batch_tokens`` real tokens per rank; with
    ``pack: false`` each trajectory is a right-padded row and ``micro_batch_tokens`` bounds
    rows x longest. Gradients accumulate over micro-batches.

    ``sequence_parallel`` (Ulysses): N ranks share each packed row, N x
    ``micro_batch_tokens`` tokens split N ways, with all-to-all around attention; FSDP shards
    over all ranks and data parallelism is ``world / N``. N must divide the trainer's world
    size and the model's attention heads; needs ``pack``.

    Memory: ``gradient_checkpointing`` recomputes each decoder layer in backward (keeps only
    the layer inputs). ``activation_offload`` (needs ``gradient_checkpointing``) parks those
    inputs in pinned host memory between forward and backward, prefetched one layer ahead in
    backward (``offload.py``): for the longest rows. ``logprob_chunk`` positions at a time go
    through the log-prob head (logits recomputed in backward); ``0`` builds full
    ``[tokens, vocab]`` float32 logits.

    ``attention``: ``auto`` is ``flash_attention_2`` on CUDA when flash-attn is installed
    (``pip install laminar-fsdp[gpu]``), else ``sdpa``; for packed rows it selects the
    engine's own packed attention, whose kernel is ``packed_attention``: ``flash`` (varlen
    FlashAttention), ``flex`` (one compiled flex attention call per layer under a document
    mask), ``sdpa`` (one SDPA call per trajectory per layer); ``auto``: flash where
    installed, else flex on CUDA, else sdpa (``attention.py``).

    ``compile``: ``inductor`` compiles each decoder layer's forward and the log-prob head's
    per-chunk math with ``torch.compile``; packed rows are then padded to a multiple of
    ``compile_bucket`` tokens so compiled graphs are reused across micro-batches.
    ``aot_eager`` traces the same graphs without code generation (tests, debugging).
    ``none`` (default): eager (compiling on CPU costs a C++ build per graph).

    ``export_bucket_mb``: weights are exported in buckets of about this size (one all-gather
    and one host copy each).

    ``backend``: ``auto`` is NCCL when CUDA is available, else gloo. ``param_dtype``: ``auto``
    trains in float32 on CPU and in ``model.dtype`` (mixed precision, float32 master weights
    and gradient reduction) on GPU.
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
    pack: bool = True
    sequence_parallel: int = 1
    gradient_checkpointing: bool = False
    logprob_chunk: int = 1024
    attention: str = "auto"
    export_bucket_mb: float = 512.0
    backend: str = "auto"
    param_dtype: str = "auto"
    reshard_after_forward: bool = True
    packed_attention: str = "auto"
    compile: str = "none"
    compile_bucket: int = 1024
    activation_offload: bool = False

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule: unknown {self.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend: unknown {self.backend!r}; known: auto, gloo, nccl")
        if self.attention not in ATTENTIONS:
            known = ", ".join(ATTENTIONS)
            raise ValueError(f"attention: unknown {self.attention!r}; known: {known}")
        if self.micro_batch_tokens < 1 or self.lr <= 0:
            raise ValueError("micro_batch_tokens must be >= 1 and lr > 0")
        if self.sequence_parallel < 1:
            raise ValueError(f"sequence_parallel must be >= 1, got {self.sequence_parallel}")
        if self.sequence_parallel > 1 and not self.pack:
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel} splits packed rows: set pack: true"
            )
        if self.logprob_chunk < 0:
            raise ValueError(
                f"logprob_chunk must be >= 0 (0: full logits), got {self.logprob_chunk}"
            )
        if self.packed_attention not in PACKED_KERNELS:
            known = ", ".join(PACKED_KERNELS)
            raise ValueError(f"packed_attention: unknown {self.packed_attention!r}; known: {known}")
        if self.compile not in COMPILE:
            raise ValueError(f"compile: unknown {self.compile!r}; known: {', '.join(COMPILE)}")
        if self.compile_bucket < 1:
            raise ValueError(f"compile_bucket must be >= 1, got {self.compile_bucket}")
        if self.activation_offload and not self.gradient_checkpointing:
            raise ValueError(
                "activation_offload parks checkpointed layers' inputs: set "
                "gradient_checkpointing: true as well"
            )
        if self.export_bucket_mb <= 0:
            raise ValueError(f"export_bucket_mb must be > 0, got {self.export_bucket_mb}")
