"""Relay-chain contract tests over a real transport between real processes.

A transport plugin's tests call these with a *picklable* factory of unopened endpoints
(``functools.partial(MyTransport, options)``): the kit spawns one process per relay
(``RelayProcess``), keeps the trainer's endpoint in the calling process, and drives the real
``RelayTier``. Rollout-side reads go through the node's shared-memory copy (``load_shared``),
as a replica on that node would.

    def test_chain(tmp_path):
        asyncio.run(check_relay_chain(partial(MyTransport, opts), tmp_path))
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from laminar_core.interfaces import Alloc, WeightTransport
from laminar_core.relay.node import VersionData
from laminar_core.relay.packing import BucketPacker, WeightIntegrityError
from laminar_core.relay.process import RelayProcess
from laminar_core.relay.shm import SharedVersionStore, SharedWeights, load_shared
from laminar_core.relay.tier import RelayTier
from laminar_core.testing.report import ContractError, require
from laminar_core.types import Bucket

log = logging.getLogger(__name__)


def make_weights(version: int, scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    """A small model whose every tensor identifies ``version`` (~``scale`` x 0.5 MB)."""
    g = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(256 * scale, 128, generator=g).to(torch.bfloat16)),
        ("layers.0.mlp.weight", torch.randn(128, 300 * scale, generator=g)),
        ("layers.0.mlp.bias", torch.arange(7, dtype=torch.int64) + version),
        ("norm.scale", torch.tensor(float(version), dtype=torch.float64)),
    ]


def assert_loaded(root: str | Path, relay_id: int, version: int, scale: int = 1) -> None:
    """The node's shared copy holds exactly ``make_weights(version)``."""
    manifest, named = load_shared(root, relay_id)
    require(
        manifest.version == version,
        f"relay {relay_id} shares version {manifest.version} on its node, not {version}",
    )
    got = dict(named)
    for name, want in make_weights(version, scale):
        t = got.get(name)
        require(
            t is not None and t.dtype == want.dtype and t.shape == want.shape,
            f"relay {relay_id} version {version}: {name} is "
            f"{None if t is None else (t.dtype, tuple(t.shape))}, sent as "
            f"{(want.dtype, tuple(want.shape))}",
        )
        require(
            t is not None and torch.equal(t, want),
            f"relay {relay_id} version {version}: {name} differs from what was sent: the "
            "transport changed bytes on the way",
        )


