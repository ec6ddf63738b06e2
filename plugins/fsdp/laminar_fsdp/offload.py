"""Activation offload: checkpointed decoder layers' inputs parked in (pinned) host memory
between forward and backward, brought back one layer ahead of the backward that needs them.

With activation checkpointing each decoder layer keeps only its input hidden states
(``[L, hidden]``, e.g. 400 MB per layer for a 128K-token row at 1.5B in bf16; 11 GB over 28
layers). :func:`offload_layer_inputs` hooks the layers:

- after a layer's forward (not its recompute in backward) the input is copied to host memory
  and its device storage freed (``untyped_storage().resize_(0)``: the tensor object, which
  the checkpoint's recompute closure holds, stays; only its memory goes);
- when the gradient of a layer's output arrives (the layer's backward, and with it the
  recompute, is next), its input is restored (waiting for a prefetch already under way, on
  CUDA) and the previous layer's input is prefetched on a side stream, so the copy overlaps
  this layer's recompute and backward.

On CPU the "host" copy is a plain copy (the mechanics run, nothing is saved): what the tests
check is that the numbers do not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class _Parked:
    tensor: Tensor
    host: Tensor
    nbytes: int
    ready: torch.cuda.Event | None = None


@dataclass
class OffloadStats:
    """Bytes moved to the host by the last forward, and the largest at one time."""

    offloaded_bytes: int = 0
    layers: int = 0


@dataclass
class _State:
    layers: list[nn.Module]
    parked: dict[int, _Parked] = field(default_factory=dict)
    inputs: dict[int, Tensor] = field(default_factory=dict)
    stream: torch.cuda.Stream | None = None
    stats: OffloadStats = field(default_factory=OffloadStats)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_tensor(out) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    return None


def _park(st: _State, i: int, x: Tensor) -> None:
    dev = x.device
    cuda = dev.type == "cuda"
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=cuda)
    # ordered on the compute stream: the copy reads x before any later kernel reuses its memory
    host.copy_(x, non_blocking=cuda)
    nbytes = x.untyped_storage().nbytes()
    x.untyped_storage().resize_(0)
    st.parked[i] = _Parked(x, host, nbytes)
    st.stats.offloaded_bytes += nbytes
    st.stats.layers += 1


def _bring_back(st: _State, i: int, prefetch: bool) -> None:
    p = st.parked.get(i)
    if p is None or p.ready is not None:
        return
    x = p.tensor
    if x.device.type == "cuda" and prefetch:
        st.stream = st.stream or torch.cuda.Stream(x.device)
        main = torch.cuda.current_stream(x.device)
        st.stream.wait_stream(main)
        with torch.cuda.stream(st.stream):
            x.untyped_storage().resize_(p.nbytes)
            x.data.copy_(p.host, non_blocking=True)  # .data: no version bump (see _restore)
            p.ready = torch.cuda.Event()
            p.ready.record(st.stream)
        return
    x.untyped_storage().resize_(p.nbytes)
    # through .data: the same memory without bumping the tensor's version counter, which
    # checkpointing checks (the values are the ones it saw in forward)
    x.data.copy_(p.host, non_blocking=x.device.type == "cuda")
    del st.parked[i]


def _restore(st: _State, i: int) -> None:
    p = st.parked.get(i)
    if p is None:
        return
    if p.ready is not None:  # prefetched on the side stream
        main = torch.cuda.current_stream(p.tensor.device)
        main.wait_event(p.ready)
        p.tensor.record_stream(main)  # its memory is used here, though allocated there
        del st.parked[i]
    else:
        _bring_back(st, i, prefetch=False)


@contextmanager
def offload_layer_inputs(layers: list[nn.Module]) -> Iterator[OffloadStats]:
    """Offload the inputs of ``layers`` (checkpointed decoder layers, in forward order) for
    the forwards and backwards run inside the block; see the module docstring. Every input
    is on the device again by the time its layer's backward runs; one left parked (a forward
    without backward) is dropped at exit."""
    st = _State(list(layers))

    def pre(i: int):
        def hook(_m, args, kwargs):
            if _in_backward():
                return
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, Tensor):
                st.inputs[i] = x

        return hook

    def post(i: int):
        def hook(_m, _args, _kwargs, out):
            if _in_backward():
                return
            x, y = st.inputs.pop(i, None), _first_tensor(out)
            if x is None or y is None or not y.requires_grad:
                return
            _park(st, i, x)

            def on_grad(g: Tensor) -> None:
                _restore(st, i)
                if i > 0:
                    _bring_back(st, i - 1, prefetch=True)

            y.register_hook(on_grad)

        return hook

    handles = []
    for i, m in enumerate(st.layers):
        handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post(i), with_kwargs=True))
    try:
        yield st.stats
    finally:
        for h in handles:
            h.remove()
        st.parked.clear()
        st.inputs.clear()
