"""Exporting full weights from FSDP2 shards, bucket by bucket, at the host-copy limit.

The old export all-gathered one parameter at a time and copied it to the host with a
synchronous, pageable ``.to("cpu", dtype)``: one collective and one blocking copy per tensor,
measured at 0.76-1.6 GB/s on an H100 against 53-54 GB/s for pinned copies (this export:
42-51 GB/s; plugins/fsdp/README.md). Here, per bucket of
about ``bucket_bytes``:

1. the local shards are cast to the export dtype *on the device* while they are packed into
   one send buffer (so a bf16 export all-gathers half the bytes of the fp32 masters);
2. ONE ``all_gather`` per bucket (not per parameter) fills a receive buffer (both reused
   from bucket to bucket), which is rearranged on the device into the full tensors' layout
   (on CUDA one contiguous buffer; on CPU, where that buffer would be the host copy, one
   allocation per tensor, see :func:`gather_bucket`);
3. on CUDA, one asynchronous copy of that buffer into a freshly allocated *pinned* host
   buffer runs on a side stream, while the next bucket is gathered; a bucket is handed out
   only when its copy's event has completed. Pinned buffers come from torch's caching host
   allocator, so a consumer that drops a bucket returns its buffer for the next one.

Every yielded tensor is a view into a host buffer owned by that bucket alone: consumers may
keep them (the runtime keeps rank 0's whole export) and nothing later overwrites them.

:class:`WeightStream` wraps the bucket generator: ``async for`` runs each bucket's blocking
work on an executor (the engine's worker thread) so the event loop keeps going -- what the
engine's ``export_weights`` async generator iterates -- and a plain ``for`` runs it in the
caller (benchmarks, tools).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor

import torch
import torch.distributed as dist
from torch import Tensor

Named = list[tuple[str, Tensor]]


def plan_buckets(named: Named, itemsize: int, bucket_bytes: int) -> list[Named]:
    """Consecutive parameters grouped so each group's full size stays within
    ``bucket_bytes`` (a parameter larger than that is a bucket of its own)."""
    buckets: list[Named] = []
    cur: Named = []
    size = 0
    for name, p in named:
        nbytes = p.numel() * itemsize
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, p))
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _all_gather(out: Tensor, inp: Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _shard0(p: Tensor) -> bool:
    """An FSDP2 parameter sharded on dim 0 over a 1-D mesh (what ``fully_shard`` makes)."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(p, DTensor)
        and p.dim() >= 1
        and p.device_mesh.ndim == 1
        and len(p.placements) == 1
        and isinstance(p.placements[0], Shard)
        and p.placements[0].dim == 0
    )