class _Tampering(WeightTransport):
    """Wraps the trainer's endpoint: corrupts or truncates one chosen bucket on the wire."""

    def __init__(self, inner: WeightTransport) -> None:
        self.inner = inner
        self.tamper: tuple[int, int, str] | None = None  # (version, index, "flip"|"truncate")

    async def open(self, role, rank, peers):
        await self.inner.open(role, rank, peers)

    def endpoint(self):
        return self.inner.endpoint()

    async def connect(self, peers):
        await self.inner.connect(peers)

    def link_model(self):
        return self.inner.link_model()

    async def send(self, bucket: Bucket, peer: int) -> None:
        if self.tamper and self.tamper[:2] == (bucket.version, bucket.index) and bucket.data:
            data = bytearray(bucket.data)
            if self.tamper[2] == "flip":
                data[len(data) // 2] ^= 0x5A
            else:
                data = data[: len(data) // 2]
            bucket = Bucket(bucket.version, bucket.index, bucket.nbytes, bucket.checksum, data)
        await self.inner.send(bucket, peer)

    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        return await self.inner.recv(peer, alloc)

    async def close(self) -> None:
        await self.inner.close()


def share_version(
    root: str | Path, relay_id: int, version: int, named_tensors: list[tuple[str, torch.Tensor]]
) -> SharedWeights:
    """Write ``version`` into ``root`` as node relay ``relay_id`` would, and return the
    reference a replica gets (for testing an engine's load from a node relay)."""
    packer = BucketPacker(named_tensors, version, 1 << 20)
    buckets = list(packer.buckets())
    SharedVersionStore(root, relay_id).write(VersionData(packer.manifest, buckets))
    return SharedWeights(str(root), relay_id, version)


async def _versions(hosts: list[RelayProcess]) -> list[int]:
    return [await h.status() if h.is_alive() else -2 for h in hosts]


async def check_relay_chain(
    make_transport: Callable[[], WeightTransport],
    shm_root: str | Path,
    relays: int = 3,
    chunks: int = 6,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    stage: bool = False,
) -> None:
    """Pipelined chain of ``relays`` relay processes: versions arrive intact everywhere;
    a corrupt or truncated bucket, a manifest that does not match the engine's layout and a
    stale version are rejected with clear errors while every relay keeps serving its last
    good version; the next good version still goes through. ``stage=True`` runs it with the
    staged push (errors past the staging then surface in ``PublishResult.error``)."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    hosts = [
        RelayProcess(i, i, i + 1, make_transport, shm_dir=str(shm_root), env=env)
        for i in range(relays)
    ]
    trainer = _Tampering(make_transport())
    tier = RelayTier(
        hosts=hosts, trainer_transport=trainer, chunks=chunks, timeout_s=timeout_s, stage=stage
    )

    async def rejected(version: int, weights: Any, what: str, match: str) -> None:
        try:
            res = await asyncio.wait_for(tier.publish(version, weights), timeout_s)
        except WeightIntegrityError as e:
            require(match in str(e), f"{what} was rejected, but not for {match!r}: {e}")
            return
        await tier.wait_broadcast()
        require(
            stage and res.error is not None,
            f"{what} was accepted: a transport delivers a bucket's bytes and header as sent, "
            "so the relay's checks see what was sent",
        )
        require(
            match in (res.error or ""), f"{what} was rejected, but not for {match!r}: {res.error}"
        )

    async def settle(want: list[int]) -> None:
        await tier.wait_broadcast()
        got = await _versions(hosts)
        require(got == want, f"the relays hold versions {got}, expected {want}")

    try:
        await asyncio.wait_for(tier.open(), timeout_s)
        for v in (1, 2):
            res = await asyncio.wait_for(tier.publish(v, make_weights(v)), timeout_s)
            require(
                res.buckets == chunks and res.master_rank == 1,
                f"version {v} went out as {res.buckets} buckets to rank {res.master_rank}; "
                f"expected {chunks} to rank 1",
            )
            await settle([v] * relays)
            require(
                res.error is None and res.master_seconds is not None,
                f"version {v}: the push failed: {res.error}",
            )
            for h in hosts:
                assert_loaded(shm_root, h.relay_id, v)
        for mode in ("flip", "truncate"):
            trainer.tamper = (3, 2, mode)
            match = "checksum" if mode == "flip" else "truncated"
            await rejected(3, make_weights(3), f"a {mode}ped bucket", match)
            await settle([2] * relays)
            assert_loaded(shm_root, hosts[-1].relay_id, 2)
        trainer.tamper = None
        renamed = [(n.replace("mlp", "ffn"), t) for n, t in make_weights(3)]
        await rejected(3, renamed, "a manifest with other names", "does not match the engine's")
        await settle([2] * relays)
        await asyncio.wait_for(tier.publish(3, make_weights(3)), timeout_s)
        await settle([3] * relays)
        try:
            await tier.publish(2, make_weights(2))
        except WeightIntegrityError as e:
            require("not newer" in str(e), f"an older version was rejected, but with: {e}")
        else:
            raise ContractError("an older version (2 after 3) was accepted")
        for h in hosts:
            assert_loaded(shm_root, h.relay_id, 3)
    finally:
        await _shutdown(tier, hosts)


async def check_relay_faults(
    make_transport: Callable[[], WeightTransport],
    shm_root: str | Path,
    chunks: int = 6,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    stage: bool = False,
) -> None:
    """Three relay processes A (master), B, C. B crashes mid-broadcast of version 2: it is
    cut out, the chain rebuilt (A -> C) and C repaired to version 2. Then A (the master)
    crashes mid-push of version 3: C becomes the master, the trainer replays version 3 to
    it, and version 4 follows; C's rollouts read the newest version throughout. With
    ``stage=True`` the replay comes from the staged copy, in the background."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    hosts = [
        RelayProcess(0, 0, 1, make_transport, shm_dir=str(shm_root), env=env, die_at=(3, 1)),
        RelayProcess(1, 1, 2, make_transport, shm_dir=str(shm_root), env=env, die_at=(2, 1)),
        RelayProcess(2, 2, 3, make_transport, shm_dir=str(shm_root), env=env),
    ]
    tier = RelayTier(
        hosts=hosts,
        trainer_transport=make_transport(),
        chunks=chunks,
        timeout_s=timeout_s,
        stage=stage,
    )
    masters: list[int] = []
    tier.on_master_change.append(lambda rank, ep: masters.append(rank))
    ready: list[tuple[int, int]] = []  # (rank, version) shared on the relay's node

    def shared_on(rank: int) -> Callable[[Any], None]:
        def seen(e: Any) -> None:
            if e.kind == "shared":
                ready.append((rank, e.version))

        return seen

    for h in hosts:
        h.events.subscribe(shared_on(h.rank))
    try:
        await asyncio.wait_for(tier.open(), timeout_s)
        await asyncio.wait_for(tier.publish(1, make_weights(1)), timeout_s)
        await tier.wait_broadcast()
        versions = await _versions(hosts)
        require(versions == [1, 1, 1], f"the relays hold versions {versions}, expected 1 each")
        # B dies on receiving bucket 1 of version 2
        await asyncio.wait_for(tier.publish(2, make_weights(2)), timeout_s)
        await asyncio.wait_for(tier.wait_broadcast(), timeout_s)
        require(not hosts[1].is_alive(), "relay B should have crashed (die_at) and did not")
        require(
            tier.chain_ranks == [1, 3],
            f"with B gone the chain is {tier.chain_ranks}, expected A -> C ([1, 3]): "
            "connect(peers) must link to a new next hop",
        )
        versions = await _versions(hosts)
        require(
            versions == [2, -2, 2],
            f"the relays hold versions {versions} (-2: dead): C was not repaired to version 2",
        )
        # A could not forward (B was gone) but holds it; C got it by repair: both are ready
        require({(1, 2), (3, 2)} <= set(ready), f"version 2 was not shared by A and C: {ready}")
        assert_loaded(shm_root, 2, 2)
        # A (master) dies on receiving bucket 1 of version 3; the export is replayed to C
        res = await asyncio.wait_for(tier.publish(3, lambda: make_weights(3)), timeout_s)
        await asyncio.wait_for(tier.wait_broadcast(), timeout_s)
        require(not hosts[0].is_alive(), "relay A should have crashed (die_at) and did not")
        require(
            res.master_rank == 3 and tier.master_rank == 3 and masters == [1, 3],
            f"with A gone the master is {res.master_rank} ({tier.master_rank}, masters "
            f"{masters}); expected C (rank 3)",
        )
        require(res.error is None, f"version 3 after the master failed: {res.error}")
        versions = await _versions(hosts)
        require(versions == [-2, -2, 3], f"the relays hold versions {versions}, expected C at 3")
        assert_loaded(shm_root, 2, 3)
        await asyncio.wait_for(tier.publish(4, make_weights(4)), timeout_s)
        await tier.wait_broadcast()
        assert_loaded(shm_root, 2, 4)
    finally:
        await _shutdown(tier, hosts)


async def _shutdown(tier: RelayTier, hosts: list[RelayProcess]) -> None:
    try:
        await asyncio.wait_for(tier.close(), 60)
    except Exception as e:
        log.warning("tier close: %r", e)
    for h in hosts:
        h.kill()
    if os.environ.get("LAMINAR_TEST_DEBUG"):
        log.warning("relay processes stopped")
