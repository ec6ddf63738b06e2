"""What a node relay tells its node's rollouts: one typed event stream per relay.

A relay emits, for each version it takes, ``COMMITTED`` (every bucket arrived and passed its
checks: the version exists on the node, replicas should stop taking work for the old one)
and then ``SHARED`` (it can be loaded on the node: in shared memory for a relay in its own
process, at once for a relay in the driver). Each kind is emitted at most once per version
and only for versions newer than the last of that kind, so subscribers see a monotone
stream. The rollout manager subscribes; nothing else needs to be wired between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)


class RelayEventKind(str, Enum):
    COMMITTED = "committed"  # the whole version is on the node, checked
    SHARED = "shared"  # and a replica on the node can load it


@dataclass(frozen=True, slots=True)
class RelayEvent:
    relay_id: int
    kind: RelayEventKind
    version: int


class RelayEvents:
    """The event stream of relay ``relay_id``: ``subscribe(fn)``, then ``fn(event)`` for each
    event, in order. A subscriber that raises is logged and does not stop the others."""

    def __init__(self, relay_id: int) -> None:
        self.relay_id = relay_id
        self.last: dict[RelayEventKind, int] = {k: -1 for k in RelayEventKind}
        self._subscribers: list[Callable[[RelayEvent], None]] = []

    def subscribe(self, fn: Callable[[RelayEvent], None]) -> None:
        self._subscribers.append(fn)

    def emit(self, kind: RelayEventKind, version: int) -> bool:
        """Tell subscribers ``version`` reached ``kind``; False (and silent) if it is not
        newer than the last such event. A version shared is also committed."""
        if version <= self.last[kind]:
            return False
        if kind is RelayEventKind.SHARED and version > self.last[RelayEventKind.COMMITTED]:
            self.emit(RelayEventKind.COMMITTED, version)
        self.last[kind] = version
        event = RelayEvent(self.relay_id, kind, version)
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:  # a subscriber's bug must not break a broadcast
                log.exception("relay %s: event subscriber failed on %s", self.relay_id, event)
        return True

    @property
    def shared(self) -> int:
        """The newest version shared on the node (-1: none yet)."""
        return self.last[RelayEventKind.SHARED]
