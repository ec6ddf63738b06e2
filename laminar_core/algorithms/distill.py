"""On-policy distillation: a teacher's per-token reverse KL as part of each token's advantage.

The student samples a response; a teacher scores the same tokens given the same prefixes
(``RolloutEngine.score``); each sampled token ``y_t`` then gets the one-sample estimate of the
per-token reverse KL ``KL(pi_student || pi_teacher)`` at that position::

    rkl_t = log pi_student(y_t | x, y_<t) - log pi_teacher(y_t | x, y_<t)

and its negation, scaled by ``coef``, is added to the token's advantage::

    A_t = A + coef * (log pi_teacher(y_t | .) - log pi_student(y_t | .))

where ``A`` is the trajectory's reward advantage (broadcast over its tokens; 0 without a
reward: reward-free distillation). The policy-gradient loss with this advantage minimises the
reverse KL to the teacher on the student's own samples (mode-seeking, dense: every token gets
its own signal), plus the reward objective.

Sources: Thinking Machines Lab, "On-Policy Distillation" (Lu et al., 2025;
https://thinkingmachines.ai/blog/on-policy-distillation/): per-token reverse KL as the
advantage with discount 0, student log-probs from the sampler; Qwen3 Technical Report
(arXiv:2505.09388, section 4.5): on-policy distillation of the lightweight models from the
flagship's logits; Agarwal et al., "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, arXiv:2306.13649).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["distill_advantages", "reverse_kl"]


def reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse-KL estimate ``(student - teacher) * mask`` (``[B, T]``, detached):
    the log-ratio of the sampled tokens; 0 where ``mask`` is 0."""
    if student_logprobs.shape != teacher_logprobs.shape or mask.shape != student_logprobs.shape:
        raise ValueError(
            f"student {tuple(student_logprobs.shape)}, teacher "
            f"{tuple(teacher_logprobs.shape)} and mask {tuple(mask.shape)} must be the same "
            f"[B, T]"
        )
    diff = (student_logprobs.detach() - teacher_logprobs.detach()).float()
    return diff * mask.to(diff.dtype)


def distill_advantages(
    advantages: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    coef: float,
) -> Tensor:
    """``A_t = A + coef * (teacher_t - student_t)`` per token (module docstring), ``[B, T]``.

    Args:
        advantages: ``[B]`` (one per trajectory, broadcast over its tokens) or ``[B, T]``.
        student_logprobs: ``[B, T]`` the student's log-probs of its sampled tokens (the
            sampler's, as Thinking Machines uses).
        teacher_logprobs: ``[B, T]`` the teacher's log-probs of the same tokens.
        mask: ``[B, T]`` 1 where a token counts; the distillation term is 0 elsewhere.
        coef: the reverse KL's weight (``algorithm.distill_coef``), >= 0.

    Returns a detached float32 ``[B, T]`` tensor.
    """
    if coef < 0:
        raise ValueError(f"distill coef must be >= 0, got {coef!r}")
    rkl = reverse_kl(student_logprobs, teacher_logprobs, mask)
    adv = advantages.detach().float()
    if adv.dim() == 1:
        if adv.shape[0] != rkl.shape[0]:
            raise ValueError(
                f"advantages must be [B] or [B, T] = {tuple(rkl.shape)}, got {tuple(adv.shape)}"
            )
        adv = adv[:, None]
    elif adv.shape != rkl.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(rkl.shape)}, got {tuple(adv.shape)}"
        )
    return adv - coef * rkl
