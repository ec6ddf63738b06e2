"""The do-nothing repack policy (repacking disabled)."""

from __future__ import annotations

from laminar_core.interfaces.build import BuildContext
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.types import Move, ReplicaState


class NoRepack(RepackPolicy):
    """Never moves anything: ``plan`` always returns ``[]``, and the rollout manager, seeing
    ``active`` False, runs no repack loop (no snapshots of the replicas are taken)."""

    active = False

    @classmethod
    def from_config(cls, ctx: BuildContext) -> NoRepack:
        return cls()

    def plan(self, replicas: list[ReplicaState]) -> list[Move]:
        return []
