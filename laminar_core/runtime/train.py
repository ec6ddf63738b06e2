"""``laminar train``: one run of the configured engines on the real clock, with a run dir.

Run directory layout::

    RUN_DIR/config.yaml        the resolved config
    RUN_DIR/metrics.jsonl      one object per trainer step (stable keys, see README)
    RUN_DIR/events.jsonl       every recorded event (trajectories, pulls, moves, steps)
    RUN_DIR/trace.json         Chrome trace / Perfetto timeline of the same events
    RUN_DIR/tensorboard/       TensorBoard event files (telemetry.tensorboard)
    RUN_DIR/wandb/             Weights & Biases files (telemetry.wandb, when a project is set)
    RUN_DIR/report/            plots and index.html, written by ``laminar report RUN_DIR``
    RUN_DIR/checkpoints/       step_N/{trainer/, loop_state.json} and ``latest``

``runtime.kind=local`` builds every engine in this process (simulated engines, tests);
``runtime.kind=ray`` places trainer ranks and replicas as Ray actors.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from laminar_core.config.loader import ResolvedConfig
from laminar_core.loop.stopping import install_stop_handlers
from laminar_core.models import model_dir
from laminar_core.runtime.local import LocalRuntime
from laminar_core.runtime.run import Run, Runtime
from laminar_core.runtime.startup_gc import startup_gc
from laminar_core.runtime.wiring import RunSpec, attach_evaluation
from laminar_core.telemetry import TENSORBOARD_DIR, TensorBoardSink
from laminar_core.telemetry.wandb import WandbSink, wandb_enabled


class TrainError(RuntimeError):
    """The run could not start or stopped on an error; the message names the cause."""


def make_run_dir(resolved: ResolvedConfig) -> Path:
    cfg = resolved.cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(resolved.to_yaml())
    return run_dir


def check_model_path(resolved: ResolvedConfig) -> None:
    """Engines other than ``sim`` load ``model.path``: fail before any actor starts."""
    cfg = resolved.cfg
    if cfg.rollout.engine == "sim" and cfg.trainer.engine == "sim":
        return
    try:
        model_dir(cfg.model.path, "laminar train")
    except FileNotFoundError as e:
        raise TrainError(str(e)) from None


def make_runtime(resolved: ResolvedConfig, run_dir: Path | None = None) -> Runtime:
    """The runtime of ``runtime.kind`` for one run of ``resolved``."""
    if resolved.cfg.runtime.kind == "ray":
        from laminar_core.runtime.ray_run import RayRuntime

        return RayRuntime(RunSpec.of(resolved, run_dir=run_dir, allow_colocate=False))
    return LocalRuntime(RunSpec.of(resolved, run_dir=run_dir))


async def start_run(resolved: ResolvedConfig, run_dir: Path | None) -> Run:
    """Start the run for ``runtime.kind`` (trainer set up, engines not started yet)."""
    cfg = resolved.cfg
    run = await make_runtime(resolved, run_dir).start()
    try:
        if run_dir is not None:
            metrics = run.controller.metrics
            if cfg.telemetry.progress:
                metrics.on_row = _print_progress
            if cfg.telemetry.tensorboard:
                metrics.add_sink(TensorBoardSink(run_dir / TENSORBOARD_DIR))
            if wandb_enabled(cfg.telemetry.wandb):
                config = resolved.to_dict()
                metrics.add_sink(WandbSink(cfg.telemetry.wandb, run_dir, config=config))
        attach_evaluation(run)  # run.eval_every: held-out eval rounds
        if cfg.run.resume:
            where = await run.controller.restore(cfg.run.resume)
            print(f"resumed from {where} at step {run.controller.step}", flush=True)
    except BaseException:
        await run.close()
        raise
    return run


async def close_run(run: Run) -> None:
    await run.close()


def train(resolved: ResolvedConfig, *, own_process: bool = False) -> Path:
    """Run ``run.steps`` trainer steps; returns the run directory.

    ``own_process``: this process exists for this run (``laminar train``), so its start-up
    runs with the cyclic GC held and freezes the heap it built (``runtime.startup_gc``);
    not done by default, since freezing a caller's heap would keep its garbage for good.
    Raises ``TrainError`` with the cause when the run cannot start or breaks.
    """
    check_model_path(resolved)
    run_dir = make_run_dir(resolved)
    print(f"run directory: {run_dir}", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cli = _process_age()  # the CLI's own imports and config checks, so far
        began = loop.time() - cli  # when the command started
        # until the run's own handlers are in place, SIGTERM cancels the start-up cleanly
        # (what was started is released) instead of killing the process under it
        me = asyncio.current_task()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            if me is not None:
                loop.add_signal_handler(signal.SIGTERM, me.cancel)
        try:
            with startup_gc() if own_process else contextlib.nullcontext():
                run = await start_run(resolved, run_dir)
        except (FileNotFoundError, ImportError, RuntimeError, ValueError) as e:
            raise TrainError(f"the run could not start: {type(e).__name__}: {e}") from e
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGTERM)
        report = run.data_report
        if report is not None and report.skipped:
            print(f"data: {report.summary()}", file=sys.stderr, flush=True)
        parts = getattr(run.runtime, "startup", {})
        if parts:
            parts = {"cli": cli, **parts}
            took = ", ".join(f"{k} {v:.1f}s" for k, v in parts.items())
            print(f"start-up: {took} ({loop.time() - began:.1f}s in all)", flush=True)
        restore = install_stop_handlers(run.controller)
        try:
            records = await run.controller.run(resolved.cfg.run.steps)
            if run.controller.stop_requested:
                print(f"stopped at step {run.controller.step} (as asked)", flush=True)
            first = run.manager.first_trajectory_at
            print(
                _summary(records)
                + (f"; first trajectory {first - began:.1f}s after start" if first else ""),
                flush=True,
            )
        except (RuntimeError, ValueError) as e:
            raise TrainError(f"the run stopped: {type(e).__name__}: {e}") from e
        finally:
            restore()
            run.events.write_jsonl(run_dir / "events.jsonl")
            run.events.write_chrome_trace(run_dir / "trace.json")
            await close_run(run)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # SIGTERM during start-up: stopped, cleaned up
    return run_dir


def _process_age() -> float:
    """Seconds since this process started (imports included: what a user waits)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # no psutil: count from here
        return 0.0


