"""Tests for the repack policies (best-fit consolidation, Laminar Algorithm 1)."""

from __future__ import annotations

import copy
import math
import random

import pytest

from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.repack import BestFitPolicy, NoRepack
from laminar_core.types import Move, ReplicaState

# Dyadic kv values (k / 2**n) below keep every sum exact in binary floating point.


def rs(
    rid: str,
    kv: float,
    running: int = 1,
    *,
    prev: float = 1.0,
    version: int = 0,
    alive: bool = True,
    ids: list[str] | None = None,
) -> ReplicaState:
    if ids is None:
        ids = [f"{rid}{i}" for i in range(running)]
    return ReplicaState(
        replica_id=rid,
        version=version,
        kv_use=kv,
        prev_kv_use=prev,
        running=running,
        traj_ids=ids,
        alive=alive,
    )


def mv(src: str, dst: str, *ids: str) -> Move:
    return Move(source=src, destination=dst, traj_ids=tuple(ids))


# --- hand-made snapshots -----------------------------------------------------------------


def test_simple_two_replica_consolidation() -> None:
    policy = BestFitPolicy()
    plan = policy.plan([rs("b", 0.25, 3), rs("a", 0.125, 2)])
    assert plan == [mv("a", "b", "a0", "a1")]


def test_densest_destination_chosen() -> None:
    policy = BestFitPolicy(kv_limit=0.75, batch_limit=8)
    snapshot = [rs("a", 0.125, 2), rs("b", 0.25, 2), rs("c", 0.375, 2), rs("d", 0.5, 2)]
    # a fits b (.375), c (.5) and d (.625): d ends up fullest. Then b fits only c (.625);
    # c (.625 after) fits nobody; d (.625) fits nobody.
    assert policy.plan(snapshot) == [mv("a", "d", "a0", "a1"), mv("b", "c", "b0", "b1")]


def test_tie_on_kv_and_running_broken_by_smallest_id() -> None:
    policy = BestFitPolicy(kv_limit=0.5, batch_limit=8)
    snapshot = [rs("c", 0.25, 2), rs("a", 0.125, 1), rs("b", 0.25, 2)]
    expected = [mv("a", "b", "a0")]
    assert policy.plan(snapshot) == expected
    for seed in range(5):  # input order does not matter
        shuffled = snapshot[:]
        random.Random(seed).shuffle(shuffled)
        assert policy.plan(shuffled) == expected


def test_tie_on_kv_broken_by_larger_projected_running() -> None:
    policy = BestFitPolicy(kv_limit=0.5, batch_limit=8)
    snapshot = [rs("a", 0.125, 1), rs("x", 0.25, 2), rs("y", 0.25, 3)]
    assert policy.plan(snapshot) == [mv("a", "y", "a0")]


def test_source_order_ties_broken_by_id() -> None:
    # Equal kv: "a" is processed first and lands on "b", never the other way round.
    policy = BestFitPolicy(kv_limit=0.5, batch_limit=8)
    assert policy.plan([rs("b", 0.25), rs("a", 0.25)]) == [mv("a", "b", "a0")]


def test_no_fit_on_kv() -> None:
    snapshot = [rs("a", 0.25), rs("b", 0.5)]
    assert BestFitPolicy(kv_limit=0.7).plan(snapshot) == []
    # Exactly at the limit fits.
    assert BestFitPolicy(kv_limit=0.75).plan(snapshot) == [mv("a", "b", "a0")]


def test_no_fit_on_requests() -> None:
    snapshot = [rs("a", 0.125, 2), rs("b", 0.25, 3)]
    assert BestFitPolicy(batch_limit=4).plan(snapshot) == []
    # Exactly at the limit fits.
    assert BestFitPolicy(batch_limit=5).plan(snapshot) == [mv("a", "b", "a0", "a1")]


def _base() -> list[ReplicaState]:
    return [rs("a", 0.125, prev=0.25), rs("b", 0.25, prev=0.5)]


@pytest.mark.parametrize(
    "extra",
    [
        # Would be the densest destination for a (.625), but kv is rising / flat.
        rs("x", 0.5, prev=0.25),
        rs("x", 0.5, prev=0.5),
        # Would be the first source (kv rising).
        rs("x", 0.0625, prev=0.03125),
        # Nothing to move: not a candidate, so not a destination either.
        rs("x", 0.5, 0, ids=[]),
        # running >= B.
        rs("x", 0.5, 4),
        rs("x", 0.0625, 4),
    ],
    ids=["rising-dest", "flat-dest", "rising-source", "idle", "full-batch", "full-batch-src"],
)
def test_not_in_ramp_down_is_never_source_or_destination(extra: ReplicaState) -> None:
    policy = BestFitPolicy(kv_limit=0.75, batch_limit=4)
    assert policy.plan([*_base(), extra]) == [mv("a", "b", "a0")]


