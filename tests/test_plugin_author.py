"""A plugin author is never misled.

The example plugin of ``docs/plugins.md`` is extracted from the guide as written, installed as
a distribution (a ``dist-info`` on ``sys.path``, so its entry point is found like a pip
install's) and must pass the conformance kit with nothing skipped; the kit must fail the same
engine when it drops the request's metadata, ignores loaded weights or blocks the event loop,
each with a message naming the fix. The three traps that used to fail silently are clear
errors: a run where nothing trains stops; a hook name with a typo is a load failure that
``laminar plugins`` and the unknown-engine error show; a class that does not implement its
interface is one config line (exit 2) before anything starts.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from laminar_core import FinishReason, LiveTrajectory, SharedWeights, Trajectory, load_config
from laminar_core.cli import main
from laminar_core.models import build_tiny_model
from laminar_core.plugins import PluginManager, builtins, hookimpl, reset_default_manager
from laminar_core.runtime.local import build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.testing import ContractError, check_rollout_engine

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "plugins.md"
_FILE_BLOCK = re.compile(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", re.S)

# Test-only plugins, installed next to the guide's example (module source by name).
_TYPO = """
from laminar_core import hookimpl

@hookimpl
def laminar_rollout_engin():  # the typo
    return {"typo": "laminar_typo_plugin:Engine"}
"""
_EMPTY = "import laminar_core  # a plugin module that forgot its hooks\n"
_HALF = '''
from laminar_core import RolloutEngine, hookimpl


class HalfEngine(RolloutEngine):
    """Implements three of the seven methods."""

    async def start(self):
        pass

    async def generate(self, request):
        raise NotImplementedError

    async def stop(self):
        pass


@hookimpl
def laminar_rollout_engines():
    return {"half": "laminar_half_plugin:HalfEngine"}
'''
_FAILING = '''
from laminar_core import hookimpl
from laminar_core.sim.rollout import SimRolloutEngine


class FailingEngine(SimRolloutEngine):
    """Every generate raises: no trajectory of the run can train."""

    async def generate(self, request):
        raise ValueError("this engine cannot generate")


@hookimpl
def laminar_rollout_engines():
    return {"failing": FailingEngine}
'''


def guide_section(heading: str) -> str:
    """The guide's text from ``heading`` to the next ``## `` heading (each example's files
    are read from its own section: the guide has more than one ``pyproject.toml``)."""
    text = GUIDE.read_text()
    assert heading + "\n" in text, f"docs/plugins.md has no section {heading!r}"
    return text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]


def _dist(site: Path, name: str, entry_points: dict[str, str]) -> None:
    """What ``pip install`` leaves for ``importlib.metadata``: a dist-info directory."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[laminar]\n{lines}")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guide's files, written out as the reader would, plus the test plugins, on
    ``sys.path`` with their distributions' entry points."""
    site = tmp_path_factory.mktemp("site")
    files = dict(_FILE_BLOCK.findall(guide_section("## A complete example: laminar-hfgen")))
    assert {"pyproject.toml", "laminar_hfgen/engine.py", "tests/test_hfgen.py"} <= set(files)
    for rel, body in files.items():
        path = site / "laminar-hfgen" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# file: {rel}\n{body}")
    # the entry point exactly as the guide's pyproject.toml declares it
    ep = re.search(
        r"\[project.entry-points.laminar\]\n(\w+) = \"([\w.]+)\"", files["pyproject.toml"]
    )
    assert ep, "the guide's pyproject.toml declares no laminar entry point"
    _dist(site, "laminar-hfgen", {ep[1]: ep[2]})
    for module, source, dist, entry in [
        ("laminar_typo_plugin", _TYPO, "laminar-typo", "typo"),
        ("laminar_empty_plugin", _EMPTY, "laminar-empty", "empty"),
        ("laminar_half_plugin", _HALF, "laminar-half", "half"),
        ("laminar_failing_plugin", _FAILING, "laminar-failing", "failing"),
    ]:
        (site / f"{module}.py").write_text(source)
        _dist(site, dist, {entry: module})
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site / "laminar-hfgen"))
        mp.syspath_prepend(str(site / "laminar-hfgen" / "tests"))
        mp.syspath_prepend(str(site))
        reset_default_manager()
        yield site
    reset_default_manager()
    ours = ("laminar_hfgen", "test_hfgen", "laminar_typo_", "laminar_empty_", "laminar_half_")
    for name in [m for m in sys.modules if m.startswith((*ours, "laminar_failing_"))]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


@pytest.fixture(scope="module")
def hfgen(site: Path) -> type:
    from laminar_hfgen.engine import HFGenEngine

    return HFGenEngine