def _summary(records: list) -> str:
    """One line: how the reward moved over the run: the held-out eval reward (first vs
    last round) when the run evaluated, else the training batches' (first vs last steps)."""
    evals = [(r.step, r.eval_reward) for r in records if r.eval_reward is not None]
    if evals:
        (s0, e0), (s1, e1) = evals[0], evals[-1]
        return (
            f"{len(records)} steps; eval_reward {e0:.3f} (after step {s0}) -> {e1:.3f} "
            f"(after step {s1}, held-out prompts)"
        )
    rewards = [r.reward_mean for r in records if r.reward_mean is not None]
    if not rewards:
        return f"{len(records)} steps"
    k = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return f"{len(records)} steps; reward_mean {first:.3f} (first {k}) -> {last:.3f} (last {k})"


def _print_progress(row: dict) -> None:
    reward = row.get("reward_mean")
    versions = ",".join(f"{k}:{v}" for k, v in sorted(row.get("replica_versions", {}).items()))
    print(
        f"step {row['step']:>4}  version {row['weight_version']:>4}  "
        f"reward {'-' if reward is None else f'{reward:.3f}'}  "
        f"{row['samples_per_second']:.1f} samples/s  {row['tokens_per_second']:.0f} tok/s  "
        f"staleness max {row['staleness_max']}  replicas [{versions}]  "
        f"{row['wall_seconds']:.0f}s"
        + (
            f"  eval_reward {row['eval_reward']:.3f} ({row['eval_seconds']:.1f}s)"
            if row.get("eval_reward") is not None
            else ""
        ),
        flush=True,
    )