def test_kv_at_limit_is_not_a_destination() -> None:
    # A zero-kv source would fit exactly on "x" (0 + .75 <= .75), and "x" would be the
    # densest; but kv_use >= C_max is not ramp-down.
    policy = BestFitPolicy(kv_limit=0.75, batch_limit=4)
    snapshot = [rs("a", 0.0, prev=0.125), rs("x", 0.75), rs("b", 0.25)]
    assert policy.plan(snapshot) == [mv("a", "b", "a0")]


def test_versions_never_mix() -> None:
    policy = BestFitPolicy()
    assert policy.plan([rs("a", 0.125, version=0), rs("b", 0.25, version=1)]) == []
    snapshot = [
        rs("p", 0.125, version=1),
        rs("q", 0.25, version=1),
        rs("a", 0.125, version=0),
        rs("b", 0.25, version=0),
        rs("c", 0.5, version=1),
    ]
    # Within each version best-fit applies (q no longer fits on c: .875 > .8, and p is
    # emptied); versions in ascending order.
    assert policy.plan(snapshot) == [mv("a", "b", "a0"), mv("p", "c", "p0")]


def test_dead_replicas_ignored() -> None:
    policy = BestFitPolicy()
    snapshot = [
        rs("a", 0.125),
        rs("b", 0.25),
        rs("x", 0.5, alive=False),  # would be the densest destination
        rs("y", 0.0625, alive=False),  # would be the first source
    ]
    assert policy.plan(snapshot) == [mv("a", "b", "a0")]
    assert policy.plan([rs("a", 0.125, alive=False), rs("b", 0.25, alive=False)]) == []


def test_chain_is_composed() -> None:
    policy = BestFitPolicy(kv_limit=1.0, batch_limit=64)
    # a -> b (tie with c on .375, b smaller id); b (now .375) -> c (.625); c stays.
    snapshot = [rs("a", 0.125), rs("b", 0.25), rs("c", 0.25)]
    assert policy.plan(snapshot) == [mv("a", "c", "a0"), mv("b", "c", "b0")]


def test_longer_chain_is_composed() -> None:
    policy = BestFitPolicy(kv_limit=1.0, batch_limit=64)
    # a -> b, b -> c, c -> d (.875): every trajectory goes straight to d.
    snapshot = [rs("d", 0.25, 2), rs("c", 0.25, 2), rs("b", 0.25, 2), rs("a", 0.125, 2)]
    assert policy.plan(snapshot) == [
        mv("a", "d", "a0", "a1"),
        mv("b", "d", "b0", "b1"),
        mv("c", "d", "c0", "c1"),
    ]


def test_source_without_traj_ids_emits_no_move() -> None:
    # running counts a request whose id the snapshot did not list: the load still moves in
    # the working copy, but no empty Move is emitted.
    policy = BestFitPolicy(kv_limit=1.0, batch_limit=64)
    snapshot = [rs("a", 0.125, 1, ids=[]), rs("b", 0.25, 1)]
    assert policy.plan(snapshot) == []


def test_inputs_not_mutated() -> None:
    policy = BestFitPolicy(kv_limit=1.0, batch_limit=64)
    snapshot = [rs("a", 0.125), rs("b", 0.25), rs("c", 0.25), rs("x", 0.5, version=1)]
    before = copy.deepcopy(snapshot)
    ids_lists = [r.traj_ids for r in snapshot]
    plan = policy.plan(snapshot)
    assert plan  # something happened
    assert snapshot == before
    assert all(r.traj_ids is ids for r, ids in zip(snapshot, ids_lists, strict=True))
    assert policy.plan(snapshot) == plan


def test_empty_and_no_candidates() -> None:
    policy = BestFitPolicy()
    assert policy.plan([]) == []
    assert policy.plan([rs("a", 0.125)]) == []  # one candidate, nowhere to go
    assert policy.plan([rs("a", 0.5, prev=0.25), rs("b", 0.25, prev=0.125)]) == []


def test_duplicate_replica_id_rejected() -> None:
    with pytest.raises(ValueError, match="replica_id"):
        BestFitPolicy().plan([rs("a", 0.125), rs("a", 0.25, ids=["z"])])


@pytest.mark.parametrize("kv_limit", [0, 0.0, -0.1, 1.0001, 2, math.nan, math.inf, True, "0.5"])
def test_invalid_kv_limit(kv_limit: object) -> None:
    with pytest.raises(ValueError, match="kv_limit"):
        BestFitPolicy(kv_limit=kv_limit)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_limit", [0, -1, 2.5, 4.0, True, "8"])
