"""Rollouts on a node load weights from their node's relay through shared memory.

The relay writes each committed version once into a file under a tmpfs directory (``/dev/shm``
by default) and then flips a ``current`` pointer; readers on the node map the file and get
tensors that are views of it: no copy over the network, no copy in the reader until the
engine loads them. Layout per relay: ``<root>/relay<id>/v<version>.bin`` (the buckets end to
end), ``v<version>.json`` (the manifest) and ``current`` (the newest complete version).
The last ``keep`` versions stay on disk so a reader that just read the pointer can still
open its file; a file already mapped survives deletion.

``SharedWeights(root, relay_id, version)`` (``laminar_core.interfaces.weights``) is what a
driver hands a replica instead of tensors: a small picklable reference that maps exactly that
version when the replica iterates it (in the replica's own process), so the weights never
cross the network or Ray's object store on their way from the node's relay to its rollouts.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from laminar_core.interfaces.weights import SharedVersionGone, SharedWeights
from laminar_core.relay.node import VersionData
from laminar_core.relay.wire import manifest_from_json, manifest_to_json
from laminar_core.types import WeightManifest

DEFAULT_SHM_ROOT = "/dev/shm/laminar"

__all__ = [
    "DEFAULT_SHM_ROOT",
    "SharedVersionGone",
    "SharedVersionStore",
    "SharedWeights",
    "load_shared",
    "relay_dir",
    "remove_shared",
    "shared_version",
]


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


def relay_dir(root: str | os.PathLike, relay_id: int) -> Path:
    """Where relay ``relay_id`` shares its versions under ``root``."""
    return _dir(root, relay_id)


def remove_shared(root: str | os.PathLike, relay_id: int) -> None:
    """Delete relay ``relay_id``'s shared versions (tmpfs is RAM: do it when the relay
    closes), and ``root`` too if nothing else is left in it. Readers that mapped a file keep
    their mapping."""
    shutil.rmtree(_dir(root, relay_id), ignore_errors=True)
    with contextlib.suppress(OSError):  # only if empty: other relays may still share there
        Path(root).rmdir()


def run_dir_name(run: str, pid: int, serial: int, tag: str) -> str:
    """A run's directory under the shm root: run-unique, and it names the driver's pid so
    that :func:`sweep_orphans` can tell a dead run's directory from a live one's."""
    return f"{run}-{pid}-{serial}-{tag}"


def sweep_orphans(shm_dir: str | os.PathLike) -> list[str]:
    """Delete the run directories under ``shm_dir`` whose driver process is gone (a driver
    killed with ``kill -9`` cannot delete its own); returns their names. A directory whose
    name does not parse, or whose pid is alive (maybe another run's), is left alone."""
    removed: list[str] = []
    root = Path(shm_dir)
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        parts = d.name.rsplit("-", 3)
        if len(parts) != 4 or not parts[1].isdigit() or not d.is_dir():
            continue
        try:  # alive (or a pid reused by another process): not ours to delete
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:  # the driver is gone
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
        except PermissionError:  # alive, another user's
            pass
    return removed


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
    d = _dir(root, relay_id)
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
