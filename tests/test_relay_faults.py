"""Relay tier faults, integrity and hand-off, in one process (the multi-process versions run
in plugins/nccl and plugins/rdma): layout and stale-version rejection, dead relays cut out,
master re-election, wire header, shared-memory hand-off, link calibration."""

from __future__ import annotations

import asyncio

import pytest
import torch

from laminar_core.relay import (
    InProcessFabric,
    InProcessTransport,
    NodeRelay,
    RelayTier,
    RelayUnavailable,
    SharedVersionStore,
    WeightIntegrityError,
    load_shared,
    shared_version,
    unpack,
)
from laminar_core.relay.wire import decode_bucket_header, encode_bucket_header
from laminar_core.testing import check_transport, make_weights
from laminar_core.types import Bucket, manifest_from_json, manifest_to_json


def tier_of(n: int, **kw) -> tuple[RelayTier, list[NodeRelay]]:
    fabric = InProcessFabric()
    relays = [NodeRelay(i, i) for i in range(n)]
    return RelayTier.in_process(
        relays, lambda r: InProcessTransport(fabric), chunks=4, **kw
    ), relays


def held(relay: NodeRelay) -> dict[str, torch.Tensor]:
    return dict(unpack(relay.read().manifest, relay.read().buckets))


def test_manifest_layout_mismatch_rejected_everywhere() -> None:
    async def main() -> list[int]:
        tier, relays = tier_of(3)
        await tier.open()
        await tier.publish(1, make_weights(1))
        reshaped = [(n, t.reshape(-1) if t.dim() == 2 else t) for n, t in make_weights(2)]
        with pytest.raises(WeightIntegrityError, match="engine expects"):
            await tier.publish(2, reshaped)
        await tier.publish(2, make_weights(2))
        await tier.close()
        return [r.version for r in relays]

    assert asyncio.run(main()) == [2, 2, 2]


def test_expect_layout_from_the_engine() -> None:
    relay = NodeRelay(0, 0)
    relay.expect_layout([("w", (4,), torch.float32)])
    tier_relays = [relay]

    async def main() -> None:
        tier = RelayTier.in_process(tier_relays, lambda r: InProcessTransport(fabric))
        await tier.open()
        with pytest.raises(WeightIntegrityError, match="names differ"):
            await tier.publish(1, [("v", torch.zeros(4))])
        await tier.publish(1, [("w", torch.zeros(4))])
        await tier.close()

    fabric = InProcessFabric()
    asyncio.run(main())
    assert relay.version == 1


def test_stale_version_rejected_by_tier_and_relay() -> None:
    async def main() -> None:
        tier, relays = tier_of(2)
        await tier.open()
        await tier.publish(5, make_weights(5))
        with pytest.raises(WeightIntegrityError, match="not newer"):
            await tier.publish(5, make_weights(5))
        with pytest.raises(WeightIntegrityError, match="not newer"):
            relays[1].begin(4, 1)
        await tier.close()
        assert [r.version for r in relays] == [5, 5]

    asyncio.run(main())


def test_dead_master_replaced_and_trainer_pushes_to_new_one() -> None:
    async def main() -> None:
        tier, relays = tier_of(3)
        seen: list[int] = []
        tier.on_master_change.append(lambda rank, ep: seen.append(rank))
        await tier.open()
        await tier.publish(1, make_weights(1))
        relays[0].alive = False
        res = await tier.publish(2, make_weights(2))
        await tier.wait_broadcast()
        assert res.master_rank == 2 and tier.master_rank == 2 and seen == [1, 2]
        assert tier.chain_ranks == [2, 3] and tier.rebuilds == 1
        assert [r.version for r in relays] == [1, 2, 2]
        assert torch.equal(held(relays[2])["norm.scale"], torch.tensor(2.0, dtype=torch.float64))
        for r in relays[1:]:
            r.alive = False
        with pytest.raises(RelayUnavailable, match="every relay is dead"):
            await tier.publish(3, make_weights(3))
        await tier.close()

    asyncio.run(main())


def test_wire_header_and_manifest_round_trip() -> None:
    for b in (Bucket(3, 7, 100, 12345, b"x" * 60), Bucket(1, -1, 0), Bucket(2, 0, 8, -1, None)):
        got = decode_bucket_header(encode_bucket_header(b))
        assert got == (b.version, b.index, b.nbytes, b.checksum, -1 if b.data is None else 60)
    with pytest.raises(ValueError, match="40 bytes"):
        decode_bucket_header(b"short")
    tier, relays = tier_of(1)

    async def main() -> None:
        await tier.open()
        await tier.publish(1, make_weights(1))
        await tier.close()

    asyncio.run(main())
    m = relays[0].read().manifest
    assert manifest_from_json(manifest_to_json(m)) == m


def test_shared_memory_hand_off(tmp_path) -> None:
    tier, relays = tier_of(2)

    async def main() -> None:
        await tier.open()
        for v in (1, 2, 3):
            await tier.publish(v, make_weights(v))
            await tier.wait_broadcast()
            SharedVersionStore(tmp_path, relays[1].relay_id).write(relays[1].read())
        await tier.close()

    with pytest.raises(LookupError, match="shares no version"):
        load_shared(tmp_path, 1)
    asyncio.run(main())
    assert shared_version(tmp_path, 1) == 3
    _manifest, named = load_shared(tmp_path, 1)
    got = dict(named)
    for name, want in make_weights(3):
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert sorted(p.name for p in (tmp_path / "relay1").glob("v*.bin")) == ["v2.bin", "v3.bin"]


def test_calibration_feeds_the_chunk_count() -> None:
    async def main() -> tuple[tuple[float, float], int]:
        tier, _ = tier_of(4, calibrate=True)
        tier.chunks = 0
        await tier.open()
        link = tier.link
        res = await tier.publish(1, make_weights(1))
        await tier.close()
        return link, res.buckets  # type: ignore[return-value]

    (t_byte, t_start), buckets = asyncio.run(main())
    assert t_byte > 0 and t_start > 0 and buckets >= 1


def test_inprocess_conformance_includes_rebuilt_links() -> None:
    fabric = InProcessFabric()
    asyncio.run(check_transport(lambda rank: InProcessTransport(fabric)))