def test_invalid_batch_limit(batch_limit: object) -> None:
    with pytest.raises(ValueError, match="batch_limit"):
        BestFitPolicy(batch_limit=batch_limit)  # type: ignore[arg-type]


def test_valid_limits_accepted() -> None:
    p = BestFitPolicy(kv_limit=1, batch_limit=1)
    assert (p.kv_limit, p.batch_limit) == (1.0, 1)
    assert BestFitPolicy().kv_limit == 0.8 and BestFitPolicy().batch_limit == 64


def test_no_repack() -> None:
    policy = NoRepack()
    assert isinstance(policy, RepackPolicy)
    assert isinstance(BestFitPolicy(), RepackPolicy)
    assert policy.plan([]) == []
    assert policy.plan([rs("a", 0.125), rs("b", 0.25)]) == []


# --- property-style check over random snapshots ---------------------------------------


def _is_candidate(r: ReplicaState, kv_limit: float, batch_limit: int) -> bool:
    return r.alive and 0 < r.running < batch_limit and r.kv_use < min(kv_limit, r.prev_kv_use)


def _random_snapshot(rng: random.Random) -> tuple[list[ReplicaState], float, int]:
    kv_limit = rng.choice([0.5, 0.8, 1.0, rng.uniform(0.2, 1.0)])
    batch_limit = rng.randint(1, 12)
    snapshot = []
    for i in range(rng.randint(0, 12)):
        running = rng.choice([rng.randint(0, batch_limit + 1), rng.randint(1, 3)])
        kv = rng.choice([rng.uniform(0.0, 0.3), rng.randint(0, 32) / 64, rng.random()])
        prev = rng.choice([kv, kv + rng.uniform(0.0, 0.5), kv - 0.05, 1.0, 1.0])
        snapshot.append(
            ReplicaState(
                replica_id=f"r{rng.randint(0, 99):02d}-{i}",
                version=rng.choice([0, 0, 1, 2]),
                kv_use=kv,
                prev_kv_use=prev,
                running=running,
                traj_ids=[f"t{i}-{j}" for j in range(running)],
                alive=rng.random() > 0.1,
            )
        )
    return snapshot, kv_limit, batch_limit


def test_random_snapshots_invariants() -> None:
    rng = random.Random(20251014)
    nonempty = chained = 0
    for _ in range(400):
        snapshot, kv_limit, batch_limit = _random_snapshot(rng)
        before = copy.deepcopy(snapshot)
        policy = BestFitPolicy(kv_limit=kv_limit, batch_limit=batch_limit)
        plan = policy.plan(snapshot)
        assert snapshot == before
        by_id = {r.replica_id: r for r in snapshot}
        cands = {r.replica_id for r in snapshot if _is_candidate(r, kv_limit, batch_limit)}

        moved: list[str] = []
        incoming: dict[str, list[ReplicaState]] = {}
        sources = []
        for m in plan:
            src, dst = by_id[m.source], by_id[m.destination]
            assert m.traj_ids and m.source != m.destination
            assert m.source in cands and m.destination in cands
            assert src.version == dst.version
            # Whole-replica moves: exactly the source's own trajectories, nothing else.
            assert sorted(m.traj_ids) == sorted(src.traj_ids)
            moved.extend(m.traj_ids)
            sources.append(m.source)
            incoming.setdefault(m.destination, []).append(src)
        assert len(moved) == len(set(moved))
        assert len(sources) == len(set(sources))
        assert not set(sources) & set(incoming)
        for dst_id, srcs in incoming.items():
            dst = by_id[dst_id]
            assert dst.kv_use + sum(s.kv_use for s in srcs) <= kv_limit + 1e-9
            assert dst.running + sum(s.running for s in srcs) <= batch_limit
        if not plan:
            # Nothing moved only if no two candidates of one version fit together.
            for a in cands:
                for b in cands:
                    ra, rb = by_id[a], by_id[b]
                    if a != b and ra.version == rb.version:
                        assert (
                            ra.kv_use + rb.kv_use > kv_limit
                            or ra.running + rb.running > batch_limit
                        )
        # Deterministic, also under reordering of the input.
        shuffled = snapshot[:]
        rng.shuffle(shuffled)
        assert policy.plan(shuffled) == plan
        nonempty += bool(plan)
        chained += any(len(v) > 1 for v in incoming.values())
    # The generator really exercises consolidation, including multi-source destinations.
    assert nonempty > 80
    assert chained > 5