def gather_bucket(
    params: list[Tensor],
    dtype: torch.dtype,
    device: torch.device,
    flat: bool = True,
    scratch: dict[str, Tensor] | None = None,
) -> tuple[Tensor | None, list[Tensor]]:
    """``(buffer, fulls)``: new full tensors of ``params`` in ``dtype`` on ``device``.

    ``flat``: the fulls are views of ONE new contiguous ``buffer`` (what a single
    device-to-host copy needs); otherwise each is its own allocation and ``buffer`` is
    ``None`` (on CPU: freshly mapped memory costs a page fault per page -- 0.4 GB/s measured
    here for a new 21 MB buffer -- while per-tensor allocations reuse the heap a consumer
    freed). ``scratch`` keeps the all-gather's send/receive buffers across buckets.

    FSDP2 dim-0 shards: rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))`` with
    ``c = ceil(rows / world)``; each rank packs its rows (cast to ``dtype``) at fixed, padded
    offsets, so one all-gather gives every rank every shard. Anything else (a plain tensor, a
    DTensor with another layout) goes through ``full_tensor()``.
    """
    sizes = [p.numel() for p in params]
    out = None
    if flat:
        out = torch.empty(sum(sizes), dtype=dtype, device=device)
        views = [out[o : o + n].view(p.shape) for p, o, n in zip(params, _offsets(sizes), sizes)]
    else:
        views = [torch.empty(p.shape, dtype=dtype, device=device) for p in params]
    sharded = [i for i, p in enumerate(params) if _shard0(p)]
    for i, p in enumerate(params):
        if i not in sharded:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            views[i].copy_(full.detach())
    if not sharded:
        return out, views
    mesh = params[sharded[0]].device_mesh
    world, group = mesh.size(), mesh.get_group()
    if world == 1:
        for i in sharded:
            views[i].copy_(params[i].to_local().detach())
        return out, views
    rows = [params[i].shape[0] for i in sharded]
    per_row = [params[i].numel() // max(1, params[i].shape[0]) for i in sharded]
    chunk = [math.ceil(r / world) for r in rows]
    slot = [c * w for c, w in zip(chunk, per_row, strict=True)]  # padded shard size
    total = sum(slot)
    send = _scratch(scratch, "send", total, dtype, device)
    for i, o, n in zip(sharded, _offsets(slot), slot, strict=True):
        local = params[i].to_local().detach().reshape(-1)
        send[o : o + local.numel()].copy_(local)  # casts on the device
        send[o + local.numel() : o + n].zero_()  # the padding (not read; keeps it defined)
    recv = _scratch(scratch, "recv", world * total, dtype, device)
    _all_gather(recv, send, group)
    recv = recv.view(world, total)
    for i, o, n, c, w, r in zip(sharded, _offsets(slot), slot, chunk, per_row, rows, strict=True):
        shards = recv[:, o : o + n].view(world, c, w)  # rank j's padded rows
        dest = views[i].view(r, w)
        k = r // c  # ranks whose rows are all real
        dest[: k * c].view(k, c, w).copy_(shards[:k])
        if r > k * c:
            dest[k * c :].copy_(shards[k, : r - k * c])
    return out, views


def _scratch(
    cache: dict[str, Tensor] | None, key: str, n: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``n`` elements of a buffer kept in ``cache`` (grown when too small)."""
    if cache is None:
        return torch.empty(n, dtype=dtype, device=device)
    buf = cache.get(key)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = cache[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


def _offsets(sizes: list[int]) -> list[int]:
    out, o = [], 0
    for n in sizes:
        out.append(o)
        o += n
    return out


def export_buckets(
    named: Named, dtype: torch.dtype, device: torch.device, bucket_bytes: int
) -> Iterator[Named]:
    """Yield ``[(name, full host tensor), ...]`` bucket by bucket (collective: every rank of
    the FSDP group must run it in step). On CUDA, bucket ``k``'s device-to-host copy overlaps
    bucket ``k+1``'s gather; see the module docstring."""
    buckets = plan_buckets(named, torch.empty(0, dtype=dtype).element_size(), bucket_bytes)
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device=device) if cuda else None
    scratch: dict[str, Tensor] = {}
    pending: tuple[Named, torch.cuda.Event | None] | None = None
    for bucket in buckets:
        names = [n for n, _ in bucket]
        with torch.no_grad():
            params = [p for _, p in bucket]
            dev_buf, fulls = gather_bucket(params, dtype, device, flat=cuda, scratch=scratch)
        if cuda:
            host = torch.empty(dev_buf.shape, dtype=dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host.copy_(dev_buf, non_blocking=True)
                dev_buf.record_stream(stream)  # keep the device buffer until the copy ends
                event = torch.cuda.Event()
                event.record(stream)
            views = _host_views(host, fulls)
            current = (list(zip(names, views, strict=True)), event)
        else:
            current = (list(zip(names, fulls, strict=True)), None)  # already host memory
        if pending is not None:
            yield _ready(pending)
        pending = current
    if pending is not None:
        yield _ready(pending)


def _host_views(host: Tensor, fulls: list[Tensor]) -> list[Tensor]:
    out, o = [], 0
    for f in fulls:
        out.append(host[o : o + f.numel()].view(f.shape))
        o += f.numel()
    return out


def _ready(pending: tuple[Named, torch.cuda.Event | None]) -> Named:
    tensors, event = pending
    if event is not None:
        event.synchronize()
    return tensors


class WeightStream:
    """``(name, tensor)`` pairs, produced bucket by bucket by ``make()`` (a fresh bucket
    iterator) -- iterable both ways (see the module docstring). Under ``async for`` each
    bucket's work runs in ``executor`` (``None``: asyncio's default, as ``to_thread``);
    ``before_each`` runs in the thread that does it (the trainer pins its CUDA device)."""

    def __init__(
        self,
        make: Callable[[], Iterator[Named]],
        before_each: Callable[[], None] | None = None,
        executor: Executor | None = None,
    ) -> None:
        self._make = make
        self._before = before_each or (lambda: None)
        self._executor = executor

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        self._before()
        for bucket in self._make():
            yield from bucket

    def __aiter__(self) -> AsyncIterator[tuple[str, Tensor]]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[tuple[str, Tensor]]:
        buckets = self._make()

        def step() -> Named | None:
            self._before()
            return next(buckets, None)

        loop = asyncio.get_running_loop()
        while (bucket := await loop.run_in_executor(self._executor, step)) is not None:
            for item in bucket:
                yield item
