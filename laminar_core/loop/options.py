"""The rollout manager's options (``rollout.*`` and ``repack.interval_s`` of the config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laminar_core.types import SamplingParams


@dataclass
class ManagerOptions:
    groups_per_step: int
    max_concurrent: int = 1024  # trajectories per replica (running + waiting)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    repack_interval_s: float = 5.0  # 0 disables the timer (after-step repack still runs)
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    partial_sync_s: float = 5.0  # 0: the pool learns partial outputs only on abort
    max_restarts: int = 3  # restarts of one replica within restart_window_s before eviction
    restart_window_s: float = 600.0
