"""The sandbox's seccomp filter: an allow-list of the syscalls model-written Python needs.

The list (:data:`ALLOWED`) was measured: ``scripts/measure_syscalls.py`` runs the programs of
``tests/syscall_corpus.py`` (the stdlib, numpy and sympy -- the shipped ``preload`` stack --,
files in ``/tmp``, subprocesses and shells, threads, multiprocessing, asyncio and sockets,
signals and timers, ctypes, mmap, sqlite, the ``os`` module's process and file calls) under
``strace -f``, with CPython 3.11 (and numpy, sympy) and 3.13 (the stdlib programs), and lists
what they call. That set is in, plus only: the variants libc picks between by architecture
or version for a call in the set (arm64 has no ``dup2``, ``poll``, ``epoll_wait``, ``open``
...: ``dup3``, ``ppoll``, ``epoll_pwait``, the ``*at`` calls; ``getrlimit`` for
``prlimit64``), the xattr reads ``shutil.copystat`` makes after ``listxattr``, System V IPC
(capped per sandbox by its IPC namespace), and ``restart_syscall`` (how the kernel resumes
an interrupted sleep). Everything else fails with ``ENOSYS`` (libc then falls back where it
can, e.g. ``clone3`` to ``clone``), and the doors below fail with ``EPERM``
(:data:`REFUSED`): the kernel keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``,
io_uring, Linux AIO (``io_setup`` takes a host-wide quota, ``fs.aio-max-nr``),
``memfd_create`` (memory that no limit but a cgroup sees), ``ptrace`` and
``process_vm_*``, namespaces and mounts, kernel modules and kexec.

Arguments are checked where a syscall is only partly wanted: ``socket``/``socketpair`` only
for ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` (no vsock, which no namespace isolates; no
netlink or packet sockets: ``EAFNOSUPPORT``), ``clone`` without namespace flags (``EPERM``),
``clone3`` not at all (its flags are behind a pointer a filter cannot read: ``ENOSYS``, and
libc falls back to ``clone``). Another ABI (i386 on x86_64, x32) is refused outright.

Built here, on the host, and handed to the runner with its config: the runner installs it
in the child that runs the code, after the limits and before the code.
"""

from __future__ import annotations

import struct

#: AUDIT_ARCH_* of the architectures with a table below
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

