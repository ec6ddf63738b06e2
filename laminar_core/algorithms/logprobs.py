"""Log-probs and entropy of sampled tokens without materialising ``[tokens, vocab]`` logits.

A policy-gradient trainer needs, per position, only ``log p(label)`` (and, for metrics or an
entropy bonus, the entropy) of ``softmax(hidden @ W.T / temperature)``. Computing the full
logits first costs ``tokens x vocab`` floats several times over (the matmul output, its fp32
copy, the temperature-scaled copy, the log-softmax; at vocab 151,936 that is ~1.85 GiB per
1K tokens at 1.5B), and autograd keeps them for backward.

:func:`chunked_logprobs` computes the same numbers ``chunk_size`` positions at a time inside a
custom autograd ``Function``: forward keeps only the per-position results and saves the
inputs (hidden states, weight, labels); backward recomputes each chunk's logits and turns them
into gradients for the hidden states and the weight on the spot. Peak extra memory is
``O(chunk_size x vocab)`` in both directions, and nothing of that size is saved for backward.

The numbers are those of the plain path, in the same order of operations::

    z = (hidden @ W.T + b).float() / temperature
    logprob = log_softmax(z)[label]        entropy = -sum(softmax(z) * log_softmax(z))

so in float32 the two agree to rounding (the tests hold them to 1e-5).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunked_logprobs", "full_logprobs"]


def full_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference path: full float32 logits, then log-softmax. Same contract as
    :func:`chunked_logprobs`; its memory is ``O(tokens x vocab)``."""
    z = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).sum(-1)  # a new tensor, not a view
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``labels`` (and optionally the entropy) under ``softmax(hidden @ W.T / T)``.

    Args:
        hidden: ``[..., H]`` final hidden states (after the last norm), any float dtype.
        weight: ``[V, H]`` output projection (the LM head), same dtype as ``hidden``.
        labels: ``[...]`` integer token ids in ``[0, V)``, the leading shape of ``hidden``.
        temperature: the sampling temperature; logits are divided by it (in float32) inside
            each chunk, as the rollout engine does before its softmax.
        chunk_size: positions per chunk; peak extra memory is about
            ``4 * chunk_size * V * 4`` bytes (in backward). ``<= 0`` falls back to
            :func:`full_logprobs`.
        bias: optional ``[V]`` bias of the projection.
        with_entropy: also return the entropy of each position's distribution.

    Returns:
        ``(logprobs, entropy)``: float32 tensors of the leading shape; ``entropy`` is ``None``
        unless asked for. Both are differentiable with respect to ``hidden``, ``weight`` and
        ``bias``; backward recomputes the logits chunk by chunk.

    Raises:
        ValueError: mismatched shapes or a non-positive temperature.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match the weight's {weight.shape[-1]}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must be hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        return full_logprobs(hidden, weight, labels, temperature, bias, with_entropy)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = _ChunkedLogprobs.apply(
        h2, weight, bias, labels, float(temperature), int(chunk_size), with_entropy
    )
    return lp, (ent if with_entropy else None)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    return torch.nn.functional.linear(h, weight, bias).float() / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward over ``chunk_size`` positions at a time; see the module docstring.

    Saved for backward: the inputs only (hidden ``[N, H]``, weight, bias, flat labels).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        # outputs in the labels' shape, written through flat views (an output that is a view
        # would trip in-place checks downstream, e.g. FSDP's)
        n = hidden.shape[0]
        kw = {"dtype": torch.float32, "device": hidden.device}
        lp_out = torch.empty(labels.shape, **kw)
        ent_out = torch.empty(labels.shape, **kw) if with_entropy else torch.empty(0, **kw)
        lp, ent, labels = lp_out.view(-1), ent_out.view(-1), labels.reshape(-1)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            z = _chunk_logits(hidden[s:e], weight, bias, temperature)
            lse = torch.logsumexp(z, -1)
            lp[s:e] = z.gather(-1, labels[s:e, None]).squeeze(-1) - lse
            if with_entropy:
                logp = z.sub_(lse[:, None])  # in place: z is not needed any more
                ent[s:e] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return lp_out, ent_out

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulate the weight's gradient over chunks in float32, cast once at the end
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            logp = torch.log_softmax(_chunk_logits(h, weight, bias, t), -1)
            p = logp.exp()
            gz = torch.zeros_like(p)
            if g_lp is not None:
                g = g_lp.reshape(-1)[s:e].float()
                # d log p(y) / dz = onehot(y) - p
                gz.addcmul_(p, g[:, None], value=-1.0)
                gz.scatter_add_(-1, labels[s:e, None], g[:, None])
            if g_ent is not None:
                g = g_ent.reshape(-1)[s:e].float()
                # H = -sum p log p;  dH / dz_j = -p_j (log p_j + H)
                h_ent = -(p * logp).sum(-1, keepdim=True)
                gz.sub_(p * (logp + h_ent) * g[:, None])
            gz.div_(t)  # z = logits / t
            gz_c = gz.to(hidden.dtype)
            if need_h:
                grad_h[s:e] = gz_c @ weight
            if need_w:
                if h.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h)
                else:  # half-precision matmul (as the forward), accumulated in float32
                    grad_w.add_(gz_c.t() @ h)
            if need_b:
                grad_b.add_(gz.sum(0))
        if g_lp is None and g_ent is None and need_h:
            grad_h.zero_()
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b and bias is not None else None,
            None,
            None,
            None,
            None,
        )
