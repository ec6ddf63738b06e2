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

The shared files ``SharedWeights`` reads are defined here too (``load_shared``, the reader
side; ``relay.shm`` writes them): per relay ``<root>/relay<id>/v<version>.bin`` (the buckets
end to end), ``v<version>.json`` (the manifest) and ``current`` (the newest complete version).
"""

from __future__ import annotations

import abc
import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from laminar_core.types import WeightManifest, manifest_from_json

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
        _manifest, tensors = load_shared(self.root, self.relay_id, version=self.version)
        return tensors

    @property
    def path(self) -> Path:
        """The version's file (the buckets end to end)."""
        return relay_dir(self.root, self.relay_id) / f"v{self.version}.bin"


# -- the files SharedWeights reads (relay.shm.SharedVersionStore writes them) -----------------
def relay_dir(root: str | os.PathLike, relay_id: int) -> Path:
    """Where relay ``relay_id`` shares its versions under ``root``."""
    return Path(root) / f"relay{relay_id}"


def shared_version(root: str | os.PathLike, relay_id: int) -> int:
    """The newest version the node's relay shares (-1 if none yet)."""
    try:
        return int((relay_dir(root, relay_id) / "current").read_text())
    except FileNotFoundError:
        return -1


def load_shared(
    root: str | os.PathLike, relay_id: int, retries: int = 3, version: int | None = None
) -> tuple[WeightManifest, Iterator[tuple[str, torch.Tensor]]]:
    """Map the relay's current version (or exactly ``version``): ``(manifest, named tensors)``.

    Tensors are copy-on-write views of the mapped file (writes stay private to the reader).
    Raises ``LookupError`` if the relay shares no version yet (or not ``version`` yet), and
    ``SharedVersionGone`` if ``version`` was already replaced by newer ones and deleted.
    The files are opened before this returns: an error never comes half-way through the
    tensors.
    """
    d = relay_dir(root, relay_id)
    for _ in range(retries):
        v = shared_version(root, relay_id) if version is None else version
        if v < 0:
            raise LookupError(f"relay {relay_id} shares no version under {d} yet")
        try:
            manifest = manifest_from_json((d / f"v{v}.json").read_text())
            with open(d / f"v{v}.bin", "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            break
        except FileNotFoundError:  # pruned between reading the pointer and opening: retry
            if version is None:
                continue
            current = shared_version(root, relay_id)
            if current > version:
                raise SharedVersionGone(
                    f"relay {relay_id} no longer shares version {version} under {d}: it was "
                    f"replaced by newer versions (current {current}); load the current one"
                ) from None
            raise LookupError(
                f"relay {relay_id} does not share version {version} under {d} yet "
                f"(current {current})"
            ) from None
    else:
        raise LookupError(f"relay {relay_id}: version files under {d} keep disappearing")
    if manifest.total_bytes != size:
        raise ValueError(f"{d / f'v{v}.bin'} is {size} bytes, manifest says {manifest.total_bytes}")
    if version is not None and manifest.version != version:
        raise ValueError(f"{d / f'v{v}.json'} holds version {manifest.version}, not {version}")

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in manifest.tensors:
            dtype = getattr(torch, spec.dtype)
            if spec.nbytes == 0 or mm is None:
                yield spec.name, torch.empty(spec.shape, dtype=dtype)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if spec.offset % itemsize:  # misaligned for a typed view: copy this one
                raw = raw.clone()
            yield spec.name, raw.view(dtype).reshape(spec.shape)

    return manifest, gen()
