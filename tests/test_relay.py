"""Tests for laminar_core.relay: packing, checksums, node relays, the chain and its latency."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from laminar_core.relay import (
    BucketPacker,
    InProcessFabric,
    InProcessTransport,
    NodeRelay,
    RelayCancelled,
    RelayHost,
    RelayTier,
    WeightIntegrityError,
    chain_latency,
    optimal_chunks,
    unpack,
    verify_bucket,
)
from laminar_core.relay.packing import checksum
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.config import SimTransportConfig
from laminar_core.sim.transport import SimFabric, SimTransport
from laminar_core.types import Bucket


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.f32", torch.randn(3, 5, generator=g)),
        ("b.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.empty", torch.empty(0, 4)),
        ("d.i64", torch.randint(-(2**62), 2**62, (4, 3), generator=g, dtype=torch.int64)),
        ("e.big", torch.randn(50, generator=g)),  # 200 bytes: spans several 64-byte buckets
        ("f.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("g.t", torch.arange(12, dtype=torch.int32).reshape(3, 4).t()),  # not contiguous
    ]


def pack(named, version: int = 1, bucket_bytes: int = 64):
    packer = BucketPacker(named, version, bucket_bytes)
    buckets = list(packer.buckets())
    return packer.manifest, buckets


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert torch.equal(g, w), name


def corrupt(b: Bucket, at: int = 0) -> Bucket:
    data = bytearray(b.data)
    data[at] ^= 0x01
    return Bucket(b.version, b.index, b.nbytes, b.checksum, bytes(data))


# --- packing -------------------------------------------------------------------------------


def test_pack_unpack_round_trip_exact() -> None:
    named = tensors()
    manifest, buckets = pack(named, bucket_bytes=64)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert manifest.total_bytes == total
    assert manifest.bucket_sizes == [64] * (total // 64) + ([total % 64] if total % 64 else [])
    assert [b.index for b in buckets] == list(range(manifest.num_buckets))
    assert manifest.checksums == [b.checksum for b in buckets]
    big = next(s for s in manifest.tensors if s.name == "e.big")
    assert big.nbytes == 200 and big.nbytes > 64  # really spans buckets
    for b in buckets:
        verify_bucket(b)
    assert_same(list(unpack(manifest, buckets)), named)


@pytest.mark.parametrize("bucket_bytes", [1, 3, 7, 1 << 20])
def test_round_trip_for_odd_bucket_sizes(bucket_bytes: int) -> None:
    named = tensors()
    manifest, buckets = pack(named, bucket_bytes=bucket_bytes)
    assert all(b.nbytes <= bucket_bytes for b in buckets)
    assert_same(list(unpack(manifest, buckets)), named)


def test_manifest_offsets_are_contiguous() -> None:
    manifest, _ = pack(tensors(), bucket_bytes=64)
    pos = 0
    for spec in manifest.tensors:
        assert spec.offset == pos
        assert spec.bucket == pos // 64
        pos += spec.nbytes
    d = next(s for s in manifest.tensors if s.name == "d.i64")
    assert (d.shape, d.dtype, d.nbytes) == ((4, 3), "int64", 96)


def test_meta_tensors_make_phantom_buckets() -> None:
    named = [
        ("a", torch.empty(10, dtype=torch.float32, device="meta")),  # 40 bytes
        ("b", torch.empty(3, 3, dtype=torch.bfloat16, device="meta")),  # 18 bytes
    ]
    manifest, buckets = pack(named, bucket_bytes=16)
    assert manifest.bucket_sizes == [16, 16, 16, 10]
    assert [b.nbytes for b in buckets] == [16, 16, 16, 10]
    assert all(b.data is None and b.checksum == -1 for b in buckets)
    assert manifest.checksums == [-1] * 4
    assert manifest.total_bytes == 58
    assert unpack(manifest, buckets) is None
    verify_bucket(buckets[0])  # phantom buckets have nothing to verify


def test_meta_exact_multiple_has_no_empty_tail_bucket() -> None:
    manifest, _ = pack([("a", torch.empty(8, device="meta"))], bucket_bytes=16)
    assert manifest.bucket_sizes == [16, 16]


@pytest.mark.parametrize("meta_first", [True, False])
def test_mixing_meta_and_real_raises(meta_first: bool) -> None:
    meta = ("m", torch.empty(4, device="meta"))
    real = ("r", torch.ones(4))
    named = [meta, real] if meta_first else [real, meta]
    with pytest.raises(ValueError, match="mix"):
        pack(named)


def test_bucket_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BucketPacker([], 1, 0)


def test_verify_bucket_catches_flipped_byte() -> None:
    _, buckets = pack(tensors())
    for b in buckets[:3]:
        verify_bucket(b)
        with pytest.raises(WeightIntegrityError, match="checksum"):
            verify_bucket(corrupt(b, at=b.nbytes - 1))


def test_verify_bucket_catches_truncation() -> None:
    _, buckets = pack(tensors())
    b = buckets[0]
    short = Bucket(b.version, b.index, b.nbytes, b.checksum, b.data[:-1])
    with pytest.raises(WeightIntegrityError, match="truncated"):
        verify_bucket(short)
    with pytest.raises(WeightIntegrityError, match="truncated"):
        verify_bucket(b, expected_size=b.nbytes + 1)


# --- node relay ----------------------------------------------------------------------------


def stage(relay: NodeRelay, version: int, value: float = 1.0):
    named = [("w", torch.full((40,), value))]
    manifest, buckets = pack(named, version=version, bucket_bytes=64)
    relay.begin(version, len(buckets))
    return manifest, buckets, named


def commit_version(relay: NodeRelay, version: int, value: float = 1.0):
    manifest, buckets, named = stage(relay, version, value)
    for b in buckets:
        relay.put(b)
    relay.commit(manifest)
    return named


def test_node_relay_commit_and_read() -> None:
    relay = NodeRelay(0, 0)
    assert relay.version == -1
    with pytest.raises(LookupError):
        relay.read()
    named = commit_version(relay, 3, value=2.0)
    data = relay.read()
    assert relay.version == data.version == 3
    assert_same(list(unpack(data.manifest, data.buckets)), named)


@pytest.mark.parametrize("version", [2, 3])
def test_node_relay_rejects_older_or_equal_version(version: int) -> None:
    relay = NodeRelay(0, 0)
    commit_version(relay, 3)
    with pytest.raises(WeightIntegrityError, match="not newer"):
        relay.begin(version, 1)
    assert relay.version == 3


def test_node_relay_rejects_bucket_of_unstaged_version() -> None:
    relay = NodeRelay(0, 0)
    commit_version(relay, 1)
    _, buckets = pack([("w", torch.ones(4))], version=2)
    with pytest.raises(WeightIntegrityError, match="not staged"):
        relay.put(buckets[0])
    relay.begin(3, 1)
    with pytest.raises(WeightIntegrityError, match="not staged"):
        relay.put(buckets[0])  # version 2, while 3 is staged


def test_node_relay_never_exposes_half_received_version() -> None:
    relay = NodeRelay(0, 0)
    old = commit_version(relay, 1, value=1.0)
    manifest, buckets, new = stage(relay, 2, value=5.0)
    assert len(buckets) > 1
    for b in buckets[:-1]:
        relay.put(b)
        assert relay.version == 1
        data = relay.read()
        assert_same(list(unpack(data.manifest, data.buckets)), old)
    with pytest.raises(WeightIntegrityError, match="incomplete"):
        relay.commit(manifest)  # one bucket missing
    assert relay.version == 1
    # a fresh attempt at the same version can still succeed
    manifest, buckets, new = stage(relay, 2, value=5.0)
    for b in buckets:
        relay.put(b)
    relay.commit(manifest)
    data = relay.read()
    assert_same(list(unpack(data.manifest, data.buckets)), new)


def test_node_relay_corrupted_bucket_keeps_previous_version() -> None:
    relay = NodeRelay(0, 0)
    old = commit_version(relay, 1)
    manifest, buckets, _ = stage(relay, 2, value=9.0)
    for b in buckets[1:]:
        relay.put(b)
    with pytest.raises(WeightIntegrityError, match="checksum"):
        relay.put(corrupt(buckets[0]))
    with pytest.raises(WeightIntegrityError):
        relay.commit(manifest)
    assert relay.version == 1
    data = relay.read()
    assert_same(list(unpack(data.manifest, data.buckets)), old)


def test_node_relay_commit_checks_manifest() -> None:
    """A self-consistent bucket (checksum recomputed) that is not the published one."""
    relay = NodeRelay(0, 0)
    commit_version(relay, 1)
    manifest, buckets, _ = stage(relay, 2, value=9.0)
    forged = corrupt(buckets[0])
    from laminar_core.relay.packing import checksum

    forged.checksum = checksum(forged.data)
    relay.put(forged)  # passes the per-bucket check
    for b in buckets[1:]:
        relay.put(b)
    with pytest.raises(WeightIntegrityError, match="manifest"):
        relay.commit(manifest)
    assert relay.version == 1


def test_node_relay_events() -> None:
    """A relay in the driver tells its subscribers each committed version, once, in order
    (committed, then shared: it serves what it committed at once)."""
    relay = NodeRelay(0, 0)
    seen: list[tuple[str, int]] = []
    relay.events.subscribe(lambda e: seen.append((e.kind.value, e.version)))
    commit_version(relay, 1)
    commit_version(relay, 2)
    assert seen == [("committed", 1), ("shared", 1), ("committed", 2), ("shared", 2)]


# --- the tier over the in-process transport --------------------------------------------------


def test_tier_inprocess_delivers_identical_tensors_to_every_relay() -> None:
    named = tensors()

    async def main():
        fabric = InProcessFabric()
        relays = [NodeRelay(i, node=i) for i in range(4)]
        commits: list[tuple[int, int]] = []
        for r in relays:
            r.events.subscribe(
                lambda e, r=r: (
                    commits.append((r.relay_id, e.version)) if e.kind == "shared" else None
                )
            )
        tier = RelayTier.in_process(
            relays, lambda rank: InProcessTransport(fabric), bucket_bytes=32
        )
        await tier.open()
        res = await tier.publish(1, named)
        versions_at_return = [r.version for r in relays]
        await tier.close()
        return tier, res, versions_at_return, commits, relays

    tier, res, at_return, commits, relays = run_virtual(main())
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert res.version == 1 and res.bytes == total
    assert res.buckets == math.ceil(total / 32)
    assert at_return[0] == 1  # the master holds it when the trainer resumes
    assert at_return[-1] == -1  # ... the tail does not yet
    assert sorted(commits) == [(i, 1) for i in range(4)]
    for r in relays:
        data = r.read()
        assert data.version == 1
        assert_same(list(unpack(data.manifest, data.buckets)), named)
    assert tier.relay_for_node(2) is relays[2]
    with pytest.raises(LookupError):
        tier.relay_for_node(9)


def test_tier_successive_versions_and_dead_relay_cut_out() -> None:
    async def main():
        fabric = InProcessFabric()
        relays = [NodeRelay(i, node=i) for i in range(3)]
        tier = RelayTier.in_process(
            relays, lambda rank: InProcessTransport(fabric), bucket_bytes=16
        )
        await tier.open()
        await tier.publish(1, [("w", torch.full((10,), 1.0))])
        relays[1].alive = False
        await tier.publish(2, [("w", torch.full((10,), 2.0))])
        await tier.close()
        return relays

    relays = run_virtual(main())
    assert [r.version for r in relays] == [2, 1, 2]
    for r, value in zip(relays, [2.0, 1.0, 2.0]):
        ((_, t),) = list(unpack(r.read().manifest, r.read().buckets))
        assert torch.equal(t, torch.full((10,), value))


# --- latency model -------------------------------------------------------------------------


def test_chain_latency_hand_values() -> None:
    # p=4, M=1000, k=14: (4 + 14 - 2) * (1000/14 * 0.001 + 0.01)
    assert chain_latency(4, 1000, 14, 0.001, 0.01) == pytest.approx(16 * (1 / 14 + 0.01))
    assert chain_latency(4, 1000, 1, 0.001, 0.01) == pytest.approx(3 * 1.01)
    assert chain_latency(4, 1000, 0, 0.001, 0.01) == pytest.approx(3 * 1.01)  # k<1 -> 1
    assert chain_latency(2, 1000, 10, 0.001, 0.01) == pytest.approx(10 * 0.11)
    assert chain_latency(1, 1000, 10, 0.001, 0.01) == 0.0


def test_optimal_chunks_hand_values() -> None:
    # k* = sqrt(2 * 1000 * 0.001 / 0.01) = sqrt(200) ~ 14.14; T(14) < T(15)
    assert math.sqrt(200) == pytest.approx(14.142, abs=1e-3)
    assert chain_latency(4, 1000, 14, 0.001, 0.01) < chain_latency(4, 1000, 15, 0.001, 0.01)
    k = optimal_chunks(4, 1000, 0.001, 0.01)
    assert k == 14
    best = min(range(1, 200), key=lambda c: chain_latency(4, 1000, c, 0.001, 0.01))
    assert k == best
    # k* = sqrt(8 * 1e9 * 1e-9 / 1e-3) = sqrt(8000) ~ 89.4
    assert optimal_chunks(10, 1e9, 1e-9, 1e-3) in (89, 90)
    assert optimal_chunks(10, 1e9, 1e-9, 1e-3, max_chunks=16) == 16
    assert optimal_chunks(2, 1e9, 1e-9, 1e-3) == 1  # a single hop gains nothing from chunks
    assert optimal_chunks(10, 1e9, 1e-9, 0.0, max_chunks=64) == 64


@pytest.mark.parametrize(("n_relays", "k"), [(1, 3), (3, 7), (6, 4)])
def test_sim_chain_commits_at_model_time(n_relays: int, k: int) -> None:
    chunk = 250_000
    model_bytes = k * chunk
    cfg = SimTransportConfig(link_gbps=16.0, start_s=0.004, push_gbps=16.0)
    t_byte, t_start = 8.0 / (cfg.link_gbps * 1e9), cfg.start_s

    async def main():
        fabric = SimFabric()
        relays = [NodeRelay(i, node=i) for i in range(n_relays)]
        loop = asyncio.get_running_loop()
        commit_at: dict[int, float] = {}
        for r in relays:
            r.events.subscribe(lambda e, r=r: commit_at.setdefault(r.relay_id, loop.time()))
        tier = RelayTier.in_process(relays, lambda rank: SimTransport(cfg, fabric), chunks=k)
        await tier.open()
        weights = [("w", torch.empty(model_bytes, dtype=torch.uint8, device="meta"))]
        res = await tier.publish(1, weights)
        returned_at = loop.time()
        await tier.close()
        return res, returned_at, commit_at

    res, returned_at, commit_at = run_virtual(main())
    assert res.buckets == k
    # the trainer -> master hop is one more link of the chain: p = relays + 1 endpoints
    tail = chain_latency(n_relays + 1, model_bytes, k, t_byte, t_start)
    assert commit_at[n_relays - 1] == pytest.approx(tail, rel=1e-6)
    # every relay serves the version once it holds it (relay i is endpoint i + 2)
    for i in range(n_relays):
        want = chain_latency(i + 2, model_bytes, k, t_byte, t_start)
        assert commit_at[i] == pytest.approx(want, rel=1e-6)
    # the trainer stalls only for its push to the master, independent of the chain length
    push = chain_latency(2, model_bytes, k, t_byte, t_start)
    assert returned_at == pytest.approx(push, rel=1e-6)
    assert res.stall_seconds == pytest.approx(push, rel=1e-6)
    if n_relays > 1:
        assert returned_at < commit_at[n_relays - 1]


def test_sim_tier_picks_optimal_chunks_from_link_model() -> None:
    cfg = SimTransportConfig(link_gbps=8.0, start_s=0.01, push_gbps=8.0)
    model_bytes = 10_000_000  # t_byte = 1e-9 s/byte

    async def main():
        fabric = SimFabric()
        tier = RelayTier.in_process(
            [NodeRelay(i, i) for i in range(7)], lambda r: SimTransport(cfg, fabric)
        )
        await tier.open()
        weights = [("w", torch.empty(model_bytes, dtype=torch.uint8, device="meta"))]
        res = await tier.publish(1, weights)
        await tier.close()
        return res

    res = run_virtual(main())
    # p = 8 endpoints: k* = sqrt(6 * 1e7 * 1e-9 / 0.01) = sqrt(6) ~ 2.45
    assert res.buckets == optimal_chunks(8, model_bytes, 1e-9, 0.01) == 2


class CountingTransport(InProcessTransport):
    """Records, at each send from the trainer, how many tensors the export had yielded."""

    def __init__(self, fabric: InProcessFabric, pulled: list[int], seen: list[int]) -> None:
        super().__init__(fabric)
        self.pulled, self.seen = pulled, seen

    async def send(self, bucket: Bucket, peer: int) -> None:
        if self.rank == 0:
            self.seen.append(self.pulled[0])
        await super().send(bucket, peer)


def test_publish_streams_the_export_after_the_first_version() -> None:
    """From the second version on, buckets leave while the export is still being walked
    (the trainer never holds the whole model as bytes)."""
    pulled, seen = [0], []

    def export(version: int):
        for i in range(8):
            pulled[0] += 1
            yield f"w{i}", torch.full((256,), float(version))

    async def main() -> None:
        fabric = InProcessFabric()
        relays = [NodeRelay(i, i) for i in range(3)]
        tier = RelayTier.in_process(
            relays, lambda r: CountingTransport(fabric, pulled, seen), bucket_bytes=1024
        )
        await tier.open()
        await tier.publish(1, export(1))
        assert seen and min(seen) == 8  # first version: walked once to learn its size
        pulled[0], seen[:] = 0, []
        await tier.publish(2, export(2))
        await tier.close()
        assert seen[0] < 8, "the second version was materialised before sending"
        got = dict(unpack(relays[-1].read().manifest, relays[-1].read().buckets))
        assert torch.equal(got["w7"], torch.full((256,), 2.0))

    asyncio.run(main())


def test_publish_rejects_an_export_of_another_size_and_recovers() -> None:
    """A version whose export changed size is refused before it completes anywhere; relays
    keep the last good version, and the next correct version goes through."""

    async def main() -> None:
        fabric = InProcessFabric()
        relays = [NodeRelay(i, i) for i in range(3)]
        tier = RelayTier.in_process(relays, lambda r: InProcessTransport(fabric), bucket_bytes=1000)
        await tier.open()
        await tier.publish(1, [("w", torch.zeros(1000))])  # 4000 bytes, 4 buckets
        for bad in ([("w", torch.zeros(1100))], [("w", torch.zeros(900))]):
            with pytest.raises(WeightIntegrityError, match="not the announced 4000 bytes"):
                await tier.publish(2, bad)
            assert [r.version for r in relays] == [1, 1, 1]
        await tier.publish(2, [("w", torch.ones(1000))])
        await tier.close()
        assert [r.version for r in relays] == [2, 2, 2]
        got = dict(unpack(relays[-1].read().manifest, relays[-1].read().buckets))
        assert torch.equal(got["w"], torch.ones(1000))

    asyncio.run(main())


class CorruptingTransport(InProcessTransport):
    """Flips one byte of bucket 1 of version 2 on the link from relay rank 2 onwards."""

    async def send(self, bucket: Bucket, peer: int) -> None:
        if self.rank == 2 and bucket.version == 2 and bucket.index == 1 and bucket.data:
            data = bytearray(bucket.data)
            data[0] ^= 0xFF
            bucket = Bucket(bucket.version, bucket.index, bucket.nbytes, bucket.checksum, data)
        await super().send(bucket, peer)


def test_corrupt_bucket_mid_chain_keeps_last_good_version_and_never_hangs() -> None:
    async def main() -> None:
        fabric = InProcessFabric()
        relays = [NodeRelay(i, i) for i in range(4)]
        tier = RelayTier.in_process(
            relays, lambda r: CorruptingTransport(fabric), bucket_bytes=1000
        )
        await tier.open()
        await tier.publish(1, [("w", torch.zeros(1000))])
        await tier.publish(2, [("w", torch.ones(1000))])
        await tier.publish(3, [("w", torch.full((1000,), 3.0))])  # waits for 2's broadcast
        await tier.close()
        return [r.version for r in relays]

    versions_after_3 = asyncio.run(asyncio.wait_for(main(), 30))
    assert versions_after_3 == [3, 3, 3, 3]


def test_corrupt_bucket_mid_chain_rejected_downstream() -> None:
    async def main() -> list[int]:
        fabric = InProcessFabric()
        relays = [NodeRelay(i, i) for i in range(4)]
        tier = RelayTier.in_process(
            relays, lambda r: CorruptingTransport(fabric), bucket_bytes=1000
        )
        await tier.open()
        await tier.publish(1, [("w", torch.zeros(1000))])
        await tier.publish(2, [("w", torch.ones(1000))])
        await tier.close()  # waits for the broadcast to end
        return [r.version for r in relays]

    # relays 1 and 2 (ranks 1, 2) got clean bytes; rank 3 got the flipped byte and rank 4
    # only the abort marker: both keep version 1
    assert asyncio.run(asyncio.wait_for(main(), 30)) == [2, 2, 1, 1]


@pytest.mark.parametrize("index", [-2, 3])
def test_node_relay_rejects_bucket_index_out_of_range(index: int) -> None:
    relay = NodeRelay(0, 0)
    relay.begin(1, 3)
    with pytest.raises(WeightIntegrityError, match="has 3 buckets"):
        relay.put(Bucket(1, index, 4, checksum(b"abcd"), b"abcd"))


# --- memory: views, recycled buffers, staging ---------------------------------------------------


def test_packer_whole_buckets_are_views_of_the_tensor() -> None:
    """A bucket inside one tensor is that tensor's memory (no copy); one that spans
    tensors is a copy."""
    a, b = torch.zeros(16), torch.zeros(6)  # 64 + 24 bytes, 32-byte buckets
    buckets = list(BucketPacker([("a", a), ("b", b)], 1, 32).buckets())
    assert [x.nbytes for x in buckets] == [32, 32, 24]
    a[0], b[0] = 7.0, 7.0
    assert bytes(buckets[0].data[:4]) == a[:1].numpy().tobytes()  # sees the write: a view
    assert bytes(buckets[2].data[:4]) == bytes(4)  # assembled before the write: a copy
    # a staged version (arena) copies everything: it must not change with the trainer
    packer = BucketPacker([("a", a), ("b", b)], 1, 32, arena_bytes=88)
    copied = list(packer.buckets())
    a[0] = 9.0
    assert [x.nbytes for x in copied] == [32, 32, 24]
    assert bytes(copied[0].data[:4]) == torch.tensor([7.0]).numpy().tobytes()
    seven = torch.tensor([7.0]).numpy().tobytes()
    assert b"".join(bytes(x.data) for x in copied)[64:68] == seven  # b's first float


def test_packer_ring_recycles_its_buffers_across_versions() -> None:
    named = [(f"w{i}", torch.full((5,), float(i))) for i in range(8)]  # 20-byte tensors
    ring: list[memoryview] = []
    seen = set()
    for version in (1, 2):
        packer = BucketPacker(named, version, 32, reuse=True, ring=ring)
        for bucket in packer.buckets():  # every bucket spans tensors: all in the ring
            seen.add(id(bucket.data.obj))
            assert verify_bucket(bucket) is None  # valid while it is the newest
    assert len(ring) == 3 and seen == {id(b.obj) for b in ring}


def test_node_relay_recycles_a_superseded_versions_buffers() -> None:
    """In steady state a relay holds two versions' worth of buffers: the one it serves
    and the one it receives into."""
    relay = NodeRelay(0, 0)

    def receive(version: int) -> list[int]:
        manifest, buckets = pack([("w", torch.full((40,), float(version)))], version, 64)
        relay.begin(version, len(buckets))
        ids = []
        for b in buckets:
            buf = relay.alloc(len(b.data))
            buf[:] = b.data
            ids.append(id(buf.obj))
            relay.put(Bucket(b.version, b.index, b.nbytes, b.checksum, buf))
        relay.commit(manifest)
        return ids

    v1, v2, v3, v4 = (receive(v) for v in (1, 2, 3, 4))
    assert set(v3) == set(v1) and set(v4) == set(v2) and not set(v1) & set(v2)
    assert relay.allocated_bytes == 2 * 160
    ((_, t),) = list(unpack(relay.read().manifest, relay.read().buckets))
    assert torch.equal(t, torch.full((40,), 4.0))


def test_staged_publish_returns_before_the_push_and_delivers_the_staged_copy() -> None:
    """With staging the trainer's stall is the copy, not the push: publish returns at once
    (virtual time), the master holds the version later, and weights the trainer changes
    after publish returned do not leak into the version."""
    cfg = SimTransportConfig(link_gbps=8.0, start_s=0.001, push_gbps=8.0)

    async def main():
        fabric = SimFabric()
        relays = [NodeRelay(i, i) for i in range(3)]
        tier = RelayTier.in_process(
            relays, lambda r: SimTransport(cfg, fabric), chunks=4, stage=True
        )
        await tier.open()
        loop = asyncio.get_running_loop()
        w = torch.full((1000,), 1.0)
        t0 = loop.time()
        res = await tier.publish(1, lambda: [("w", w)])
        returned = loop.time() - t0
        held_at_return = [r.version for r in relays]
        w.fill_(5.0)  # the trainer's next step changes its weights in place
        await tier.wait_broadcast()
        res2 = await tier.publish(2, [("w", torch.full((1000,), 2.0))])
        await tier.close()
        return res, res2, returned, held_at_return, relays

    res, res2, returned, held_at_return, relays = run_virtual(main())
    assert returned == 0.0 and res.stall_seconds == 0.0
    assert held_at_return == [-1, -1, -1]
    assert res.master_seconds is not None and res.master_seconds > 0
    assert res2.master_seconds is not None  # the second version went through too
    for r in relays:
        ((_, t),) = list(unpack(r.read().manifest, r.read().buckets))
        assert torch.equal(t, torch.full((1000,), 2.0))
    assert res.buckets == 4


def test_staged_publish_rejects_a_wrong_sized_export_before_anything_is_sent() -> None:
    async def main() -> None:
        fabric = InProcessFabric()
        relays = [NodeRelay(i, i) for i in range(2)]
        tier = RelayTier.in_process(
            relays, lambda r: InProcessTransport(fabric), chunks=2, stage=True
        )
        await tier.open()
        await tier.publish(1, [("w", torch.zeros(100))])
        await tier.wait_broadcast()
        with pytest.raises(WeightIntegrityError, match="not the announced 400 bytes"):
            await tier.publish(2, [("w", torch.zeros(120))])
        await tier.publish(2, [("w", torch.ones(100))])
        await tier.close()
        assert [r.version for r in relays] == [2, 2]

    asyncio.run(main())


# --- calls that reach a relay out of order (Ray's async actors do not keep call order) ----


class LateReceive:
    """A relay host whose ``receive`` calls reach it after the manifest's offer."""

    def __init__(self, host: RelayHost) -> None:
        self.host = host

    def __getattr__(self, name: str):
        return getattr(self.host, name)

    async def receive(self, *args):
        await asyncio.sleep(0.05)
        return await self.host.receive(*args)


