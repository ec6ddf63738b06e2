"""``chunked_logprobs`` against the full-logits path: same numbers and gradients (fp32, CPU),
and what it keeps for backward is the inputs, never ``[tokens, vocab]`` logits."""

from __future__ import annotations

import pytest
import torch

from laminar_core.algorithms import chunked_logprobs, full_logprobs

N, H, V = 53, 24, 301  # chunks that do not divide the tokens


def _inputs(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    labels = torch.randint(0, V, (2, N), generator=g)
    return hidden, weight, b, labels


def _run(fn, temperature: float, bias: bool, **kw):
    hidden, weight, b, labels = _inputs(bias=bias)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(2, N, generator=g), torch.randn(2, N, generator=g)
    lp, ent = fn(hidden, weight, labels, temperature, bias=b, with_entropy=True, **kw)
    (lp * w_lp + ent * w_ent).sum().backward()
    grads = [hidden.grad, weight.grad] + ([b.grad] if bias else [])
    return [lp.detach(), ent.detach(), *grads]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 16, 1000])
def test_chunked_matches_full_path(temperature, bias, chunk):
    want = _run(full_logprobs, temperature, bias)
    got = _run(chunked_logprobs, temperature, bias, chunk_size=chunk)
    for name, a, b in zip(("logprobs", "entropy", "d_hidden", "d_weight", "d_bias"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_logprob_gradient_alone_and_full_fallback():
    hidden, weight, _, labels = _inputs(bias=False)
    lp, ent = chunked_logprobs(hidden, weight, labels, chunk_size=7)
    assert ent is None
    lp.sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    full, _ = chunked_logprobs(hidden, weight, labels, chunk_size=0)  # 0: the full path
    full.sum().backward()
    torch.testing.assert_close(got, hidden.grad, atol=1e-5, rtol=1e-5)
    assert (lp <= 0).all()


def _saved(fn, **kw) -> list[torch.Size]:
    hidden, weight, b, labels = _inputs()
    shapes = []

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # parameters and inputs are not held for us
            shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fn(hidden.detach().requires_grad_() * 1.0, weight, labels, 0.7, bias=b, **kw)
    del lp, ent
    return shapes


def test_saved_for_backward_is_o_chunk_not_o_tokens_x_vocab():
    full = _saved(full_logprobs, with_entropy=True)
    chunked = _saved(chunked_logprobs, chunk_size=8, with_entropy=True)
    numel = lambda shapes: sum(torch.Size(s).numel() for s in shapes)  # noqa: E731
    assert any(s[-1] == V and torch.Size(s).numel() >= 2 * N * V for s in full)
    assert all(s[-1] != V for s in chunked)  # no logits of any size are kept
    # what is kept: the hidden states, the labels and each position's log-sum-exp, nothing
    # per vocabulary entry
    assert numel(chunked) <= 2 * N * (H + 2)
    assert numel(full) > 5 * numel(chunked)


def test_bad_shapes_and_temperature_are_named():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="hidden size"):
        chunked_logprobs(hidden[..., :-1], weight, labels)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_logprobs(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, labels, temperature=0.0)


def test_compiled_chunk_math_matches_eager():
    """``compiled`` (torch.compile of each chunk's softmax math) gives the eager path's
    log-probs, entropy and gradients. The ``aot_eager`` backend: dynamo's trace and AOT
    autograd's graphs without inductor's code generation (a C++ build per graph on CPU, over
    a minute here; the GPU run compiles with inductor)."""
    eager = _run(chunked_logprobs, 0.6, True, chunk_size=16)
    got = _run(chunked_logprobs, 0.6, True, chunk_size=16, compiled="aot_eager")
    for name, a, b in zip(("logprobs", "entropy", "d_hidden", "d_weight", "d_bias"), got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
