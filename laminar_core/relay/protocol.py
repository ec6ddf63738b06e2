"""What the relay tier and a relay host say to each other, wherever the host lives.

Chain ranks: the trainer's endpoint is rank 0 (``TRAINER_RANK``); relays are ranks 1..p in
chain order. Per version and per try (``attempt``, numbered by the tier) the tier calls, on
every relay of the chain: ``receive(version, count, pred, nxt, attempt)`` (read ``count``
buckets from ``pred``, forward each to ``nxt``; returns once the version is committed here)
and ``offer_manifest(manifest, attempt)`` (in either order: Ray's async actors do not keep
call order), then ``drain(version)`` (returns once forwarding and the node share ended).
``cancel(version, attempt)`` calls a try off; ``serve(version, nxt)`` sends a held version
to a relay that missed it (repair); ``probe`` receives calibration buckets; ``status()`` is
the version held and shared on the node.

A host handle is a ``RelayHost`` in this process or a proxy to one elsewhere (``RemoteRelay``
subclasses: a spawned process, a Ray actor).
"""

from __future__ import annotations

from typing import Any, Protocol

from laminar_core.interfaces import TransportError
from laminar_core.types import WeightManifest

TRAINER_RANK = 0
ABORT = -1  # bucket index of the marker that abandons a version down the chain
PROBE = -3  # version number of calibration buckets (never staged)


class RelayCancelled(RuntimeError):
    """The tier called off this version here (an upstream relay died); nothing was committed."""


class ForwardFailed(TransportError):
    """This relay committed and shared the version, but could not send it on (the next
    relay is gone): the version is good here, the chain needs repair after it."""


class RelayDied(TransportError):
    """The relay's process (or actor) is gone."""


class RelayUnavailable(RuntimeError):
    """No live relay can take the version (all dead, or the master died mid-push and the
    export cannot be replayed); publish again once the chain is back."""


class HostHandle(Protocol):
    """What the tier drives (see module docstring). Every method but ``is_alive`` is a
    coroutine; a dead host's calls raise ``RelayDied`` (or another ``TransportError``)."""

    @property
    def relay_id(self) -> int: ...

    def is_alive(self) -> bool: ...
    async def open(self) -> Any: ...
    async def connect(self, peers: dict[int, Any]) -> None: ...
    async def receive(
        self, version: int, count: int, pred: int, nxt: int | None, attempt: int
    ) -> int: ...
    async def offer_manifest(self, manifest: WeightManifest, attempt: int) -> None: ...
    async def drain(self, version: int) -> None: ...
    async def cancel(self, version: int, attempt: int) -> None: ...
    async def serve(self, version: int, nxt: int) -> None: ...
    async def probe(self, pred: int, count: int) -> None: ...
    async def status(self) -> int: ...
    async def close(self) -> None: ...
