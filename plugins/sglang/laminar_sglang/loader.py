"""SGLang custom weight loader: a new version loaded by each scheduler (TP rank) from a file
in the node's shared memory.

SGLang's ``update_weights_from_tensor`` hands named tensors to the model's ``load_weights``
in every scheduler process, after serialising them through its own IPC. Laminar's weights
already sit in a file every process on the node can map: the node relay's version file
(``SharedWeights``), or a safetensors file the replica wrote for tensors it got in memory.
So the host passes a *reference* instead (``encode``: one small uint8 tensor naming the
file), registered as SGLang's ``custom_weight_loader``; ``load_weights`` below runs in each
scheduler, maps the file and feeds its tensors straight into the model's own loader (which
fuses q/k/v and gate/up and shards for tensor parallelism as at start-up). Nothing is copied
through SGLang's IPC, and every TP rank maps the same file.

A tied output embedding needs nothing special: SGLang's Qwen2-style models make ``lm_head``
the embedding module itself, so loading ``model.embed_tokens.weight`` updates both (the
trainer exports no ``lm_head.weight`` for a tied model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

#: What the host passes as SGLang's ``load_format`` (and lists in ``custom_weight_loader``).
LOAD_FORMAT = "laminar_sglang.loader.load_weights"
MARKER = "laminar.weights_ref"


def encode(ref: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The one-tensor payload that stands for ``ref`` (``{"kind": "shared", "root",
    "relay_id", "version"}`` or ``{"kind": "safetensors", "path"}``)."""
    data = json.dumps(ref).encode()
    return [(MARKER, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def decode(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    if len(named_tensors) != 1 or named_tensors[0][0] != MARKER:
        names = [n for n, _ in named_tensors][:3]
        raise ValueError(f"laminar-sglang loader got tensors {names}..., not a weights reference")
    return json.loads(bytes(named_tensors[0][1].cpu().numpy().tobytes()))


def tensors(ref: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors ``ref`` points at, as views of the mapped file."""
    if ref["kind"] == "shared":
        from laminar_core import SharedWeights

        return iter(SharedWeights(ref["root"], int(ref["relay_id"]), int(ref["version"])))
    if ref["kind"] == "safetensors":
        from safetensors import safe_open

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(ref["path"], framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, f.get_tensor(name)

        return gen()
    raise ValueError(f"laminar-sglang loader: unknown weights reference {ref!r}")


def load_weights(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-loader entry point (runs in each scheduler process)."""
    model.load_weights(tensors(decode(named_tensors)))
