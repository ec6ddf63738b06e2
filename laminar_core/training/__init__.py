"""What every trainer engine shares, done once in core: the trajectories a step trains on,
advantages, mini-batches, the split over data-parallel groups and into token-budget
micro-batches, the loss inputs and loss of each micro-batch, and the step's metrics.

A trainer plugin subclasses :class:`ModelTrainerEngine` and implements the model-specific
part (``forward``, ``forward_backward``, ``optimizer_step``, export, checkpoints); see
``docs/plugins.md``. The helpers below are public for engines that need them (e.g. mapping
per-position log-probs to per-trajectory response rows with :func:`responses`).
"""

from laminar_core.training.batching import (
    BatchLayout,
    MicroBatch,
    assign_ranks,
    collate,
    collate_packed,
    empty_micro_batch,
    pack_bins,
    pack_micro_batches,
    padded,
    plan_micro_batches,
    response_mask,
    responses,
    split_mini_batches,
    trainable,
)
from laminar_core.training.engine import ModelTrainerEngine
from laminar_core.training.lora import (
    LoRALinear,
    LoRASpec,
    adapter_tensors,
    apply_lora,
    merge_into,
    peft_name,
    read_adapter,
    write_adapter,
)
from laminar_core.training.step import LossFn, TrainStep, add_logprob_agreement, group_advantages

__all__ = [
    "BatchLayout",
    "LoRALinear",
    "LoRASpec",
    "LossFn",
    "MicroBatch",
    "ModelTrainerEngine",
    "TrainStep",
    "adapter_tensors",
    "add_logprob_agreement",
    "apply_lora",
    "assign_ranks",
    "collate",
    "collate_packed",
    "empty_micro_batch",
    "group_advantages",
    "merge_into",
    "pack_bins",
    "pack_micro_batches",
    "padded",
    "peft_name",
    "plan_micro_batches",
    "read_adapter",
    "response_mask",
    "responses",
    "split_mini_batches",
    "trainable",
    "write_adapter",
]
