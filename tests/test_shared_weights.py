"""``SharedWeights``: a replica loads exactly the version it was told to from its node relay's
shared memory; the driver's proxy of a remote relay (``RemoteRelay``) announces versions on
its event stream and hands out those references."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import torch

from laminar_core.relay.events import RelayEventKind
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.packing import BucketPacker
from laminar_core.relay.remote import RemoteRelay
from laminar_core.relay.shm import (
    SharedVersionGone,
    SharedVersionStore,
    SharedWeights,
    relay_dir,
    remove_shared,
    run_dir_name,
    sweep_orphans,
)

COMMITTED, SHARED = RelayEventKind.COMMITTED, RelayEventKind.SHARED


class _Unreachable(RemoteRelay):
    """A remote relay's proxy with no channel: only its node-relay side is exercised."""

    def __init__(self, relay_id: int, node: int, root, alive: list[bool]) -> None:
        super().__init__(relay_id, node, str(root))
        self.up = alive

    async def _call(self, method, *args):
        raise AssertionError(f"no relay behind this proxy ({method})")

    def _alive(self) -> bool:
        return self.up[0]


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


def test_remote_relay_announces_versions_and_hands_out_references(tmp_path) -> None:
    alive = [True]
    view = _Unreachable(2, 1, tmp_path, alive)
    heard: list[tuple[str, int]] = []
    view.events.subscribe(lambda e: heard.append((e.kind.value, e.version)))
    assert view.version == -1 and view.alive
    with pytest.raises(LookupError):
        view.weights()
    view.events.emit(SHARED, 1)
    view.events.emit(SHARED, 1)  # repeated and older announcements are ignored
    view.events.emit(SHARED, 0)
    view.events.emit(SHARED, 3)
    assert [v for k, v in heard if k == "shared"] == [1, 3] and view.version == 3
    share(tmp_path, 2, [3])
    sw = view.weights()  # what the manager's pull hands the replica
    assert sw.version == 3 and sw == SharedWeights(str(tmp_path), 2, 3)
    assert_weights(dict(sw), 3)
    # committed at the relay, still being written: subscribers hear it (replicas stop
    # admitting), but replicas keep loading the newest shared version until it lands
    view.events.emit(COMMITTED, 5)
    view.events.emit(COMMITTED, 4)
    assert [v for k, v in heard if k == "committed"] == [1, 3, 5]
    assert view.version == 3 and view.weights().version == 3
    view.events.emit(SHARED, 5)
    view.events.emit(COMMITTED, 5)
    assert heard[-1] == ("shared", 5) and view.version == 5
    alive[0] = False
    assert not view.alive


def test_a_driver_side_relay_hands_out_its_buckets() -> None:
    async def main() -> None:
        relay = NodeRelay(0, 0)
        commit(relay, 4)
        got = relay.weights()
        assert got.version == 4
        assert_weights(dict(got), 4)

    asyncio.run(main())


def test_a_dead_drivers_run_directory_is_swept_and_a_live_ones_kept(tmp_path) -> None:
    """A driver killed with kill -9 leaves its run directory; the next run removes it."""
    import subprocess

    dead = subprocess.Popen(["sleep", "60"])
    dead.kill()
    dead.wait()
    names = {
        "dead": run_dir_name("quick-start", dead.pid, 0, "ab12cd"),
        "live": run_dir_name("quick-start", os.getpid(), 0, "ef34ab"),
        "other": "not-a-run",
    }
    for name in names.values():
        (tmp_path / name / "relay0").mkdir(parents=True)
        (tmp_path / name / "relay0" / "v1.bin").write_bytes(b"x")
    assert sweep_orphans(tmp_path) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], "not-a-run"])
    assert sweep_orphans(tmp_path / "absent") == []