#: name -> (x86_64 number, aarch64 number or None where arm64 has no such call), from the
#: kernel headers (``scripts/syscall_numbers.py`` prints them)
NUMBERS: dict[str, tuple[int, int | None]] = {
    "accept": (43, 202), "accept4": (288, 242), "access": (21, None), "add_key": (248, 217),
    "alarm": (37, None), "arch_prctl": (158, None), "bind": (49, 200), "bpf": (321, 280),
    "brk": (12, 214), "chdir": (80, 49), "chmod": (90, None), "chown": (92, None),
    "chroot": (161, 51), "clock_getres": (229, 114), "clock_gettime": (228, 113),
    "clock_nanosleep": (230, 115), "clone": (56, 220), "clone3": (435, 435), "close": (3, 57),
    "close_range": (436, 436), "connect": (42, 203), "copy_file_range": (326, 285),
    "delete_module": (176, 106), "dup": (32, 23), "dup2": (33, None), "dup3": (292, 24),
    "epoll_create": (213, None), "epoll_create1": (291, 20), "epoll_ctl": (233, 21),
    "epoll_pwait": (281, 22), "epoll_pwait2": (441, 441), "epoll_wait": (232, None),
    "execve": (59, 221), "exit": (60, 93), "exit_group": (231, 94), "faccessat": (269, 48),
    "faccessat2": (439, 439), "fadvise64": (221, 223), "fallocate": (285, 47),
    "fchdir": (81, 50), "fchmod": (91, 52), "fchmodat": (268, 53), "fchown": (93, 55),
    "fchownat": (260, 54), "fcntl": (72, 25), "fdatasync": (75, 83), "fgetxattr": (193, 10),
    "finit_module": (313, 273), "flistxattr": (196, 13), "flock": (73, 32), "fork": (57, None),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fsopen": (430, 430), "fspick": (433, 433),
    "fstat": (5, 80), "fstatfs": (138, 44), "fsync": (74, 82), "ftruncate": (77, 46),
    "futex": (202, 98), "getcwd": (79, 17), "getdents64": (217, 61), "getegid": (108, 177),
    "geteuid": (107, 175), "getgid": (104, 176), "getgroups": (115, 158),
    "getitimer": (36, 102), "getpeername": (52, 205), "getpgid": (121, 155),
    "getpgrp": (111, None), "getpid": (39, 172), "getppid": (110, 173),
    "getpriority": (140, 141), "getrandom": (318, 278), "getresgid": (120, 150),
    "getresuid": (118, 148), "getrlimit": (97, 163), "getrusage": (98, 165),
    "getsid": (124, 156), "getsockname": (51, 204), "getsockopt": (55, 209),
    "gettid": (186, 178), "gettimeofday": (96, 169), "getuid": (102, 174),
    "getxattr": (191, 8), "init_module": (175, 105), "io_cancel": (210, 3),
    "io_destroy": (207, 1), "io_getevents": (208, 4), "io_pgetevents": (333, 292),
    "io_setup": (206, 0), "io_submit": (209, 2), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "io_uring_setup": (425, 425), "ioctl": (16, 29),
    "kexec_file_load": (320, 294), "kexec_load": (246, 104), "keyctl": (250, 219),
    "kill": (62, 129), "lchown": (94, None), "lgetxattr": (192, 9), "link": (86, None),
    "linkat": (265, 37), "listen": (50, 201), "listxattr": (194, 11), "llistxattr": (195, 12),
    "lseek": (8, 62), "madvise": (28, 233), "mbind": (237, 235), "memfd_create": (319, 279),
    "memfd_secret": (447, 447), "mkdir": (83, None), "mkdirat": (258, 34), "mmap": (9, 222),
    "mount": (165, 40), "mount_setattr": (442, 442), "move_mount": (429, 429),
    "mprotect": (10, 226), "mremap": (25, 216), "msgctl": (71, 187), "msgget": (68, 186),
    "msgrcv": (70, 188), "msgsnd": (69, 189), "msync": (26, 227), "munmap": (11, 215),
    "name_to_handle_at": (303, 264), "nanosleep": (35, 101), "newfstatat": (262, 79),
    "open": (2, None), "open_by_handle_at": (304, 265), "open_tree": (428, 428),
    "openat": (257, 56), "perf_event_open": (298, 241), "pidfd_getfd": (438, 438),
    "pidfd_open": (434, 434), "pipe": (22, None), "pipe2": (293, 59), "pivot_root": (155, 41),
    "poll": (7, None), "ppoll": (271, 73), "pread64": (17, 67), "prlimit64": (302, 261),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "pselect6": (270, 72),
    "ptrace": (101, 117), "pwrite64": (18, 68), "read": (0, 63), "readlink": (89, None),
    "readlinkat": (267, 78), "readv": (19, 65), "recvfrom": (45, 207), "recvmsg": (47, 212),
    "rename": (82, None), "renameat": (264, 38), "renameat2": (316, 276),
    "request_key": (249, 218), "restart_syscall": (219, 128), "rmdir": (84, None),
    "rseq": (334, 293), "rt_sigaction": (13, 134), "rt_sigpending": (127, 136),
    "rt_sigprocmask": (14, 135), "rt_sigreturn": (15, 139), "rt_sigtimedwait": (128, 137),
    "sched_get_priority_max": (146, 125), "sched_get_priority_min": (147, 126),
    "sched_getaffinity": (204, 123), "sched_getparam": (143, 121),
    "sched_getscheduler": (145, 120), "sched_setaffinity": (203, 122),
    "sched_yield": (24, 124), "select": (23, None), "semctl": (66, 191), "semget": (64, 190),
    "semop": (65, 193), "semtimedop": (220, 192), "sendfile": (40, 71), "sendmsg": (46, 211),
    "sendto": (44, 206), "set_robust_list": (273, 99), "set_tid_address": (218, 96),
    "setitimer": (38, 103), "setns": (308, 268), "setpgid": (109, 154),
    "setpriority": (141, 140), "setrlimit": (160, 164), "setsid": (112, 157),
    "setsockopt": (54, 208), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "shmget": (29, 194), "shutdown": (48, 210), "sigaltstack": (131, 132), "socket": (41, 198),
    "socketpair": (53, 199), "statfs": (137, 43), "statx": (332, 291), "symlink": (88, None),
    "symlinkat": (266, 36), "sysinfo": (99, 179), "tgkill": (234, 131), "time": (201, None),
    "times": (100, 153), "tkill": (200, 130), "truncate": (76, 45), "umask": (95, 166),
    "umount2": (166, 39), "uname": (63, 160), "unlink": (87, None), "unlinkat": (263, 35),
    "unshare": (272, 97), "userfaultfd": (323, 282), "utimensat": (280, 88),
    "vfork": (58, None), "wait4": (61, 260), "waitid": (247, 95), "write": (1, 64),
    "writev": (20, 66),
}  # fmt: skip

