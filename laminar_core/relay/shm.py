"""Rollouts on a node load weights from their node's relay through shared memory.

The relay writes each committed version once into a file under a tmpfs directory (``/dev/shm``
by default) and then flips a ``current`` pointer; readers on the node map the file and get
tensors that are views of it: no copy over the network, no copy in the reader until the
engine loads them. Layout per relay: ``<root>/relay<id>/v<version>.bin`` (the buckets end to
end), ``v<version>.json`` (the manifest) and ``current`` (the newest complete version).
The last ``keep`` versions stay on disk so a reader that just read the pointer can still
open its file; a file already mapped survives deletion.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from laminar_core.relay.node import VersionData
from laminar_core.relay.wire import manifest_from_json, manifest_to_json
from laminar_core.types import WeightManifest

DEFAULT_SHM_ROOT = "/dev/shm/laminar"


def _dir(root: str | os.PathLike, relay_id: int) -> Path:
    return Path(root) / f"relay{relay_id}"


class SharedVersionStore:
    """Writer side: lives in the relay's process."""

    def __init__(self, root: str | os.PathLike, relay_id: int, keep: int = 2) -> None:
        self.dir = _dir(root, relay_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)

    def write(self, data: VersionData) -> Path:
        """Write one committed version and make it the current one (atomic for readers)."""
        v = data.version
        path = self.dir / f"v{v}.bin"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for b in data.buckets:
                if b.data is None:
                    raise ValueError("phantom (simulated) versions have no bytes to share")
                f.write(b.data)
        os.replace(tmp, path)
        meta = self.dir / f"v{v}.json"
        meta.with_suffix(".jtmp").write_text(manifest_to_json(data.manifest))
        os.replace(meta.with_suffix(".jtmp"), meta)
        cur = self.dir / "current.tmp"
        cur.write_text(str(v))
        os.replace(cur, self.dir / "current")
        self._prune(v)
        return path

    def _prune(self, newest: int) -> None:
        versions = sorted(int(p.stem[1:]) for p in self.dir.glob("v*.bin") if p.stem[1:].isdigit())
        for old in versions[: -self.keep]:
            if old < newest:
                for suffix in (".bin", ".json"):
                    (self.dir / f"v{old}{suffix}").unlink(missing_ok=True)


def shared_version(root: str | os.PathLike, relay_id: int) -> int:
    """The newest version the node's relay shares (-1 if none yet)."""
    try:
        return int((_dir(root, relay_id) / "current").read_text())
    except FileNotFoundError:
        return -1


def load_shared(
    root: str | os.PathLike, relay_id: int, retries: int = 3
) -> tuple[WeightManifest, Iterator[tuple[str, torch.Tensor]]]:
    """Map the relay's current version: ``(manifest, named tensors)``.

    Tensors are copy-on-write views of the mapped file (writes stay private to the reader).
    Raises ``LookupError`` if the relay shares no version yet.
    """
    d = _dir(root, relay_id)
    for _ in range(retries):
        v = shared_version(root, relay_id)
        if v < 0:
            raise LookupError(f"relay {relay_id} shares no version under {d} yet")
        try:
            manifest = manifest_from_json((d / f"v{v}.json").read_text())
            with open(d / f"v{v}.bin", "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            break
        except FileNotFoundError:  # pruned between reading the pointer and opening: retry
            continue
    else:
        raise LookupError(f"relay {relay_id}: version files under {d} keep disappearing")
    if manifest.total_bytes != size:
        raise ValueError(f"{d / f'v{v}.bin'} is {size} bytes, manifest says {manifest.total_bytes}")

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
