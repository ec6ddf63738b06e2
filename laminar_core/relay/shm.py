"""Rollouts on a node load weights from their node's relay through shared memory.

The relay writes each committed version once into a file under a tmpfs directory (``/dev/shm``
by default) and then flips a ``current`` pointer; readers on the node map the file and get
tensors that are views of it: no copy over the network, no copy in the reader until the
engine loads them. Layout per relay: ``<root>/relay<id>/v<version>.bin`` (the buckets end to
end), ``v<version>.json`` (the manifest) and ``current`` (the newest complete version).
The last ``keep`` versions stay on disk so a reader that just read the pointer can still
open its file; a file already mapped survives deletion.

This module is the writer. The reader, ``SharedWeights(root, relay_id, version)`` and
``load_shared``, is the engine interface's (``laminar_core.interfaces.weights``, re-exported
here): ``SharedWeights`` is what a driver hands a replica instead of tensors, a small picklable
reference that maps exactly that version when the replica iterates it (in the replica's own
process), so the weights never cross the network or Ray's object store on their way from the
node's relay to its rollouts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from laminar_core.interfaces.weights import (
    SharedVersionGone,
    SharedWeights,
    load_shared,
    relay_dir,
    shared_version,
)
from laminar_core.relay.node import VersionData
from laminar_core.types import manifest_to_json

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


class SharedVersionStore:
    """Writer side: lives in the relay's process."""

    def __init__(self, root: str | os.PathLike, relay_id: int, keep: int = 2) -> None:
        self.dir = relay_dir(root, relay_id)
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


def remove_shared(root: str | os.PathLike, relay_id: int) -> None:
    """Delete relay ``relay_id``'s shared versions (tmpfs is RAM: do it when the relay
    closes), and ``root`` too if nothing else is left in it. Readers that mapped a file keep
    their mapping."""
    shutil.rmtree(relay_dir(root, relay_id), ignore_errors=True)
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
