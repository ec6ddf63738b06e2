"""Turning named tensors into checksummed buckets and back.

Tensors are laid end to end in one byte stream which is cut into equal buckets (the last may
be shorter); a tensor may span buckets. Packing streams: it holds one bucket at a time, so
peak memory stays at one bucket beyond the tensors themselves. ``meta`` tensors (the
simulator's) become *phantom* buckets that carry a size and no bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import xxhash

from laminar_core.types import Bucket, TensorSpec, WeightManifest


class WeightIntegrityError(ValueError):
    """A bucket or manifest that fails its checks; the receiver keeps its last good version."""


_CHECKSUM_MASK = (1 << 63) - 1  # fits the wire header's signed int64; -1 stays "no bytes"
UNSUMMED = -2  # a packed bucket whose checksum its sender takes later (``checksums=False``)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of ``data`` (top bit cleared). ~12 GB/s on one core, 3x CRC32's speed: on a
    relay the checksum runs on every hop, beside the copies the wire itself costs."""
    return xxhash.xxh3_64_intdigest(data) & _CHECKSUM_MASK


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu().reshape(-1)  # 1-D first: a 0-dim tensor cannot be viewed
    # View as bytes through uint8 so every dtype (bf16 included) round-trips exactly.
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device (a GPU tensor's are copied to
    host slice by slice, straight into the bucket buffers: no intermediate host copy)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _copy(dst: memoryview, t: torch.Tensor, src: Any, pos: int, n: int) -> None:
    """``src[pos:pos + n]`` (a host tensor's bytes as a memoryview, a device tensor's as a
    uint8 tensor) into ``dst``: a memcpy on the host (single-threaded it is 2x torch's
    copy), straight from the device otherwise."""
    if t.device.type == "cpu":
        dst[:] = src[pos : pos + n]
    else:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(src[pos : pos + n])


def _host_buffer(nbytes: int, pin: bool) -> memoryview:
    if pin:  # page-locked: the GPU -> host copy runs at full PCIe speed
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy().data
    return memoryview(bytearray(nbytes))