#: measured (see the module docstring), most frequent first
ALLOWED: tuple[str, ...] = (
    # memory, files, time: what every Python process does all the time
    "read", "write", "close", "mmap", "munmap", "mprotect", "brk", "madvise", "mremap",
    "futex", "fstat", "newfstatat", "statx", "openat", "open", "lseek", "pread64", "pwrite64",
    "readv", "writev", "ioctl", "fcntl", "getdents64", "clock_gettime", "clock_getres",
    "gettimeofday", "time", "clock_nanosleep", "nanosleep", "getrandom", "msync", "mbind",
    # signals
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "rt_sigtimedwait",
    "rt_sigpending", "restart_syscall", "kill", "tgkill", "tkill", "alarm", "getitimer",
    "setitimer",
    # files and directories (in the sandbox's own /tmp: the rest is read-only)
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getcwd", "chdir",
    "fchdir", "mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2", "link",
    "linkat", "unlink", "unlinkat", "symlink", "symlinkat", "chmod", "fchmod", "fchmodat",
    "chown", "fchown", "lchown", "fchownat", "umask", "utimensat", "truncate", "ftruncate",
    "fsync", "fdatasync", "flock", "fallocate", "fadvise64", "statfs", "fstatfs",
    "sendfile", "copy_file_range", "listxattr", "llistxattr", "flistxattr", "getxattr",
    "lgetxattr", "fgetxattr", "close_range",
    # pipes, polling, sockets (AF_UNIX/INET/INET6 only, see socket below)
    "pipe", "pipe2", "dup", "dup2", "dup3", "select", "pselect6", "poll", "ppoll",
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "epoll_pwait2", "socket", "socketpair", "connect", "accept", "accept4", "bind",
    "listen", "sendto", "recvfrom", "sendmsg", "recvmsg", "shutdown", "getsockname",
    "getpeername", "setsockopt", "getsockopt",
    # processes and threads (clone: no namespace flags, see below)
    "clone", "vfork", "fork", "execve", "wait4", "waitid", "exit",
    "exit_group", "set_tid_address", "set_robust_list", "rseq", "arch_prctl", "pidfd_open",
    "sched_yield", "sched_getaffinity",
    "sched_setaffinity", "sched_getparam", "sched_getscheduler", "sched_get_priority_max",
    "sched_get_priority_min", "getpriority", "setpriority",
    # who and where am I; limits and usage
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getresuid",
    "getresgid", "getgroups", "getpgrp", "getpgid", "setpgid", "getsid", "setsid", "uname",
    "sysinfo", "times", "getrusage", "getrlimit", "setrlimit", "prlimit64",
    # System V IPC: capped per sandbox in its IPC namespace (shmmax, shmall, shmmni, ...)
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
)  # fmt: skip

#: refused with EPERM (everything else not allowed gets ENOSYS)
REFUSED: tuple[str, ...] = (
    "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "io_setup", "io_destroy",
    "io_submit", "io_cancel", "io_getevents", "io_pgetevents", "memfd_create", "memfd_secret",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
    "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module",
)  # fmt: skip

