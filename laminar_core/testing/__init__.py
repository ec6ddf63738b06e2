"""Contract tests a plugin author runs against their own engine.

Each ``check_*`` coroutine drives an engine through its interface's lifecycle and raises
``AssertionError`` naming the broken rule. Use them from pytest::

    from laminar_core.sim.clock import run_virtual   # or asyncio.run for real engines
    from laminar_core.testing import check_rollout_engine

    def test_my_engine_contract():
        asyncio.run(check_rollout_engine(lambda name: MyEngine(name), prompt_ids=[1, 2, 3]))
"""

from laminar_core.testing.environment import check_environment
from laminar_core.testing.relay import (
    assert_loaded,
    check_relay_chain,
    check_relay_faults,
    make_weights,
    share_version,
)
from laminar_core.testing.rollout import check_rollout_engine
from laminar_core.testing.trainer import check_trainer_engine, contract_batch
from laminar_core.testing.transport import check_transport

__all__ = [
    "assert_loaded",
    "check_environment",
    "check_relay_chain",
    "check_relay_faults",
    "check_rollout_engine",
    "check_trainer_engine",
    "check_transport",
    "contract_batch",
    "make_weights",
    "share_version",
]