def test_a_manifest_offered_before_its_receive_is_kept() -> None:
    """For a small version the trainer offers the manifest at once; a relay that hears of
    the reception only afterwards still commits (it used to drop the offer and wait for
    the manifest until relay.timeout_s)."""

    async def main() -> list[int]:
        fabric = InProcessFabric()
        hosts = [
            LateReceive(RelayHost(NodeRelay(i, i), InProcessTransport(fabric), i + 1))
            for i in range(2)
        ]
        tier = RelayTier(hosts=hosts, trainer_transport=InProcessTransport(fabric), chunks=1)
        await tier.open()
        for v in (1, 2):
            await tier.publish(v, [("w", torch.full((10,), float(v)))])
            await tier.wait_broadcast()
        await tier.close()
        return [h.host.relay.version for h in hosts]

    assert asyncio.run(asyncio.wait_for(main(), 20)) == [2, 2]


def test_a_called_off_attempt_is_refused_when_its_calls_arrive_late() -> None:
    async def main() -> None:
        host = RelayHost(NodeRelay(0, 0), InProcessTransport(InProcessFabric()), 1)
        await host.cancel(5, attempt=3)
        with pytest.raises(RelayCancelled):
            await host.receive(5, 1, 0, None, 3)
        manifest, _ = pack([("w", torch.zeros(4))], 5)
        await host.offer_manifest(manifest, 3)  # dropped: no reception waits for it
        assert 5 not in host._jobs

    asyncio.run(main())