#: syscalls whose arguments the filter reads, or that get their own answer
SPECIAL = ("socket", "socketpair", "clone", "clone3")

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NAMESPACES |= 0x20000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000

_ALLOW, _KILL = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
# classic BPF opcodes: BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_JMP|JSET|K,
# BPF_JMP|JA (32-bit offset), BPF_RET|K
_LD, _JEQ, _JGE, _JSET, _JA, _RET = 0x20, 0x15, 0x35, 0x45, 0x05, 0x06
# offsets in struct seccomp_data: nr, arch, args[0] (its low 32 bits: little-endian)
_NR, _ARCH, _ARG0 = 0, 4, 16


def numbers(machine: str) -> dict[str, int]:
    """``{name: number}`` on ``machine`` (``platform.machine()``) of the names this module
    knows; ``KeyError`` for an architecture without a table."""
    column = tuple(ARCHES).index(machine)
    return {name: nrs[column] for name, nrs in NUMBERS.items() if nrs[column] is not None}


def program(machine: str) -> bytes | None:
    """The filter for ``machine`` as a classic-BPF program (``struct sock_filter`` array),
    or ``None`` on an architecture without a table (then no filter is installed).

    Laid out so that every conditional jump (8-bit offsets) is short: the checks of the
    special calls and their answers first, then the allowed calls with ``allow`` right
    after them, then the refused ones; the kernel's seccomp cache makes the allowed calls
    whose answer does not depend on their arguments cost nothing after their first use.
    """
    if machine not in ARCHES:
        return None
    nr = numbers(machine)
    allowed = [nr[n] for n in ALLOWED if n in nr and n not in SPECIAL]
    refused = [nr[n] for n in REFUSED if n in nr]
    if len(allowed) > 250:
        raise ValueError("seccomp: too many allowed calls for one block of short jumps")
    prog: list = [
        (_LD, _ARCH, None, None),
        (_JEQ, ARCHES[machine], None, "kill"),
        (_LD, _NR, None, None),
        *([(_JGE, X32_SYSCALL_BIT, "kill", None)] if machine == "x86_64" else []),
        (_JEQ, nr["socket"], "socket", None),
        (_JEQ, nr["socketpair"], "socketpair", None),
        (_JEQ, nr["clone"], "clone", None),
        (_JEQ, nr["clone3"], "enosys", None),
        (_JA, "list", None, None),
        "kill", (_RET, _KILL, None, None),
        "enosys", (_RET, _ERRNO | ENOSYS, None, None),
        "socket", (_LD, _ARG0, None, None),  # AF_INET, AF_INET6, or on to AF_UNIX
        (_JEQ, AF_INET, "pass", None),
        (_JEQ, AF_INET6, "pass", None),
        "socketpair", (_LD, _ARG0, None, None),
        (_JEQ, AF_UNIX, "pass", None),
        (_RET, _ERRNO | EAFNOSUPPORT, None, None),
        "clone", (_LD, _ARG0, None, None),
        (_JSET, CLONE_NAMESPACES, None, "pass"),
        (_RET, _ERRNO | EPERM, None, None),
        "pass", (_RET, _ALLOW, None, None),
        "list",
        *[(_JEQ, n, "allow", None) for n in allowed],
        (_JA, "refused", None, None),
        "allow", (_RET, _ALLOW, None, None),
        "refused",
        *[(_JEQ, n, "deny", None) for n in refused],
        (_RET, _ERRNO | ENOSYS, None, None),
        "deny", (_RET, _ERRNO | EPERM, None, None),
    ]  # fmt: skip
    labels: dict[str, int] = {}
    insns: list[tuple] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)

    def offset(target: str | None, i: int) -> int:
        return 0 if target is None else labels[target] - i - 1

    out = b""
    for i, (code, k, jt, jf) in enumerate(insns):
        if code == _JA:  # the target is in k (32 bits)
            out += struct.pack("=HBBI", code, 0, 0, offset(k, i))
            continue
        jt, jf = offset(jt, i), offset(jf, i)
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError(f"seccomp: a jump at {i} is out of range ({jt}, {jf})")
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out
