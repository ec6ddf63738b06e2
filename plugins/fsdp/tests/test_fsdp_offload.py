"""Activation offload parks each checkpointed layer's input off the device between forward and
backward (its storage is empty while parked) and changes no gradient."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from laminar_fsdp.offload import offload_layer_inputs


class _Layer(GradientCheckpointingLayer):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _model(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    layers = nn.ModuleList(_Layer(16) for _ in range(3))
    for m in layers:
        m.gradient_checkpointing = True
        m._gradient_checkpointing_func = lambda f, *a: torch.utils.checkpoint.checkpoint(
            f, *a, use_reentrant=False
        )
    return layers.train()


def _grads(offload: bool):
    layers = _model()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    parked_sizes = []
    with offload_layer_inputs(list(layers)) if offload else torch.enable_grad() as stats:
        h = x * 1.0  # the first layer's input is not a leaf
        inputs = []
        for m in layers:
            inputs.append(h)
            h = m(h)
        parked_sizes = [t.untyped_storage().nbytes() for t in inputs]
        h.square().sum().backward()
    grads = [x.grad] + [p.grad for p in layers.parameters()]
    return grads, parked_sizes, stats


def test_offload_parks_inputs_and_keeps_gradients():
    ref, sizes_ref, _ = _grads(offload=False)
    got, sizes, stats = _grads(offload=True)
    assert all(n > 0 for n in sizes_ref)
    assert sizes == [0, 0, 0]  # every layer's input left the device after its forward
    assert stats.layers == 3 and stats.offloaded_bytes == sum(sizes_ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
