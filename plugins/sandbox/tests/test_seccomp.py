"""The syscall allow-list lets the code a model writes run (``syscall_corpus.py``, under both
isolation mechanisms, with ReTool's ``preload`` stack) and agrees with the kernel headers."""

from __future__ import annotations

import ast
import asyncio
import os
import platform
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from syscall_corpus import PROGRAMS

from laminar_sandbox import Limits, SandboxPool, seccomp


@pytest.fixture(scope="module", params=["bwrap", "namespaces"])
def pool(request: pytest.FixtureRequest) -> Iterator[tuple[SandboxPool, asyncio.AbstractEventLoop]]:
    tool = "bwrap" if request.param == "bwrap" else "unshare"
    if os.geteuid() != 0 or shutil.which(tool) is None:
        if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
            pytest.fail(f"the local sandbox needs root and {tool}")
        pytest.skip(f"the local sandbox needs root and {tool}")
    loop = asyncio.new_event_loop()
    # ReTool's example's limits: multiprocessing and numpy want room
    limits = Limits(memory_mb=2048, processes=64, disk_mb=128)
    p = SandboxPool(limits, request.param, workers=2, preload=["numpy", "sympy"])
    loop.run_until_complete(p.start())
    yield p, loop
    loop.run_until_complete(p.close())
    loop.close()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_model_written_python_runs_under_the_allow_list(pool, name: str) -> None:
    p, loop = pool
    r = loop.run_until_complete(p.run(PROGRAMS[name], 120.0))
    out = r.stdout + r.stderr
    assert r.status == "ok" and r.stdout.rstrip().endswith("OK"), f"{r.status}: {out[-2000:]}"
    for refusal in ("Function not implemented", "Operation not permitted"):
        assert refusal not in out, out[-2000:]


def test_the_numbers_are_the_kernels() -> None:
    """The tables against this host's kernel headers (x86_64, and arm64's generic table)."""
    header = Path("/usr/include/asm-generic/unistd.h")
    if shutil.which("cpp") is None or not header.exists():
        pytest.skip("needs cpp and the kernel headers (linux-libc-dev)")
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    out = subprocess.run(
        [sys.executable, str(scripts / "syscall_numbers.py")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    tables = dict(line.split(" = ", 1) for line in out.stdout.splitlines())
    for column, arch in enumerate(seccomp.ARCHES):
        expected = ast.literal_eval(tables[arch].split("  #")[0])
        ours = {n: nrs[column] for n, nrs in seccomp.NUMBERS.items() if nrs[column] is not None}
        assert ours == expected, arch


def test_the_filter_is_well_formed_on_each_architecture() -> None:
    for arch in seccomp.ARCHES:
        prog = seccomp.program(arch)
        assert prog is not None and len(prog) % 8 == 0 and len(prog) // 8 < 4096
        insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
        assert insns[-1][0] == 0x06  # ends with a return
        assert set(seccomp.ALLOWED) & set(seccomp.REFUSED) == set()
    assert seccomp.program("s390x") is None  # no table: no filter (the README says so)
    assert platform.machine() not in ("x86_64", "aarch64") or seccomp.program(platform.machine())
