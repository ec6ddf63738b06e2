"""Weight sync over real transports between real processes: bandwidth, stall, pipelining.

Prints, in one run on this machine:
  (a) raw loopback bandwidth of the medium: a plain TCP socket between two processes, and a
      memcpy (what the shared-memory/RDMA path is bounded by on one host);
  (b) chain broadcast of the model (default 1 GiB) to 1, 2, 4 and 8 relay processes per transport,
      as a fraction of (a) — ``fraction_of_link`` = (M / T) / socket bandwidth, the paper's
      measure, and ``aggregate_fraction`` = (p·M / T) / socket bandwidth, the bytes every hop
      moved (on one machine all hops share its cores and memory bus, on a cluster each hop
      has its own link);
  (c) the trainer's stall against the relay count: with the staged push (the default) until
      the version is copied to host memory, and until the master relay holds it;
  (d) chunked pipeline vs unchunked: the latency model's predicted time beside the measured.

    python benchmarks/weight_sync.py [--mb 1024] [--relays 1 2 4 8] [--transports nccl rdma]
                                     [--slot-mb 8] [--json FILE]

``--json`` writes the same figures; the keys (per transport and relay count: ``bytes``,
``seconds``, ``fraction_of_link``, ``trainer_stall_seconds``) are kept stable for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import say, table

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
import torch

from laminar_core.relay import RelayProcess, RelayTier, chain_latency

torch.set_num_threads(1)
GiB = 1 << 30
UCX_ENV = {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES")}


# --- (a) the medium ----------------------------------------------------------------------------


def _sink(port: int, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(4 << 20)
        view, got = memoryview(buf), 0
        while got < total:
            n = s.recv_into(view)
            if not n:
                break
            got += n
        s.sendall(b"k")


def socket_gbps(total: int) -> float:
    """One TCP stream over loopback between two processes (4 MiB writes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = mp.get_context("spawn").Process(target=_sink, args=(srv.getsockname()[1], total))
    p.start()
    conn, _ = srv.accept()
    chunk = memoryview(bytearray(4 << 20))
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.recv(1)
    dt = time.perf_counter() - t0
    conn.close()
    srv.close()
    p.join()
    return sent / dt / 1e9


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(b, a)
    t0 = time.perf_counter()
    for _ in range(4):
        np.copyto(b, a)
    return 4 * nbytes / (time.perf_counter() - t0) / 1e9


# --- (b)-(d) the chain ----------------------------------------------------------------------------


def transport_factory(name: str, slot_mb: float = 8.0):
    if name == "nccl":
        from laminar_nccl import NcclOptions, TorchDistTransport

        return partial(TorchDistTransport, NcclOptions(backend="auto", timeout_s=600))
    if name == "rdma":
        from laminar_rdma import NixlOptions, NixlTransport

        return partial(NixlTransport, NixlOptions(slots=8, slot_mb=slot_mb, timeout_s=600))
    raise SystemExit(f"unknown transport {name!r} (nccl, rdma)")


TENSORS = 8  # the benchmark model: this many bf16 tensors of equal size


def model_bytes(total: int) -> int:
    """What ``model(total, v)`` exports: ``total`` rounded down to whole tensors."""
    return TENSORS * (total // TENSORS // 2) * 2


def model(total: int, version: int) -> list[tuple[str, torch.Tensor]]:
    per = model_bytes(total) // TENSORS // 2  # bf16 elements
    return [
        (f"layer{i}.weight", torch.full((per,), float(version), dtype=torch.bfloat16))
        for i in range(TENSORS)
    ]


async def broadcast(
    name: str, relays: int, total: int, chunks: int | None, stage: bool = True, slot_mb: float = 8.0
) -> dict:
    """Spawn ``relays`` relay processes, publish versions, measure the steady state;
    ``chunks=None``: k*. ``stage``: the staged push (``relay.stage_push``, the default)."""
    factory = transport_factory(name, slot_mb)
    env = {"OMP_NUM_THREADS": "1", **UCX_ENV}
    hosts = [RelayProcess(i, i, i + 1, factory, env=env) for i in range(relays)]
    tier = RelayTier(
        hosts=hosts,
        trainer_transport=factory(),
        chunks=chunks or 0,
        calibrate=chunks is None,
        timeout_s=900,
        stage=stage,
    )
    try:
        await tier.open()
        link = tier.link or await tier.calibrate()
        nbytes = model_bytes(total)
        loop = asyncio.get_running_loop()
        # Versions 1 and 2 are the cold start (links set up, the trainer's bucket ring and
        # the relays' two version buffers faulted in); versions 3-5 are the steady state of a
        # training run: the figures are their medians.
        runs = []
        for version in range(1, 6):
            weights = model(total, version)
            t0 = loop.time()
            res = await tier.publish(version, weights, model_bytes=nbytes)
            await tier.wait_broadcast()
            runs.append((loop.time() - t0, res.stall_seconds, res.master_seconds, res.buckets))
            del weights  # one model's tensors at a time (8 relays x 2 versions fill 24 GiB)
        held = [await h.status() for h in hosts]
        assert held == [5] * relays, f"relays hold {held}"
        steady = runs[2:]
        seconds, stall, master = (statistics.median(r[i] for r in steady) for i in range(3))
        t_byte, t_start = link
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "first_version_seconds": runs[0][0],
            "trainer_stall_seconds": stall,
            "master_seconds": master,  # until the master held it
            "staged": stage,
            "chunks": runs[-1][3],
            "t_byte": t_byte,
            "t_start": t_start,
            # trainer -> master is the chain's first hop: p = relays + 1 endpoints
            "predicted_seconds": chain_latency(relays + 1, nbytes, runs[-1][3], t_byte, t_start),
        }
    finally:
        await tier.close()
        for h in hosts:
            h.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1024, help="model size in MiB (default 1 GiB)")
    ap.add_argument("--relays", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--transports", nargs="+", default=["nccl", "rdma"])
    ap.add_argument("--pipeline-relays", type=int, default=4, help="relays for (d)")
    ap.add_argument("--slot-mb", type=float, default=8.0, help="relay.rdma.slot_mb for NIXL")
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = ap.parse_args()
    total = int(args.mb * (1 << 20))

    say(f"(a) raw loopback bandwidth ({os.cpu_count()} cores)")
    sock = socket_gbps(min(total, 2 * GiB))
    mem = memcpy_gbps()
    say(
        table(
            [["TCP socket, 1 stream", f"{sock:.2f}"], ["memcpy (numpy)", f"{mem:.2f}"]],
            ["medium", "GB/s"],
        )
    )
    out: dict = {
        "model_bytes": total,
        "link": {"socket_gbps": sock, "memcpy_gbps": mem},
        "transports": {},
    }

    rows, stall_rows = [], []
    for name in args.transports:
        out["transports"][name] = {}
        for p in args.relays:
            r = asyncio.run(broadcast(name, p, total, None, slot_mb=args.slot_mb))
            gbps = r["bytes"] / r["seconds"] / 1e9
            say(
                f"  ... {name}, {p} relays: {r['seconds']:.2f} s, stall "
                f"{r['trainer_stall_seconds']:.3f} s, master holds {r['master_seconds']:.3f} s"
            )
            r["fraction_of_link"] = gbps / sock
            # every one of the p hops (trainer -> master included) moved the model
            r["aggregate_fraction"] = p * gbps / sock
            out["transports"][name][str(p)] = r
            rows.append(
                [
                    name,
                    str(p),
                    str(r["chunks"]),
                    f"{r['seconds']:.2f}",
                    f"{r['first_version_seconds']:.2f}",
                    f"{r['predicted_seconds']:.2f}",
                    f"{gbps:.2f}",
                    f"{r['fraction_of_link']:.2f}",
                    f"{r['aggregate_fraction']:.2f}",
                ]
            )
        first = out["transports"][name][str(args.relays[0])]
        for p in args.relays:
            r = out["transports"][name][str(p)]
            stall, master = r["trainer_stall_seconds"], r["master_seconds"] or float("nan")
            stall_rows.append(
                [
                    name,
                    str(p),
                    f"{stall:.3f}",
                    f"{stall / first['trainer_stall_seconds']:.2f}x",
                    f"{master:.3f}",
                    f"{master / first['master_seconds']:.2f}x",
                ]
            )
    say(
        f"\n(b) chain broadcast of {total / GiB:.2f} GiB (steady state: median of versions 3-5; "
        "'first s': version 1), chunks from k* with the measured link"
    )
    say(
        table(
            rows,
            [
                "transport",
                "relays",
                "k",
                "seconds",
                "first s",
                "model s",
                "GB/s",
                "fraction_of_link",
                "aggregate_fraction",
            ],
        )
    )
    base = args.relays[0]
    say(
        "\n(c) trainer stall: staged push (the default; until the version is copied to host "
        "memory and the trainer may resume) and until the master relay holds it"
    )
    say(
        table(
            stall_rows,
            ["transport", "relays", "stall s", f"vs {base}", "master holds s", f"vs {base}"],
        )
    )

    name, p = args.transports[0], args.pipeline_relays
    say(f"\n(d) pipelined vs unchunked: {name}, {p} relays, streamed push (no staging copy)")
    prow, pipe = [], []
    for chunks in (1, None):
        r = asyncio.run(broadcast(name, p, total, chunks, stage=False))
        pipe.append(
            {
                "chunks": r["chunks"],
                "measured_seconds": r["seconds"],
                "predicted_seconds": r["predicted_seconds"],
            }
        )
        prow.append(
            [
                "unchunked" if chunks == 1 else "k* (model)",
                str(r["chunks"]),
                f"{r['predicted_seconds']:.2f}",
                f"{r['seconds']:.2f}",
            ]
        )
    say(table(prow, ["mode", "k", "predicted s", "measured s"]))
    out["pipeline"] = {"transport": name, "relays": p, "rows": pipe}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        say(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
