"""laminar-nccl over gloo (CPU): the transport contract, a 3-relay pipelined chain between
real processes, and relay / master crashes. NCCL itself needs GPUs (see README)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from functools import partial

import pytest
import torch

from laminar_core.plugins import PluginManager
from laminar_core.testing import check_relay_chain, check_relay_faults, check_transport
from laminar_nccl import NcclOptions, TorchDistTransport
from laminar_nccl.transport import node_address

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
GLOO = NcclOptions(backend="gloo", timeout_s=60)


def test_registered_as_plugin() -> None:
    pm = PluginManager()
    pm.load_entry_points()
    assert pm.get("transport", "nccl") is TorchDistTransport


def test_gloo_transport_conformance() -> None:
    asyncio.run(check_transport(lambda rank: TorchDistTransport(GLOO)))


def test_host_auto_binds_to_the_nodes_own_address() -> None:
    """``host: auto`` (relays on several nodes): endpoints advertise this node's address,
    not loopback, and still talk."""
    opts = dataclasses.replace(GLOO, host="auto")
    made: list[TorchDistTransport] = []

    def make(rank: int) -> TorchDistTransport:
        made.append(TorchDistTransport(opts))
        return made[-1]

    asyncio.run(check_transport(make))
    assert made[0].host == node_address() and made[0].host != "auto"


def test_bad_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="auto, nccl or gloo"):
        TorchDistTransport(NcclOptions(backend="mpi"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use backend=gloo"):
            TorchDistTransport(NcclOptions(backend="nccl"))


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
def test_chain_of_three_relay_processes(tmp_path, stage: bool) -> None:
    make = partial(TorchDistTransport, GLOO)
    asyncio.run(check_relay_chain(make, tmp_path, relays=3, stage=stage))


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
def test_relay_and_master_crashes(tmp_path, stage: bool) -> None:
    asyncio.run(check_relay_faults(partial(TorchDistTransport, GLOO), tmp_path, stage=stage))
