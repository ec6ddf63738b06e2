"""Contract tests a plugin author runs against their own engine (see docs/plugins.md).

Each ``check_*`` coroutine drives an engine through its interface's lifecycle and raises
``ContractError`` (an ``AssertionError``, raised explicitly: a kit checks the same under
``python -O``) naming the broken rule and the likely fix. Use them from pytest::

    from laminar_core.testing import check_rollout_engine

    def test_my_engine_contract(tiny_model_dir):
        report = asyncio.run(
            check_rollout_engine(MyEngine, model_dir=tiny_model_dir, strict=True)
        )  # strict: a skipped check fails too

A simulated engine runs under ``laminar_core.sim.clock.run_virtual`` instead of
``asyncio.run``.
"""

from laminar_core.testing.environment import check_environment
from laminar_core.testing.lora import check_lora_versions
from laminar_core.testing.ranks import run_ranks
from laminar_core.testing.reference import HFReference, engine_from_config
from laminar_core.testing.relay import (
    assert_loaded,
    check_relay_chain,
    check_relay_faults,
    make_weights,
    share_version,
)
from laminar_core.testing.report import ContractError, KitReport
from laminar_core.testing.requires import require_modules
from laminar_core.testing.rollout import check_rollout_engine
from laminar_core.testing.trainer import check_trainer_engine, contract_batch
from laminar_core.testing.transport import check_transport

__all__ = [
    "ContractError",
    "HFReference",
    "KitReport",
    "assert_loaded",
    "check_environment",
    "check_lora_versions",
    "check_relay_chain",
    "check_relay_faults",
    "check_rollout_engine",
    "check_trainer_engine",
    "check_transport",
    "contract_batch",
    "engine_from_config",
    "make_weights",
    "require_modules",
    "run_ranks",
    "share_version",
]
