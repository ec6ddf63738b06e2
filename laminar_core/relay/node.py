"""A node relay: the newest complete weight version on one node, in host memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from laminar_core.relay.packing import WeightIntegrityError, verify_bucket
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
    """

    def __init__(self, relay_id: int, node: int) -> None:
        self.relay_id = relay_id
        self.node = node
        self.current: VersionData | None = None
        self._staging: dict[int, list[Bucket | None]] = {}
        self._changed = asyncio.Event()
        self.alive = True
        self.listeners: list[Callable[[int], None]] = []  # called with the new version

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
        self.current = VersionData(manifest, stage)  # type: ignore[arg-type]
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self.listeners:
            listener(manifest.version)

    def abandon(self, version: int) -> None:
        self._staging.pop(version, None)

    async def wait_newer(self, version: int) -> int:
        """Return once a version newer than ``version`` is held."""
        while self.version <= version:
            await self._changed.wait()
        return self.version

    def read(self) -> VersionData:
        if self.current is None:
            raise LookupError(f"relay {self.relay_id} holds no version yet")
        return self.current
