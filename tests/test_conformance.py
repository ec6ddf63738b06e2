"""Core's own engines pass the conformance kit that plugins use."""

from __future__ import annotations

import asyncio

from laminar_core.relay.inprocess import InProcessFabric, InProcessTransport
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.config import SimRolloutConfig, SimTransportConfig
from laminar_core.sim.lengths import LengthModel
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.sim.transport import SimFabric, SimTransport
from laminar_core.testing import check_rollout_engine, check_transport


def test_sim_rollout_engine_conformance() -> None:
    lengths = LengthModel.lognormal(30, 10, 4096, seed=1)
    cfg = SimRolloutConfig(decode_step_s=0.01, weight_load_s=0.1)
    report = run_virtual(check_rollout_engine(lambda name: SimRolloutEngine(name, cfg, lengths)))
    assert "a partial resumes on another replica of its version" in report.checked, report


def test_sim_rollout_engine_built_from_config_conformance() -> None:
    """The class, built as the runtime builds it (Options, from_config)."""
    report = run_virtual(check_rollout_engine(SimRolloutEngine, options={"decode_step_s": 0.01}))
    assert report.checked[0].startswith("built as the runtime builds it"), report


def test_inprocess_transport_conformance() -> None:
    fabric = InProcessFabric()
    asyncio.run(check_transport(lambda rank: InProcessTransport(fabric)))


def test_sim_transport_conformance() -> None:
    fabric, cfg = SimFabric(), SimTransportConfig()
    run_virtual(check_transport(lambda rank: SimTransport(cfg, fabric)))
