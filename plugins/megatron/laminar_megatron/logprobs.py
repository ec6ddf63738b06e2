"""Token log-probs from vocabulary-parallel logits, without gathering the vocabulary.

Under tensor parallelism the output layer leaves each rank with its slice of the
vocabulary (``parallel_output=True``). The log-prob of a target token is
``logit[target] - max - log(sum(exp(logits - max)))`` over the *full* vocabulary: the max
and the sum of exponentials are all-reduced over the TP group (a max and a sum of one number
per token), and the target's logit comes from the one rank whose slice holds it (an
all-reduced sum of zeros elsewhere). Memory per rank stays ``[tokens, vocab / tp]``.

Columns past the real vocabulary (megatron's padding) are masked to ``-inf``: they are not
tokens, and vLLM's log-probs do not include them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        width = logits.shape[-1]
        logits = logits.float()
        real = vocab_size - vocab_start  # columns of this slice that are real tokens
        if real < width:
            logits = logits.clone()
            logits[..., max(real, 0) :] = float("-inf")
        top = logits.max(-1).values
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        local = (target >= vocab_start) & (target < vocab_start + width)
        index = (target - vocab_start).clamp(0, width - 1)
        shifted = logits - top.unsqueeze(-1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * local
        exp = shifted.exp_()  # reuses ``shifted``'s memory
        sum_exp = exp.sum(-1)
        if group is not None:
            both = torch.stack([sum_exp, picked])  # one all-reduce for the two sums
            dist.all_reduce(both, group=group)
            sum_exp, picked = both[0], both[1]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, local)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad):
        # d logp / d logit_j = [j == target] - softmax_j: this rank's slice only; the grad of
        # the (replicated) input to the output layer is summed over TP by megatron's layer.
        softmax, index, local = ctx.saved_tensors
        out = softmax * -grad.unsqueeze(-1)
        out.scatter_add_(-1, index.unsqueeze(-1), (grad * local).unsqueeze(-1))
        return out, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``log_softmax(logits over the full vocabulary)[target]``, differentiable.

    ``logits``: ``[..., V / tp]``, this rank's contiguous slice (rank ``r`` holds columns
    ``r * V/tp`` onwards) of logits already divided by the sampling temperature; ``target``:
    ``[...]`` token ids; ``vocab_size``: the real vocabulary (columns at or past it are
    padding); ``group``: the tensor-parallel group (``None`` or size 1: the full vocabulary
    is here). Returns float32 ``[...]``.
    """
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    start = rank * logits.shape[-1]
    return _VocabParallelLogProb.apply(
        logits, target, start, vocab_size, group if size > 1 else None
    )
