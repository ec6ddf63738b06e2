"""Real bytes through the whole loop: trainer export -> master relay -> chain -> node relays
-> every replica's ``update_weights``, with engines registered as plugins."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from laminar_core import BuildContext, TensorWeights, WeightsRef, hookimpl, load_config
from laminar_core.plugins import PluginManager
from laminar_core.runtime.local import build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.sim.trainer import SimTrainerEngine


def weights_for(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(16, 64, generator=g),
        "lm_head.bias": torch.arange(7, dtype=torch.int64) + version,
        "scale": torch.tensor(float(version)),
    }


class TensorTrainer(SimTrainerEngine):
    """The simulated trainer, but exporting real tensors that identify the version."""

    @classmethod
    def from_config(cls, ctx: BuildContext) -> TensorTrainer:
        return cls(ctx.options, ctx.gpus, 1000)

    async def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        for item in weights_for(self.steps).items():  # steps == the version being published
            yield item


class RecordingEngine(SimRolloutEngine):
    """The simulated replica, keeping every version's tensors it was given."""

    loaded: dict[str, dict[int, dict[str, torch.Tensor]]] = {}

    @classmethod
    def from_config(cls, ctx: BuildContext) -> RecordingEngine:
        base = SimRolloutEngine.from_config(ctx)
        return cls(base.replica_id, base.cfg, base.lengths, index=ctx.index)

    async def update_weights(self, weights: WeightsRef) -> None:
        assert isinstance(weights, TensorWeights), weights  # relays in the driver: tensors
        got = {name: t.clone() for name, t in weights}
        self.loaded.setdefault(self.replica_id, {})[weights.version] = got
        await super().update_weights(weights)


RecordingEngine.Options = SimRolloutEngine.Options
TensorTrainer.Options = SimTrainerEngine.Options


class TestPlugin:
    @hookimpl
    def laminar_trainer_engines(self):
        return {"tensor": TensorTrainer}

    @hookimpl
    def laminar_rollout_engines(self):
        return {"recording": RecordingEngine}


def test_every_replica_loads_exact_weights_of_each_version(small_overrides) -> None:
    pm = PluginManager()
    pm.load_entry_points()
    pm.register(TestPlugin(), name="test-plugin", package="tests")
    overrides = [
        *small_overrides,
        "trainer.engine=tensor",
        "rollout.engine=recording",
        "relay.transport=inprocess",
        "relay.bucket_mb=0.001",  # ~1 KB buckets: tensors span buckets
        "run.steps=4",
    ]
    overrides = [o.replace("trainer.sim.", "trainer.tensor.") for o in overrides]
    overrides = [o.replace("rollout.sim.", "rollout.recording.") for o in overrides]
    resolved = load_config(None, overrides, pm=pm)
    RecordingEngine.loaded = {}

    async def main():
        run = build_local_run(resolved, pm=pm)
        await asyncio.wait_for(run.controller.run(4), 3600)
        return run

    run = run_virtual(main())
    assert run.tier.history and all(r.buckets > 1 for r in run.tier.history)
    assert len(run.tier.relays) == 3  # 6 replicas, 2 per node: a chain of three relays
    assert RecordingEngine.loaded, "no replica pulled weights"
    for replica, versions in RecordingEngine.loaded.items():
        assert versions, replica
        for version, tensors in versions.items():
            want = weights_for(version)
            assert tensors.keys() == want.keys()
            for name, t in want.items():
                assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), (
                    replica,
                    version,
                    name,
                )
    # every relay ended holding the newest version
    assert {r.version for r in run.tier.relays} == {4}
