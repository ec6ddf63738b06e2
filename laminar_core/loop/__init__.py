"""The loop: controller, rollout manager, schedules, the replica lifecycle."""

from laminar_core.loop.controller import Controller, StepRecord
from laminar_core.loop.manager import ManagerOptions, ReplicaSlot, RolloutManager
from laminar_core.loop.schedules import Schedule, ScheduleError
from laminar_core.loop.supervisor import ReplicaPhase, ReplicaSupervisor

__all__ = [
    "Controller",
    "ManagerOptions",
    "ReplicaPhase",
    "ReplicaSlot",
    "ReplicaSupervisor",
    "RolloutManager",
    "Schedule",
    "ScheduleError",
    "StepRecord",
]
