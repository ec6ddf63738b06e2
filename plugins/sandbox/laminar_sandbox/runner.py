"""The supervisor that runs inside one sandbox (standard library only; trusted code).

The pool starts it as ``python -I -c <this file's source> <config json>``, inside bwrap's
namespaces, inside ``unshare(1)``'s (then it builds the filesystem view itself and
``pivot_root``\\s into it), or with no isolation. It runs as root *inside* the namespaces and
never runs model code itself:

1. (``namespaces``) builds the root: a small tmpfs holding read-only binds of the
   interpreter, the system libraries, a few device nodes, a fresh ``/proc`` and a sized
   tmpfs ``/tmp``; pivots into it; the host's other files are out of reach.
2. imports the ``preload`` modules (so each run starts warm) and writes ``ready`` on the
   status pipe, then waits for the code on stdin (until EOF).
3. forks the child that runs the code: ``/dev/null`` as stdin, every other inherited file
   closed, the sandbox's own uid/gid (no root, no capabilities, ``no_new_privs``), rlimits
   on address space, CPU time, processes, file size, open files and core dumps, a seccomp
   filter (``seccomp_filter``), cwd ``/tmp``.
4. when the child exits: kills whatever it left running (every process in the sandbox's pid
   namespace), reaps, and writes ``exit`` with the status on the status pipe.

Exit status conventions of the child: ``EXIT_MEMORY`` when the code died of ``MemoryError``,
``EXIT_SETUP`` when the sandbox could not be set up (nothing of the code ran).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import socket
import struct
import sys
import time
import traceback

EXIT_MEMORY = 120
EXIT_SETUP = 121

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

_libc = ctypes.CDLL(None, use_errno=True)

# seccomp: the syscalls the code may not make (numbers per architecture)
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
CLONE_NEWUSER = 0x10000000
SECCOMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SECCOMP_NR = {
    "x86_64": {
        "unshare": 272, "clone": 56, "clone3": 435,
        "denied": (248, 249, 250, 321, 298, 323, 425, 426, 427),
    },
    "aarch64": {
        "unshare": 97, "clone": 220, "clone3": 435,
        "denied": (217, 218, 219, 280, 241, 282, 425, 426, 427),
    },
}  # fmt: skip
# denied: add_key, request_key, keyctl, bpf, perf_event_open, userfaultfd, io_uring_*


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            src.encode() if src else None,
            dst.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {src or fstype} on {dst}",
    )


def build_root(root: str, layout: list[list]) -> None:
    """Make ``root`` (an empty host directory) the sandbox's ``/`` with ``layout``'s mounts.

    Ops: ``["ro", src, dst]`` read-only bind, ``["dev", name]`` the host's ``/dev/name``,
    ``["symlink", target, dst]``, ``["tmpfs", dst, size_bytes, mode]``, ``["proc", dst]``,
    ``["dir", dst]``. Runs in a private mount namespace: the host sees none of it.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for op in layout:
        kind = op[0]
        if kind == "ro":
            src, dst = op[1], root + op[2]
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                open(dst, "a").close()
            _mount(src, dst, None, MS_BIND)
            _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        elif kind == "dev":
            dst = f"{root}/dev/{op[1]}"
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
            _mount(f"/dev/{op[1]}", dst, None, MS_BIND)
            _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
        elif kind == "symlink":
            dst = root + op[2]
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(op[1], dst)
        elif kind == "tmpfs":
            dst = root + op[1]
            os.makedirs(dst, exist_ok=True)
            _mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, f"size={op[2]},mode={op[3]:o}")
        elif kind == "proc":
            dst = root + op[1]
            os.makedirs(dst, exist_ok=True)
            _mount("proc", dst, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "dir":
            os.makedirs(root + op[1], exist_ok=True)
            os.chmod(root + op[1], 0o755)
        else:
            raise ValueError(f"unknown layout op {op!r}")
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(root)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the new
    # root alone (no directory for the old root is needed)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def seccomp_filter(machine: str) -> bytes | None:
    """A classic-BPF seccomp program (``None`` on an architecture not listed): user
    namespaces cannot be created (``unshare``/``clone`` with ``CLONE_NEWUSER`` fail with
    EPERM; ``clone3``, whose flags a filter cannot read, fails with ENOSYS so libc falls
    back to ``clone``), the kernel keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``
    and ``io_uring`` are refused (EPERM), another ABI's syscalls kill the process. All else
    is allowed: the point is to close the kernel's most exploited doors, not to list what
    Python needs."""
    nrs = SECCOMP_NR.get(machine)
    if nrs is None:
        return None
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog: list = [
        (ld, 4, None, None),  # seccomp_data.arch
        (jeq, SECCOMP_ARCH[machine], None, "kill"),
        (ld, 0, None, None),  # seccomp_data.nr
        (jge, 0x40000000, "eperm", None),  # x32 syscall numbers
        (jeq, nrs["unshare"], "flags", None),
        (jeq, nrs["clone"], "flags", None),
        (jeq, nrs["clone3"], "enosys", None),
        *[(jeq, nr, "eperm", None) for nr in nrs["denied"]],
        (ret, allow, None, None),
        "flags",
        (ld, 16, None, None),  # low word of args[0] (little-endian): the clone flags
        (jset, CLONE_NEWUSER, "eperm", None),
        (ret, allow, None, None),
        "eperm",
        (ret, eperm, None, None),
        "enosys",
        (ret, enosys, None, None),
        "kill",
        (ret, kill, None, None),
    ]
    labels, insns = {}, []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)

    def off(target: str | None, i: int) -> int:
        return 0 if target is None else labels[target] - i - 1

    out = b""
    for i, (code, k, jt, jf) in enumerate(insns):
        out += struct.pack("=HBBI", code, off(jt, i), off(jf, i), k)
    return out


