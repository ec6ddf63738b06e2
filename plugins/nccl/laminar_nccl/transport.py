"""``WeightTransport`` over torch.distributed point-to-point: NCCL on GPU, gloo on CPU.

Every link (an ordered pair of endpoints that exchange buckets) gets its own two-rank process
group, built lazily on the first send/recv between the two and rendezvoused through the
lower rank's ``TCPStore`` (each endpoint hosts one; ``endpoint()`` is its ``host:port``).
Per-link groups are what make relay faults survivable: a dead relay breaks only the groups it
was in, and the rebuilt chain's new links are fresh groups between live endpoints. (A single
world-sized group would have to be torn down and re-formed by every member.) This is the
"stateless process group" approach verl's and vLLM's weight-sync paths also use.

A bucket travels as a 5 x int64 header (``laminar_core.encode_bucket_header``) followed by
its payload as one uint8 tensor. On NCCL both are staged through the endpoint's CUDA device
(pinned host memory for the copies); on gloo they are sent from host memory directly.
Collective-free: no barrier, no all-reduce; ``send``/``recv`` post the operation on the event
loop's thread and wait for it on a worker thread, so sends and receives to different peers
overlap (what the relay pipeline needs).
"""

from __future__ import annotations

import asyncio
import datetime
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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

_TAG = 0  # one FIFO per link: gloo and NCCL keep send order per (pair, tag)


@dataclass
class NcclOptions:
    """Options under ``relay.nccl`` in the run config."""

    backend: str = "auto"  # auto (nccl when CUDA is available, else gloo) | nccl | gloo
    # address this endpoint's store and gloo sockets bind to; "auto": this node's own address
    # (what relays on several nodes need), resolved when the endpoint opens
    host: str = "127.0.0.1"
    timeout_s: float = 300.0  # a link's operations fail after this long (peer hung)
    device: int = -1  # CUDA device for nccl; -1: torch.cuda.current_device()