# -- the guide's example plugin, from the guide alone ---------------------------------------


def test_guide_example_is_found_through_its_entry_point(site: Path, hfgen: type) -> None:
    import test_hfgen  # the guide's own test file

    test_hfgen.test_registered_through_the_entry_point()
    table = PluginManager()
    table.load_entry_points()
    assert ("rollout", "hfgen", "laminar-hfgen") in [
        (i.kind, i.name, i.package) for i in table.infos()
    ]


def test_guide_example_passes_the_kit_with_nothing_skipped(site: Path, tiny: str) -> None:
    import test_hfgen

    test_hfgen.test_config_resolves(tiny)
    test_hfgen.test_contract(tiny)  # strict=True, expect_partial=True: nothing skipped


async def _kit(engine: type, tiny: str) -> None:
    await check_rollout_engine(engine, model_dir=tiny, max_tokens=12, expect_partial=True)


def test_kit_fails_an_engine_that_drops_metadata(hfgen: type, tiny: str) -> None:
    class DropsMetadata(hfgen):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            traj = await super().generate(request)
            traj.metadata = {}
            return traj

    with pytest.raises(AssertionError, match=r"Trajectory.metadata lacks the request's") as e:
        asyncio.run(_kit(DropsMetadata, tiny))
    assert "copy request.metadata into the Trajectory" in str(e.value)


@pytest.mark.parametrize("ignored", ["every load", "SharedWeights"])
def test_kit_fails_an_engine_that_ignores_loaded_weights(hfgen: type, tiny: str, ignored) -> None:
    class IgnoresWeights(hfgen):
        async def update_weights(self, weights):  # type: ignore[no-untyped-def]
            if ignored == "every load" or isinstance(weights, SharedWeights):
                self.version = weights.version  # the version moves, the weights do not
                return
            await super().update_weights(weights)

    kind = "TensorWeights" if ignored == "every load" else "SharedWeights"
    with pytest.raises(AssertionError, match=rf"after update_weights\({kind}\)") as e:
        asyncio.run(_kit(IgnoresWeights, tiny))
    assert "the engine ignored the loaded weights" in str(e.value)


def test_kit_fails_an_engine_that_blocks_the_event_loop(hfgen: type, tiny: str) -> None:
    class Blocking(hfgen):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            live = LiveTrajectory(request, request.traj_id, [], [], [self.version])
            finish = self._decode(live)  # on the event loop: nothing else runs meanwhile
            return Trajectory(
                request.traj_id,
                request.group_id,
                self.version,
                prompt_ids=list(request.prompt_ids),
                response_ids=live.tokens,
                logprobs=live.logprobs,
                num_prompt_tokens=len(request.prompt_ids),
                num_response_tokens=len(live.tokens),
                finish_reason=FinishReason.STOP if finish == "stop" else FinishReason.LENGTH,
                versions=[self.version],
                metadata=dict(request.metadata),
            )

    with pytest.raises(AssertionError, match="the engine blocks the event loop"):
        asyncio.run(_kit(Blocking, tiny))


def _decodes_in_a_background_task(hfgen: type) -> type:
    class BackgroundDecode(hfgen):
        """``generate`` awaits, while one background task decodes the queued trajectories
        on the event loop (the second outside author's engine)."""

        async def start(self):  # type: ignore[no-untyped-def]
            await super().start()
            self.queue: asyncio.Queue = asyncio.Queue()
            self.worker = asyncio.ensure_future(self.decode_queued())

        async def decode_queued(self):  # type: ignore[no-untyped-def]
            while True:
                live, done = await self.queue.get()
                live.started = True
                done.set_result(self._decode(live))  # on the loop: nothing else runs meanwhile

        async def generate(self, request):  # type: ignore[no-untyped-def]
            with self.inflight.track(request, self.version, started=False) as live:
                done = asyncio.get_running_loop().create_future()
                self.queue.put_nowait((live, done))
                live.finish = await done
            return self.inflight.trajectory(live)

        async def stop(self):  # type: ignore[no-untyped-def]
            self.worker.cancel()
            await super().stop()

    return BackgroundDecode


