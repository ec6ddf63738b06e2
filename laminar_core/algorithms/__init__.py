"""RL objectives as pure torch functions: advantage estimators, policy losses, corrections.

No engine, no I/O: every function maps tensors to tensors (plus metrics as Python floats, or
as device tensors from ``policy_loss_terms``).
"""

from .advantages import compute_advantages, dr_grpo, grpo, reinforce_pp, rloo
from .config import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    AlgorithmConfig,
    validate_algorithm,
)
from .logprobs import chunked_logprobs, full_logprobs
from .losses import (
    aggregate,
    kl_penalty,
    metric_floats,
    policy_loss,
    policy_loss_terms,
    ppo_clip_loss,
    truncated_is_weights,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "AlgorithmConfig",
    "aggregate",
    "chunked_logprobs",
    "compute_advantages",
    "dr_grpo",
    "full_logprobs",
    "grpo",
    "kl_penalty",
    "metric_floats",
    "policy_loss",
    "policy_loss_terms",
    "ppo_clip_loss",
    "reinforce_pp",
    "rloo",
    "truncated_is_weights",
    "validate_algorithm",
]
