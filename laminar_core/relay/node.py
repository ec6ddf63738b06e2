"""A node relay: the newest complete weight version on one node, in host memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from laminar_core.interfaces.weights import ModelOnly, TensorWeights, WeightsRef
from laminar_core.relay.events import RelayEventKind, RelayEvents
from laminar_core.relay.packing import WeightIntegrityError, unpack, verify_bucket
from laminar_core.types import Bucket, WeightManifest


@dataclass
class VersionData:
    """One complete, verified version. Immutable once committed: readers keep their reference."""

    manifest: WeightManifest
    buckets: list[Bucket]

    @property
    def version(self) -> int:
        return self.manifest.version


class NodeRelay:
    """Versioned store of one node.

    Receiving happens into a staging area (``begin`` → ``put`` per bucket → ``commit``); only
    ``commit`` makes a version visible, so a relay never serves a half-received version.
    Versions are monotonic: staging a version that is not newer than the held one is
    rejected, and any failed check leaves the last good version in place.

    The *layout* (names, shapes, dtypes in order) is what the rollout engines expect: set it
    with ``expect_layout`` (from the engine), or it is pinned by the first committed version.
    A manifest with another layout is rejected at commit.

    Events: ``events`` (``relay.events``) tells subscribers of each committed version; a
    relay in the driver serves what it committed at once, so the version is also shared.

    Memory: ``alloc(nbytes)`` hands a transport a buffer to receive a bucket into. Buffers
    handed out here are recycled once their version is superseded (by then its broadcast,
    repair and node share have finished: the tier runs versions one after another; readers
    of an in-process relay hold buckets the transport allocated, which are never recycled),
    so in steady state a relay holds two versions' worth and receives into memory that is
    already faulted in (and, for RDMA, registered) instead of allocating per bucket.
    """

    def __init__(self, relay_id: int, node: int) -> None:
        self.relay_id = relay_id
        self.node = node
        self.layout: list[tuple[str, tuple[int, ...], str]] | None = None
        self.current: VersionData | None = None
        self._staging: dict[int, list[Bucket | None]] = {}
        self.alive = True
        self.events = RelayEvents(relay_id)
        self._free: dict[int, list[memoryview]] = {}  # size -> recycled buffers
        self._owned: dict[int, memoryview] = {}  # id -> buffers handed out by alloc
        self.allocated_bytes = 0  # fresh memory alloc() had to take (not recycled)

    def alloc(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` for a bucket being received (see class docstring)."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        buf = memoryview(bytearray(nbytes))  # zero-filled: faulted in before the wire writes
        self._owned[id(buf)] = buf
        self.allocated_bytes += nbytes
        return buf

    def _recycle(self, data: VersionData | None) -> None:
        if data is None:
            return
        for b in data.buckets:
            buf = b.data
            if buf is not None and self._owned.get(id(buf)) is buf:
                self._free.setdefault(len(buf), []).append(buf)

    @property
    def version(self) -> int:
        return -1 if self.current is None else self.current.version

    def begin(self, version: int, num_buckets: int) -> None:
        if version <= self.version:
            raise WeightIntegrityError(
                f"relay {self.relay_id}: version {version} is not newer than held {self.version}"
            )
        self._staging[version] = [None] * num_buckets

    def put(self, bucket: Bucket) -> None:
        stage = self._staging.get(bucket.version)
        if stage is None:
            raise WeightIntegrityError(
                f"relay {self.relay_id}: bucket for version {bucket.version} that is not staged"
            )
        if not 0 <= bucket.index < len(stage):
            raise WeightIntegrityError(
                f"relay {self.relay_id}: version {bucket.version} has {len(stage)} buckets, "
                f"got bucket index {bucket.index}"
            )
        verify_bucket(bucket)
        stage[bucket.index] = bucket

    def commit(self, manifest: WeightManifest) -> None:
        stage = self._staging.pop(manifest.version, None)
        if stage is None or any(b is None for b in stage):
            raise WeightIntegrityError(
                f"relay {self.relay_id}: version {manifest.version} incomplete at commit"
            )
        got = [b.checksum for b in stage]  # type: ignore[union-attr]
        if got != list(manifest.checksums) or [b.nbytes for b in stage] != list(  # type: ignore[union-attr]
            manifest.bucket_sizes
        ):
            raise WeightIntegrityError(
                f"relay {self.relay_id}: version {manifest.version} buckets do not match manifest"
            )
        if manifest.version <= self.version:
            raise WeightIntegrityError(
                f"relay {self.relay_id}: version {manifest.version} older than held {self.version}"
            )
        self.check_layout(manifest)
        if self.layout is None:
            self.layout = [(s.name, tuple(s.shape), s.dtype) for s in manifest.tensors]
        self._recycle(self.current)
        self.current = VersionData(manifest, stage)  # type: ignore[arg-type]
        self._forget_strays()
        self.events.emit(RelayEventKind.SHARED, manifest.version)

    def _forget_strays(self) -> None:
        """Stop tracking buffers that went nowhere (a rejected bucket, an abandoned version),
        so they are freed instead of kept for recycling."""
        live = [b.data for b in self.current.buckets] if self.current else []
        live += [buf for bufs in self._free.values() for buf in bufs]
        live += [b.data for stage in self._staging.values() for b in stage if b is not None]
        self._owned = {id(x): x for x in live if x is not None and self._owned.get(id(x)) is x}

    def expect_layout(self, specs: Iterable[tuple[str, tuple[int, ...], str]]) -> None:
        """Names, shapes and dtypes (in export order) every committed version must have."""
        self.layout = [(n, tuple(shape), str(dt).removeprefix("torch.")) for n, shape, dt in specs]

    def check_layout(self, manifest: WeightManifest) -> None:
        if self.layout is None:
            return
        got = [(s.name, tuple(s.shape), s.dtype) for s in manifest.tensors]
        if got == self.layout:
            return
        want_names, got_names = [n for n, _, _ in self.layout], [n for n, _, _ in got]
        if want_names != got_names:
            missing = sorted(set(want_names) - set(got_names))[:3]
            extra = sorted(set(got_names) - set(want_names))[:3]
            what = f"names differ (missing {missing}, unexpected {extra})"
            if not missing and not extra:
                what = "tensor order differs"
        else:
            name, want, have = next(
                (w[0], w[1:], g[1:]) for w, g in zip(self.layout, got) if w != g
            )
            what = f"{name!r} is {have[0]} {have[1]}, the engine expects {want[0]} {want[1]}"
        raise WeightIntegrityError(
            f"relay {self.relay_id}: version {manifest.version} manifest does not match the "
            f"engine's weights: {what}; export the rollout's names, shapes and dtypes"
        )

    def abandon(self, version: int) -> None:
        self._staging.pop(version, None)

    def weights(self) -> WeightsRef:
        """The held version for a replica's ``update_weights``: its tensors, or
        ``ModelOnly`` for a phantom (simulated) version."""
        data = self.read()
        tensors = unpack(data.manifest, data.buckets)
        if tensors is None:
            return ModelOnly(data.version)
        return TensorWeights(data.version, list(tensors))

    def read(self) -> VersionData:
        if self.current is None:
            raise LookupError(f"relay {self.relay_id} holds no version yet")
        return self.current
