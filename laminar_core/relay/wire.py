"""What crosses a wire besides bucket bytes: the fixed bucket header and the manifest.

Transports that move raw bytes (torch.distributed, NIXL) send a ``Bucket`` as a header plus
its payload; the header layout is shared here so every transport frames buckets alike. The
manifest travels on the control plane (relay processes get it over their RPC channel) as JSON
(``types.manifest_to_json``).
"""

from __future__ import annotations

import struct

from laminar_core.types import Bucket

# version, index, nbytes (announced), checksum, payload length (-1: no bytes follow: a
# phantom bucket or a marker). The payload length is sent apart from ``nbytes`` so that a
# truncated bucket arrives truncated and is rejected by the receiver's checks.
_HEADER = struct.Struct("<qqqqq")
HEADER_BYTES = _HEADER.size


def encode_bucket_header(bucket: Bucket) -> bytes:
    """The fixed-size header of ``bucket`` (its payload travels separately)."""
    payload = -1 if bucket.data is None else len(bucket.data)
    return _HEADER.pack(bucket.version, bucket.index, bucket.nbytes, bucket.checksum, payload)


def decode_bucket_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int]:
    """``(version, index, nbytes, checksum, payload_len)`` from :func:`encode_bucket_header`
    (``payload_len`` is -1 when no bytes follow)."""
    if len(raw) != HEADER_BYTES:
        raise ValueError(f"bucket header must be {HEADER_BYTES} bytes (got {len(raw)})")
    version, index, nbytes, digest, payload = _HEADER.unpack(bytes(raw))
    if nbytes < 0 or payload < -1:
        raise ValueError(f"corrupt bucket header ({nbytes} bytes, payload {payload})")
    return version, index, nbytes, digest, payload
