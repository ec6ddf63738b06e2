"""Weights & Biases sink: each metrics row's numbers logged at its trainer step.

Configured by ``telemetry.wandb`` (off while ``project`` is empty). The keys are the
``metrics.jsonl`` keys, nested dicts flattened to ``a/b`` exactly as the TensorBoard sink
does (``replica_versions/r0``), so a dashboard built on one reads the other; the run's
resolved config becomes the W&B run config.

``wandb`` is imported only when a sink is built: the package is optional, and asking for
W&B without it installed is an error that names the install command (a run the user asked
to log must not silently log nothing). ``mode: offline`` needs neither network nor account:
the run is written under ``RUN_DIR/wandb/`` and can be uploaded later with ``wandb sync``.

Hook it to a :class:`~laminar_core.telemetry.metrics.MetricsWriter` with
``metrics.add_sink(WandbSink(cfg.telemetry.wandb, run_dir, config=resolved.to_dict()))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from laminar_core.telemetry.tensorboard import scalars

if TYPE_CHECKING:  # telemetry does not import the config package at run time
    from laminar_core.config.schema import WandbConfig

WANDB_MODES = ("online", "offline", "disabled")
INSTALL_HINT = "pip install wandb"


def wandb_enabled(cfg: WandbConfig) -> bool:
    """W&B logging is on when a project is named and the mode is not ``disabled``."""
    return bool(cfg.project) and cfg.mode != "disabled"


class WandbSink:
    """A metrics sink (``sink(row)``) logging to one W&B run; ``close()`` finishes the run.

    The W&B step is ``row[step_key]`` (the trainer step; rows without it use a running
    count). Raises ``ValueError`` for an unknown ``mode``, ``ImportError`` (naming the
    install command) when ``wandb`` is missing, and ``RuntimeError`` when W&B cannot start
    (e.g. online without ``wandb login``).
    """

    def __init__(
        self,
        cfg: WandbConfig,
        run_dir: str | Path,
        config: dict[str, Any] | None = None,
        step_key: str = "step",
    ) -> None:
        if cfg.mode not in WANDB_MODES:
            raise ValueError(
                f"telemetry.wandb.mode: '{cfg.mode}' is not one of {', '.join(WANDB_MODES)}"
            )
        try:
            import wandb
        except ImportError:
            raise ImportError(
                f"telemetry.wandb.project is set but the wandb package is not installed: "
                f"{INSTALL_HINT} (or leave telemetry.wandb.project empty)"
            ) from None
        self.step_key = step_key
        self._count = 0
        run_dir = Path(run_dir)
        try:
            self._run: Any = wandb.init(
                project=cfg.project,
                entity=cfg.entity or None,
                name=cfg.name or run_dir.name,
                tags=list(cfg.tags) or None,
                mode=cast("Literal['online', 'offline', 'disabled']", cfg.mode),  # checked at load
                dir=str(run_dir),  # W&B's files go to RUN_DIR/wandb/
                config=config,
            )
        except Exception as e:  # wandb's own errors (login, network) have no common base
            hint = "run `wandb login`, or set telemetry.wandb.mode=offline"
            raise RuntimeError(
                f"W&B could not start (telemetry.wandb.mode={cfg.mode}): "
                f"{type(e).__name__}: {e}; {hint}"
            ) from e

    @property
    def run(self) -> Any:
        """The ``wandb`` run (``None`` once closed)."""
        return self._run

    def __call__(self, row: dict[str, Any]) -> None:
        if self._run is None:
            return
        step = row.get(self.step_key)
        step = int(step) if isinstance(step, (int, float)) else self._count
        self._count += 1
        data = {tag: value for tag, value in scalars(row) if tag != self.step_key}
        self._run.log(data, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
