"""Running agents per episode (``gateway.runners``) and the ``agent:`` config checks.

Real subprocesses and real coroutines: a command's reward read from its stdout line or its
reward file, a crash and a hang named as such, a hung program killed with everything it
started in its process group (nothing left behind); an entrypoint's reward, crash, hang and
a non-async function refused; one-line config errors naming the key and the fix.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from laminar_core import load_config
from laminar_core.config.loader import ConfigError
from laminar_core.gateway.runners import AgentFailed, CommandRunner, EntrypointRunner

ROW = {"prompt": "a*3=", "answer": "aaa"}


def _run(runner, timeout_s: float = 20.0):
    return asyncio.run(runner.run("http://127.0.0.1:9/v1", "lmn-key", ROW, timeout_s))


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_command_sees_the_session_and_reports_its_reward() -> None:
    code = (
        "import json, os; row = json.loads(os.environ['LAMINAR_ROW']); "
        "assert os.environ['OPENAI_BASE_URL'].endswith('/v1'); "
        "assert os.environ['OPENAI_API_KEY'] == 'lmn-key'; "
        "print('noise'); print('LAMINAR_REWARD=0.25'); print('LAMINAR_REWARD=' + "
        "str(len(row['answer'])))"
    )
    assert _run(CommandRunner(_py(code))) == 3.0  # the last such line
    via_file = "import os; open(os.environ['LAMINAR_REWARD_FILE'], 'w').write('0.5')"
    assert _run(CommandRunner(_py(via_file))) == 0.5
    assert _run(CommandRunner(_py("print('no reward here')"))) is None  # reward.fn scores


def test_a_command_that_fails_is_named_so() -> None:
    with pytest.raises(AgentFailed) as e:
        _run(CommandRunner(_py("import sys; sys.exit('boom')")))
    assert e.value.kind == "crashed" and "exited with 1: boom" in str(e.value)
    with pytest.raises(AgentFailed) as e:
        _run(CommandRunner(_py("print('LAMINAR_REWARD=lots')")))
    assert e.value.kind == "bad_reward"
    with pytest.raises(AgentFailed) as e:
        _run(CommandRunner(["/nonexistent/agent"]))
    assert e.value.kind == "crashed" and "could not start" in str(e.value)


def test_a_hung_command_is_killed_with_its_process_group(tmp_path) -> None:
    pids = tmp_path / "pids"
    # the program starts a child (in its group) and both hang
    code = (
        "import os, subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(300)"
    )
    t0 = time.monotonic()
    with pytest.raises(AgentFailed) as e:
        _run(CommandRunner(_py(code), grace_s=0.5), timeout_s=3.0)
    assert e.value.kind == "timeout"
    assert time.monotonic() - t0 < 30
    for pid in map(int, pids.read_text().split()):
        _gone(pid)


def _gone(pid: int) -> None:
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (its parent reaps it)
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} outlived its episode")


async def _good(base_url, api_key, row):
    return 0.75


async def _crash(base_url, api_key, row):
    raise RuntimeError("the agent's own bug")


async def _hang(base_url, api_key, row):
    await asyncio.sleep(300)


def _sync(base_url, api_key, row):
    return 1.0


def test_an_entrypoint_runs_in_the_loop_with_its_outcome_named() -> None:
    assert _run(EntrypointRunner(_good)) == 0.75
    with pytest.raises(AgentFailed) as e:
        _run(EntrypointRunner(_crash))
    assert e.value.kind == "crashed" and "the agent's own bug" in str(e.value)
    with pytest.raises(AgentFailed) as e:
        _run(EntrypointRunner(_hang), timeout_s=0.5)
    assert e.value.kind == "timeout"
    with pytest.raises(ValueError, match="not an async function"):
        EntrypointRunner.of("test_agent_runners:_sync")
    with pytest.raises(ValueError, match=r"cannot import 'nowhere\.at_all:run'"):
        EntrypointRunner.of("nowhere.at_all:run")
    assert EntrypointRunner.of("test_agent_runners:_good").fn is _good


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agent.entrypoint=a.b:run", "agent.command=[x]"], "both set"),
        (["agent.entrypoint=a.b"], "is not 'package.module:function'"),
        (["agent.entrypoint=a.b:run", "env.name=python_sandbox"], "drop env.name"),
        (["agent.command=[x]", "agent.max_sessions=4"], "raise agent.max_sessions"),
        (["agent.forks=all"], "agent.forks: unknown 'all'"),
        (["agent.timeout_s=0"], "agent.timeout_s must be > 0"),
        (["agent.command=[x]", "data.samples_per_prompt=2"], "needs a real rollout engine"),
        (["agent.max_attempts=0"], "agent.max_attempts must be >= 1"),
        (["agent.entrypoint=a.b:run", "agent.sandbox=true"], "agent.command programs only"),
    ],
)
def test_agent_config_errors_name_the_key(overrides, message) -> None:
    base = ["data.samples_per_prompt=8"]
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [*base, *overrides])
    assert "\n" not in str(e.value)


def _sandbox_or_skip():
    from laminar_core.gateway.runners import command_sandbox

    try:
        return command_sandbox({})
    except ValueError as e:
        if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))


def test_agent_sandbox_without_bubblewrap_is_a_one_line_config_error(monkeypatch) -> None:
    """``agent.sandbox`` where bwrap is missing: refused when the config is validated,
    naming the problem and the fix (the plugin's own check, reached through core)."""
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda n, *a, **k: None if n == "bwrap" else real_which(n))
    with pytest.raises(ConfigError, match="apt-get install bubblewrap") as e:
        load_config(None, SANDBOXED)
    assert "\n" not in str(e.value) and "agent.sandbox" in str(e.value)
    with pytest.raises(ConfigError, match="sandbox_options: unknown key"):
        load_config(None, [*SANDBOXED, "agent.sandbox_options={gpus: 1}"])
    monkeypatch.undo()
    assert load_config(None, SANDBOXED).cfg.agent.sandbox  # where bwrap is there: accepted


