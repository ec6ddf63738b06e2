"""The relay tier: trainer → master relay → pipelined chain → node relays → replicas.

The trainer pushes a version to the master relay only and resumes (its stall does not grow
with the number of relays). The master then forwards it down a chain bucket by bucket:
relay ``i`` forwards bucket ``j`` while it receives bucket ``j + 1``. Each relay commits
the version only once every bucket arrived and passed its checksum. Broadcasts run one after
the other in version order; a newer publish waits for the previous broadcast.

Faults: before each publish the tier drops dead relays from the chain and reconnects the
survivors (the first live relay is the master: if the old one died, a new master is elected
and the trainer pushes there). A relay that dies during a broadcast makes the tier call the
version off on every live relay (so nobody waits on a dead peer), rebuild the chain, and
repair: relays that missed the version get it from one that holds it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.host import ABORT, PROBE, ForwardFailed, RelayHost
from laminar_core.relay.latency import optimal_chunks
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import _UNSUMMED, BucketPacker, WeightIntegrityError, checksum
from laminar_core.types import Bucket, WeightManifest

log = logging.getLogger(__name__)

_THREADED_STAGE = 64 << 20  # exports this large are staged on a worker thread
TRAINER_RANK = 0  # relays are ranks 1..p in chain order; the first live relay is the master

__all__ = [
    "ABORT",
    "TRAINER_RANK",
    "HostHandle",
    "PublishResult",
    "RelayTier",
    "RelayUnavailable",
]

Export = Iterable[tuple[str, torch.Tensor]]


class RelayUnavailable(RuntimeError):
    """No live relay can take the version (all dead, or the master died mid-push and the
    export cannot be replayed); publish again once the chain is back."""


class _MasterLost(RuntimeError):
    pass


class HostHandle(Protocol):
    """What the tier drives: a ``RelayHost`` in this process or a proxy to one elsewhere
    (``RelayProcess``, a Ray actor). Every method but ``is_alive`` is a coroutine."""

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


_PAGE = 4096


def _peek(export: Export) -> tuple[torch.Tensor | None, Export]:
    """The export's first tensor (``None`` if empty) and the export, intact: whether a
    version is phantom (meta tensors, the simulator's) or on a GPU shows on the first."""
    if isinstance(export, list):
        return (export[0][1] if export else None), export
    it = iter(export)
    first = next(it, None)
    if first is None:
        return None, iter(())
    return first[1], itertools.chain([first], it)


class _Staged:
    """A version copied out of the trainer into host buffers: what a staged push sends (and
    replays to a new master if the old one dies). Checksums are taken as the buckets go out,
    not while the trainer waits for the copy."""

    def __init__(self, manifest: WeightManifest, buckets: list[Bucket], chunk: int) -> None:
        self._manifest = manifest
        self._buckets = buckets
        self.sizes = list(manifest.bucket_sizes)
        self.checksums = list(manifest.checksums)
        self.chunk = chunk
        self.bytes = sum(self.sizes)

    @property
    def manifest(self) -> WeightManifest:
        m = self._manifest
        return WeightManifest(m.version, m.tensors, self.sizes, self.checksums)

    def buckets(self) -> Iterable[Bucket]:
        for i, b in enumerate(self._buckets):
            if b.checksum == _UNSUMMED and b.data is not None:
                b.checksum = self.checksums[i] = checksum(b.data)
            yield b


class RelayTier:
    """Relays chained in rank order; the first live one is the master.

    Either ``relays`` (``NodeRelay`` objects in this process) with ``transport_factory(rank)``
    returning an unopened ``WeightTransport`` per endpoint, or ``hosts`` (handles to relays
    hosted elsewhere, ranks 1..p in order) with the trainer's own ``trainer_transport``.

    Staging (``stage=True``): ``publish`` copies the version into host buffers (recycled
    across versions: one model's worth) and returns; the push to the master and the chain
    broadcast run in the background. The trainer's stall is then one copy of its weights
    (the GPU → host copy on a GPU trainer), flat in the number of relays and independent of
    the link, and a master that dies mid-push is always replayed from the staged copy.
    Phantom (simulated) versions are never staged: their push time is the modelled stall.

    Chunking: ``chunks`` (> 0) fixes the chunk count; else ``link=(t_byte, t_start)`` (from
    config), the transport's ``link_model()``, or a measurement (``calibrate=True``: probes
    the trainer → master link at ``open``) feed the latency model's ``k*``; with none of
    them ``bucket_bytes`` fixes the chunk size.
    """

    def __init__(
        self,
        relays: list[NodeRelay] | None = None,
        transport_factory: Callable[[int], WeightTransport] | None = None,
        bucket_bytes: int = 64 << 20,
        chunks: int = 0,
        *,
        hosts: list[HostHandle] | None = None,
        trainer_transport: WeightTransport | None = None,
        link: tuple[float, float] | None = None,
        calibrate: bool = False,
        max_chunks: int = 4096,
        timeout_s: float = 600.0,
        stage: bool = False,
    ) -> None:
        if hosts is None and not relays:
            raise ValueError("the relay tier needs at least one relay")
        if hosts is not None and trainer_transport is None:
            raise ValueError("a tier over relay hosts needs the trainer's own transport")
        if hosts is None and transport_factory is None:
            raise ValueError("a tier over in-process relays needs a transport_factory")
        self.relays = list(relays or [])
        self._factory = transport_factory
        self._given_hosts = hosts
        self._trainer = trainer_transport
        self.bucket_bytes = bucket_bytes
        self.chunks = chunks
        self.link = link
        self.calibrate_on_open = calibrate
        self.max_chunks = max_chunks
        self.timeout_s = timeout_s
        self._hosts: list[tuple[int, HostHandle]] = []
        self._chain: list[tuple[int, HostHandle]] = []
        self._endpoints: dict[int, Any] = {}
        self._model_bytes: int | None = None  # size of the last version published
        self._last_version: int | None = None
        self.history: list[PublishResult] = []
        self._ring: list[memoryview] = []  # the trainer side's bucket buffers, recycled
        self.stage = stage
        self._staging: list[memoryview] = []  # a staged version's buffer, recycled
        self._background: set[asyncio.Future] = set()  # broadcasts (and repairs) under way
        self.rebuilds = 0  # times the chain was rebuilt after a relay died
        self.on_master_change: list[Callable[[int, Any], None]] = []  # (rank, endpoint)
        # (rank, version): a relay host committed the version and shared it with its node
        # (its ``drain`` returned); how a driver-side view of a remote relay learns of it.
        self.on_ready: list[Callable[[int, int], None]] = []
        self._seen: set[tuple[int, int]] = set()  # (rank, version) on_ready already told
        self._attempts = 0

    # --- membership ---------------------------------------------------------------------------

    @property
    def master_rank(self) -> int:
        """Rank the trainer pushes to (the first live relay)."""
        return self._chain[0][0]

    @property
    def chain_ranks(self) -> list[int]:
        return [r for r, _ in self._chain]

    @property
    def _transports(self) -> dict[int, WeightTransport]:
        """Endpoints of this process by rank (trainer and in-process relays)."""
        out: dict[int, WeightTransport] = {TRAINER_RANK: self._trainer}  # type: ignore[dict-item]
        for r, h in self._hosts:
            if isinstance(h, RelayHost):
                out[r] = h.transport
        return out

    async def open(self) -> None:
        if self._given_hosts is None:
            assert self._factory is not None
            self._trainer = self._factory(TRAINER_RANK)
            self._hosts = [
                (rank, RelayHost(r, self._factory(rank), rank))
                for rank, r in enumerate(self.relays, start=1)
            ]
        else:
            self._hosts = list(enumerate(self._given_hosts, start=1))
        assert self._trainer is not None
        await self._trainer.open("trainer", TRAINER_RANK, {})
        self._endpoints[TRAINER_RANK] = self._trainer.endpoint()
        eps = await asyncio.gather(*(h.open() for _, h in self._hosts))
        self._endpoints.update({r: ep for (r, _), ep in zip(self._hosts, eps)})
        await self._refresh(force=True)
        if self.calibrate_on_open and self.chunks <= 0 and self.link is None:
            await self.calibrate()

    async def close(self) -> None:
        await self._settle()
        for _, h in self._hosts:
            try:
                await h.close()
            except Exception as e:  # a dead relay cannot close cleanly
                log.debug("closing relay host: %s", e)
        if self._trainer is not None:
            await self._trainer.close()

    async def _refresh(self, force: bool = False) -> None:
        """Cut dead relays out of the chain, elect the master, and reconnect the survivors."""
        alive = [(r, h) for r, h in self._hosts if h.is_alive()]
        if not alive:
            raise RelayUnavailable("every relay is dead: restart relays before publishing")
        if not force and [r for r, _ in alive] == self.chain_ranks:
            return
        old = self._chain[0][0] if self._chain else None
        gone = sorted(set(self.chain_ranks) - {r for r, _ in alive})
        self._chain = alive
        peers = {TRAINER_RANK: self._endpoints[TRAINER_RANK]}
        peers.update({r: self._endpoints[r] for r, _ in alive})
        assert self._trainer is not None
        await asyncio.gather(self._trainer.connect(peers), *(h.connect(peers) for _, h in alive))
        if not force:
            self.rebuilds += 1
            log.warning("relay(s) %s cut out; chain is now %s", gone, self.chain_ranks)
        if old is not None and alive[0][0] != old:
            log.warning("master relay %s is gone: relay %s is the new master", old, alive[0][0])
        if old != alive[0][0]:
            for cb in self.on_master_change:
                cb(alive[0][0], self._endpoints[alive[0][0]])

    # --- chunking -----------------------------------------------------------------------------

    def chunk_bytes(self, model_bytes: int, align: bool = False) -> int:
        """Bucket size for a model of ``model_bytes`` (see class docstring). ``align``
        (real bytes) rounds a size from ``k`` up to whole pages, so every bucket of a
        version starts page-aligned in the sender's and receivers' buffers (typed views
        of it and DMA want that); phantom versions keep the model's exact sizes."""
        k = self.chunks
        link = self.link
        if link is None and self._trainer is not None:
            link = self._trainer.link_model()
        if k <= 0 and link is not None:
            t_byte, t_start = link
            endpoints = len(self._chain or self._hosts or self.relays) + 1
            k = optimal_chunks(endpoints, model_bytes, t_byte, t_start, self.max_chunks)
        if k > 0:
            chunk = max(1, math.ceil(model_bytes / k))
            if align and chunk > _PAGE:
                chunk = math.ceil(chunk / _PAGE) * _PAGE
            return chunk
        return self.bucket_bytes

    async def calibrate(
        self, small: int = 4096, large: int = 8 << 20, reps: int = 4
    ) -> tuple[float, float]:
        """Measure ``(t_byte, t_start)`` on the trainer → master link and use it for ``k*``."""
        assert self._trainer is not None
        loop = asyncio.get_running_loop()
        rank, master = self._chain[0]

        async def timed(size: int) -> float:
            b = Bucket(PROBE, 0, size, 0, bytes(size))

            async def push() -> None:
                for _ in range(reps):
                    await self._trainer.send(b, rank)  # type: ignore[union-attr]

            t0 = loop.time()
            await asyncio.gather(master.probe(TRAINER_RANK, reps), push())
            return (loop.time() - t0) / reps

        await timed(small)  # warm the link up (connection set-up is not t_start)
        ts, tl = await timed(small), await timed(large)
        t_start = max(ts, 1e-7)
        t_byte = max(tl - ts, 1e-12) / (large - small)
        self.link = (t_byte, t_start)
        log.info(
            "relay link measured: t_byte=%.3g s/B (%.2f GB/s), t_start=%.3g s",
            t_byte,
            1e-9 / t_byte,
            t_start,
        )
        return self.link

    # --- publishing ---------------------------------------------------------------------------

    async def _settle(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _track(self, aw: Any) -> asyncio.Future:
        fut = asyncio.ensure_future(aw)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)
        return fut

    async def wait_broadcast(self) -> None:
        """Return once the last version's chain broadcast (and any repair) has ended."""
        await self._settle()

    async def publish(
        self,
        version: int,
        named_tensors: Export | Callable[[], Export],
        model_bytes: int | None = None,
    ) -> PublishResult:
        """Push ``version`` to the master; return once the master holds it (the trainer's
        stall), or once it is staged in host memory with ``stage=True`` (see class
        docstring). The chain broadcast continues in the background.

        The export is streamed bucket by bucket, so the trainer holds one bucket at a time.
        The chunk size needs the model's size up front: ``model_bytes`` if given, else the
        previous version's (weights keep their size); only the very first publish walks the
        export once to measure it. ``named_tensors`` may be a callable returning the export:
        then a master that dies mid-push is replaced and the export replayed to the new one.
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._settle()
        if self._last_version is not None and version <= self._last_version:
            raise WeightIntegrityError(
                f"version {version} is not newer than the last published {self._last_version}; "
                "versions must increase"
            )
        replayable = callable(named_tensors)
        export = named_tensors() if replayable else named_tensors  # type: ignore[operator]
        if self.stage:
            staged, export = await self._stage(version, export, model_bytes, replayable)
            if staged is not None:
                result = PublishResult(
                    version, staged.bytes, len(staged.sizes), loop.time() - t0, self.master_rank
                )
                self._model_bytes = staged.bytes  # (the version counts once the master has it)
                result.pushed = loop.create_future()
                self.history.append(result)
                self._track(self._push_staged(staged, result, t0))
                return result
        for attempt in range(2):
            await self._refresh()
            try:
                result, finish = await self._publish_once(version, export, model_bytes, t0)  # type: ignore[arg-type]
            except _MasterLost as e:
                await self._refresh()
                if not replayable or attempt:
                    raise RelayUnavailable(
                        f"master relay died while version {version} was pushed; the new master "
                        f"is relay rank {self.master_rank}: publish again"
                    ) from e
                log.warning(
                    "master died mid-push; replaying version %s to rank %s",
                    version,
                    self.master_rank,
                )
                export = named_tensors()  # type: ignore[operator]
                continue
            self._last_version = version
            result.master_seconds = result.stall_seconds
            self.history.append(result)
            self._track(finish)
            return result
        raise AssertionError("unreachable")

    def _check_size(
        self, version: int, index: int, nbytes: int, chunk: int, count: int, model_bytes: int
    ) -> None:
        want = min(chunk, model_bytes - index * chunk)
        if index >= count or nbytes != want:
            raise WeightIntegrityError(
                f"version {version}: the export is not the announced {model_bytes} bytes "
                f"(bucket {index} has {nbytes}, expected {max(want, 0)}); weights must keep "
                "their names, shapes and dtypes between versions"
            )

    async def _stage(
        self, version: int, export: Export, model_bytes: int | None, threaded: bool
    ) -> tuple[_Staged | None, Export]:
        """Copy ``export`` into the staging buffers; ``(None, export)`` for a phantom one.

        A large materialised export (a list) is copied on a worker thread so the event loop
        keeps serving; a generator (it may run collectives) is walked on this thread.
        """
        first, export = _peek(export)
        if first is None or first.device.type == "meta":
            return None, export
        if model_bytes is None:
            model_bytes = self._model_bytes
        if model_bytes is None:
            export = list(export)
            model_bytes = sum(t.numel() * t.element_size() for _, t in export)
        chunk = self.chunk_bytes(model_bytes, align=True)
        count = math.ceil(model_bytes / chunk)
        packer = BucketPacker(
            export,
            version,
            chunk,
            ring=self._staging,
            pin=first.device.type == "cuda",
            checksums=False,  # taken as the buckets go out: the trainer waits for the copy only
            arena_bytes=model_bytes,  # one copy per tensor into one recycled host buffer
        )

        def run() -> list[Bucket]:
            out = []
            for b in packer.buckets():
                self._check_size(version, b.index, b.nbytes, chunk, count, model_bytes)
                out.append(b)
            if len(out) != count:
                self._check_size(version, len(out), 0, chunk, count, model_bytes)
            return out

        big = model_bytes >= _THREADED_STAGE  # below it a thread hop costs more than the copy
        buckets = await asyncio.to_thread(run) if threaded and big else run()
        return _Staged(packer.manifest, buckets, chunk), export

    async def _push_staged(self, staged: _Staged, result: PublishResult, t0: float) -> None:
        """Background: push a staged version to the master (replaying it to a new master if
        the old one dies), then wait for its broadcast."""
        try:
            await self._push_staged_once(staged, result, t0)
        finally:
            if result.pushed is not None and not result.pushed.done():
                result.pushed.set_result(result.master_seconds is not None)

    async def _push_staged_once(self, staged: _Staged, result: PublishResult, t0: float) -> None:
        version = result.version
        for _ in range(3):
            try:
                await self._refresh()
                res, finish = await self._publish_once(version, staged, staged.bytes, t0)
            except _MasterLost as e:
                log.warning("version %s: master lost (%s); replaying the staged copy", version, e)
                continue
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
                log.error("version %s: push to the master failed: %s", version, result.error)
                return
            result.master_seconds, result.master_rank = res.stall_seconds, res.master_rank
            self._last_version = version
            if result.pushed is not None and not result.pushed.done():
                result.pushed.set_result(True)
            await finish
            return
        result.error = "no master took it after 3 attempts"
        log.error("version %s: %s", version, result.error)

    async def _publish_once(
        self, version: int, source: Export | _Staged, model_bytes: int | None, t0: float
    ) -> tuple[PublishResult, asyncio.Future]:
        """Push one version to the current master; return once it holds it, with the task
        that finishes the broadcast (the caller tracks it)."""
        loop = asyncio.get_running_loop()
        attempt = self._next_attempt()
        packer: BucketPacker | _Staged
        if isinstance(source, _Staged):
            packer, model_bytes, chunk = source, source.bytes, source.chunk
            count = len(source.sizes)
        else:
            if model_bytes is None:
                model_bytes = self._model_bytes
            if model_bytes is None:
                source = list(source)
                model_bytes = sum(t.numel() * t.element_size() for _, t in source)
            first, source = _peek(source)
            real = first is not None and not first.is_meta
            chunk = self.chunk_bytes(model_bytes, align=real)
            count = math.ceil(model_bytes / chunk)
            packer = BucketPacker(source, version, chunk, reuse=True, ring=self._ring)
        chain = list(self._chain)
        master_rank, master = chain[0]
        master_done = loop.create_future()

        async def host_job(i: int) -> None:
            host = chain[i][1]
            pred = TRAINER_RANK if i == 0 else chain[i - 1][0]
            nxt = chain[i + 1][0] if i + 1 < len(chain) else None
            await host.receive(version, count, pred, nxt, attempt)
            if i == 0 and not master_done.done():
                master_done.set_result(loop.time())
            try:
                await host.drain(version)
            except ForwardFailed:
                self._ready(chain[i][0], version)  # good here; the repair serves the rest
                raise
            self._ready(chain[i][0], version)

        def check(index: int, nbytes: int) -> None:
            self._check_size(version, index, nbytes, chunk, count, model_bytes)  # type: ignore[arg-type]

        async def offer_manifest() -> None:
            m = packer.manifest
            await asyncio.gather(
                *(h.offer_manifest(m, attempt) for _, h in chain), return_exceptions=True
            )

        offers: list[asyncio.Future] = []

        async def trainer_send() -> None:
            # Each bucket is checked before it leaves, and the last one is held back until
            # the export is exhausted, so a wrong-sized export never completes a version.
            tr, held = self._trainer, None
            for b in packer.buckets():
                check(b.index, b.nbytes)
                if held is not None:
                    await tr.send(held, master_rank)  # type: ignore[union-attr]
                held = b
            if len(packer.sizes) != count:
                check(len(packer.sizes), 0)
            offers.append(asyncio.ensure_future(offer_manifest()))
            if held is not None:
                await tr.send(held, master_rank)  # type: ignore[union-attr]

        jobs = [asyncio.ensure_future(host_job(i)) for i in range(len(chain))]

        async def call_off() -> None:
            await asyncio.gather(
                *(h.cancel(version, attempt) for _, h in chain if h.is_alive()),
                return_exceptions=True,
            )
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, *offers, return_exceptions=True)

        # A transport may wait forever on a dead peer: if the master dies while the trainer
        # pushes, its job fails (RelayDied) and this interrupts the push.
        me, lost = asyncio.current_task(), []

        def on_master(job: asyncio.Future) -> None:
            failed = not job.cancelled() and job.exception() is not None
            if failed and not master.is_alive() and me is not None and not lost and pushing:
                lost.append(job.exception())
                me.cancel()

        pushing = True
        jobs[0].add_done_callback(on_master)
        try:
            await trainer_send()
        except asyncio.CancelledError:
            if not lost:
                raise
            me.uncancel()  # type: ignore[union-attr]
            await call_off()
            raise _MasterLost(f"master relay rank {master_rank} died: {lost[0]!r}") from None
        except WeightIntegrityError:
            pushing = False
            # The abort marker travels the chain like data, so every link is left empty.
            await self._trainer.send(Bucket(version, ABORT, 0), master_rank)  # type: ignore[union-attr]
            await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), self.timeout_s)
            raise
        except Exception as e:  # the wire to the master broke: is the master gone?
            pushing = False
            for _ in range(50):
                if not master.is_alive():
                    break
                await asyncio.sleep(0.05)
            await call_off()
            if not master.is_alive():
                raise _MasterLost(str(e)) from e
            raise
        pushing = False
        await asyncio.wait([master_done, jobs[0]], return_when=asyncio.FIRST_COMPLETED)
        if not master_done.done():
            err = jobs[0].exception()
            if not master.is_alive():
                await call_off()
                raise _MasterLost(str(err)) from err
            # the master rejected the version: the rest of the chain drains and keeps its own
            self._track(self._finish(version, attempt, chain, jobs, count, None))
            raise err  # type: ignore[misc]
        self._model_bytes = model_bytes
        result = PublishResult(version, model_bytes, count, loop.time() - t0, master_rank)
        finish = asyncio.ensure_future(
            self._finish(version, attempt, chain, jobs, count, packer.manifest)
        )
        return result, finish

    async def _finish(
        self,
        version: int,
        attempt: int,
        chain: list[tuple[int, HostHandle]],
        jobs: list[asyncio.Task],
        count: int,
        manifest: WeightManifest | None,
    ) -> None:
        """Wait for the broadcast; if a relay died, call it off, rebuild and repair."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pending = set(jobs)
        while pending:
            done, pending = await asyncio.wait(
                pending,
                timeout=max(0.0, deadline - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                log.error("version %s: broadcast timed out after %ss", version, self.timeout_s)
                break
            if any(not h.is_alive() for _, h in chain):
                break
        if pending:
            await asyncio.gather(
                *(h.cancel(version, attempt) for _, h in chain if h.is_alive()),
                return_exceptions=True,
            )
            for j in pending:
                j.cancel()
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        for (rank, _), out in zip(chain, outcomes):
            if isinstance(out, BaseException):
                log.error("relay rank %s failed to take version %s: %r", rank, version, out)
        if pending:  # relays that hold it although their job was called off are ready too
            missed = [(r, h) for r, h in chain if h.is_alive() and (r, version) not in self._seen]
            held = await asyncio.gather(*(h.status() for _, h in missed), return_exceptions=True)
            for (rank, _), v in zip(missed, held):
                if v == version:
                    self._ready(rank, version)
        if manifest is not None and any(not h.is_alive() for _, h in chain):
            try:
                await self._refresh()
                await self._repair(version, count, manifest)
            except Exception as e:
                log.error("version %s: repair after a relay death failed: %r", version, e)

    def _next_attempt(self) -> int:
        """A new number for a try at a version: a relay pairs each ``receive`` with the
        ``offer_manifest`` of the same try, whichever reaches it first."""
        self._attempts += 1
        return self._attempts

    def _ready(self, rank: int, version: int) -> None:
        if (rank, version) in self._seen:
            return
        self._seen = {(r, v) for r, v in self._seen if v == version} | {(rank, version)}
        for cb in self.on_ready:
            try:
                cb(rank, version)
            except Exception:  # a listener's bug must not fail the broadcast
                log.exception("relay on_ready listener failed")

    async def _repair(self, version: int, count: int, manifest: WeightManifest) -> None:
        """Relays of the rebuilt chain that missed ``version`` get it from one holding it."""
        chain = list(self._chain)
        attempt = self._next_attempt()
        held = await asyncio.gather(*(h.status() for _, h in chain), return_exceptions=True)
        have = [chain[i] for i, v in enumerate(held) if v == version]
        need = [chain[i] for i, v in enumerate(held) if isinstance(v, int) and v < version]
        if not have or not need:
            if need:
                log.error(
                    "version %s: no live relay holds it; %s keep older versions",
                    version,
                    [r for r, _ in need],
                )
            return
        sub = [have[0], *need]
        log.warning("repairing version %s: rank %s -> %s", version, sub[0][0], [r for r, _ in need])

        async def target(i: int) -> None:
            host = sub[i][1]
            nxt = sub[i + 1][0] if i + 1 < len(sub) else None
            got = asyncio.ensure_future(host.receive(version, count, sub[i - 1][0], nxt, attempt))
            await host.offer_manifest(manifest, attempt)
            await got
            await host.drain(version)
            self._ready(sub[i][0], version)

        tasks = [asyncio.ensure_future(sub[0][1].serve(version, sub[1][0]))]
        tasks += [asyncio.ensure_future(target(i)) for i in range(1, len(sub))]
        _, pending = await asyncio.wait(tasks, timeout=self.timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(
            *(h.cancel(version, attempt) for _, h in need if h.is_alive() and pending),
            return_exceptions=True,
        )
        for t, (rank, _) in zip(tasks, sub):
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.error(
                    "repair of version %s at rank %s failed: %r", version, rank, t.exception()
                )

    def relay_for_node(self, node: int) -> NodeRelay:
        for r in self.relays:
            if r.node == node:
                return r
        raise LookupError(f"no relay on node {node}")
