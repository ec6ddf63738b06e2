"""``WeightTransport`` over NIXL: one-sided RDMA writes into registered host buffers.

Each endpoint is a NIXL agent (UCX backend: RDMA verbs on a cluster, TCP on a laptop and in
CI). At ``open`` it allocates and registers two pools of host memory once, a receive pool and
a send pool of ``slots`` slots each; they are reused for every bucket of every version (no
per-version registration, which is what makes RDMA registration cost disappear).
``endpoint()`` is the agent's metadata (it carries those registrations); ``connect(peers)``
loads the peers' metadata.

Flow control is receiver-driven: the first ``recv(peer)`` grants the peer some receive slots
(a notification naming slot and address); the sender copies a fragment of the bucket into a
free send slot and WRITEs it straight into a granted slot, with a notification carrying the
bucket header and the fragment's place; the receiver copies the fragment out and re-grants
the slot. Buckets larger than a slot travel as several fragments, several in flight at once.
Notifications carry a per-link sequence number, so fragments and empty or phantom buckets
(sent as bare notifications) are consumed in the order sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar_core import (
    BUCKET_HEADER_BYTES,
    Alloc,
    Bucket,
    BuildContext,
    TransportError,
    WeightTransport,
    decode_bucket_header,
    encode_bucket_header,
)

_GRANT = b"G"  # receiver -> sender: slot, address
_DATA = b"D"  # sender -> receiver: seq, slot (-1: no payload), frag_off, frag_len + header
_G = struct.Struct("<qq")
_D = struct.Struct("<qqqq")


@dataclass
class NixlOptions:
    """Options under ``relay.rdma`` in the run config."""

    slots: int = 8  # registered slots per pool (receive and send)
    slot_mb: float = 8.0  # slot size; larger buckets travel in fragments
    backend: str = "UCX"
    ucx_tls: str = ""  # e.g. "tcp,self" (CI, laptops) or "rc,ud,self" (InfiniBand); "": UCX picks
    ucx_net_devices: str = ""  # e.g. "lo" on one machine, "mlx5_0:1" on a cluster
    timeout_s: float = 300.0  # waiting on a silent peer fails after this long
    poll_s: float = 0.0002  # notification polling interval (x4 at most between messages)
    idle_poll_s: float = 0.05  # ... and with no send or receive under way (woken by one)
    # NIXL's own progress thread spins on the UCX worker, a core per endpoint even when idle
    # (with 4 relays on 2 cores it halved the chain's speed); our notification polling
    # drives progress while a transfer is under way, so it is off unless asked for
    progress_thread: bool = False


def _import_nixl() -> tuple[Any, Any]:
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ImportError(
                "laminar-rdma needs NIXL: pip install nixl-cu12 (works without CUDA over UCX TCP)"
            ) from e
    return nixl_agent, nixl_agent_config


@dataclass
class _Inbound:
    """What this endpoint receives from one peer."""

    msgs: dict[int, tuple] = field(default_factory=dict)  # seq -> parsed data notification
    next_seq: int = 0
    granted: set[int] = field(default_factory=set)
    started: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Outbound:
    """What this endpoint sends to one peer."""

    grants: asyncio.Queue = field(default_factory=asyncio.Queue)  # (slot, addr) granted to us
    seq: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class NixlTransport(WeightTransport):
    """One endpoint (see module docstring)."""

    Options = NixlOptions

    @classmethod
    def from_config(cls, ctx: BuildContext) -> NixlTransport:
        return cls(ctx.options)

    def __init__(self, options: NixlOptions | None = None) -> None:
        self.opt = options or NixlOptions()
        if self.opt.slots < 2 or self.opt.slot_mb <= 0:
            raise ValueError("relay.rdma needs slots >= 2 and slot_mb > 0")
        self.slot_bytes = int(self.opt.slot_mb * (1 << 20))
        self.rank = -1
        self.agent: Any = None
        self.peers: dict[int, Any] = {}
        self._names: dict[int, str] = {}  # rank -> remote agent name
        self._ranks: dict[str, int] = {}
        self._in: dict[int, _Inbound] = {}
        self._out: dict[int, _Outbound] = {}
        self._free_recv: deque[int] = deque()
        self._free_send: asyncio.Queue[int] = asyncio.Queue()
        self._poller: asyncio.Task | None = None
        self._active = 0  # sends and receives under way
        self._wake = asyncio.Event()
        self._error: BaseException | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None:
        for key, value in (
            ("UCX_TLS", self.opt.ucx_tls),
            ("UCX_NET_DEVICES", self.opt.ucx_net_devices),
        ):
            if value:
                os.environ[key] = value
        nixl_agent, nixl_agent_config = _import_nixl()
        self.rank = rank
        name = f"laminar-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(
            enable_prog_thread=self.opt.progress_thread, backends=[self.opt.backend]
        )
        self.agent = nixl_agent(name, config)
        n = self.opt.slots * self.slot_bytes
        # Registered once, reused for every bucket of every version.
        self._recv_pool = np.zeros(n, dtype=np.uint8)
        self._send_pool = np.zeros(n, dtype=np.uint8)
        self._regs = [
            self.agent.register_memory([(pool.ctypes.data, n, 0, "")], "DRAM")
            for pool in (self._recv_pool, self._send_pool)
        ]
        self._free_recv.extend(range(self.opt.slots))
        for s in range(self.opt.slots):
            self._free_send.put_nowait(s)
        self._metadata = self.agent.get_agent_metadata()
        self._poller = asyncio.ensure_future(self._poll())
        if peers:
            await self.connect(peers)

    def endpoint(self) -> Any:
        return self._metadata

    async def connect(self, peers: dict[int, Any]) -> None:
        for rank in list(self._names):
            if rank not in peers or peers[rank] != self.peers.get(rank):
                self._forget(rank)
        self.peers = dict(peers)
        for rank, md in peers.items():
            if rank != self.rank and rank not in self._names:
                name = self.agent.add_remote_agent(md)
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._names[rank], self._ranks[name] = name, rank

    def _forget(self, rank: int) -> None:
        name = self._names.pop(rank, None)
        if name is not None:
            self._ranks.pop(name, None)
            with contextlib.suppress(Exception):  # already gone on the NIXL side
                self.agent.remove_remote_agent(name)
        inbound = self._in.pop(rank, None)
        if inbound is not None:  # slots granted to a peer that is gone come back
            self._free_recv.extend(inbound.granted)
        self._out.pop(rank, None)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for reg in getattr(self, "_regs", []):
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        self._regs = []

    # --- notifications -------------------------------------------------------------------------

    async def _poll(self) -> None:
        idle = 0
        while True:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as e:  # the agent is broken: fail every waiter
                self._error = TransportError(f"rank {self.rank}: NIXL notifications: {e}")
                for inbound in self._in.values():
                    inbound.event.set()
                return
            got = False
            for name, msgs in notifs.items():
                rank = self._ranks.get(name.decode() if isinstance(name, bytes) else name)
                if rank is None:
                    continue
                for msg in msgs:
                    got = True
                    self._on_notif(rank, bytes(msg))
            idle = 0 if got else min(idle + 1, 4)  # back off to 4 x poll_s when quiet
            if got or self._active:
                await asyncio.sleep(0 if got else self.opt.poll_s * idle)
                continue
            # Nothing under way (a relay between versions): poll rarely, so idle endpoints
            # do not take the CPU from busy ones; a send or receive wakes the poller at once.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.opt.idle_poll_s)

    def _on_notif(self, rank: int, msg: bytes) -> None:
        kind, body = msg[:1], msg[1:]
        if kind == _GRANT:
            self._outbound(rank).grants.put_nowait(_G.unpack(body))
        elif kind == _DATA:
            seq, slot, off, length = _D.unpack_from(body)
            header = body[_D.size : _D.size + BUCKET_HEADER_BYTES]
            inbound = self._inbound(rank)
            inbound.msgs[seq] = (slot, off, length, header)
            inbound.event.set()

    def _inbound(self, rank: int) -> _Inbound:
        return self._in.setdefault(rank, _Inbound())

    def _outbound(self, rank: int) -> _Outbound:
        return self._out.setdefault(rank, _Outbound())

    def _name(self, peer: int) -> str:
        name = self._names.get(peer)
        if name is None:
            raise TransportError(
                f"rank {self.rank}: no NIXL agent known for peer {peer}; call connect(peers)"
            )
        return name

    def _grant(self, peer: int, inbound: _Inbound) -> None:
        """Offer free receive slots to ``peer``, keeping half the pool for other links."""
        quota = max(1, self.opt.slots // 2)
        while self._free_recv and len(inbound.granted) < quota:
            slot = self._free_recv.popleft()
            inbound.granted.add(slot)
            addr = self._recv_pool.ctypes.data + slot * self.slot_bytes
            self.agent.send_notif(self._name(peer), _GRANT + _G.pack(slot, addr))

    # --- buckets -------------------------------------------------------------------------------

    async def send(self, bucket: Bucket, peer: int) -> None:
        self._active += 1
        self._wake.set()
        try:
            await self._send(bucket, peer)
        finally:
            self._active -= 1

    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        self._active += 1
        self._wake.set()
        try:
            return await self._recv(peer, alloc)
        finally:
            self._active -= 1

    async def _send(self, bucket: Bucket, peer: int) -> None:
        name = self._name(peer)
        out = self._outbound(peer)
        header = encode_bucket_header(bucket)
        async with out.lock:
            data = bucket.data
            if data is None or len(data) == 0:
                msg = _DATA + _D.pack(out.seq, -1, 0, 0) + header
                out.seq += 1
                self.agent.send_notif(name, msg)
                return
            src = np.frombuffer(data, dtype=np.uint8)
            writes = []
            for off in range(0, len(src), self.slot_bytes):
                n = min(self.slot_bytes, len(src) - off)
                slot, addr = await self._wait(out.grants.get(), f"a receive slot from {peer}")
                local = await self._free_send.get()
                base = local * self.slot_bytes
                self._send_pool[base : base + n] = src[off : off + n]
                msg = _DATA + _D.pack(out.seq, slot, off, n) + header
                out.seq += 1
                ldesc = self.agent.get_xfer_descs(
                    [(self._send_pool.ctypes.data + base, n, 0)], "DRAM"
                )
                rdesc = self.agent.get_xfer_descs([(addr, n, 0)], "DRAM")
                handle = self.agent.initialize_xfer("WRITE", ldesc, rdesc, name, msg)
                if self.agent.transfer(handle) == "ERR":
                    handle.release()
                    self._free_send.put_nowait(local)
                    raise TransportError(f"rank {self.rank}: WRITE to peer {peer} failed")
                writes.append(asyncio.ensure_future(self._complete(handle, local, peer)))
            await asyncio.gather(*writes)

    async def _complete(self, handle: Any, local: int, peer: int) -> None:
        try:
            state = self.agent.check_xfer_state(handle)
            while state == "PROC":
                await asyncio.sleep(self.opt.poll_s)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"rank {self.rank}: WRITE to peer {peer} ended in {state}")
        finally:
            handle.release()
            self._free_send.put_nowait(local)

    async def _wait(self, aw: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(aw, self.opt.timeout_s)
        except TimeoutError as e:
            raise TransportError(
                f"rank {self.rank}: no {what} within {self.opt.timeout_s}s (peer gone?)"
            ) from e

    async def _next(self, peer: int, inbound: _Inbound) -> tuple:
        async def take() -> tuple:
            while inbound.next_seq not in inbound.msgs:
                if self._error is not None:
                    raise self._error
                inbound.event.clear()
                await inbound.event.wait()
            inbound.next_seq += 1
            return inbound.msgs.pop(inbound.next_seq - 1)

        return await self._wait(take(), f"data from peer {peer}")

    async def _recv(self, peer: int, alloc: Alloc | None) -> Bucket:
        self._name(peer)
        inbound = self._inbound(peer)
        if not inbound.started:
            inbound.started = True
            self._grant(peer, inbound)
        slot, off, length, header = await self._next(peer, inbound)
        version, index, nbytes, digest, payload = decode_bucket_header(header)
        if payload < 0:
            return Bucket(version, index, nbytes, digest, None)
        buf = alloc(payload) if alloc is not None and payload else bytearray(payload)
        view = memoryview(buf)
        got = 0
        while True:
            if slot >= 0:
                base = slot * self.slot_bytes
                view[off : off + length] = self._recv_pool[base : base + length].data
                got += length
                inbound.granted.discard(slot)
                self._free_recv.append(slot)
                self._grant(peer, inbound)
            if got >= payload:
                return Bucket(version, index, nbytes, digest, buf)
            slot, off, length, header = await self._next(peer, inbound)
