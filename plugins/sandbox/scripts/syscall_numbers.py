"""Print the syscall numbers of ``laminar_sandbox.seccomp``'s names for x86_64 and aarch64,
from the kernel headers of this host (``linux-libc-dev``): how the tables in ``seccomp.py``
were made, and how to extend them when a name is added to the allow-list.

Usage: python plugins/sandbox/scripts/syscall_numbers.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile

X86_64 = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
# arm64 uses the generic table with these switches (arch/arm64/include/uapi/asm/unistd.h)
AARCH64 = """#define __BITS_PER_LONG 64
#define __ARCH_WANT_RENAMEAT
#define __ARCH_WANT_NEW_STAT
#define __ARCH_WANT_SET_GET_RLIMIT
#define __ARCH_WANT_TIME32_SYSCALLS
#define __ARCH_WANT_SYS_CLONE3
#define __ARCH_WANT_MEMFD_SECRET
#include <asm-generic/unistd.h>
"""


def _defines(text: str) -> dict[str, int]:
    raw = dict(re.findall(r"^#define (__NR\w+)\s+(\S+)\s*$", text, re.MULTILINE))
    out: dict[str, int] = {}
    for name in raw:
        value, seen = raw[name], set()
        while value in raw and value not in seen:  # __NR_fcntl -> __NR3264_fcntl -> 25
            seen.add(value)
            value = raw[value]
        if value.isdigit() and name.startswith("__NR_"):
            out[name[len("__NR_") :]] = int(value)
    return out


def tables() -> dict[str, dict[str, int]]:
    x86 = _defines(subprocess.run(["cpp", "-dM", X86_64], capture_output=True, text=True).stdout)
    with tempfile.NamedTemporaryFile("w", suffix=".h") as f:
        f.write(AARCH64)
        f.flush()
        a64 = subprocess.run(["cpp", "-dM", f.name], capture_output=True, text=True).stdout
    return {"x86_64": x86, "aarch64": _defines(a64)}


def main() -> None:
    from laminar_sandbox import seccomp

    names = sorted({*seccomp.ALLOWED, *seccomp.REFUSED, *seccomp.SPECIAL})
    for arch, table in tables().items():
        known = {n: table[n] for n in names if n in table}
        print(f"{arch} = {known!r}  # {len(known)} of {len(names)}")


if __name__ == "__main__":
    main()
