"""The loop: controller, rollout manager, schedules."""

from laminar_core.loop.controller import Controller, StepRecord
from laminar_core.loop.manager import ManagerOptions, ReplicaSlot, RolloutManager
from laminar_core.loop.schedules import Schedule, ScheduleError

__all__ = [
    "Controller",
    "ManagerOptions",
    "ReplicaSlot",
    "RolloutManager",
    "Schedule",
    "ScheduleError",
    "StepRecord",
]
