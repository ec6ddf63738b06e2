"""Measure the syscalls model-written Python makes, for the sandbox's seccomp allow-list.

Runs each program of ``tests/syscall_corpus.py`` (plus the runner's own steps between
installing the filter and running the code) under ``strace -f`` on this host, with a private
``/tmp`` and ``/dev/shm`` (``unshare --mount``) and the sandbox's environment variables, and
prints the union of the syscalls made, then how it compares with
``laminar_sandbox.seccomp.ALLOWED``: what the corpus makes that the list lacks (must be
empty, but for ``clone3``, which the filter answers ENOSYS so that libc uses ``clone``) and
what the list has beyond the corpus (each deliberate: see ``seccomp.py``'s docstring).

Usage (root, strace installed)::

    python plugins/sandbox/scripts/measure_syscalls.py [--python PYTHON] [--preload numpy sympy]
        [--skip numpy sympy]   # e.g. for an interpreter without them
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from syscall_corpus import PROGRAMS  # noqa: E402

from laminar_sandbox import seccomp  # noqa: E402
from laminar_sandbox.pool import _SANDBOX_ENV  # noqa: E402

#: what the runner's child does after installing the filter, before the code
RUNNER_TAIL = """
import os, sys
os.closerange(3, 1 << 16)
sys.stdin = open(os.devnull)
sys.stdout.reconfigure(line_buffering=True)
sys.stderr.reconfigure(line_buffering=True)
exec(compile("print(1)", "<code>", "exec"), {"__name__": "__main__"})
sys.stdout.flush()
os._exit(0)
"""

_CALL = re.compile(r"^(?:\[pid\s+\d+\]\s+)?(?:\d+\s+)?([a-z_0-9]+)\(")


def measure(python: str, preload: list[str], name: str, code: str) -> collections.Counter:
    """The syscalls ``code`` makes (with ``preload`` imported first, as the runner does),
    counted by name."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as out:
        trace = f"{out}/trace"
        program = "".join(f"import {m}\n" for m in preload) + code
        # a private /tmp and /dev/shm (nothing a program leaves reaches the host's), and the
        # sandbox's address-space limit (the 20 GB program)
        script = (
            "mount -t tmpfs -o size=256m tmpfs /tmp && mount -t tmpfs -o size=64m tmpfs "
            "/dev/shm && cd /tmp && ulimit -v 2097152 && "
            f'exec strace -f -qq -o {trace} {python} -I -c "$PROGRAM"'
        )
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env={**_SANDBOX_ENV, "PROGRAM": program},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if "OK" not in r.stdout and name != "runner":
            print(f"  {name}: did not print OK:\n{r.stdout[-500:]}\n{r.stderr[-1500:]}")
        calls: collections.Counter = collections.Counter()
        for line in Path(trace).read_text().splitlines():
            m = _CALL.match(line)
            if m:
                calls[m.group(1)] += 1
        return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--preload", nargs="*", default=["numpy", "sympy"])
    ap.add_argument("--skip", nargs="*", default=[], help="programs not to run (names)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("measure_syscalls: needs root (unshare --mount)")
    total: collections.Counter = collections.Counter()
    for name, code in {"runner": RUNNER_TAIL, **PROGRAMS}.items():
        if name in args.skip:
            continue
        calls = measure(args.python, args.preload, name, code)
        print(f"{name}: {len(calls)} syscalls")
        total.update(calls)
    print(f"\nthe corpus makes {len(total)} syscalls:")
    print(" ".join(sorted(total)))
    allowed = set(seccomp.ALLOWED)
    missing = sorted(set(total) - allowed)
    print(f"\nmade but not allowed ({len(missing)}): {' '.join(missing) or '-'}")
    extra = sorted(allowed - set(total))
    print(f"allowed beyond the corpus ({len(extra)}): {' '.join(extra) or '-'}")


if __name__ == "__main__":
    main()