def node_address() -> str:
    """This node's address as the other nodes see it: the interface of the default route
    (no packet is sent), else the hostname's address."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _bytes_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers are only read from here
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8)


class TorchDistTransport(WeightTransport):
    """One endpoint (see module docstring). ``peers`` maps rank -> ``endpoint()``."""

    Options = NcclOptions

    @classmethod
    def from_config(cls, ctx: BuildContext) -> TorchDistTransport:
        return cls(ctx.options)

    def __init__(self, options: NcclOptions | None = None) -> None:
        self.opt = options or NcclOptions()
        backend = self.opt.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"relay.nccl.backend must be auto, nccl or gloo (got {backend!r})")
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError(
                "relay.nccl.backend=nccl needs CUDA and a torch build with NCCL; "
                "use backend=gloo (or auto) on CPU machines"
            )
        if not dist.is_available() or (backend == "gloo" and not dist.is_gloo_available()):
            raise ValueError("this torch build has no torch.distributed gloo backend")
        self.backend = backend
        self.rank = -1
        self.host = self.opt.host
        self.peers: dict[int, Any] = {}
        self._store: Any = None
        self._endpoint: str | None = None
        self._pairs: dict[int, tuple[Any, Any]] = {}  # peer -> (its endpoint, process group)
        self._pair_locks: dict[int, asyncio.Lock] = {}
        self._send_locks: dict[int, asyncio.Lock] = {}
        self._recv_locks: dict[int, asyncio.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="laminar-nccl")
        self._timeout = datetime.timedelta(seconds=self.opt.timeout_s)

    # --- lifecycle ---------------------------------------------------------------------------

    async def open(self, role: str, rank: int, peers: dict[int, Any]) -> None:
        self.rank = rank
        if self.backend == "nccl":
            dev = self.opt.device if self.opt.device >= 0 else torch.cuda.current_device()
            self.device = torch.device("cuda", dev)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.host = node_address() if self.opt.host == "auto" else self.opt.host
        self._store = await self._run(
            lambda: dist.TCPStore(
                self.host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout
            )
        )
        self._endpoint = f"{self.host}:{self._store.port}"
        if peers:
            await self.connect(peers)

    def endpoint(self) -> Any:
        if self._endpoint is None:
            raise RuntimeError("endpoint() before open()")
        return self._endpoint

    async def connect(self, peers: dict[int, Any]) -> None:
        self.peers = dict(peers)
        for peer, (ep, _) in list(self._pairs.items()):
            if self.peers.get(peer) != ep:  # gone, or restarted elsewhere: forget the link
                del self._pairs[peer]

    async def close(self) -> None:
        self._pairs.clear()
        self._store = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- links ---------------------------------------------------------------------------------

    async def _run(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _pair(self, peer: int) -> Any:
        ep = self.peers.get(peer)
        if ep is None:
            raise TransportError(
                f"rank {self.rank}: no endpoint known for peer {peer}; call connect(peers) "
                "with every member's endpoint first"
            )
        entry = self._pairs.get(peer)
        if entry is not None and entry[0] == ep:
            return entry[1]
        lock = self._pair_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            entry = self._pairs.get(peer)
            if entry is not None and entry[0] == ep:
                return entry[1]
            pg = await self._run(lambda: self._make_pair(peer, ep))
            self._pairs[peer] = (ep, pg)
            return pg

    def _make_pair(self, peer: int, peer_ep: str) -> Any:
        """Blocking rendezvous of the two-rank group for the link with ``peer``."""
        me_low = self.rank < peer
        lo_ep = self._endpoint if me_low else peer_ep
        lo, hi = sorted((self.rank, peer))
        hi_ep = peer_ep if me_low else self._endpoint
        if me_low:
            store = self._store
        else:
            host, port = str(peer_ep).rsplit(":", 1)
            store = dist.TCPStore(
                host, int(port), is_master=False, wait_for_workers=False, timeout=self._timeout
            )
        prefix = dist.PrefixStore(f"laminar/{lo}@{lo_ep}/{hi}@{hi_ep}", store)
        pair_rank = 0 if me_low else 1
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self._timeout
                return dist.ProcessGroupNCCL(prefix, pair_rank, 2, opts)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(prefix, pair_rank, 2, opts)
        except Exception as e:
            raise TransportError(f"rank {self.rank}: cannot link with peer {peer}: {e}") from e

    def _other(self, peer: int) -> int:
        return 1 if self.rank < peer else 0  # the peer's rank inside the pair's group

    async def _wait(self, works: list[Any], what: str, peer: int) -> None:
        def wait_all() -> None:
            for w in works:
                w.wait()

        try:
            await self._run(wait_all)
        except Exception as e:
            self._pairs.pop(peer, None)  # a broken link is not reused
            raise TransportError(f"rank {self.rank}: {what} peer {peer} failed: {e}") from e

    # --- buckets -------------------------------------------------------------------------------

    async def send(self, bucket: Bucket, peer: int) -> None:
        pg = await self._pair(peer)
        lock = self._send_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            header = _bytes_tensor(bytearray(encode_bucket_header(bucket)))
            tensors = [header]
            if bucket.data is not None and len(bucket.data):
                tensors.append(_bytes_tensor(bucket.data))
            if self.backend == "nccl":
                tensors = [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]
            dst = self._other(peer)
            try:
                works = [pg.send([t], dst, _TAG) for t in tensors]
            except Exception as e:
                self._pairs.pop(peer, None)
                raise TransportError(f"rank {self.rank}: send to peer {peer} failed: {e}") from e
            await self._wait(works, "send to", peer)

    async def recv(self, peer: int, alloc: Alloc | None = None) -> Bucket:
        pg = await self._pair(peer)
        lock = self._recv_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            src = self._other(peer)
            header = torch.empty(BUCKET_HEADER_BYTES, dtype=torch.uint8, device=self.device)
            try:
                works = [pg.recv([header], src, _TAG)]
            except Exception as e:
                self._pairs.pop(peer, None)
                raise TransportError(f"rank {self.rank}: recv from {peer} failed: {e}") from e
            await self._wait(works, "recv from", peer)
            version, index, nbytes, digest, payload = decode_bucket_header(
                header.cpu().numpy().tobytes()
            )
            data: Any = None
            if payload > 0 and alloc is not None:
                data = alloc(payload)  # recycled host memory: no page faults on the way in
                host = _bytes_tensor(data)
                buf = host if self.backend == "gloo" else torch.empty_like(host, device=self.device)
                await self._wait([pg.recv([buf], src, _TAG)], "recv from", peer)
                if buf is not host:
                    host.copy_(buf)
            elif payload >= 0:
                buf = torch.empty(payload, dtype=torch.uint8, device=self.device)
                if payload:
                    await self._wait([pg.recv([buf], src, _TAG)], "recv from", peer)
                data = memoryview(buf.cpu().numpy())
            return Bucket(version, index, nbytes, digest, data)
