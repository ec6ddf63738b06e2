"""The relay tier: versioned node relays, the pipelined chain, packing and checksums."""

from laminar_core.relay.inprocess import InProcessFabric, InProcessTransport
from laminar_core.relay.host import RelayCancelled, RelayHost
from laminar_core.relay.latency import chain_latency, optimal_chunks
from laminar_core.relay.node import NodeRelay, VersionData
from laminar_core.relay.packing import BucketPacker, WeightIntegrityError, unpack, verify_bucket
from laminar_core.relay.tier import PublishResult, RelayTier, RelayUnavailable

__all__ = [
    "BucketPacker",
    "InProcessFabric",
    "InProcessTransport",
    "NodeRelay",
    "PublishResult",
    "RelayCancelled",
    "RelayHost",
    "RelayTier",
    "RelayUnavailable",
    "VersionData",
    "WeightIntegrityError",
    "chain_latency",
    "optimal_chunks",
    "unpack",
    "verify_bucket",
]
