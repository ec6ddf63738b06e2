"""Log-probs and entropy of sampled tokens without materialising ``[tokens, vocab]`` logits.

A policy-gradient trainer needs, per position, only ``log p(label)`` (and, for metrics or an
entropy bonus, the entropy) of ``softmax(hidden @ W.T / temperature)``. Computing the full
logits first costs ``tokens x vocab`` floats several times over (the matmul output, its fp32
copy, the temperature-scaled copy, the log-softmax; at vocab 151,936 that is ~1.85 GiB per
1K tokens at 1.5B), and autograd keeps them for backward.

:func:`chunked_logprobs` computes the same numbers ``chunk_size`` positions at a time inside a
custom autograd ``Function``: forward keeps only the per-position results and saves the
inputs (hidden states, weight, labels) and each position's log-sum-exp; backward recomputes
each chunk's logits (one matmul: the softmax needs no second reduction, the saved log-sum-exp
normalises it) and turns them into gradients for the hidden states and the weight on the spot.
The entropy comes from the same chunk as the log-prob, in the same pass.

Why backward recomputes rather than doing the gradient in forward (as fused
linear-cross-entropy kernels do): the gradient needs ``d loss / d logprob``, which the RL loss
(clipped ratios, masks, advantages: core's ``policy_loss``) only gives after the head has
returned; keeping the ``[tokens, vocab]`` probabilities until then is what the head avoids.
Peak extra memory is ``O(chunk_size x vocab)`` in both directions, and nothing of that size is
saved for backward.

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
    compiled: bool | str = False,
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
        with_entropy: also return the entropy of each position's distribution (computed
            from the same chunk's logits as the log-prob: no second pass).
        compiled: run each chunk's softmax math through ``torch.compile`` (fused kernels;
            worth it on GPU, where the eager ops are each a pass over ``[chunk, V]``); a
            string names the ``torch.compile`` backend (``True``: inductor).

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
        h2, weight, bias, labels, float(temperature), int(chunk_size), with_entropy, compiled
    )
    return lp, (ent if with_entropy else None)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One chunk's logits in the compute dtype (the matmul, left to the BLAS library)."""
    return torch.nn.functional.linear(h, weight, bias)


def _forward_stats(
    logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's ``(logprob of label, logsumexp, entropy or None)`` from its logits, in
    one pass's worth of reads: the entropy is ``-sum(p * log p)`` with ``log p = z - lse``
    from the same log-sum-exp, not a second softmax over the vocabulary."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, -1)
    lp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    ent = None
    if with_entropy:
        logp = z - lse[:, None]
        ent = -(torch.exp(logp) * logp).sum(-1)
    return lp, lse, ent


def _grad_logits(
    logits: Tensor,
    lse: Tensor,
    labels: Tensor,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    temperature: float,
) -> Tensor:
    """``d loss / d logits`` of one chunk (float32), from the forward's saved log-sum-exp:
    ``p = exp(z - lse)`` directly, no reduction over the vocabulary unless the entropy
    carries a gradient."""
    z = logits.float() / temperature
    logp = z - lse[:, None]
    p = torch.exp(logp)
    gz = torch.zeros_like(p)
    if g_lp is not None:
        # d log p(y) / dz = onehot(y) - p
        gz = gz - p * g_lp[:, None]
        gz = gz.scatter_add(-1, labels[:, None], g_lp[:, None])
    if g_ent is not None:
        # H = -sum p log p;  dH / dz_j = -p_j (log p_j + H)
        h_ent = -(p * logp).sum(-1, keepdim=True)
        gz = gz - p * (logp + h_ent) * g_ent[:, None]
    return gz / temperature


_COMPILED: dict[str, tuple] = {}


def _kernels(compiled: bool | str):
    """The per-chunk math, eager or through ``torch.compile`` (one fused kernel per chunk
    instead of about ten passes over ``[chunk, vocab]``; ``dynamic``: the last chunk's
    length differs and must not recompile)."""
    if not compiled or torch.compiler.is_compiling():
        return _forward_stats, _grad_logits
    backend = compiled if isinstance(compiled, str) else "inductor"
    if backend not in _COMPILED:
        _COMPILED[backend] = (
            torch.compile(_forward_stats, dynamic=True, backend=backend),
            torch.compile(_grad_logits, dynamic=True, backend=backend),
        )
    return _COMPILED[backend]


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward over ``chunk_size`` positions at a time; see the module docstring.

    Saved for backward: the inputs (hidden ``[N, H]``, weight, bias, flat labels) and each
    position's float32 log-sum-exp, so backward recomputes a chunk's logits (one matmul) and
    needs no second reduction over the vocabulary.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy, compiled):
        # outputs in the labels' shape, written through flat views (an output that is a view
        # would trip in-place checks downstream, e.g. FSDP's)
        n = hidden.shape[0]
        kw = {"dtype": torch.float32, "device": hidden.device}
        lp_out = torch.empty(labels.shape, **kw)
        ent_out = torch.empty(labels.shape, **kw) if with_entropy else torch.empty(0, **kw)
        lp, ent, labels = lp_out.view(-1), ent_out.view(-1), labels.reshape(-1)
        lse = torch.empty(n, **kw)
        fwd, _ = _kernels(compiled)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            c_lp, c_lse, c_ent = fwd(
                _chunk_logits(hidden[s:e], weight, bias), labels[s:e], temperature, with_entropy
            )
            lp[s:e], lse[s:e] = c_lp, c_lse
            if with_entropy:
                ent[s:e] = c_ent
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        ctx.set_materialize_grads(False)
        return lp_out, ent_out

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_size
        _, grad_logits = _kernels(ctx.compiled)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        g_lp = g_lp.reshape(-1).float() if g_lp is not None else None
        g_ent = g_ent.reshape(-1).float() if g_ent is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulate the weight's gradient over chunks in float32, cast once at the end
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            gz = grad_logits(
                _chunk_logits(h, weight, bias),
                lse[s:e],
                labels[s:e],
                g_lp[s:e] if g_lp is not None else None,
                g_ent[s:e] if g_ent is not None else None,
                t,
            )
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
            None,
        )