@pytest.mark.parametrize("max_block_s", [0.5, 60.0], ids=["held too long", "hid the abort"])
def test_kit_names_a_background_task_that_blocks_the_event_loop(
    hfgen: type, tiny: str, max_block_s: float
) -> None:
    """Without strict: it used to pass with abort and resume skipped ("the long trajectory
    finished first"), and with ``strict=True`` it was told to give long_tokens room. With a
    generous ``max_block_s`` the kit still tells a trajectory the engine hid from it (the loop
    held for most of its life) from one that was too short."""
    engine = _decodes_in_a_background_task(hfgen)
    with pytest.raises(ContractError, match="the engine blocks the event loop") as e:
        asyncio.run(
            check_rollout_engine(engine, model_dir=tiny, max_tokens=32, max_block_s=max_block_s)
        )
    msg = str(e.value)
    assert re.search(r"\(in .*test_plugin_author\.py:\d+ \(decode_queued\), at ", msg), msg
    assert "Give them room" not in msg
    if max_block_s > 1:
        assert "before the kit could see it in flight" in msg, msg


_BROKEN_UNDER_O = """
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.testing import ContractError, check_rollout_engine

assert False, "python -O keeps asserts"  # the interpreter really strips them


class DropsMetadata(SimRolloutEngine):
    async def generate(self, request):
        traj = await super().generate(request)
        traj.metadata = {}
        return traj


try:
    run_virtual(check_rollout_engine(DropsMetadata, options={"decode_step_s": 0.01}))
except ContractError as e:
    print("failed:", e)
else:
    print("passed")
"""


