"""What ``RolloutEngine.update_weights`` receives: a typed reference to one weight version.

Exactly three kinds reach an engine, so a new engine knows what it must handle:

* ``TensorWeights(version, tensors)``: named tensors in this process's memory (a relay in
  the driver unpacked them; a test built them). Iterate it for ``(name, tensor)``.
* ``SharedWeights(root, relay_id, version)``: the version a node relay wrote into the node's
  shared memory (``/dev/shm``). It pickles to a few bytes; iterating it (in the replica's own
  process, or in any process on the node: an engine may hand it to its workers as is) maps
  the file and yields copy-on-write views, so the weights are copied once, into the engine.
* ``ModelOnly(version)``: a simulated trainer's version. There are no tensors: the engine
  only records that it now holds ``version``.

In every case the names, shapes and dtypes are the rollout's (Hugging Face) ones, in the
trainer's export order; a tied output embedding is sent once, as the input embedding (no
``lm_head.weight`` when the model ties it). ``weights.version`` is the version the engine
holds once ``update_weights`` returns.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

NamedTensors = Iterator[tuple[str, torch.Tensor]]


class WeightsRef(abc.ABC):
    """One weight version for ``RolloutEngine.update_weights`` (see module docstring)."""

    version: int
    #: True when any process on the replica's node can load it as is (pass it on uncopied).
    node_local: bool = False


@dataclass(frozen=True)
class TensorWeights(WeightsRef):
    """Named tensors held in memory, in export order."""

    version: int
    tensors: Sequence[tuple[str, torch.Tensor]] = field(repr=False)

    def __iter__(self) -> NamedTensors:
        return iter(self.tensors)


@dataclass(frozen=True)
class ModelOnly(WeightsRef):
    """A version without tensors (simulated engines): only the version number changes."""

    version: int


class SharedVersionGone(LookupError):
    """The relay's shared memory no longer holds the version asked for (newer ones replaced
    it); load the relay's current version instead."""


@dataclass(frozen=True)
class SharedWeights(WeightsRef):
    """Exactly ``version`` of relay ``relay_id``'s shared weights under ``root``, as an
    iterable of ``(name, tensor)`` that maps the file only when iterated.

    It loads that version or fails: a version the relay does not share yet raises
    ``LookupError``, one already replaced by newer versions raises ``SharedVersionGone``; it
    never loads another version in its place, because the caller records the version it
    asked for as the one the replica holds. The error comes before the first tensor, so the
    engine's weights are untouched.
    """

    root: str
    relay_id: int
    version: int
    node_local = True

    def __iter__(self) -> NamedTensors:
        # The file format belongs to the relay tier (relay/shm.py); imported here, not at
        # module level, so the interfaces stay below the relay tier in the import graph.
        from laminar_core.relay.shm import load_shared

        _manifest, tensors = load_shared(self.root, self.relay_id, version=self.version)
        return tensors

    @property
    def path(self) -> Path:
        """The version's file (the buckets end to end)."""
        from laminar_core.relay.shm import relay_dir

        return relay_dir(self.root, self.relay_id) / f"v{self.version}.bin"
