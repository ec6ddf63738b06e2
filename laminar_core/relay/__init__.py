"""The relay tier: versioned node relays, the pipelined chain, packing and checksums."""

from laminar_core.relay.host import ForwardFailed, RelayCancelled, RelayHost
from laminar_core.relay.inprocess import InProcessFabric, InProcessTransport
from laminar_core.relay.latency import chain_latency, optimal_chunks
from laminar_core.relay.node import NodeRelay, VersionData
from laminar_core.relay.packing import BucketPacker, WeightIntegrityError, unpack, verify_bucket
from laminar_core.relay.process import RelayDied, RelayProcess
from laminar_core.relay.shm import SharedVersionStore, load_shared, shared_version
from laminar_core.relay.tier import PublishResult, RelayTier, RelayUnavailable

__all__ = [
    "BucketPacker",
    "ForwardFailed",
    "InProcessFabric",
    "InProcessTransport",
    "NodeRelay",
    "PublishResult",
    "RelayCancelled",
    "RelayDied",
    "RelayHost",
    "RelayProcess",
    "RelayTier",
    "RelayUnavailable",
    "SharedVersionStore",
    "VersionData",
    "WeightIntegrityError",
    "chain_latency",
    "load_shared",
    "optimal_chunks",
    "shared_version",
    "unpack",
    "verify_bucket",
]