def test_the_kit_checks_under_python_O() -> None:
    """``python -O`` strips ``assert`` statements: a kit made of them passed a broken engine
    while checking nothing."""
    out = subprocess.run(
        [sys.executable, "-O", "-c", _BROKEN_UNDER_O],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert out.startswith("failed: t0: Trajectory.metadata lacks the request's"), out


def test_kit_reports_what_it_skipped() -> None:
    report = run_virtual(check_rollout_engine(SimRolloutEngine, options={"decode_step_s": 0.01}))
    assert "abort() returns what was produced; its generate returns ABORTED" in report.checked
    assert set(report.skipped) == {
        "log-probs",
        "stop strings end the response at the token that completes one",
        "weight content (TensorWeights, SharedWeights)",
        "score(): log_softmax(logits) of each given token after its prefix",
    }
    assert "SKIP  weight content (TensorWeights, SharedWeights): model-only engine" in str(report)
    with pytest.raises(AssertionError, match="strict: checks were skipped"):
        run_virtual(check_rollout_engine(SimRolloutEngine, strict=True))


def test_expect_partial_says_the_trajectory_finished_not_that_abort_failed() -> None:
    short = {"decode_step_s": 0.01, "lengths": {"median": 2, "p99_over_p50": 1.5}}
    report = run_virtual(check_rollout_engine(SimRolloutEngine, options=short))
    assert (
        "finished before the abort in each of 3 attempts"
        in report.skipped["abort / partials / resume"]
    )
    with pytest.raises(AssertionError) as e:
        run_virtual(check_rollout_engine(SimRolloutEngine, options=short, expect_partial=True))
    msg = str(e.value)
    assert "the trajectories had finished, abort did not fail" in msg
    assert re.search(r"\(stop after \d+ tokens; ", msg), msg


# -- trap 1: a run where nothing trains stops, naming the cause ------------------------------


class _DropsMetadata(SimRolloutEngine):
    async def generate(self, request):  # type: ignore[no-untyped-def]
        traj = await super().generate(request)
        traj.metadata = {}  # the trap: the reward cannot find the prompt's row
        return traj


def _row_reward(traj: Trajectory) -> float:
    """Reads the prompt's row, as every real reward does; half the rows lack what it needs."""
    if traj.metadata["prompt_index"] % 2:
        raise KeyError("answer")
    return 1.0


def _sim_run(small_overrides: list[str], engine: type, *extra: str, runs: list | None = None):  # type: ignore[no-untyped-def]
    """A simulated run (virtual clock) with ``engine`` as the rollout engine and
    ``_row_reward``; returns it once its steps are done."""

    class Plugin:
        @hookimpl
        def laminar_rollout_engines(self) -> dict[str, object]:
            return {"under_test": engine}

    pm = PluginManager()
    pm.register(builtins, name="core")
    pm.register(Plugin(), name="under-test")
    overrides = [o.replace("rollout.sim.", "rollout.under_test.") for o in small_overrides]
    resolved = load_config(None, [*overrides, "rollout.engine=under_test", *extra], pm=pm)
    runs = [] if runs is None else runs

    async def go() -> None:
        run = build_local_run(resolved, pm=pm, reward_fn=_row_reward)
        run.controller.keep_batches = True
        runs.append(run)
        await run.controller.run(resolved.cfg.run.steps)

    run_virtual(go())
    return runs[-1]


def test_a_run_whose_every_reward_fails_stops_naming_the_cause(small_overrides) -> None:
    runs: list = []
    with pytest.raises(RuntimeError) as e:
        _sim_run(small_overrides, _DropsMetadata, "run.steps=6", runs=runs)
    msg = str(e.value)
    assert msg.startswith("every trajectory of the last 3 steps failed (96 trajectories), so ")
    assert "the first error: reward: KeyError: 'prompt_index'" in msg
    assert "copies request.metadata into Trajectory.metadata" in msg
    assert "run.max_failed_steps=3" in msg
    assert runs[0].controller.step == 2  # stopped before training the third failed step


def test_failures_short_of_every_trajectory_or_the_limit_do_not_stop(small_overrides) -> None:
    run = _sim_run(small_overrides, SimRolloutEngine, "run.steps=4")  # half the rewards fail
    assert run.controller.step == 4
    reasons = [t.finish_reason for b in run.controller.batches for t in b.trajectories]
    assert FinishReason.FAILED in reasons and FinishReason.STOP in reasons
    run = _sim_run(small_overrides, _DropsMetadata, "run.steps=4", "run.max_failed_steps=0")
    assert run.controller.step == 4  # 0: never stop
    assert all(
        t.finish_reason is FinishReason.FAILED for t in run.controller.batches[-1].trajectories
    )


def test_laminar_train_exits_2_when_nothing_trains(site: Path, tiny: str, tmp_path, capsys) -> None:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            "rollout.engine=failing",
            "rollout.failing.decode_step_s=0.001",
            f"model.path={tiny}",  # a non-sim engine: the run checks the model exists
            f"run.out_dir={tmp_path}",
            "run.steps=5",
            "telemetry.progress=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "laminar: error: the run stopped: RuntimeError: every trajectory of the last 3 " in err
    assert "engine r0: ValueError: this engine cannot generate" in err or "engine r1" in err


# -- trap 2: a typo in a hook name is an error, shown where the user looks -------------------


def test_typo_in_a_hook_name_is_shown_by_laminar_plugins(site: Path, capsys) -> None:
    reset_default_manager()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    failed = out.split("failed to load:\n", 1)[1]
    assert (
        "laminar-typo (entry point 'typo'): unknown hook 'laminar_rollout_engin' "
        "(did you mean 'laminar_rollout_engines'?)"
    ) in failed
    nothing = out.split("registered nothing:\n", 1)[1]
    assert "laminar-empty (entry point 'empty'): no function marked @hookimpl" in nothing
    cfg = str(ROOT / "examples/train_sim_tiny.yaml")
    assert main(["config", "show", cfg, "rollout.engine=typo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar: error: rollout.engine: unknown rollout engine 'typo'")
    assert "plugin laminar-typo (entry point 'typo') failed to load: unknown hook" in err


# -- trap 3: a class that does not implement its interface: one line, exit 2 ----------------


def test_engine_missing_methods_fails_config_show_and_train(site: Path, tmp_path, capsys) -> None:
    reset_default_manager()
    line = (
        "laminar: error: rollout.engine: rollout engine 'half' (laminar_half_plugin:HalfEngine)"
        " does not implement RolloutEngine: missing abort, partials, stats, update_weights"
        " (see docs/plugins.md)\n"
    )
    cfg = str(ROOT / "examples/train_sim_tiny.yaml")
    assert main(["config", "show", cfg, "rollout.engine=half"]) == 2
    assert capsys.readouterr().err == line
    args = ["train", cfg, "rollout.engine=half"]
    assert main([*args, f"run.out_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == line
    assert list(tmp_path.iterdir()) == []  # nothing started, no run directory


# -- a Ray run leaves no empty shared-memory root behind -------------------------------------


def test_stop_removes_the_shared_memory_root_once_empty(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from laminar_core.runtime.ray_run import RayRuntime

    root = tmp_path / "laminar"

    def stop(run_dir: Path) -> None:
        rt = RayRuntime.__new__(RayRuntime)  # only what _release touches
        rt.actors, rt.pg, rt.shm_root, rt.replica_engines = [], None, str(run_dir), []
        rt.teacher_engines, rt.teacher_nodes, rt.zygote = [], [], None
        (run_dir / "relay0").mkdir(parents=True)
        (run_dir / "relay0" / "v3.bin").write_bytes(b"w")
        rt._release()

    (root / "other-run").mkdir(parents=True)  # another run still uses the root
    stop(root / "run-a")
    assert not (root / "run-a").exists() and root.is_dir()
    (root / "other-run").rmdir()
    stop(root / "run-b")
    assert not root.exists()
