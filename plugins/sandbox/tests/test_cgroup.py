"""The sandboxes' cgroups: where the pool makes them and what it writes (against a directory
standing in for cgroupfs), and, on this host's real cgroup v2 hierarchy, that a sandbox starts
inside its leaf and its own cgroup namespace and that the pool removes the leaves.

The stand-in is there because a host that can delegate the memory and pids controllers is
not always at hand (a hybrid host binds them to cgroup v1): the budget itself is checked
for real by ``tests/security/test_host_limits.py`` wherever the host delegates them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from laminar_sandbox import IsolationUnavailable, Limits, SandboxPool
from laminar_sandbox.cgroup import SandboxCgroups, hierarchy


def fake_hierarchy(root: Path, own: str, delegated: dict[str, str]) -> None:
    """Directories of a cgroup tree: ``delegated`` maps a cgroup (offered cpu, memory and
    pids by its parent) to what it hands out to its children (its subtree_control)."""
    for path, subtree in delegated.items():
        d = root / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text("cpu memory pids\n")
        (d / "cgroup.subtree_control").write_text(subtree + "\n")
    (root / own.lstrip("/")).mkdir(parents=True, exist_ok=True)


def test_the_leaves_and_their_limits(tmp_path: Path) -> None:
    """A pool in a systemd unit: its own cgroup delegates nothing, its parent (the slice)
    hands out memory and pids, so the leaves go beside the unit; each gets the budget."""
    fake_hierarchy(tmp_path, "/sys.slice/run.service", {"/sys.slice": "memory pids cpu"})
    cg = SandboxCgroups(
        "required", 512 << 20, 32, cpus=1.5, root=str(tmp_path), own="/sys.slice/run.service"
    )
    cg.setup(2)
    assert Path(cg.base).parent == tmp_path / "sys.slice"
    assert Path(cg.base).name.startswith(f"laminar-sandbox-{os.getpid()}-")
    leaf = Path(cg.leaf(1))
    assert (leaf / "memory.max").read_text() == str(512 << 20)
    assert (leaf / "pids.max").read_text() == "36"  # the code's 32 and the sandbox's own
    assert (leaf / "cpu.max").read_text() == "150000 100000"
    assert (Path(cg.base) / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert cg.wrap(1, ["bwrap", "x"]) == [
        "/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', f"{leaf}/cgroup.procs", "bwrap", "x"
    ]  # fmt: skip
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert cg.oom_kills(1) == 2 and cg.oom_kills(0) == 0


@pytest.mark.parametrize(
    ("delegated", "reason"),
    [
        ({"/a": "", "/a/b": ""}, "does not delegate the memory and pids controllers"),
        ({}, "offers no memory or pids controller"),
    ],
)
def test_no_cgroup_is_named_and_required_refuses(
    tmp_path: Path, delegated: dict, reason: str, caplog
) -> None:
    fake_hierarchy(tmp_path, "/a/b", delegated)
    auto = SandboxCgroups("auto", 1 << 30, 8, root=str(tmp_path), own="/a/b")
    auto.setup(1)
    assert not auto.base and reason in auto.reason
    assert auto.wrap(0, ["bwrap"]) == ["bwrap"] and auto.oom_kills(0) == 0
    assert "no cgroup for the sandboxes" in caplog.text and "Delegate=yes" in caplog.text
    with pytest.raises(IsolationUnavailable, match=rf"cgroup=required.*{reason}.*Fix: run"):
        SandboxCgroups("required", 1 << 30, 8, root=str(tmp_path), own="/a/b").setup(1)
    off = SandboxCgroups("off", 1 << 30, 8, root=str(tmp_path), own="/a/b")
    off.setup(1)
    assert not off.base and not off.reason
    with pytest.raises(ValueError, match="cgroup must be one of auto, required, off"):
        SandboxCgroups("on", 1, 1)


class BareCgroups(SandboxCgroups):
    """Leaves without controllers: what any cgroup v2 hierarchy allows (the mechanics only)."""

    controllers = ()


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_a_sandbox_runs_in_its_leaf_and_the_leaf_goes_with_the_pool(isolation: str) -> None:
    tool = "bwrap" if isolation == "bwrap" else "unshare"
    found = hierarchy()
    if os.geteuid() != 0 or shutil.which(tool) is None or found is None:
        pytest.skip("needs root, a cgroup v2 hierarchy and " + tool)
    mount, own = found
    if not os.access(os.path.join(mount, own.lstrip("/")), os.W_OK):
        pytest.skip(f"the cgroup v2 hierarchy at {mount} is not writable here")

    async def main() -> tuple[str, list[str], str]:
        pool = SandboxPool(Limits(memory_mb=512), isolation, workers=1)
        pool.cgroups = BareCgroups("required", 512 << 20, 64)
        await pool.start()
        try:
            leaf = pool.cgroups.leaf(0)
            run = asyncio.ensure_future(
                pool.run("import time\nprint(open('/proc/self/cgroup').read())\ntime.sleep(1)", 30)
            )
            await asyncio.sleep(0.5)
            members = Path(f"{leaf}/cgroup.procs").read_text().split()
            result = await run
            return leaf, members, result.stdout
        finally:
            await pool.close()

    leaf, members, seen = asyncio.run(main())
    assert len(members) >= 2  # the sandbox's processes: bwrap or unshare, the runner, the code
    assert "0::/\n" in seen  # its own cgroup namespace, rooted at the leaf
    assert not os.path.exists(leaf) and not os.path.exists(os.path.dirname(leaf))
