"""Publishing a version, and noticing when none gets through.

A relay tier that cannot take a version (no live relay: they are being restarted) is
survived: the trainer goes on and the rollouts keep the weights they have. Once no version
has reached the master relay for ``relay.max_unavailable_s``, :meth:`Delivery.check` stops
the run with the cause.
"""

from __future__ import annotations

import asyncio
import logging

from laminar_core.loop.trainer_group import TrainerGroup
from laminar_core.relay.protocol import RelayUnavailable
from laminar_core.relay.tier import PublishResult, RelayTier

log = logging.getLogger(__name__)


class Delivery:
    """Publishes versions through the relay tier and tracks since when none got through."""

    def __init__(self, max_unavailable_s: float) -> None:
        self.max_unavailable_s = max_unavailable_s  # 0: never stop the run
        self._since: float | None = None  # publishes failing since then
        self._why = ""

    async def publish(self, trainer: TrainerGroup, version: int, tier: RelayTier) -> PublishResult:
        """Push ``version`` from ``trainer``; a tier that cannot take it is survived (module
        docstring)."""
        loop = asyncio.get_running_loop()
        try:
            pub = await trainer.publish(version, tier)
        except RelayUnavailable as e:
            self._undelivered(loop.time(), str(e))
            return PublishResult(version, 0, 0, 0.0, error=str(e))
        if pub.pushed is not None and not pub.pushed.done():
            pub.pushed.add_done_callback(lambda _f: self._pushed(pub, loop.time()))
        else:
            self._pushed(pub, loop.time())
        return pub

    def check(self, now: float) -> None:
        """Raise once no version got through for ``max_unavailable_s``."""
        limit = self.max_unavailable_s
        since = self._since
        if limit > 0 and since is not None and now - since > limit:
            raise RuntimeError(
                f"no replica could receive new weights for {now - since:.0f}s "
                f"({self._why}); the relay tier did not come back within "
                f"relay.max_unavailable_s={limit:g}: check the relay actors' logs, or raise "
                "relay.max_unavailable_s"
            )

    def _pushed(self, pub: PublishResult, now: float) -> None:
        if pub.error is None and pub.master_seconds is not None:
            self._since, self._why = None, ""
        else:
            self._undelivered(now, pub.error or "the push to the master failed")

    def _undelivered(self, now: float, why: str) -> None:
        if self._since is None:
            self._since = now
            log.warning("no relay took the new version (%s); rollouts keep the old one", why)
        self._why = why
