"""How a local sandbox is isolated: the filesystem view, the command line, the refusals.

Three mechanisms (``isolation``):

* ``bwrap`` -- bubblewrap (Debian package ``bubblewrap``) builds new network, pid, mount,
  IPC and UTS namespaces and the filesystem view below.
* ``namespaces`` -- the same namespaces made with ``unshare(1)`` (util-linux); the runner
  builds the same filesystem view itself (bind mounts and ``pivot_root``).
* ``none`` -- no namespaces at all: the code sees the host's files and network. Only rlimits
  and (as root) a separate uid apply. An explicit opt-in for trusted code, never a fallback.

``auto`` tries ``bwrap`` then ``namespaces`` and refuses, naming what each lacked and the fix,
when neither works. Both isolated mechanisms need root on the host (the runner drops to a
per-sandbox uid); under another uid the pool refuses.

The filesystem view: ``/usr`` and the other system library directories (or their
merged-``/usr`` symlinks), the interpreter's installation (``sys.prefix`` and
``sys.base_prefix``, wherever they are: a venv under ``/tmp`` is bound over the private
``/tmp``, and symlinks on the way to them are recreated) and any ``ro_paths``, all
read-only; ``/dev`` with ``null``, ``zero``, ``full``, ``random`` and ``urandom``; a private
tmpfs ``/tmp`` (the working directory, ``disk_mb`` in size, at most ``files`` inodes) and
``/dev/shm`` (the same); and ``/proc``, which the runner mounts itself (``hidepid``: the code
sees its own processes only; ``subset=pid``: none of the host's ``/proc`` files). Nothing
else of the host: not ``/home``, ``/root``, ``/etc``, the run directory or its checkpoints.

The sandbox's configuration reaches the runner on a pipe, never on a command line (which
``/proc`` would show): its argv holds the pipe's file descriptor only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import time
from dataclasses import dataclass, field

from laminar_core import EnvUnavailable

ISOLATIONS = ("auto", "bwrap", "namespaces", "none")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "full", "random", "urandom")

#: Sandbox uids come from this range, one per worker, claimed with a lock file so two pools
#: on one host never share one (RLIMIT_NPROC counts per uid, and leftovers are found by it).
UID_BASE = 1_600_000_000
UID_RANGE = 100_000
UID_LOCK_DIR = "/tmp/laminar-sandbox-uids"


class IsolationUnavailable(EnvUnavailable):
    """The configured isolation cannot work on this host (the message says why and the fix)."""


@dataclass(frozen=True)
class Layout:
    """The sandbox's filesystem view as a list of ops (see ``runner.build_root``)."""

    ops: list[list] = field(default_factory=list)

    def bwrap_args(self) -> list[str]:
        args: list[str] = []
        dev_done = False
        for op in self.ops:
            kind = op[0]
            if kind == "ro":
                args += ["--ro-bind", op[1], op[2]]
            elif kind == "dev":
                if not dev_done:  # bwrap's --dev is the same minimal set, plus pts/shm
                    args += ["--dev", "/dev"]
                    dev_done = True
            elif kind == "symlink":
                args += ["--symlink", op[1], op[2]]
            elif kind == "tmpfs":  # the runner remounts it with nr_inodes (bwrap has no option)
                args += ["--perms", f"{op[3]:o}", "--size", str(op[2]), "--tmpfs", op[1]]
            elif kind == "proc":  # the runner mounts it (hidepid, subset=pid)
                args += ["--perms", "555", "--dir", op[1]]
            elif kind == "dir":
                args += ["--perms", "755", "--dir", op[1]]
        return args


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def filesystem_view(
    python_dirs: list[str], ro_paths: list[str], disk_bytes: int, inodes: int = 0
) -> Layout:
    """The ops for the view described in the module docstring. ``python_dirs``: the
    interpreter's installation (its prefixes and its executable's directory), as the host
    names them (symlinks on the way are recreated inside); ``inodes``: ``nr_inodes`` of each
    tmpfs (0: the kernel's default)."""
    ops: list[list] = []
    bound: list[str] = []
    private = ["/tmp", "/dev/shm"]  # tmpfs mounts: never re-made by a "dir" op
    made: set[str] = set(private)

    def parents(path: str) -> None:
        # directories leading to a bind, readable by the sandbox's uid (bwrap would make
        # them 0700, leaving the interpreter under /root out of the code's reach)
        parent = os.path.dirname(path)
        if parent in ("/", "") or parent in made or _covered(parent, bound):
            return
        parents(parent)
        made.add(parent)
        ops.append(["dir", parent])

    def reach(path: str) -> None:
        """Bind ``path`` read-only, recreating the symlinks that lead to it."""
        current = "/"
        parts = [p for p in os.path.normpath(path).split("/") if p]
        for i, part in enumerate(parts):
            step = os.path.join(current, part)
            if _covered(step, bound):
                return  # inside a bound directory: its symlinks come with it
            if os.path.islink(step):
                target = os.readlink(step)
                if step not in made:
                    parents(step)
                    made.add(step)
                    ops.append(["symlink", target, step])
                rest = os.path.join(os.path.realpath(step), *parts[i + 1 :])
                return reach(rest)
            current = step
        real = os.path.realpath(path)
        if not os.path.exists(real):
            raise IsolationUnavailable(f"sandbox ro_paths: {path} does not exist on this host")
        parents(real)
        ops.append(["ro", real, real])
        bound.append(real)

    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            ops.append(["symlink", os.readlink(d), d])
            made.add(d)
        elif os.path.isdir(d):
            ops.append(["ro", d, d])
            bound.append(d)
    for f in SYSTEM_FILES:
        if os.path.isfile(f):
            parents(f)
            ops.append(["ro", f, f])
    ops += [["dev", d] for d in DEVICES]
    # the private tmpfs mounts before the binds: an interpreter under /tmp is bound on top
    ops += [["tmpfs", d, disk_bytes, 0o1777, inodes] for d in private]
    for p in [*python_dirs, *ro_paths]:
        reach(os.path.abspath(p))
    ops.append(["proc", "/proc"])
    return Layout(ops)


