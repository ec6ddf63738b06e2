"""``trainer.megatron`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass

LR_SCHEDULES = ("constant", "linear", "cosine")
RECOMPUTE = ("none", "full", "selective")
PARAM_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass
class MegatronOptions:
    """Parallel layout, optimiser, schedule and batching of one megatron-core trainer group.

        Layout: ``tp`` (tensor), ``pp`` (pipeline) and ``dp`` (data) parallel sizes; the trainer's
        world size must equal ``tp * pp * dp``. ``dp: 0`` takes what is left
        (``world / (tp * pp)``). Ranks are ordered tp fastest, then dp, then pp (megatron's
        ``tp-cp-ep-dp-pp``).

        Optimiser: megatron's Adam (decoupled weight decay; no decay on biases and norms) behind
        its ``DistributedOptimizer`` (optimiser state and fp32 master weights sharded over dp)
        when ``distributed_optimizer``; gradients clipped to ``grad_clip`` (global norm). The
        learning rate follows megatron's ``OptimizerParamScheduler``: linear warm-up from 0 over
        ``warmup_steps`` updates, then ``lr_schedule`` down to ``lr * min_lr_ratio`` at the last of
        ``run.steps * trainer.mini_batches`` updates; update ``k`` (from 0) uses the schedule at
        step ``k + 1``, so warm-up never spends an update at lr 0.

        Batching: ``micro_batch_tokens`` bounds a micro-batch's padded tokens (rows x longest);
        gradients accumulate over micro-batches (and pipeline micro-batches are these).

        ``sequence_parallel`` (with ``tp > 1``): megatron's sequence parallelism, the norms' and
        dropouts' activations split over the TP group along the sequence (micro-batches are
        padded to a multiple of ``tp`` tokens). It needs Transformer Engine (or Apex) norms, so
        GPU only.

        ``recompute``: megatron's activation recompute, ``full`` (every layer's input is kept,
        the layer re-run in backward; ``recompute_num_layers`` layers per checkpointed chunk) or
        ``selective`` (the core attention only). ``param_dtype``: ``auto`` trains in float32 on CPU
        and in ``model.dtype`` (bf16/fp16 params, fp32 master weights and grad reduction) on GPU.
        ``transformer_impl``: ``auto`` uses Transformer Engine layers when TE and CUDA are
        there, else megatron's local layers. ``make_vocab_size_divisible_by``: the embedding and
        output layer are padded to a multiple of it (and of ``tp``); padded rows never reach the
        log-probs or the exported weights. ``backend``: ``auto`` is NCCL with CUDA, else gloo
    (naming the other one is an error: megatron keeps its buffers on the GPU when it has one).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 0
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
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_num_layers: int = 1
    param_dtype: str = "auto"
    transformer_impl: str = "auto"
    make_vocab_size_divisible_by: int = 128
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name, value, known in (
            ("lr_schedule", self.lr_schedule, LR_SCHEDULES),
            ("recompute", self.recompute, RECOMPUTE),
            ("param_dtype", self.param_dtype, PARAM_DTYPES),
            ("transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS),
            ("backend", self.backend, ("auto", "gloo", "nccl")),
        ):
            if value not in known:
                raise ValueError(f"{name}: unknown {value!r}; known: {', '.join(known)}")
        if self.tp < 1 or self.pp < 1 or self.dp < 0:
            raise ValueError(
                f"tp and pp must be >= 1 and dp >= 0 (0: the rest of the world); "
                f"got tp={self.tp} pp={self.pp} dp={self.dp}"
            )
        if self.micro_batch_tokens < 1 or self.lr <= 0:
            raise ValueError("micro_batch_tokens must be >= 1 and lr > 0")
        if self.recompute_num_layers < 1 or self.make_vocab_size_divisible_by < 1:
            raise ValueError("recompute_num_layers and make_vocab_size_divisible_by must be >= 1")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")

    def layout(self, world_size: int) -> tuple[int, int, int]:
        """``(tp, pp, dp)`` for ``world_size`` ranks, or ``ValueError`` naming the fix."""
        tp, pp = self.tp, self.pp
        dp = self.dp or (world_size // (tp * pp) if world_size % (tp * pp) == 0 else 0)
        if dp < 1 or tp * pp * dp != world_size:
            shown = self.dp or f"{world_size}/({tp}*{pp})"
            raise ValueError(
                f"trainer.megatron: tp*pp*dp = {tp}*{pp}*{shown} does not match the trainer's "
                f"world size {world_size}; set trainer.megatron.tp/pp/dp so their product is "
                f"{world_size} (or change the number of trainer ranks, cluster.trainer_gpus)"
            )
        return tp, pp, dp
