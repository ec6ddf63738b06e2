"""The do-nothing repack policy (repacking disabled)."""

from __future__ import annotations

from laminar_core.interfaces.build import BuildContext
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.types import Move, ReplicaState


class NoRepack(RepackPolicy):
    @classmethod
    def from_config(cls, ctx: BuildContext) -> NoRepack:
        return cls()

    """Never moves anything: ``plan`` always returns ``[]``."""

    def plan(self, replicas: list[ReplicaState]) -> list[Move]:
        return []