def _install_seccomp() -> None:
    program = seccomp_filter(platform.machine())
    if program is None:
        return
    buf = ctypes.create_string_buffer(program)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
        "prctl(SECCOMP)",
    )


def _status(fd: int, **fields: object) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _child(code: bytes, cfg: dict) -> None:
    """Runs in the forked child: lock it down, then run the code. Never returns."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        if cfg["mode"] == "none":
            os.setsid()  # the supervisor kills the session's group when the code is done
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        lim = cfg["limits"]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        os.chdir(cfg["workdir"])
        os.umask(0o022)
        _install_seccomp()
        # locked down: say so (an exit with EXIT_SETUP after this is the code's own), then
        # close every inherited file, the status pipe included
        _status(cfg["status_fd"], event="started")
        os.closerange(3, 1 << 16)
        sys.argv = ["<code>"]
        sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    except BaseException:
        traceback.print_exc()
        os._exit(EXIT_SETUP)
    rc = 0
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except MemoryError as e:
        rc = EXIT_MEMORY
        _print_user_traceback(e)
    except BaseException as e:
        rc = 1
        _print_user_traceback(e)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(rc & 0xFF)


def _print_user_traceback(e: BaseException) -> None:
    try:  # drop this file's frames: the model sees its own code's traceback only
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
    except BaseException:
        os.write(2, f"{type(e).__name__}\n".encode())


def _kill_leftovers(cfg: dict, child: int) -> None:
    """Kill everything the code left running, then reap what is ours to reap."""
    if cfg["mode"] != "none" and os.readlink("/proc/self/ns/pid") != cfg["host_pidns"]:
        # In our own pid namespace, kill(-1) reaches exactly the sandbox's processes (never
        # its init, never the caller). Outside one it would reach the whole host: hence
        # the namespace check, and the process-group kill below for isolation 'none'.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue


def main() -> None:
    cfg = json.loads(sys.argv[1])
    fd = cfg["status_fd"]
    if cfg["mode"] == "namespaces":
        build_root(cfg["root"], cfg["layout"])
    if cfg["mode"] != "none":
        socket.sethostname("sandbox")
    for name in cfg.get("preload", ()):
        __import__(name)
    _status(fd, event="ready", pid=os.getpid())
    code = sys.stdin.buffer.read()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(code, cfg)
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    wall = time.monotonic() - started
    _kill_leftovers(cfg, pid)
    _status(
        fd,
        event="exit",
        exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        cpu_s=round(usage.ru_utime + usage.ru_stime, 4),
        max_rss_kb=usage.ru_maxrss,
        wall_s=round(wall, 4),
    )


if __name__ == "__main__":
    main()
