"""Node relays as Ray actors over the real ``nccl`` transport (gloo on CPU): the chain delivers
every version into each node's shared memory, and relay deaths are survived -- one relay
crashes in the middle of a transfer, then the master is killed between versions.

Three relay actors on this machine stand for three nodes; the trainer's endpoint is in this
process, as in the Ray runtime.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("laminar_nccl")
ray = pytest.importorskip("ray")

from laminar_core import load_config
from laminar_core.relay.shm import SharedWeights, relay_dir
from laminar_core.relay.tier import RelayTier
from laminar_core.runtime.relay_actor import spawn_relay
from laminar_core.testing.relay import make_weights
from laminar_nccl.transport import TorchDistTransport


def _assert_shared(root: Path, relay_id: int, version: int) -> None:
    got = dict(SharedWeights(str(root), relay_id, version))
    for name, want in make_weights(version):
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), (relay_id, name)


def test_relay_actors_share_versions_and_survive_relay_deaths(ray_cluster, tmp_path) -> None:
    root = tmp_path / "shm"
    cfg = load_config(None, ["relay.transport=nccl", "relay.chunks=3"]).to_yaml()
    node = ray.get_runtime_context().get_node_id()
    # relay 2 (chain rank 3, the last) crashes when bucket 1 of version 2 reaches it
    hosts = [
        spawn_relay(cfg, i, i, i + 1, str(root), node, die_at=(2, 1) if i == 2 else None)
        for i in range(3)
    ]
    views = hosts  # the driver's proxy of a relay is also what its node's replicas watch
    tier = RelayTier(hosts=hosts, trainer_transport=TorchDistTransport(), chunks=3)
    heard: list[list[int]] = [[] for _ in views]
    for v, got in zip(views, heard):
        v.events.subscribe(lambda e, got=got: got.append(e.version))

    async def main() -> None:
        await tier.open()
        await tier.publish(1, make_weights(1))
        await tier.wait_broadcast()
        assert [v.version for v in views] == [1, 1, 1]
        for i, h in enumerate(hosts):
            assert h.written[1]["bytes"] == h.written[1]["manifest_bytes"] > 0
            _assert_shared(root, i, 1)

        await tier.publish(2, make_weights(2))
        await tier.wait_broadcast()
        assert [h.is_alive() for h in hosts] == [True, True, False]
        assert [v.alive for v in views] == [True, True, False]
        # the relay before the dead one committed and shared version 2 even though
        # forwarding it failed: its proxy reports it shared when its drain says so
        assert [v.version for v in views] == [2, 2, 1]
        assert tier.chain_ranks == [1, 2]

        ray.kill(hosts[0].handle)  # the master, between versions
        for _ in range(200):
            if not hosts[0].is_alive():
                break
            await asyncio.sleep(0.05)
        assert not views[0].alive
        await tier.publish(3, lambda: make_weights(3))
        await tier.wait_broadcast()
        assert tier.master_rank == 2 and tier.chain_ranks == [2]
        assert [v.version for v in views] == [2, 3, 1]
        _assert_shared(root, 1, 3)
        # subscribers heard each version once committed and once shared
        assert heard == [[1, 1, 2, 2], [1, 1, 2, 2, 3, 3], [1, 1]]
        await tier.close()
        # a relay that closes deletes what it shared; the dead ones could not
        assert not relay_dir(root, 1).exists()
        assert relay_dir(root, 0).exists() and relay_dir(root, 2).exists()

    try:
        asyncio.run(main())
    finally:
        for h in hosts:
            ray.kill(h.handle)
    assert os.path.isdir(root)
