"""One cgroup v2 leaf per sandbox: its memory, processes and (optionally) CPU as one budget.

Per-process rlimits do not add up to a bound on the host's memory: shared memory, tmpfs
files and kernel memory are no process's address space. A cgroup counts them all. The pool
(root on the host) makes ``laminar-sandbox-<pid>-<token>/slot-<i>`` under a cgroup that
delegates the ``memory`` and ``pids`` controllers, and writes each slot's limits:

* ``memory.max`` = ``memory_mb``: the sandbox's processes, its ``/tmp`` and ``/dev/shm``
  files, its System V shared memory and the kernel memory they take (``memory.swap.max`` 0:
  it cannot swap its way past the limit). Past it the kernel's OOM killer ends a process of
  this cgroup, never one of the host's; ``memory.events`` counts it, which is how the pool
  knows (:meth:`SandboxCgroups.oom_kills`), whatever the code printed or exited with.
* ``pids.max``: ``processes`` plus the sandbox's own few (bwrap, the runner).
* ``cpu.max`` when ``cpus`` > 0: that many cores' worth of time.

A sandbox is started in its slot's leaf (a shell writes itself to ``cgroup.procs``, then
execs the sandbox), inside a cgroup namespace rooted there, so everything it starts is
counted and it sees ``/`` as its cgroup. ``cgroup.kill`` ends a leaf's processes at once.

Where the cgroup comes from: the pool's own cgroup if its ``cgroup.subtree_control``
already hands out ``memory`` and ``pids`` (a delegated cgroup), else its parent's (the
leaves then sit beside the pool's cgroup, as under a systemd slice), else the hierarchy's
root (where the controllers can be enabled even with processes in it). Nothing else is
changed. ``cgroup: required`` refuses to start without it, naming the reason and the fix;
``auto`` (the default) runs with the per-process limits and the caps that hold without a
cgroup, and says so once at start; ``off`` does not look.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger("laminar.sandbox")

MODES = ("auto", "required", "off")
CONTROLLERS = ("memory", "pids")
#: processes of the sandbox itself that pids.max must leave room for (bwrap's init, the
#: runner, the shell that moves it into the cgroup)
OWN_PROCESSES = 4
_PREFIX = "laminar-sandbox-"

#: how to give the pool a cgroup
FIX = (
    "run the rollout where it may create child cgroups with the memory and pids controllers: "
    "on a cgroup v2 host (systemd.unified_cgroup_hierarchy=1), e.g. under `systemd-run "
    "--scope -p Delegate=yes`, or in a container with a writable cgroup v2 (`docker run "
    "--privileged`, or `-v /sys/fs/cgroup:/sys/fs/cgroup:rw` with the container's cgroup "
    "delegated)"
)


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _write(path: str | Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def hierarchy() -> tuple[str, str] | None:
    """``(mount point, this process's cgroup path under it)`` of the cgroup v2 hierarchy,
    or ``None`` when there is none."""
    mount = ""
    for line in _read("/proc/self/mountinfo").splitlines():
        pre, _, post = line.partition(" - ")
        if post.split(" ", 1)[0] == "cgroup2":
            fields = pre.split()
            if fields[3] == "/":  # the hierarchy's root is mounted there
                mount = fields[4].replace("\\040", " ")
                break
    own = next(
        (ln[3:] for ln in _read("/proc/self/cgroup").splitlines() if ln.startswith("0::")), None
    )
    if not mount or own is None:
        return None
    return mount, own.split(" (deleted)")[0]


class SandboxCgroups:
    """The pool's cgroups (see the module docstring). ``root`` replaces the hierarchy's
    mount point and ``own`` the pool's cgroup (tests point them at a stand-in directory)."""

    #: what a usable cgroup must delegate (the budget's controllers)
    controllers: tuple[str, ...] = CONTROLLERS

    def __init__(
        self,
        mode: str,
        memory_bytes: int,
        processes: int,
        cpus: float = 0.0,
        root: str = "",
        own: str = "",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"cgroup must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.memory_bytes, self.processes, self.cpus = memory_bytes, processes, cpus
        self._root, self._own = root, own
        self.base = ""  # our cgroup; empty: none
        self.reason = ""  # why there is none
        self._leaves: list[str] = []

    def setup(self, slots: int) -> None:
        """Make the leaves; without a usable hierarchy set ``reason`` (``auto``) or raise
        ``IsolationUnavailable`` (``required``)."""
        if self.mode == "off":
            return
        parent, self.reason = self._parent()
        if parent:
            try:
                self._make(parent, slots)
            except OSError as e:
                self.close()
                self.reason = f"cannot create the sandbox cgroups under {parent} ({e})"
        if not self.reason:
            return
        if self.mode == "required":
            from laminar_sandbox.isolation import IsolationUnavailable

            raise IsolationUnavailable(
                f"sandbox option cgroup=required, but there is no cgroup for the sandboxes: "
                f"{self.reason}. Fix: {FIX}; or set env.options.cgroup=auto to run with "
                "per-process limits only"
            )
        log.warning(
            "python_sandbox: no cgroup for the sandboxes (%s): memory is bounded per process "
            "(memory_mb of address space x processes) and by the disk and System V IPC caps, "
            "not as one budget. Fix: %s",
            self.reason,
            FIX,
        )

    def _parent(self) -> tuple[str, str]:
        found = (self._root, self._own) if self._root else hierarchy()
        if found is None:
            return "", "this host has no cgroup v2 hierarchy mounted"
        mount, own = found
        if not os.path.isdir(mount):
            return "", f"no cgroup v2 hierarchy at {mount}"
        own_dir = os.path.normpath(os.path.join(mount, own.lstrip("/")))
        candidates = [own_dir]
        if own.strip("/"):
            candidates.append(os.path.dirname(own_dir.rstrip("/")))
        reasons = []
        wanted = set(self.controllers)
        for cand in candidates:
            enabled = set(_read(f"{cand}/cgroup.subtree_control").split())
            if wanted <= enabled:
                return cand, ""
            offered = set(_read(f"{cand}/cgroup.controllers").split())
            missing = sorted(wanted - offered)
            if missing:
                reasons.append(f"{cand} offers no {' or '.join(missing)} controller{_v1(missing)}")
            elif os.path.realpath(cand) == os.path.realpath(mount):
                # the root may enable controllers with processes in it
                try:
                    _write(f"{cand}/cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
                    return cand, ""
                except OSError as e:
                    reasons.append(f"cannot enable memory and pids in {cand} ({e.strerror})")
            else:
                reasons.append(f"{cand} does not delegate the memory and pids controllers")
        return "", "; ".join(reasons)

    def _make(self, parent: str, slots: int) -> None:
        self._remove_stale(parent)
        base = os.path.join(parent, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
        os.mkdir(base)
        self.base = base
        controllers = list(self.controllers)
        if self.cpus > 0 and "cpu" in _read(f"{parent}/cgroup.subtree_control").split():
            controllers.append("cpu")
        elif self.cpus > 0:
            log.warning("python_sandbox: cpus=%g is not applied: %s has no cpu controller",
                        self.cpus, parent)  # fmt: skip
        if controllers:
            _write(f"{base}/cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
        for i in range(slots):
            leaf = f"{base}/slot-{i}"
            os.mkdir(leaf)
            self._leaves.append(leaf)
            if "memory" in controllers:
                _write(f"{leaf}/memory.max", str(self.memory_bytes))
                if os.path.exists(f"{leaf}/memory.swap.max"):
                    _write(f"{leaf}/memory.swap.max", "0")
            if "pids" in controllers:
                _write(f"{leaf}/pids.max", str(self.processes + OWN_PROCESSES))
            if "cpu" in controllers:
                _write(f"{leaf}/cpu.max", f"{max(1000, int(self.cpus * 100_000))} 100000")

    def leaf(self, slot: int) -> str:
        """The slot's cgroup directory ("" without cgroups)."""
        return self._leaves[slot] if self._leaves else ""

    def wrap(self, slot: int, command: list[str]) -> list[str]:
        """``command`` started inside the slot's cgroup (unchanged without cgroups)."""
        if not self._leaves:
            return command
        procs = f"{self._leaves[slot]}/cgroup.procs"
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', procs, *command]

    def oom_kills(self, slot: int) -> int:
        """Processes of the slot's cgroup the kernel killed for memory so far."""
        if not self._leaves:
            return 0
        for line in _read(f"{self._leaves[slot]}/memory.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill(self, slot: int) -> None:
        """End every process of the slot's cgroup (Linux >= 5.14; else nothing)."""
        if self._leaves:
            with contextlib.suppress(OSError):
                _write(f"{self._leaves[slot]}/cgroup.kill", "1")

    def close(self) -> None:
        """Remove the leaves and our cgroup (their processes are gone by now)."""
        for path in [*self._leaves, self.base]:
            if path:
                _rmdir(path)
        self._leaves, self.base = [], ""

    @staticmethod
    def _remove_stale(parent: str) -> None:
        """Remove the cgroups of pools whose process is gone (a pool killed before close)."""
        for path in Path(parent).glob(f"{_PREFIX}*-*"):
            pid = path.name[len(_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                for leaf in path.glob("slot-*"):
                    _rmdir(str(leaf))
                _rmdir(str(path))


def _v1(controllers: list[str]) -> str:
    """Where cgroup v1 mounts ``controllers`` (a hybrid host binds them there, not to v2)."""
    for line in _read("/proc/self/mountinfo").splitlines():
        pre, _, post = line.partition(" - ")
        fields = post.split()
        if fields and fields[0] == "cgroup" and set(controllers) & set(fields[-1].split(",")):
            return f" (this host mounts it as cgroup v1, at {pre.split()[4]})"
    return ""


def _rmdir(path: str, wait_s: float = 2.0) -> None:
    """rmdir a cgroup, waiting a moment for its last processes to be reaped."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if time.monotonic() > deadline:
                log.warning("python_sandbox: cannot remove cgroup %s (%s)", path, e)
                return
            time.sleep(0.02)
