"""``SharedWeights``: a replica loads exactly the version it was told to from its node relay's
shared memory; the driver-side ``SharedRelayView`` announces versions and hands out those
references."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import BucketPacker
from laminar_core.relay.shm import (
    SharedVersionGone,
    SharedVersionStore,
    SharedWeights,
    relay_dir,
    remove_shared,
)
from laminar_core.relay.view import SharedRelayView


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(40, 8, generator=g).to(torch.bfloat16)),
        ("layers.0.mlp.weight", torch.randn(8, 30, generator=g)),
        ("layers.0.mlp.bias", torch.arange(7, dtype=torch.int64) + version),
        ("empty", torch.empty(0, 3)),
        ("scale", torch.tensor(float(version), dtype=torch.float64)),
    ]


def commit(relay: NodeRelay, version: int, bucket_bytes: int = 256) -> None:
    packer = BucketPacker(weights(version), version, bucket_bytes)
    buckets = list(packer.buckets())
    relay.begin(version, len(buckets))
    for b in buckets:
        relay.put(b)
    relay.commit(packer.manifest)


def share(root, relay_id: int, versions: list[int], keep: int = 2) -> NodeRelay:
    relay = NodeRelay(relay_id, 0)
    store = SharedVersionStore(root, relay_id, keep=keep)
    for v in versions:
        commit(relay, v)
        store.write(relay.read())
    return relay


def assert_weights(got: dict[str, torch.Tensor], version: int) -> None:
    want = dict(weights(version))
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_round_trip_through_shared_memory(tmp_path) -> None:
    share(tmp_path, 3, [1, 2])
    sw = SharedWeights(str(tmp_path), 3, 1)  # not the newest, still on disk: loaded exactly
    assert_weights(dict(sw), 1)
    assert_weights(dict(SharedWeights(str(tmp_path), 3, 2)), 2)
    assert sw.path == relay_dir(tmp_path, 3) / "v1.bin" and sw.path.is_file()
    assert sw.node_local
    # it travels as a few bytes (to a replica's process) and loads there the same
    blob = pickle.dumps(sw)
    assert len(blob) < 300
    assert_weights(dict(pickle.loads(blob)), 1)
    # iterating twice maps twice: an engine may walk it more than once
    assert_weights(dict(sw), 1)


def test_loaded_tensors_are_private_copies_on_write(tmp_path) -> None:
    share(tmp_path, 0, [1])
    got = dict(SharedWeights(str(tmp_path), 0, 1))
    got["layers.0.mlp.weight"].zero_()  # an engine writing in place must not touch the file
    assert_weights(dict(SharedWeights(str(tmp_path), 0, 1)), 1)


def test_a_version_not_shared_yet_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(LookupError, match=r"does not share version 1"):
        iter(SharedWeights(str(tmp_path), 0, 1))
    share(tmp_path, 0, [1])
    with pytest.raises(LookupError, match=r"does not share version 2 .*current 1"):
        iter(SharedWeights(str(tmp_path), 0, 2))  # the error comes before any tensor


def test_a_replaced_version_is_refused_not_swapped_for_the_newer_one(tmp_path) -> None:
    share(tmp_path, 0, [1, 2, 3], keep=2)  # version 1 pruned
    with pytest.raises(SharedVersionGone, match=r"no longer shares version 1.*current 3"):
        iter(SharedWeights(str(tmp_path), 0, 1))
    assert isinstance(SharedVersionGone("x"), LookupError)


def test_remove_shared_deletes_the_relay_and_an_empty_root(tmp_path) -> None:
    root = tmp_path / "run"
    share(root, 0, [1])
    share(root, 1, [1])
    remove_shared(root, 0)
    assert not relay_dir(root, 0).exists() and relay_dir(root, 1).is_dir()
    mapped = dict(SharedWeights(str(root), 1, 1))  # a mapping outlives the files
    remove_shared(root, 1)
    assert not root.exists()
    assert_weights(mapped, 1)


def test_view_announces_versions_and_hands_out_references(tmp_path) -> None:
    async def main() -> None:
        alive = [True]
        view = SharedRelayView(2, 1, tmp_path, lambda: alive[0])
        heard: list[int] = []
        view.listeners.append(heard.append)
        assert view.version == -1 and view.alive
        with pytest.raises(LookupError):
            view.weights()
        waiter = asyncio.ensure_future(view.wait_newer(0))
        await asyncio.sleep(0)
        view.advance(1)
        assert await asyncio.wait_for(waiter, 1) == 1
        view.advance(1)  # repeated and older announcements are ignored
        view.advance(0)
        view.advance(3)
        assert heard == [1, 3] and view.version == 3
        share(tmp_path, 2, [3])
        version, sw = view.weights()  # what the manager's pull hands the replica
        assert version == 3 and sw == SharedWeights(str(tmp_path), 2, 3)
        assert_weights(dict(sw), 3)
        # committed at the relay, still being written: listeners hear it (replicas stop
        # admitting), but replicas keep loading the newest shared version until it lands
        view.committed(5)
        view.committed(4)
        assert heard == [1, 3, 5] and view.version == 3 and view.weights()[0] == 3
        view.advance(5)
        view.committed(5)
        assert heard == [1, 3, 5, 5] and view.version == 5
        alive[0] = False
        assert not view.alive

    asyncio.run(main())


def test_a_driver_side_relay_hands_out_its_buckets() -> None:
    async def main() -> None:
        relay = NodeRelay(0, 0)
        commit(relay, 4)
        version, tensors = relay.weights()
        assert version == 4
        assert_weights(dict(tensors), 4)

    asyncio.run(main())