class BucketPacker:
    """Cuts a stream of named tensors into checksummed buckets.

    Feed it ``add(name, tensor)`` per tensor (each yields the buckets that tensor
    completes) then ``finish()`` (the last, shorter bucket), or iterate ``buckets()`` over
    the ``named_tensors`` it was built with; ``manifest`` is complete once it is finished.

    A bucket that lies inside one host tensor is a view of that tensor's memory (no copy);
    one that spans tensors is assembled in a buffer. With ``reuse=True`` those buffers are a
    ring of three, recycled: a bucket's bytes then stay valid only until two more buckets
    have been taken, which suits a sender that holds one bucket back and sends each before
    taking the next (the relay tier's streamed push) and saves faulting in fresh memory for
    every bucket. Pass the same ``ring`` list to the packers of successive versions to keep
    recycling across them.

    ``arena_bytes`` (a staged push: the model's size) instead copies every tensor into one
    contiguous buffer (``ring[0]``, recycled) and cuts the buckets as slices of it: no views,
    so the version cannot change with the trainer's weights, and the copy runs in pieces the
    size of the tensors whatever the bucket size. ``checksums=False`` leaves buckets
    ``UNSUMMED`` for their sender to sum as they go out.
    """

    RING = 3

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] = (),
        version: int = 0,
        bucket_bytes: int = 1 << 20,
        reuse: bool = False,
        ring: list[memoryview] | None = None,
        pin: bool = False,
        checksums: bool = True,
        arena_bytes: int = 0,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
        self._it = named_tensors
        self.version = version
        self.bucket_bytes = bucket_bytes
        self.reuse = reuse
        self.pin = pin  # page-locked buffers (a GPU trainer's staging)
        self.checksum_now = checksums  # False: buckets carry UNSUMMED, the sender sums them
        self.arena_bytes = arena_bytes
        self._ring: list[memoryview] = ring if ring is not None else []
        if not arena_bytes and any(len(b) != bucket_bytes for b in self._ring):
            self._ring.clear()  # the chunk size changed
        if not arena_bytes:
            del self._ring[self.RING :]
        self._turn = len(self._ring) - 1
        self.tensors: list[TensorSpec] = []
        self.sizes: list[int] = []
        self.checksums: list[int] = []
        self.phantom: bool | None = None
        self._buf: memoryview | None = None  # the bucket being assembled (spans tensors)
        self._fill = 0  # bytes in it (phantom buckets count without storing)
        self._offset = 0  # bytes of the stream so far
        self._cut = 0  # arena: where the next bucket starts

    @property
    def manifest(self) -> WeightManifest:
        return WeightManifest(self.version, self.tensors, self.sizes, self.checksums)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors added so far."""
        return self._offset

    def _buffer(self) -> memoryview:
        if not self.reuse:
            return _host_buffer(self.bucket_bytes, self.pin)
        if len(self._ring) < self.RING:
            self._ring.append(_host_buffer(self.bucket_bytes, self.pin))
            self._turn = len(self._ring) - 1
        else:
            self._turn = (self._turn + 1) % self.RING
        return self._ring[self._turn]

    def _emit(self, data: memoryview | None, nbytes: int) -> Bucket:
        digest = -1 if data is None else checksum(data) if self.checksum_now else UNSUMMED
        self.sizes.append(nbytes)
        self.checksums.append(digest)
        return Bucket(self.version, len(self.sizes) - 1, nbytes, digest, data)

    def buckets(self) -> Iterator[Bucket]:
        """Every bucket of ``named_tensors`` (the tensors given at construction)."""
        for name, t in self._it:
            yield from self.add(name, t)
        yield from self.finish()

    def add(self, name: str, t: torch.Tensor) -> Iterator[Bucket]:
        """Append one tensor to the stream; yields the buckets it completes."""
        if self.arena_bytes:
            return self._add_to_arena(name, t)
        return self._add(name, t)

    def finish(self) -> Iterator[Bucket]:
        """The last, partial bucket (if any): the stream is complete."""
        if self.arena_bytes:
            if self._offset > self._cut:
                yield self._emit(self._ring[0][self._cut : self._offset], self._offset - self._cut)
                self._cut = self._offset
        elif self.phantom and self._fill:
            yield self._emit(None, self._fill)
        elif self._buf is not None and self._fill:
            yield self._emit(self._buf[: self._fill], self._fill)
        self._buf, self._fill = None, 0

    def _spec(self, name: str, t: torch.Tensor, nbytes: int) -> None:
        dtype = str(t.dtype).removeprefix("torch.")
        offset = self._offset
        self.tensors.append(
            TensorSpec(name, tuple(t.shape), dtype, offset // self.bucket_bytes, offset, nbytes)
        )

    def _add(self, name: str, t: torch.Tensor) -> Iterator[Bucket]:
        size = self.bucket_bytes
        is_meta = t.device.type == "meta"
        if self.phantom is None:
            self.phantom = is_meta
        elif self.phantom != is_meta:
            raise ValueError("cannot mix meta (simulated) and real tensors in one version")
        nbytes = t.numel() * t.element_size()
        self._spec(name, t, nbytes)
        self._offset += nbytes
        if is_meta:
            self._fill += nbytes
            while self._fill >= size:
                self._fill -= size
                yield self._emit(None, size)
            return
        view = _tensor_bytes(t) if t.device.type == "cpu" else None
        src = view if view is not None else _device_bytes(t)
        pos = 0
        while pos < nbytes:
            if view is not None and self._fill == 0 and nbytes - pos >= size:
                yield self._emit(view[pos : pos + size], size)  # inside this tensor
                pos += size
                continue
            if self._buf is None:
                self._buf = self._buffer()
            take = min(size - self._fill, nbytes - pos)
            _copy(self._buf[self._fill : self._fill + take], t, src, pos, take)
            self._fill += take
            pos += take
            if self._fill == size:
                yield self._emit(self._buf, size)
                self._buf, self._fill = None, 0

    def _add_to_arena(self, name: str, t: torch.Tensor) -> Iterator[Bucket]:
        """Copy the tensor whole into one contiguous buffer of ``arena_bytes`` (``ring[0]``,
        recycled), at its offset, and cut buckets as slices of it: the copy runs in pieces
        the size of the tensors, whatever the bucket size (what a staged push wants: its
        length is the trainer's stall). Never phantom, never views."""
        total, size = self.arena_bytes, self.bucket_bytes
        if not (self._ring and len(self._ring[0]) == total):
            self._ring[:] = [_host_buffer(total, self.pin)]
        arena = self._ring[0]
        if t.device.type == "meta":
            raise ValueError("a staged version needs real tensors (got a meta tensor)")
        nbytes = t.numel() * t.element_size()
        self._spec(name, t, nbytes)
        if self._offset + nbytes > total:
            raise WeightIntegrityError(
                f"version {self.version}: the export is not the announced {total} bytes "
                f"(it goes past them at {name!r}); weights must keep their names, shapes "
                "and dtypes between versions"
            )
        if nbytes:
            src = _tensor_bytes(t) if t.device.type == "cpu" else _device_bytes(t)
            _copy(arena[self._offset : self._offset + nbytes], t, src, 0, nbytes)
        self._offset += nbytes
        while self._offset - self._cut >= size:
            yield self._emit(arena[self._cut : self._cut + size], size)
            self._cut += size


def verify_bucket(bucket: Bucket, expected_size: int | None = None) -> None:
    """Raise ``WeightIntegrityError`` if ``bucket`` is truncated or its checksum is wrong."""
    if bucket.data is None:
        return
    if len(bucket.data) != bucket.nbytes or (
        expected_size is not None and bucket.nbytes != expected_size
    ):
        raise WeightIntegrityError(
            f"version {bucket.version} bucket {bucket.index}: truncated "
            f"({len(bucket.data)} bytes, expected {expected_size or bucket.nbytes})"
        )
    if checksum(bucket.data) != bucket.checksum:
        raise WeightIntegrityError(
            f"version {bucket.version} bucket {bucket.index}: checksum mismatch (corrupt bytes)"
        )


def unpack(
    manifest: WeightManifest, buckets: list[Bucket]
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The named tensors of a complete version, or ``None`` for a phantom (simulated) one."""
    if not buckets or buckets[0].data is None:
        return None
    size = manifest.bucket_sizes[0]

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in manifest.tensors:
            raw = bytearray()
            pos, end = spec.offset, spec.offset + spec.nbytes
            while pos < end:
                b, off = divmod(pos, size)
                take = min(end - pos, size - off)
                data = buckets[b].data
                if data is None:  # a phantom bucket inside a real version: a broken tier
                    raise ValueError(f"bucket {b} of version {manifest.version} holds no bytes")
                raw += memoryview(data)[off : off + take]
                pos += take
            dtype = getattr(torch, spec.dtype)
            empty = torch.empty(0, dtype=torch.uint8)
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else empty
            yield spec.name, t.view(dtype).reshape(spec.shape)

    return gen()
