"""The relay tier: trainer -> master relay -> pipelined chain -> node relays -> replicas.

::

    trainer (rank 0)                     node 0         node 1              node p-1
    TrainerPush --push--> master relay --> relay 2 --> ... --> relay p        (chain)
     staging,             (rank 1)          |                    |
     chunking                |              v                    v
                             v          replicas             replicas     (pull when free)
                         replicas

The trainer pushes a version to the master relay only and resumes (its stall does not grow
with the number of relays); with staging it resumes once the version is copied to host
memory. The master forwards the version down the chain bucket by bucket: relay ``i``
forwards bucket ``j`` while it receives bucket ``j + 1``. Each relay commits the version only
once every bucket arrived and passed its checksum, then shares it with its node's replicas
and says so on its event stream (``relay.events``). Broadcasts run one after the other in
version order: a newer publish waits for the previous broadcast.

The parts: ``relay.push.TrainerPush`` (the trainer's endpoint, chunking, staging, the push),
``relay.chain.Chain`` (membership, master election, repair), relay hosts behind
``relay.protocol.HostHandle`` (``RelayHost`` in this process; ``RemoteRelay`` proxies to a
process or a Ray actor). ``RelayTier`` coordinates them; ``_Attempt`` is one try at one
version through the chain as it stands.

Faults: before each publish the tier cuts dead relays out of the chain and reconnects the
survivors (the first live relay is the master: if the old one died, a new master is elected
and the trainer pushes there). A master that dies mid-push is replaced and the version
replayed (from the staged copy, or a fresh export when ``publish`` got a callable). A relay
that dies during a broadcast makes the tier call the version off on every live relay (so
nobody waits on a dead peer), rebuild the chain, and repair: relays that missed the version
get it from one that holds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.chain import Chain, Member
from laminar_core.relay.host import RelayHost
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import WeightIntegrityError
from laminar_core.relay.protocol import (
    TRAINER_RANK,
    ForwardFailed,
    HostHandle,
    RelayUnavailable,
)
from laminar_core.relay.push import Export, Outgoing, Push, TrainerPush

log = logging.getLogger(__name__)

__all__ = ["TRAINER_RANK", "PublishResult", "RelayTier", "RelayUnavailable"]

_MASTER_GONE_POLL = (50, 0.05)  # after a broken push: how long to watch the master die


class _MasterLost(RuntimeError):
    pass


@dataclass
class PublishResult:
    version: int
    bytes: int
    buckets: int
    # trainer-side: until it may resume (staged push: the version is copied to host memory;
    # otherwise: the master holds every bucket)
    stall_seconds: float
    master_rank: int = 1  # where the trainer pushed
    # from the publish call until the master held the version (staged: filled in when the
    # background push gets there; None until then or if it never does)
    master_seconds: float | None = None
    error: str | None = None  # staged: why the background push failed (the relays keep theirs)
    # staged: done once the background push ended (the master holds the version, or it
    # failed: see ``error``); None when ``publish`` itself returned only then
    pushed: asyncio.Future | None = field(default=None, repr=False, compare=False)


class RelayTier:
    """Relays chained in rank order; the first live one is the master (see module docstring).

    ``hosts`` are the relays (ranks 1..p, in order): ``RelayHost`` objects or proxies to
    relays hosted elsewhere; ``trainer_transport`` is the trainer's own unopened endpoint in
    this process, or a ``TrainerPush`` hosted where the trainer's rank 0 is (the Ray
    runtime's: the weights then go rank 0 -> master relay, never through this process).
    ``RelayTier.in_process`` builds a tier over ``NodeRelay`` objects in this process.

    Chunking (see ``relay.push``): ``chunks`` > 0 fixes the chunk count; else ``link`` =
    ``(t_byte, t_start)``, the transport's ``link_model()``, or a measurement at ``open``
    (``calibrate=True``) feeds the latency model's ``k*``; else ``bucket_bytes``. ``stage``:
    ``publish`` returns once the version is copied to host memory (phantom, simulated,
    versions are never staged: their push time is the modelled stall). ``timeout_s`` bounds
    a broadcast (or repair); past it the version is called off.
    """

    def __init__(
        self,
        hosts: Sequence[HostHandle],
        trainer_transport: WeightTransport | Push,
        *,
        bucket_bytes: int = 64 << 20,
        chunks: int = 0,
        link: tuple[float, float] | None = None,
        calibrate: bool = False,
        max_chunks: int = 4096,
        timeout_s: float = 600.0,
        stage: bool = False,
    ) -> None:
        self.chain = Chain(hosts)
        self.push: Push = (
            trainer_transport  # hosted where the trainer's rank 0 is
            if isinstance(trainer_transport, Push)
            else TrainerPush(trainer_transport)
        )
        self.push.configure(bucket_bytes, chunks, link, max_chunks, stage)
        self.calibrate_on_open = calibrate
        self.timeout_s = timeout_s
        self.history: list[PublishResult] = []
        self._last_version: int | None = None
        self._held: Outgoing | None = None  # the newest version a master took (for catch-up)
        self._staged: Outgoing | None = None  # the newest staged version (its bytes are current)
        self._attempts = 0
        self._background: set[asyncio.Future] = set()  # broadcasts (and repairs) under way

    @classmethod
    def in_process(
        cls,
        relays: list[NodeRelay],
        transport_factory: Callable[[int], WeightTransport],
        **options: Any,
    ) -> RelayTier:
        """A tier over ``relays`` in this process, each on its own endpoint from
        ``transport_factory(rank)`` (rank 0: the trainer's)."""
        if not relays:
            raise ValueError("the relay tier needs at least one relay")
        hosts: list[HostHandle] = [
            RelayHost(r, transport_factory(rank), rank) for rank, r in enumerate(relays, 1)
        ]
        return cls(hosts, transport_factory(TRAINER_RANK), **options)

    # --- membership and settings ---------------------------------------------------------------

    @property
    def relays(self) -> list[Any]:
        """What each node's replicas watch and load from, in node order: the ``NodeRelay``
        of an in-process host, or the proxy of a remote one."""
        return [h.relay if isinstance(h, RelayHost) else h for _, h in self.chain.hosts]

    def relay_for_node(self, node: int) -> Any:
        for r in self.relays:
            if r.node == node:
                return r
        raise LookupError(f"no relay on node {node}")

    @property
    def master_rank(self) -> int:
        """Rank the trainer pushes to (the first live relay)."""
        return self.chain.master[0]

    @property
    def chain_ranks(self) -> list[int]:
        return self.chain.ranks

    @property
    def rebuilds(self) -> int:
        return self.chain.rebuilds

    @property
    def on_master_change(self) -> list[Callable[[int, Any], None]]:
        return self.chain.on_master_change

    @property
    def chunks(self) -> int:
        return self.push.chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self.push.chunks = value

    @property
    def link(self) -> tuple[float, float] | None:
        return self.push.link

    # --- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open every endpoint and connect the chain (and calibrate the link); a tier that
        is open already stays as it is."""
        if self.chain.endpoints:
            return
        await self.chain.open(await self.push.open(), self.push.connect)
        if self.calibrate_on_open and self.push.chunks <= 0 and self.push.link is None:
            await self.calibrate()

    async def close(self) -> None:
        await self.wait_broadcast()
        for _, h in self.chain.hosts:
            try:
                await h.close()
            except Exception as e:  # a dead relay cannot close cleanly
                log.debug("closing relay host: %s", e)
        await self.push.close()

    async def calibrate(
        self, small: int = 4096, large: int = 8 << 20, reps: int = 4
    ) -> tuple[float, float]:
        """Measure ``(t_byte, t_start)`` on the trainer -> master link and use it for ``k*``."""
        loop = asyncio.get_running_loop()
        rank, master = self.chain.master

        async def timed(size: int) -> float:
            t0 = loop.time()
            await asyncio.gather(
                master.probe(TRAINER_RANK, reps), self.push.send_probe(rank, size, reps)
            )
            return (loop.time() - t0) / reps

        await timed(small)  # warm the link up (connection set-up is not t_start)
        ts, tl = await timed(small), await timed(large)
        t_byte = max(tl - ts, 1e-12) / (large - small)
        self.push.link = (t_byte, max(ts, 1e-7))
        log.info(
            "relay link measured: t_byte=%.3g s/B (%.2f GB/s), t_start=%.3g s",
            t_byte,
            1e-9 / t_byte,
            self.push.link[1],
        )
        return self.push.link

    # --- a relay coming back ----------------------------------------------------------------------

    async def reopen_push(self) -> None:
        """The trainer's endpoint was replaced (a restarted trainer hosts a new one): open
        it and reconnect the chain. A staged copy held by the old one is gone."""
        await self.wait_broadcast()
        self.chain.endpoints[TRAINER_RANK] = await self.push.open()
        await self.chain.refresh(self.push.connect, force=True)
        self._staged = None
        if self._held is not None and self._held.staged:
            self._held = None

    async def add_relay(self, host: HostHandle) -> None:
        """A relay of a node that joined: it becomes the last of the chain (next rank) and
        catches up to the newest version (as ``rejoin``)."""
        rank = self.chain.hosts[-1][0] + 1
        self.chain.hosts.append((rank, host))
        await self.rejoin(host)

    async def rejoin(self, host: HostHandle) -> None:
        """``host`` (a relay of this tier, replaced after it died: same rank, new process)
        joins the chain again and catches up: it gets the newest version from a relay that
        holds it, or, if no live relay does (it was the only one), from the trainer's staged
        copy. A publish waits for this (it is a background job of the tier)."""
        me = asyncio.ensure_future(self._rejoin(host))
        self._background.add(me)
        me.add_done_callback(self._background.discard)
        await me

    async def _rejoin(self, host: HostHandle) -> None:
        current = asyncio.current_task()
        others = [f for f in self._background if f is not current]
        await asyncio.gather(*others, return_exceptions=True)
        rank = next(r for r, h in self.chain.hosts if h is host)
        self.chain.endpoints[rank] = await host.open()
        await self.chain.refresh(self.push.connect, force=True)
        held, staged = self._held, self._staged
        if staged is not None and (held is None or staged.version > held.version):
            # the newest version is one whose push failed (no relay was left to take it):
            # its staged bytes are the arena's current ones, send those
            log.warning("relay rank %s: catching up from the trainer's staged copy", rank)
            await self._catch_up_from_staged(staged)
            return
        if held is None:
            return  # nothing published yet: the next publish reaches it
        live = list(self.chain.live)
        statuses = await asyncio.gather(*(h.status() for _, h in live), return_exceptions=True)
        if any(v == held.version for v in statuses):
            await self.chain.repair(
                held.version, held.count, held.manifest, self._next_attempt(), self.timeout_s
            )
        elif held is staged:
            log.warning("relay rank %s: catching up from the trainer's staged copy", rank)
            await self._catch_up_from_staged(staged)
        else:
            log.warning(
                "relay rank %s: no live relay holds version %s and its staged copy is gone: "
                "the next publish reaches it",
                rank,
                held.version,
            )

    async def _catch_up_from_staged(self, staged: Outgoing) -> None:
        attempt = _Attempt(self, staged, list(self.chain.live), self._next_attempt())
        await attempt.push()
        self._held = staged
        self._last_version = max(self._last_version or -1, staged.version)
        await attempt.finish(staged.manifest)

    # --- publishing ------------------------------------------------------------------------------

    async def wait_broadcast(self) -> None:
        """Return once the last version's chain broadcast (and any repair) has ended."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _track(self, aw: Any) -> asyncio.Future:
        fut = asyncio.ensure_future(aw)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)
        return fut

    def _next_attempt(self) -> int:
        """A new number for a try at a version: a relay pairs each ``receive`` with the
        ``offer_manifest`` of the same try, whichever reaches it first."""
        self._attempts += 1
        return self._attempts

    async def publish(
        self,
        version: int,
        named_tensors: Export | Callable[[], Export] | None,
        model_bytes: int | None = None,
    ) -> PublishResult:
        """Push ``version`` to the master; return once the master holds it (the trainer's
        stall), or once it is staged in host memory with ``stage=True``. The chain
        broadcast continues in the background.

        ``named_tensors`` is the export (an iterable or async iterable of ``(name,
        tensor)``), streamed bucket by bucket, or a callable returning one: then a master
        that dies mid-push is replaced and the export replayed to the new one (``None``: the
        push exports itself, where it is hosted; a staged copy is still replayed). The chunk
        size needs the model's size up front: ``model_bytes`` if given, else the previous
        version's (weights keep their size); only the first publish walks the export once.
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self.wait_broadcast()
        if self._last_version is not None and version <= self._last_version:
            raise WeightIntegrityError(
                f"version {version} is not newer than the last published {self._last_version}; "
                "versions must increase"
            )
        replay: Callable[[], Export] | None = None
        export: Export | None
        if callable(named_tensors):
            replay, export = named_tensors, named_tensors()
        else:
            export = named_tensors
        out: Outgoing | None = None
        if self.push.stage:  # staged before the chain is looked at: the trainer waits for it
            out = await self.push.prepare(version, export, len(self.chain.live) + 1, model_bytes)
            if out.staged:
                self._staged = out
                self.push.model_bytes = out.nbytes  # (the version counts once the master has it)
                result = PublishResult(
                    version, out.nbytes, out.count, loop.time() - t0, self.master_rank
                )
                result.pushed = loop.create_future()
                self.history.append(result)
                self._track(self._push_staged(out, result, t0))
                return result
        for tries in range(2):
            await self.chain.refresh(self.push.connect)
            if out is None:
                endpoints = len(self.chain.live) + 1
                out = await self.push.prepare(version, export, endpoints, model_bytes, False)
            try:
                result, finish = await self._push(out, t0)
            except _MasterLost as e:
                await self.chain.refresh(self.push.connect)
                if replay is None or tries:
                    raise RelayUnavailable(
                        f"master relay died while version {version} was pushed; the new master "
                        f"is relay rank {self.master_rank}: publish again"
                    ) from e
                log.warning(
                    "master died mid-push; replaying version %s to rank %s",
                    version,
                    self.master_rank,
                )
                export, model_bytes, out = replay(), out.nbytes, None
                continue
            self._last_version = version
            result.master_seconds = result.stall_seconds
            self.history.append(result)
            self._track(finish)
            return result
        raise AssertionError("unreachable")

    async def _push_staged(self, out: Outgoing, result: PublishResult, t0: float) -> None:
        """Background: push a staged version to the master (replaying it to a new master if
        the old one dies), then wait for its broadcast."""
        try:
            for _ in range(3):
                try:
                    await self.chain.refresh(self.push.connect)
                    res, finish = await self._push(out, t0)
                except _MasterLost as e:
                    log.warning(
                        "version %s: master lost (%s); replaying the staged copy", out.version, e
                    )
                    continue
                except Exception as e:
                    result.error = f"{type(e).__name__}: {e}"
                    log.error(
                        "version %s: push to the master failed: %s", out.version, result.error
                    )
                    return
                result.master_seconds, result.master_rank = res.stall_seconds, res.master_rank
                self._last_version = out.version
                _resolve(result.pushed, True)
                await finish
                return
            result.error = "no master took it after 3 attempts"
            log.error("version %s: %s", out.version, result.error)
        finally:
            _resolve(result.pushed, result.master_seconds is not None)

    async def _push(self, out: Outgoing, t0: float) -> tuple[PublishResult, asyncio.Future]:
        """One try through the current chain: return once the master holds the version,
        with the future that finishes the broadcast (and any repair)."""
        attempt = _Attempt(self, out, list(self.chain.live), self._next_attempt())
        await attempt.push()
        self.push.model_bytes = out.nbytes
        self._held = out
        loop = asyncio.get_running_loop()
        result = PublishResult(
            out.version, out.nbytes, out.count, loop.time() - t0, attempt.master[0]
        )
        return result, asyncio.ensure_future(attempt.finish(out.manifest))


class _Attempt:
    """One try at pushing ``out`` down ``members`` (the live chain when it started).

    Per relay a job receives the version from its predecessor and forwards it to its
    successor (``receive``), then finishes forwarding and sharing it (``drain``); the
    trainer sends to the master; the manifest goes to every relay once the export has been
    walked. ``push`` returns once the master committed; ``finish`` waits for the rest.
    """

    def __init__(self, tier: RelayTier, out: Outgoing, members: list[Member], attempt: int):
        self.tier = tier
        self.out = out
        self.members = members
        self.attempt = attempt
        self.master = members[0]
        loop = asyncio.get_running_loop()
        self.master_committed: asyncio.Future = loop.create_future()
        self.jobs = [asyncio.ensure_future(self._job(i)) for i in range(len(members))]
        self.offer: asyncio.Future = asyncio.ensure_future(self._offer_manifest())

    async def _job(self, i: int) -> None:
        host = self.members[i][1]
        pred = TRAINER_RANK if i == 0 else self.members[i - 1][0]
        nxt = self.members[i + 1][0] if i + 1 < len(self.members) else None
        await host.receive(self.out.version, self.out.count, pred, nxt, self.attempt)
        if i == 0 and not self.master_committed.done():
            self.master_committed.set_result(None)
        await host.drain(self.out.version)

    async def _offer_manifest(self) -> None:
        await self.out.manifest_ready.wait()
        manifest = self.out.manifest
        await asyncio.gather(
            *(h.offer_manifest(manifest, self.attempt) for _, h in self.members),
            return_exceptions=True,
        )

    async def call_off(self) -> None:
        """Cancel this try on every live relay and stop its jobs."""
        await self.tier.chain.cancel(self.members, self.out.version, self.attempt)
        for j in (*self.jobs, self.offer):
            j.cancel()
        await asyncio.gather(*self.jobs, self.offer, return_exceptions=True)

    def _master_died(self) -> bool:
        job = self.jobs[0]
        failed = job.done() and not job.cancelled() and job.exception() is not None
        return failed and not self.master[1].is_alive()

    async def push(self) -> None:
        """Send to the master; return once it committed. Raises ``_MasterLost`` if it died
        (the try is called off), the export's ``WeightIntegrityError`` (the relays are left
        empty-handed by an abort marker), or what the master rejected the version with."""
        master_rank, master = self.master
        send = asyncio.ensure_future(self.out.send(master_rank))
        # A transport may wait forever on a dead peer: the master's job fails at once
        # (RelayDied) when it dies, and that interrupts the send.
        await asyncio.wait({send, self.jobs[0]}, return_when=asyncio.FIRST_COMPLETED)
        if not send.done() and self._master_died():
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
            await self.call_off()
            raise _MasterLost(f"master relay rank {master_rank} died: {self.jobs[0].exception()!r}")
        try:
            await send
        except WeightIntegrityError:
            self.offer.cancel()
            await self.out.abort(master_rank)
            await asyncio.wait_for(
                asyncio.gather(*self.jobs, return_exceptions=True), self.tier.timeout_s
            )
            raise
        except Exception as e:  # the wire to the master broke: is the master gone?
            tries, pause = _MASTER_GONE_POLL
            for _ in range(tries):
                if not master.is_alive():
                    break
                await asyncio.sleep(pause)
            await self.call_off()
            if not master.is_alive():
                raise _MasterLost(str(e)) from e
            raise
        await asyncio.wait(
            {self.master_committed, self.jobs[0]}, return_when=asyncio.FIRST_COMPLETED
        )
        if self.master_committed.done():
            return
        err = self.jobs[0].exception()
        assert err is not None
        if not master.is_alive():
            await self.call_off()
            raise _MasterLost(str(err)) from err
        # the master rejected the version: the rest of the chain drains and keeps its own
        self.tier._track(self.finish(None))
        raise err

    async def finish(self, manifest: Any) -> None:
        """Wait for the broadcast; if a relay died, call it off, rebuild and repair."""
        chain, version = self.tier.chain, self.out.version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.tier.timeout_s
        pending = set(self.jobs)
        while pending:
            done, pending = await asyncio.wait(
                pending,
                timeout=max(0.0, deadline - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                log.error("version %s: broadcast timed out after %ss", version, self.tier.timeout_s)
                break
            if chain.any_dead(self.members):
                break
        if pending:
            await chain.cancel(self.members, version, self.attempt)
            for j in pending:
                j.cancel()
        outcomes = await asyncio.gather(*self.jobs, return_exceptions=True)
        for (rank, _), got in zip(self.members, outcomes):
            if isinstance(got, BaseException) and not isinstance(got, ForwardFailed):
                log.error("relay rank %s failed to take version %s: %r", rank, version, got)
        if pending:
            # A relay whose job was called off after it committed still shares the version:
            # asking its status tells its node (a remote relay's proxy reports it shared).
            await asyncio.gather(
                *(h.status() for _, h in self.members if h.is_alive()), return_exceptions=True
            )
        if manifest is not None and chain.any_dead(self.members):
            try:
                await chain.refresh(self.tier.push.connect)
                await chain.repair(
                    version,
                    self.out.count,
                    manifest,
                    self.tier._next_attempt(),
                    self.tier.timeout_s,
                )
            except Exception as e:
                log.error("version %s: repair after a relay death failed: %r", version, e)


def _resolve(fut: asyncio.Future | None, value: bool) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
