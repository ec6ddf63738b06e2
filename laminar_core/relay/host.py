"""A relay host: one node relay, its transport endpoint, and the pipelined receive loop.

The host lives where its relay lives: in the driver (in-process tier, simulator), or in a
relay process or Ray actor (``relay.server.RelayServer``), driven over RPC by the tier through
a ``RemoteRelay``. The calls are ``relay.protocol``'s. Per version the tier calls
``receive(version, count, pred, nxt)`` on every host of the chain: the host reads ``count``
buckets from ``pred`` and hands each to a forwarding task towards ``nxt`` as soon as it has
passed its checksum, so relay ``i`` forwards bucket ``j`` while it receives bucket ``j + 1``.
``receive`` returns once the version is committed here (the master's return ends the
trainer's stall); ``drain`` returns once forwarding finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import WeightIntegrityError
from laminar_core.relay.protocol import ABORT, ForwardFailed, RelayCancelled
from laminar_core.types import Bucket, WeightManifest

log = logging.getLogger(__name__)

_THREADED_CHECK = 1 << 20  # buckets this large are checked on a worker thread


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass
class _Job:
    version: int
    attempt: int
    manifest: asyncio.Future
    committed: asyncio.Future
    forwarded: asyncio.Future
    tasks: list[asyncio.Task] = field(default_factory=list)
    shared: Any = None  # what ``on_commit`` returned (awaited by ``drain``)


class RelayHost:
    """Drives one ``NodeRelay`` over one ``WeightTransport`` endpoint (rank ``rank``).

    ``die_at=(version, index)`` is fault injection for chaos tests: the hosting process
    exits the moment that bucket arrives (``os._exit``), as a crashed relay would.
    ``on_commit(relay)`` runs when a version is committed here and may return an awaitable
    (e.g. the write into the node's shared memory): ``drain`` and ``status`` wait for it.
    """

    def __init__(
        self,
        relay: NodeRelay,
        transport: WeightTransport,
        rank: int,
        manifest_timeout_s: float = 600.0,
        die_at: tuple[int, int] | None = None,
        on_commit: Callable[[NodeRelay], Any] | None = None,  # may return an awaitable
    ) -> None:
        self.relay = relay
        self.transport = transport
        self.rank = rank
        self.manifest_timeout_s = manifest_timeout_s
        self.die_at = tuple(die_at) if die_at else None
        self.on_commit = on_commit
        self._jobs: dict[int, _Job] = {}
        self._sharing: dict[int, Any] = {}  # version -> its on_commit awaitable, newest only
        self._called_off: dict[int, int] = {}  # version -> the last attempt called off
        self._serving: dict[int, asyncio.Task] = {}
        self._probe_buf = memoryview(b"")  # calibration buckets land here, then are dropped

    # --- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> Any:
        await self.transport.open("relay", self.rank, {})
        return self.transport.endpoint()

    async def connect(self, peers: dict[int, Any]) -> None:
        await self.transport.connect(peers)

    @property
    def relay_id(self) -> int:
        return self.relay.relay_id

    def is_alive(self) -> bool:
        return self.relay.alive

    async def status(self) -> int:
        """The version held here, once its share with the node (if one is under way) ended:
        what the tier reads as "ready on this node"."""
        held = self.relay.version
        sharing = self._sharing.get(held)
        if inspect.isawaitable(sharing):
            with contextlib.suppress(Exception):
                await asyncio.shield(sharing)
        return held

    async def close(self) -> None:
        for v in list(self._jobs):
            await self.cancel(v)
        await self.transport.close()

    # --- one version ---------------------------------------------------------------------------

    def _job(self, version: int, attempt: int) -> _Job | None:
        """The reception of ``version`` for the tier's ``attempt`` (made by whichever of its
        ``receive`` and ``offer_manifest`` comes first: over Ray, an async actor does not
        run calls in the order they were sent); ``None`` for a call of an older attempt."""
        job = self._jobs.get(version)
        if (job is not None and attempt < job.attempt) or attempt <= self._called_off.get(
            version, -1
        ):
            return None  # a late call of an attempt that was replaced or called off
        if job is None or attempt > job.attempt:
            loop = asyncio.get_running_loop()
            job = _Job(
                version, attempt, loop.create_future(), loop.create_future(), loop.create_future()
            )
            for fut in (job.manifest, job.committed, job.forwarded):
                fut.add_done_callback(_retrieve)  # outcomes nobody awaits are not "lost"
            self._jobs[version] = job
        return job

    async def offer_manifest(self, manifest: WeightManifest, attempt: int = 0) -> None:
        """The manifest of the version being received (complete once the export is walked),
        for the tier's ``attempt``: it may come before or after ``receive`` of the same
        attempt; one of an older attempt is dropped (it must not complete a later attempt
        with the wrong manifest)."""
        job = self._job(manifest.version, attempt)
        if job is not None and not job.manifest.done():
            job.manifest.set_result(manifest)

    async def receive(
        self, version: int, count: int, pred: int, nxt: int | None, attempt: int = 0
    ) -> int:
        """Receive ``count`` buckets of ``version`` from ``pred``, forwarding each to ``nxt``
        (``attempt``: the tier's number for this try at the version, see ``_job``).

        Returns the version once committed here; raises ``WeightIntegrityError`` if a bucket
        or the manifest fails its checks (the relay keeps its last good version),
        ``RelayCancelled`` if the tier called it off (or a newer attempt replaced this
        one), or the transport's error.
        """
        job = self._job(version, attempt)
        if job is None or job.tasks:
            raise RelayCancelled(f"version {version}: attempt {attempt} was replaced")
        job.tasks.append(asyncio.ensure_future(self._run(job, count, pred, nxt)))
        return await asyncio.shield(job.committed)

    async def drain(self, version: int) -> None:
        """Return once this host finished forwarding ``version`` and sharing it with its
        node (raise what went wrong: ``ForwardFailed`` if only the forwarding did)."""
        job = self._jobs.get(version)
        if job is None:
            return
        try:
            try:
                await asyncio.shield(job.forwarded)
                lost = None
            except (asyncio.CancelledError, RelayCancelled):
                raise
            except BaseException as e:  # the next relay is gone: still share it here
                lost = e
            if inspect.isawaitable(job.shared):
                await job.shared
            if lost is not None:
                raise ForwardFailed(
                    f"relay {self.relay.relay_id} holds version {version} but could not "
                    f"forward it: {lost}"
                ) from lost
        finally:
            if job.committed.done() and job.forwarded.done():
                self._jobs.pop(version, None)

    async def cancel(self, version: int, attempt: int = 0) -> None:
        """Call off ``version`` here, up to the tier's ``attempt``: stop receiving and
        forwarding it (a peer died), and refuse that attempt's calls that arrive later. A
        version already committed here stays (and its sharing with the node completes)."""
        job = self._jobs.get(version)
        upto = max(attempt, job.attempt if job is not None else 0)
        self._called_off[version] = max(self._called_off.get(version, 0), upto)
        if job is not None and job.attempt <= upto:
            del self._jobs[version]
        else:
            job = None
        if job is not None:
            held = job.committed.done() and not job.committed.exception()
            if held and inspect.isawaitable(job.shared):
                # committed here: the version is good, finish sharing it with the node
                with contextlib.suppress(Exception):
                    await job.shared
            for t in job.tasks:
                t.cancel()
            await asyncio.gather(*job.tasks, return_exceptions=True)
            for fut in (job.committed, job.forwarded, job.manifest):
                if not fut.done():
                    fut.set_exception(RelayCancelled(f"version {version} cancelled"))
        task = self._serving.pop(version, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def serve(self, version: int, nxt: int) -> None:
        """Send the held ``version`` to ``nxt`` (repairing a chain after a relay died)."""
        data = self.relay.read()
        if data.version != version:
            raise WeightIntegrityError(
                f"relay {self.relay.relay_id} holds version {data.version}, not {version}"
            )

        async def run() -> None:
            for b in data.buckets:
                await self.transport.send(b, nxt)

        task = self._serving[version] = asyncio.ensure_future(run())
        try:
            await task
        finally:
            self._serving.pop(version, None)

    def _scratch(self, nbytes: int) -> memoryview:
        if len(self._probe_buf) < nbytes:
            self._probe_buf = memoryview(bytearray(nbytes))
        return self._probe_buf[:nbytes]

    async def probe(self, pred: int, count: int) -> None:
        """Receive and drop ``count`` calibration buckets from ``pred``."""
        for _ in range(count):
            await self.transport.recv(pred, self._scratch)

    # --- the pipeline --------------------------------------------------------------------------

    async def _run(self, job: _Job, count: int, pred: int, nxt: int | None) -> None:
        relay, tr, version = self.relay, self.transport, job.version
        loop = asyncio.get_running_loop()
        # (bucket, its check) in arrival order; the check (checksum + staging) runs on a
        # worker thread so the next bucket's receive is posted at once instead of waiting
        # for it, and a bucket is forwarded only once it passed.
        fwd: asyncio.Queue[tuple[Bucket, asyncio.Future | None] | None] = asyncio.Queue()
        checks: list[asyncio.Future] = []
        failed: list[BaseException] = []

        def note(fut: asyncio.Future) -> None:
            if not fut.cancelled() and fut.exception() is not None and not failed:
                failed.append(fut.exception())  # type: ignore[arg-type]

        async def forward() -> None:
            aborted = False  # after an abort marker nothing more goes down this link
            try:
                while (item := await fwd.get()) is not None:
                    b, check = item
                    if aborted:
                        continue
                    if check is not None:
                        try:
                            await check
                        except WeightIntegrityError:
                            b = Bucket(version, ABORT, 0)
                    aborted = b.index == ABORT
                    await tr.send(b, nxt)  # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # the next relay is gone: keep receiving regardless
                if not job.forwarded.done():
                    job.forwarded.set_exception(e)
                return
            if not job.forwarded.done():
                job.forwarded.set_result(None)

        fwd_task = None
        if nxt is not None:
            fwd_task = asyncio.ensure_future(forward())
            job.tasks.append(fwd_task)
        elif not job.forwarded.done():
            job.forwarded.set_result(None)

        def stage(b: Bucket) -> None:
            if b.version != version:
                raise WeightIntegrityError(
                    f"relay {relay.relay_id}: got a bucket of version {b.version} "
                    f"while receiving {version}"
                )
            relay.put(b)

        failure: BaseException | None = None
        try:
            relay.begin(version, count)
        except WeightIntegrityError as e:
            failure = e  # still drain what upstream sends, so every link stays clean
            fwd.put_nowait((Bucket(version, ABORT, 0), None))
        try:
            for _ in range(count):
                try:
                    b = await tr.recv(pred, relay.alloc)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # the predecessor is gone: nothing more will come
                    if failure is None:
                        failure = e
                        fwd.put_nowait((Bucket(version, ABORT, 0), None))
                    break
                if self.die_at is not None and (b.version, b.index) == self.die_at:
                    log.error("relay %s: injected fault, exiting", relay.relay_id)
                    os._exit(17)
                if b.index == ABORT:  # upstream gave up: it sends nothing after this
                    if failure is None:
                        failure = WeightIntegrityError(f"version {version} abandoned upstream")
                        fwd.put_nowait((b, None))
                    break
                if failure is not None or failed:
                    continue  # draining what upstream still sends
                if b.data is not None and len(b.data) >= _THREADED_CHECK:
                    check = loop.run_in_executor(None, stage, b)
                else:  # small or phantom: a thread hop costs more than the check
                    check = loop.create_future()
                    try:
                        stage(b)
                        check.set_result(None)
                    except WeightIntegrityError as e:
                        check.set_exception(e)
                check.add_done_callback(note)
                checks.append(check)
                fwd.put_nowait((b, check))
            await asyncio.gather(*checks, return_exceptions=True)
            if failure is None and failed:
                failure = failed[0]
            if failure is None:
                manifest = await asyncio.wait_for(
                    asyncio.shield(job.manifest), self.manifest_timeout_s
                )
                relay.commit(manifest)  # serve it as soon as it is complete here
                if self.on_commit is not None:
                    job.shared = self.on_commit(relay)
                    if inspect.isawaitable(job.shared):
                        job.shared = asyncio.ensure_future(job.shared)
                    self._sharing = {version: job.shared}
        except asyncio.CancelledError:
            relay.abandon(version)
            raise
        except BaseException as e:
            failure = failure or e
        finally:
            fwd.put_nowait(None)
        if failure is not None:
            relay.abandon(version)
            if not job.committed.done():
                job.committed.set_exception(failure)
        elif not job.committed.done():
            job.committed.set_result(version)
        if fwd_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await fwd_task
