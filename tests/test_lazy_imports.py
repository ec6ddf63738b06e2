"""Start-up imports: each process imports what its part uses (issue 38).

Every Laminar process (the CLI and driver, each trainer rank, replica and relay) imports
``laminar_core``; what that costs is paid once per process, on every run's start-up.
"""

from __future__ import annotations

import subprocess
import sys

import laminar_core


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_the_public_names_load_on_first_use():
    """``import laminar_core`` alone imports no submodule (so not torch); each public name
    still resolves, through ``from laminar_core import X`` as through the attribute."""
    assert "torch" not in _modules_after("import laminar_core")
    assert "laminar_core.training" not in _modules_after("from laminar_core import load_config")
    for name in laminar_core.__all__:
        assert getattr(laminar_core, name) is not None, name
    assert set(laminar_core.__all__) <= set(dir(laminar_core))
    try:
        laminar_core.NoSuchName  # noqa: B018
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_a_run_without_agents_imports_no_gateway():
    """The driver and the actors' host modules leave the agent gateway (and fastapi, ~0.4
    CPU s per process) to a run with ``agent.*`` set."""
    held = _modules_after(
        "import laminar_core.cli, laminar_core.runtime.ray_run, laminar_core.runtime.hosts\n"
        "import laminar_core.runtime.relay_actor, laminar_core.runtime.train"
    )
    assert "laminar_core.runtime.hosts" in held
    assert not {"laminar_core.gateway", "fastapi"} & held


def test_a_thin_host_actor_imports_no_engine():
    """A host actor whose engine runs in a process forked from the zygote
    (``runtime.zygote``) imports ``runtime.hosts`` and the zygote's client: neither may
    pull in torch, transformers or vLLM (the seconds of CPU the zygote is there to save)."""
    held = _modules_after("import laminar_core.runtime.hosts, laminar_core.runtime.zygote")
    assert not {"torch", "transformers", "vllm"} & held
