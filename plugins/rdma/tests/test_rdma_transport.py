"""laminar-rdma over NIXL with UCX on TCP loopback: the transport contract, a 3-relay
pipelined chain between real processes, and relay / master crashes."""

from __future__ import annotations

import asyncio
import os
from functools import partial

import pytest
import torch

from laminar_core.plugins import PluginManager
from laminar_core.testing import check_relay_chain, check_relay_faults, check_transport

pytest.importorskip("nixl_cu12", reason="pip install nixl-cu12 (runs without CUDA)")
from laminar_rdma import NixlOptions, NixlTransport

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
UCX = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
# small slots so that buckets travel in several fragments, several in flight
OPTS = NixlOptions(slots=4, slot_mb=0.25, ucx_tls="tcp,self", ucx_net_devices="lo", timeout_s=60)


def test_registered_as_plugin() -> None:
    pm = PluginManager()
    pm.load_entry_points()
    assert pm.get("transport", "rdma") is NixlTransport


def test_bad_options_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="slots >= 2"):
        NixlTransport(NixlOptions(slots=1))


def test_nixl_transport_conformance() -> None:
    asyncio.run(check_transport(lambda rank: NixlTransport(OPTS)))


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
def test_chain_of_three_relay_processes(tmp_path, stage: bool) -> None:
    make = partial(NixlTransport, OPTS)
    asyncio.run(check_relay_chain(make, tmp_path, relays=3, env=UCX, stage=stage))


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
def test_relay_and_master_crashes(tmp_path, stage: bool) -> None:
    asyncio.run(check_relay_faults(partial(NixlTransport, OPTS), tmp_path, env=UCX, stage=stage))
