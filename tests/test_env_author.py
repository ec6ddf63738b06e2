"""An environment author is never misled either.

The example environment of ``docs/plugins.md`` (``laminar-calc``) is extracted from the guide
as written, installed outside the repository (a ``dist-info`` on ``sys.path``, so its entry
point is found like a pip install's), chosen by name through the config's ``env.name`` and
the plugin manager, and must pass ``check_environment``, its own tests included. The kit must
fail the same environment when it blocks the event loop or ignores ``max_turns``, each with a
message naming the fix.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from laminar_core import EnvContext, Environment, Episode, StepResult, load_config, make_environment
from laminar_core.plugins import PluginManager, reset_default_manager
from laminar_core.testing import check_environment

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "plugins.md"
SECTION = "## A complete example: laminar-calc"
_FILE_BLOCK = re.compile(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", re.S)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
KIT = {
    "row": {"prompt": "What is 12 * (3 + 4)?", "answer": "84"},
    "parser": "tool_call",
    "tool_turn": "Let me compute. " + CALL % "12 * (3 + 4)",
    "answer_turn": "The answer is 84.",
    "bad_turn": "<tool_call>{not json}</tool_call>",
}


def guide_files() -> dict[str, str]:
    """The ``# file:`` blocks of the example's section (the hfgen example has its own)."""
    text = GUIDE.read_text()
    assert SECTION + "\n" in text, f"docs/plugins.md has no section {SECTION!r}"
    section = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    return dict(_FILE_BLOCK.findall(section))


@pytest.fixture(scope="module")
def calc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guide's files, written out as a reader would, on ``sys.path`` with the
    distribution's entry point, exactly as the guide's pyproject.toml declares it."""
    assert importlib.util.find_spec("laminar_calc") is None, "laminar_calc is importable already"
    site = tmp_path_factory.mktemp("envsite")
    root = site / "laminar-calc"
    files = guide_files()
    expected = {"pyproject.toml", "laminar_calc/plugin.py", "laminar_calc/env.py"}
    assert expected | {"tests/test_calc.py"} <= set(files), sorted(files)
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# file: {rel}\n{body}")
    ep = re.search(
        r"\[project.entry-points.laminar\]\n(\w+) = \"([\w.]+)\"", files["pyproject.toml"]
    )
    assert ep, "the guide's pyproject.toml declares no laminar entry point"
    name = re.search(r'^name = "([\w-]+)"', files["pyproject.toml"], re.M)
    assert name and name[1] == "laminar-calc"
    info = site / "laminar_calc-0.1.0.dist-info"  # what pip install leaves
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: laminar-calc\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[laminar]\n{ep[1]} = {ep[2]}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        mp.syspath_prepend(str(root / "tests"))
        mp.syspath_prepend(str(site))
        reset_default_manager()  # the next lookup scans the entry points again
        yield root
    reset_default_manager()
    for mod in [m for m in sys.modules if m.startswith(("laminar_calc", "test_calc"))]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def env_cls(calc: Path) -> type:
    from laminar_calc.env import CalculatorEnv

    assert Path(sys.modules["laminar_calc"].__file__).is_relative_to(calc)  # outside the repo
    return CalculatorEnv


def test_guide_env_is_found_through_its_entry_point(env_cls: type) -> None:
    pm = PluginManager()
    pm.load_entry_points()
    rows = [(i.kind, i.name, i.package) for i in pm.infos()]
    assert ("env", "calculator", "laminar-calc") in rows
    assert pm.get("env", "calculator") is env_cls
    assert not [f for f in pm.failures if "calc" in f.source], pm.failures


def test_guide_env_chosen_by_name_passes_the_kit(env_cls: type) -> None:
    built: list[Any] = []

    def make(ctx: EnvContext) -> Environment:
        cfg = load_config(None, ["env.name=calculator", "env.parser=tool_call"]).cfg.env
        cfg.max_turns, cfg.timeout_s = ctx.max_turns, ctx.timeout_s
        env = make_environment(cfg)  # through the default plugin manager, as a run builds it
        built.append(env)
        return env

    t0 = time.monotonic()
    asyncio.run(
        check_environment(
            make, **KIT, concurrency=8, leftovers=lambda: [e for b in built for e in b.episodes]
        )
    )
    assert type(built[0]) is env_cls and built[0].ctx.options == env_cls.Options()
    assert time.monotonic() - t0 < 10


def test_guide_env_passes_its_own_tests(calc: Path) -> None:
    import test_calc  # the guide's own test file

    test_calc.test_contract()
    test_calc.test_observations()
    test_calc.test_options_are_checked()


def _blocking(env_cls: type) -> type:
    class AsksABlockingService(env_cls):  # type: ignore[misc,valid-type]
        def call(self, call):  # type: ignore[no-untyped-def]
            time.sleep(0.8)  # a blocking HTTP client, say: on the event loop
            return super().call(call)

    return AsksABlockingService


def _ignores_max_turns(env_cls: type) -> type:
    class IgnoresMaxTurns(env_cls):  # type: ignore[misc,valid-type]
        async def reset(self, row: dict[str, Any]) -> Episode:
            episode = await super().reset(row)
            step = episode.step

            async def forgetful(text: str) -> StepResult:
                episode.turns = 0  # never runs out of tool turns
                return await step(text)

            episode.step = forgetful  # type: ignore[method-assign]
            return episode

    return IgnoresMaxTurns


@pytest.mark.parametrize(
    ("broken", "message", "fix"),
    [
        (
            _blocking,
            r"step\(tool_turn\) held the event loop for [\d.]+ s without yielding \(at .*"
            r"test_env_author\.py:\d+ \(call\)\): the environment blocks the event loop",
            "await slow work off the loop (asyncio.to_thread",
        ),
        (
            _ignores_max_turns,
            r"the tool call after max_turns=2 did not end the episode",
            "return done=True, info finish='max_turns'",
        ),
    ],
    ids=["blocks the event loop", "ignores max_turns"],
)
def test_kit_fails_a_broken_guide_env(env_cls: type, broken: Any, message: str, fix: str) -> None:
    cls = broken(env_cls)
    with pytest.raises(AssertionError, match=message) as e:
        asyncio.run(check_environment(cls, **KIT))
    assert fix in str(e.value)
