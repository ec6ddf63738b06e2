"""The relay tier: versioned node relays, the pipelined chain, packing and checksums.

``tier`` coordinates; ``push`` is the trainer's side; ``chain`` the membership, election and
repair; ``host`` the per-relay pipeline; ``protocol`` what the tier says to a relay host;
``server`` / ``remote`` / ``process`` a relay in its own process and the driver's proxy to it;
``node`` the versioned store; ``events`` what a relay tells its node's replicas; ``shm`` the
node's shared-memory copy; ``packing`` / ``wire`` buckets, checksums, headers; ``latency`` the
chain's latency model; ``inprocess`` the in-process transport.
"""

from laminar_core.relay.chain import Chain
from laminar_core.relay.events import RelayEvent, RelayEventKind, RelayEvents
from laminar_core.relay.host import RelayHost
from laminar_core.relay.inprocess import InProcessFabric, InProcessTransport
from laminar_core.relay.latency import chain_latency, optimal_chunks
from laminar_core.relay.node import NodeRelay, VersionData
from laminar_core.relay.packing import BucketPacker, WeightIntegrityError, unpack, verify_bucket
from laminar_core.relay.process import RelayProcess
from laminar_core.relay.protocol import (
    ForwardFailed,
    HostHandle,
    RelayCancelled,
    RelayDied,
    RelayUnavailable,
)
from laminar_core.relay.push import TrainerPush
from laminar_core.relay.remote import RemoteRelay
from laminar_core.relay.server import RelayServer
from laminar_core.relay.shm import SharedVersionStore, load_shared, shared_version
from laminar_core.relay.tier import PublishResult, RelayTier

__all__ = [
    "BucketPacker",
    "Chain",
    "ForwardFailed",
    "HostHandle",
    "InProcessFabric",
    "InProcessTransport",
    "NodeRelay",
    "PublishResult",
    "RelayCancelled",
    "RelayDied",
    "RelayEvent",
    "RelayEventKind",
    "RelayEvents",
    "RelayHost",
    "RelayProcess",
    "RelayServer",
    "RelayTier",
    "RelayUnavailable",
    "RemoteRelay",
    "SharedVersionStore",
    "TrainerPush",
    "VersionData",
    "WeightIntegrityError",
    "chain_latency",
    "load_shared",
    "optimal_chunks",
    "shared_version",
    "unpack",
    "verify_bucket",
]
