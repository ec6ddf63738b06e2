"""Living in an actor's process: what every host process does to itself, with no Ray in it
(a host forked from the zygote, ``runtime.zygote``, has none): ``limit_threads`` keeps torch
to the threads it was given, ``pin_cores`` keeps the process on its cores, ``log_to`` sends
its output to the run's log, and ``detach_resource_tracker`` lets what its engine processes
registered with multiprocessing outlive the process group, so it is cleaned up.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from laminar_core.config.checks import parse_cores

__all__ = ["detach_resource_tracker", "limit_threads", "log_to", "pin_cores", "process_state"]


def process_state() -> tuple[bool, int, list[list[int]]]:
    """This process as its part left it once started: (cyclic GC on, objects frozen
    (``startup_gc``), the cores each of its threads and each of its children may run on
    (``pin_cores``)). For tests and operators; a host actor answers it from its engine's
    process, forked or not (``process_state`` on the hosts)."""
    import gc
    from pathlib import Path

    cores = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread or a child that ended meanwhile
            kids = (task / "children").read_text().split()
            for pid in [int(task.name), *map(int, kids)]:
                cores.append(sorted(os.sched_getaffinity(pid)))
    return gc.isenabled(), gc.get_freeze_count(), cores


def limit_threads() -> None:
    """Ray gives each worker the node's full CPU count by default; with several engines on
    one small machine that oversubscription makes torch many times slower."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, n))


def pin_cores(text: str, key: str) -> frozenset[int] | None:
    """Keep this process, every thread it has and every thread and process it starts on the
    cores of CPU list ``text`` (``runtime.trainer_cores`` / ``replica_cores``, named by
    ``key`` in errors). Empty: leave the OS's choice. Returns the cores, or ``None``.

    Raises ``RuntimeError`` where a core is not one this process may run on (not on this
    node, or outside its container's allowance), naming the cores it may use.
    """
    if not text:
        return None
    cores = parse_cores(text)
    allowed = os.sched_getaffinity(0)
    if missing := cores - allowed:
        import socket

        raise RuntimeError(
            f"{key}: '{text}' names cores {sorted(missing)} that this process may not use "
            f"on node {socket.gethostname()} (it may use {_cpu_list(allowed)}); choose cores "
            "from those, or leave the key empty"
        )
    # sched_setaffinity(0) is the calling thread only: Ray's, gRPC's and any pool's threads
    # already running must follow, and new ones inherit from the thread that starts them
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)
    return cores


def _cpu_list(cores: set[int] | frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def log_to(path: str | None) -> None:
    """Send this actor process's output (and that of every process it starts: vLLM's engine
    core and workers) to ``path``, appended, instead of Ray's log forwarding to the driver's
    terminal (``telemetry.engine_logs``). ``None``: leave it where Ray puts it."""
    if not path:
        return
    import sys

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def detach_resource_tracker() -> int | None:
    """Start this process's multiprocessing resource tracker outside the process: in a
    session of its own and not as its child. Returns its pid, or ``None`` where a tracker
    was already running or this Python's tracker is not the one this knows (then nothing
    changes).

    Why: an engine that runs processes of its own (vLLM's engine core and workers, started
    with ``spawn``) creates named semaphores and shared memory in ``/dev/shm``, registered
    with the tracker, which unlinks whatever is left once every process holding its pipe is
    gone. When Ray ends an actor it kills the actor's child processes (``ray.kill``) or its
    whole process group (the actor died): the tracker died with the engine and nothing
    unlinked its names (``sem.mp-*`` files in /dev/shm after every restarted replica,
    measured). Detached, it outlives them, sees its pipe close when the last of them is
    gone, unlinks what they left and exits.

    The tracker runs as ``ResourceTracker.ensure_running`` starts it (CPython 3.11-3.13: the
    same command; ``_fd`` is the pipe's write end, ``_pid`` the process), launched through a
    short-lived intermediate process so that it is not this process's child."""
    import signal
    import subprocess
    from multiprocessing import resource_tracker, spawn, util

    # CPython's private tracker state (checked for below): typed loosely on purpose
    tracker: Any = resource_tracker._resource_tracker
    if not all(hasattr(tracker, a) for a in ("_lock", "_fd", "_pid")):
        return None
    with tracker._lock:
        if tracker._fd is not None:
            return None
        r, w = os.pipe()
        exe = spawn.get_executable()
        flags: list[str] = getattr(util, "_args_from_interpreter_flags")()  # noqa: B009
        command = [exe, *flags, "-c"]
        command.append(f"from multiprocessing.resource_tracker import main;main({r})")
        # as ensure_running: SIGINT/SIGTERM blocked until the tracker has its own handlers
        blocked = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            done = subprocess.run(
                [exe, "-c", _LAUNCH, str(r), *command],
                pass_fds=[r],
                stdout=subprocess.PIPE,
                text=True,
                check=True,
                timeout=60,
            )
            pid = int(done.stdout)
        except BaseException:
            os.close(w)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
            os.close(r)
        tracker._fd, tracker._pid = w, pid
        return pid


# the intermediate: starts the tracker (argv[2:]) in a new session, says its pid, and exits,
# leaving it to init. The tracker writes only to stderr (the actor's: its log); not holding
# stdout, it lets the caller read the pid to the end.
_LAUNCH = """
import os, subprocess, sys
proc = subprocess.Popen(
    sys.argv[2:], pass_fds=[int(sys.argv[1])], start_new_session=True, stdout=subprocess.DEVNULL
)
print(proc.pid, flush=True)
os._exit(0)
"""