SANDBOXED = ["agent.command=[x]", "agent.sandbox=true", "rollout.engine=vllm"]


def test_a_hung_sandboxed_command_is_killed_with_all_it_started(tmp_path) -> None:
    """Past the wall clock the sandboxed program is killed with everything it started,
    a ``setsid`` daemon too (it escapes the process group, not the pid namespace)."""
    marker = f"laminar-hung-{os.getpid()}-{time.time_ns()}"
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen(['setsid', sys.executable, '-c', 'import time; time.sleep(600)', "
        f"'{marker}']); time.sleep(600)"
    )
    runner = CommandRunner(_py(code), sandbox=_sandbox_or_skip())
    with pytest.raises(AgentFailed) as e:
        _run(runner, timeout_s=3.0)
    assert e.value.kind == "timeout"

    def alive() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    assert alive() == []


def test_a_sandboxed_command_is_found_as_the_driver_finds_it(tmp_path) -> None:
    """``command: [python, ...]`` runs the driver's ``python`` inside the sandbox; a program
    the sandbox cannot see is a crash naming the fix."""
    box = _sandbox_or_skip()
    code = "import sys; print('LAMINAR_REWARD=' + str(sys.version_info.minor))"
    assert _run(CommandRunner(["python", "-c", code], sandbox=box)) == sys.version_info.minor
    hidden = tmp_path / "agent.sh"
    hidden.write_text("#!/bin/sh\necho LAMINAR_REWARD=1\n")
    hidden.chmod(0o755)
    with pytest.raises(AgentFailed, match=r"put it and its files under .*ro_paths") as e:
        _run(CommandRunner([str(hidden)], sandbox=box))
    assert e.value.kind == "crashed"