def command(isolation: str, python: str, runner_source: str, config_fd: int) -> list[str]:
    """The argv that starts one sandbox's runner under ``isolation``; it reads its config
    from the pipe ``config_fd``."""
    inner = [python, "-I", "-c", runner_source, str(config_fd)]
    if isolation == "none":
        return inner
    if isolation == "namespaces":
        return [
            *("unshare", "--net", "--pid", "--mount", "--ipc", "--uts", "--cgroup"),
            *("--fork", "--kill-child", "--propagation", "private", "--"),
            *inner,
        ]
    if isolation == "bwrap":
        raise ValueError("bwrap needs the layout: use bwrap_command")
    raise ValueError(f"unknown isolation {isolation!r}")


def bwrap_command(layout: Layout, python: str, runner_source: str, config_fd: int) -> list[str]:
    """The argv that starts one sandbox's runner under bwrap (config on ``config_fd``)."""
    return [
        "bwrap",
        *("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"),
        *("--unshare-cgroup-try", "--hostname", "sandbox"),
        *("--die-with-parent", "--new-session"),
        *layout.bwrap_args(),
        *("--remount-ro", "/", "--chdir", "/tmp"),
        *(python, "-I", "-c", runner_source, str(config_fd)),
    ]


def candidates(isolation: str) -> tuple[list[str], list[str]]:
    """``(mechanisms to try in order, reasons others were ruled out)`` for ``isolation``.

    Raises :class:`IsolationUnavailable` when none is left to try.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "none":
        return ["none"], []
    wanted = ["bwrap", "namespaces"] if isolation == "auto" else [isolation]
    reasons: list[str] = []
    if os.geteuid() != 0:
        raise IsolationUnavailable(
            f"sandbox isolation '{isolation}' needs root on the host (it builds namespaces "
            f"and runs each sandbox as its own uid); this process runs as uid {os.geteuid()}. "
            "Fix: run the rollout as root in a container, or use options.backend="
            "sandbox_fusion (a remote sandbox service)"
        )
    tried = []
    for mech in wanted:
        if mech == "bwrap" and shutil.which("bwrap") is None:
            reasons.append("bwrap: not installed (fix: apt-get install bubblewrap)")
        elif mech == "namespaces" and shutil.which("unshare") is None:
            reasons.append("namespaces: unshare(1) not found (fix: apt-get install util-linux)")
        else:
            tried.append(mech)
    if not tried:
        raise refusal(isolation, reasons)
    return tried, reasons


def refusal(isolation: str, reasons: list[str]) -> IsolationUnavailable:
    return IsolationUnavailable(
        f"sandbox isolation '{isolation}' is not available on this host: "
        + "; ".join(reasons)
        + ". Model-written code is not run unisolated unless you say so: set "
        "env.options.isolation=none to run it with rlimits only (trusted code only), or "
        "options.backend=sandbox_fusion for a remote sandbox"
    )


class UidLease:
    """Claims ``n`` unused uids from the sandbox range for this process's lifetime."""

    def __init__(self, n: int) -> None:
        os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
        self.uids: list[int] = []
        self._fds: list[int] = []
        for uid in range(UID_BASE, UID_BASE + UID_RANGE):
            if len(self.uids) == n:
                break
            fd = os.open(f"{UID_LOCK_DIR}/{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if processes_of(uid):  # left by a pool that died: not ours to reuse
                os.close(fd)
                continue
            self.uids.append(uid)
            self._fds.append(fd)
        if len(self.uids) < n:
            self.release()
            raise IsolationUnavailable(
                f"no free sandbox uid in [{UID_BASE}, {UID_BASE + UID_RANGE}) (lock files in "
                f"{UID_LOCK_DIR}); fix: end other sandbox pools on this host"
            )

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self.uids = [], []


def processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is ``uid``, from ``/proc``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # gone meanwhile
        state = uids = b""
        for line in status.split(b"\n"):
            if line.startswith(b"State:"):
                state = line.split()[1]
            elif line.startswith(b"Uid:"):
                uids = line
                break
        if state != b"Z" and uids and str(uid).encode() in uids.split()[1:3]:
            found.append(int(entry.name))
    return found


def _children(pid: int) -> list[int]:
    try:  # every thread's list: the runner is single-threaded, but be thorough
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from ``/proc``."""
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it, with no window for an orphan to escape.

    ``pid`` is stopped first, so it cannot start another process while its tree is read.
    Killing a sandbox's pid-namespace init (bwrap's, or the runner under ``unshare``) takes
    every process of the namespace with it, whatever session or group they moved to; the
    parent-death signals of ``bwrap --die-with-parent`` / ``unshare --kill-child`` are set
    by the child after it starts, so killing only the outer process right after a spawn
    would leave the sandbox running, holding the output pipes.
    """
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    # a signal is delivered asynchronously: a clone() in progress completes first, so read
    # the tree only once the process is seen stopped (or dead)
    deadline = time.monotonic() + 1.0
    while _state(pid) not in ("T", "t", "Z", "X", "") and time.monotonic() < deadline:
        time.sleep(0.0005)
    for child in reversed(descendants(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
