"""The repack policy interface."""

from __future__ import annotations

import abc

from laminar_core.types import Move, ReplicaState


class RepackPolicy(abc.ABC):
    """A pure function of a snapshot: which unfinished trajectories move where.

    ``plan`` does no I/O and keeps no state between calls (``prev_kv_use`` travels in the
    snapshot). Every move stays inside one weight version and names each trajectory at most
    once; the rollout manager executes the plan with ``abort`` on the source and resumed
    ``generate`` calls on the destination.

    ``active = False`` declares a policy that never moves anything: the manager then takes
    no snapshots for it (a snapshot asks every replica for its stats).
    """

    active: bool = True

    @abc.abstractmethod
    def plan(self, replicas: list[ReplicaState]) -> list[Move]: ...
