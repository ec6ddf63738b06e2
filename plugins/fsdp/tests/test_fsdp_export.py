"""Bucketed export: one all-gather per bucket reassembles FSDP's dim-0 shards exactly, also
uneven ones (a rank holding fewer rows, or none), casts on the way, and hands out tensors the
consumer owns, through both iteration protocols."""

from __future__ import annotations

import asyncio
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from laminar_core import free_port
from laminar_fsdp.export import WeightStream, export_buckets, plan_buckets

# rows 5 over 2 ranks: 3 + 2; rows 1: 1 + 0; a vector; a square matrix; a 3-D tensor
SHAPES = {"a": (5, 3), "b": (1, 4), "c": (7,), "d": (4, 4), "e": (3, 2, 2)}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _rank(rank: int, port: int, out: dict) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full = _tensors()
    named = [(k, distribute_tensor(v, mesh, [Shard(0)])) for k, v in full.items()]
    named.append(("plain", torch.arange(6.0)))  # not a DTensor: goes out as it is
    cpu = torch.device("cpu")
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        buckets = list(export_buckets(named, dtype, cpu, bucket_bytes=40 * dtype.itemsize))
        res[str(dtype)] = ([len(b) for b in buckets], dict(kv for b in buckets for kv in b))
    stream = WeightStream(lambda: export_buckets(named, torch.float32, cpu, 64))

    async def collect():
        return [(k, v) async for k, v in stream]

    res["async"] = asyncio.run(collect())
    res["sync"] = list(stream)
    out[rank] = res
    dist.destroy_process_group()


def test_uneven_shards_come_back_whole_in_both_dtypes():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    want = {**_tensors(), "plain": torch.arange(6.0)}
    for rank in (0, 1):
        res = out[rank]
        sizes, got = res["torch.float32"]
        assert len(sizes) > 1  # several buckets of at most 40 elements (or one big tensor)
        assert list(got) == list(want)  # parameter order kept
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        _, got16 = res["torch.bfloat16"]
        for k, v in want.items():
            assert got16[k].dtype == torch.bfloat16 and torch.equal(got16[k], v.bfloat16()), k
        assert [k for k, _ in res["async"]] == [k for k, _ in res["sync"]] == list(want)
        for (_, a), (_, b) in zip(res["async"], res["sync"], strict=True):
            assert torch.equal(a, b)


def test_bucket_plan_bounds_each_bucket():
    named = [(str(i), torch.empty(n)) for i, n in enumerate([3, 3, 3, 10, 1, 1])]
    buckets = plan_buckets(named, itemsize=4, bucket_bytes=24)  # 6 elements a bucket
    assert [[k for k, _ in b] for b in buckets] == [["0", "1"], ["2"], ["3"], ["4", "5"]]
    buckets = plan_buckets(named, itemsize=2, bucket_bytes=24)  # 12 elements a bucket
    assert [[k for k, _ in b] for b in buckets] == [["0", "1", "2"], ["3", "4", "5"]]


def test_exported_tensors_are_copies_the_consumer_owns():
    p = torch.nn.Parameter(torch.ones(4, 2))
    buckets = export_buckets([("w", p)], torch.float32, torch.device("cpu"), 1 << 20)
    ((name, t),) = [kv for b in buckets for kv in b]
    with torch.no_grad():
        p.add_(1.0)  # the next optimiser step
    assert name == "w" and torch.equal(t, torch.ones(4, 2))
