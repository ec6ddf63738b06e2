"""A rollout engine's scratch directory in shared memory, for files it hands to its own
worker processes on the node: weights in memory (``TensorWeights``) staged as a safetensors
file that every worker maps.

``/dev/shm`` is RAM and outlives a process: a file left by an engine killed in the middle of
an update stays until someone removes it. So each process writes under a directory named for
its pid, and an engine removes, when it starts, the directories of processes that no longer
exist::

    self.scratch = ShmScratch("laminar-myengine-")

    async def start(self):
        self.scratch.remove_orphans()

    async def update_weights(self, weights):
        ...
        with self.scratch.safetensors(weights, self.replica_id) as path:
            await my_workers_load(path)  # the file is removed after

    async def stop(self):
        self.scratch.release()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_core.interfaces.weights import TensorWeights

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class ShmScratch:
    """``<root>/<prefix><pid>``: this process's scratch directory (root: ``/dev/shm``, or
    the temporary directory where there is none)."""

    def __init__(self, prefix: str, root: str | Path | None = None) -> None:
        self.prefix = prefix
        self.root = Path(root) if root is not None else SHM

    @property
    def path(self) -> Path:
        return self.root / f"{self.prefix}{os.getpid()}"

    def dir(self) -> Path:
        """This process's directory, created if needed."""
        d = self.path
        d.mkdir(exist_ok=True)
        return d

    def remove_orphans(self) -> None:
        """Remove the directories of processes (of this prefix) that no longer exist."""
        for d in self.root.glob(f"{self.prefix}*"):
            pid = d.name.removeprefix(self.prefix)
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass

    def release(self) -> None:
        """Remove this process's directory if it is empty (another engine of this process
        may still use it)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()

    @contextlib.contextmanager
    def safetensors(self, weights: TensorWeights, name: str) -> Iterator[str]:
        """Write ``weights`` to a safetensors file here (contiguous CPU copies, the tensors
        in memory freed once written) and yield its path; the file is removed after."""
        from safetensors.torch import save_file

        tensors = {n: t.detach().contiguous().cpu() for n, t in weights}
        fd, path = tempfile.mkstemp(
            prefix=f"{name}-v{weights.version}-", suffix=".safetensors", dir=self.dir()
        )
        os.close(fd)
        try:
            save_file(tensors, path)
            del tensors
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def shm_files_of(pid: int) -> list[str]:
    """``/dev/shm`` files mapped by process ``pid`` and its descendants (from /proc)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
    found: set[str] = set()
    for p in procs:
        try:
            maps = Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            # already unlinked (its owner cleaned up), or a relay's version (its own cleanup)
            ours = path.startswith("/dev/shm/") and not path.startswith("/dev/shm/laminar")
            if ours and not path.endswith("(deleted)"):
                found.add(path)
    return sorted(found)
