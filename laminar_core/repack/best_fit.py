"""Best-fit consolidation of long-tail trajectories (Laminar, arXiv 2510.12633, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laminar_core.interfaces.build import BuildContext
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.types import Move, ReplicaState


@dataclass(slots=True)
class _Slot:
    """Working copy of one candidate replica while a pass is planned."""

    replica_id: str
    kv_use: float
    running: int
    traj_ids: list[str] = field(default_factory=list)  # what it holds now, in arrival order
    emptied: bool = False


class BestFitPolicy(RepackPolicy):
    """Consolidate ramp-down replicas onto the fewest, fullest replicas of the same version.

    Contract (see ``RepackPolicy``): ``plan`` is a pure function of the snapshot. It never
    mutates its input, is deterministic, keeps every move inside one weight version, names
    each trajectory at most once, never emits a move with ``source == destination`` or with
    no trajectory ids, and no replica is both a source and a final destination. After the
    plan is executed every destination holds ``kv_use <= kv_limit`` and
    ``running <= batch_limit`` (projected by adding the sources' ``kv_use`` / ``running``).

    Algorithm (best-fit consolidation), per weight version:

    1. Candidates are alive replicas in ramp-down:
       ``kv_use < min(kv_limit, prev_kv_use)`` and ``0 < running < batch_limit``.
       Nothing else is ever a source or a destination.
    2. Sort candidates by ``kv_use`` ascending, ties by ``replica_id``.
    3. For each candidate in that order that is not yet emptied, the destinations are the
       other non-emptied candidates where ``dest.kv_use + src.kv_use <= kv_limit`` and
       ``dest.running + src.running <= batch_limit`` (current, possibly updated, values).
       Pick the one that ends up fullest: largest projected ``kv_use``, then largest
       projected ``running``, then smallest ``replica_id``. Move everything the source
       holds there, add its load to the destination and mark the source emptied. If no
       destination fits, the source stays.
    4. A replica that received trajectories can later be emptied itself; the plan is then
       composed so each trajectory goes straight from its original replica to its final
       one (``A->B, B->C`` becomes ``A->C, B->C``).

    Moves are returned in the order their source replicas were processed (versions in
    ascending order).

    Args:
        kv_limit: ``C_max``, the KV-cache share (0, 1] a destination may reach.
        batch_limit: ``B``, the roofline decode batch: the most requests a destination may
            hold (below it a decode step costs about the same as at it).
    """

    @classmethod
    def from_config(cls, ctx: BuildContext) -> BestFitPolicy:
        """``C_max`` and ``B`` from ``repack.kv_limit`` and ``repack.batch_limit``."""
        return cls(ctx.config.repack.kv_limit, ctx.config.repack.batch_limit)

    def __init__(self, kv_limit: float = 0.8, batch_limit: int = 64) -> None:
        if (
            isinstance(kv_limit, bool)
            or not isinstance(kv_limit, (int, float))
            or not (0.0 < kv_limit <= 1.0)
        ):
            raise ValueError(f"kv_limit must be a number in (0, 1], got {kv_limit!r}")
        if isinstance(batch_limit, bool) or not isinstance(batch_limit, int) or batch_limit < 1:
            raise ValueError(f"batch_limit must be an integer >= 1, got {batch_limit!r}")
        self.kv_limit = float(kv_limit)
        self.batch_limit = batch_limit

    def __repr__(self) -> str:
        return f"BestFitPolicy(kv_limit={self.kv_limit}, batch_limit={self.batch_limit})"

    def _is_candidate(self, r: ReplicaState) -> bool:
        return (
            r.alive
            and 0 < r.running < self.batch_limit
            # kv_use < min(C_max, prev_kv_use), written so a NaN anywhere means "no"
            and r.kv_use < self.kv_limit
            and r.kv_use < r.prev_kv_use
        )

    def plan(self, replicas: list[ReplicaState]) -> list[Move]:
        seen: set[str] = set()
        for r in replicas:
            if r.replica_id in seen:
                raise ValueError(f"duplicate replica_id {r.replica_id!r} in snapshot")
            seen.add(r.replica_id)

        groups: dict[int, list[ReplicaState]] = {}
        for r in replicas:
            if self._is_candidate(r):
                groups.setdefault(r.version, []).append(r)

        moves: list[Move] = []
        for version in sorted(groups):
            moves.extend(self._plan_group(groups[version]))
        return moves

    def _plan_group(self, candidates: list[ReplicaState]) -> list[Move]:
        order = sorted(candidates, key=lambda r: (r.kv_use, r.replica_id))
        slots = {
            r.replica_id: _Slot(r.replica_id, r.kv_use, r.running, list(r.traj_ids)) for r in order
        }
        original = {r.replica_id: r.traj_ids for r in order}
        origin: dict[str, str] = {}  # traj id -> replica it was on in the snapshot
        for r in order:
            for t in r.traj_ids:
                origin.setdefault(t, r.replica_id)

        processed: list[str] = []  # emptied replicas, in processing order
        for r in order:
            src = slots[r.replica_id]
            if src.emptied:
                continue
            best: _Slot | None = None
            best_key: tuple[float, int] | None = None
            for dest in slots.values():  # iteration order is the sorted order
                if dest is src or dest.emptied:
                    continue
                kv = dest.kv_use + src.kv_use
                running = dest.running + src.running
                if kv > self.kv_limit or running > self.batch_limit:
                    continue
                key = (kv, running)
                if (
                    best is None
                    or best_key is None
                    or key > best_key
                    or (key == best_key and dest.replica_id < best.replica_id)
                ):
                    best, best_key = dest, key
            if best is None:
                continue
            best.kv_use += src.kv_use
            best.running += src.running
            best.traj_ids.extend(src.traj_ids)
            src.kv_use, src.running, src.traj_ids = 0.0, 0, []
            src.emptied = True
            processed.append(src.replica_id)

        # Compose chains: each trajectory goes from its original replica to where it ended.
        final: dict[str, str] = {}
        for slot in slots.values():
            for t in slot.traj_ids:
                final[t] = slot.replica_id
        moves: list[Move] = []
        emitted: set[str] = set()
        for source in processed:
            by_dest: dict[str, list[str]] = {}
            for t in original[source]:
                if t in emitted or origin.get(t) != source:
                    continue
                target = final.get(t)
                if target is None or target == source:
                    continue
                emitted.add(t)
                by_dest.setdefault(target, []).append(t)
            for target, ids in by_dest.items():
                moves.append(Move(source=source, destination=target, traj_ids=tuple(ids)))
        return moves
