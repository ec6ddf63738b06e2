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
  (d) chunked pipeline vs unchunked: the latency model's predicted time beside the measured;
  (e) full model vs LoRA (``trainer.lora``): bytes per version and the time to put one
      version on every relay, per model shape (the tiny model; Qwen2.5-0.5B/1.5B shapes),
      the full model against a rank-8 adapter on all seven projections (a version is the
      adapter tensors alone).

    python benchmarks/weight_sync.py [--mb 1024] [--relays 1 2 4 8] [--transports nccl rdma]
                                     [--slot-mb 8] [--json FILE]
                                     [--lora-shapes tiny 0.5b] [--lora-rank 8] [--only-lora]

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
    name: str,
    relays: int,
    total: int,
    chunks: int | None,
    stage: bool = True,
    slot_mb: float = 8.0,
    weights=None,
) -> dict:
    """Spawn ``relays`` relay processes, publish versions, measure the steady state;
    ``chunks=None``: k*. ``stage``: the staged push (``relay.stage_push``, the default).
    ``weights(version)``: the named tensors of a version (default: ``model(total, v)``)."""
    weights_of = weights or partial(model, total)
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
        nbytes = sum(t.numel() * t.element_size() for _, t in weights_of(0))
        loop = asyncio.get_running_loop()
        # Versions 1 and 2 are the cold start (links set up, the trainer's bucket ring and
        # the relays' two version buffers faulted in); versions 3-5 are the steady state of a
        # training run: the figures are their medians.
        runs = []
        for version in range(1, 6):
            weights = weights_of(version)
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


# -- (e) full vs LoRA ----------------------------------------------------------------------------
#: Qwen2-style shapes: hidden, intermediate, layers, heads, kv heads, vocab (tied embeddings).
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2, 151936),  # Qwen2.5-0.5B
    "1.5b": (1536, 8960, 28, 12, 2, 151936),  # Qwen2.5-1.5B
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_shape() -> tuple[int, ...]:
    """The quickstart's tiny model, as ``laminar tiny-model`` builds it."""
    import tempfile

    from laminar_core.models import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        c = json.loads((build_tiny_model(Path(d) / "m", seed=0) / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return (*(c[k] for k in keys), c["num_key_value_heads"], c["vocab_size"])


def linear_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """``{projection: (out, in)}`` of one decoder layer."""
    hidden, inter, _layers, heads, kv, _vocab = shape
    kv_dim = hidden // heads * kv
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (kv_dim, hidden),
        "v_proj": (kv_dim, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def version_tensors(shape: tuple[int, ...], rank: int, version: int) -> list:
    """A version in HF/PEFT naming, bf16: the full model (``rank`` 0) or the adapter."""
    hidden, _inter, layers, _heads, _kv, vocab = shape
    out = []
    if not rank:
        out.append(("model.embed_tokens.weight", (vocab, hidden)))
    for i in range(layers):
        stem = f"model.layers.{i}"
        for name, (o, n) in linear_shapes(shape).items():
            kind = "mlp" if name in PROJECTIONS[4:] else "self_attn"
            mod = f"{stem}.{kind}.{name}"
            if rank:
                out.append((f"base_model.model.{mod}.lora_A.weight", (rank, n)))
                out.append((f"base_model.model.{mod}.lora_B.weight", (o, rank)))
            else:
                out.append((f"{mod}.weight", (o, n)))
                if name in ("q_proj", "k_proj", "v_proj"):  # Qwen2's attention biases
                    out.append((f"{mod}.bias", (o,)))
        if not rank:
            out += [(f"{stem}.input_layernorm.weight", (hidden,))]
            out += [(f"{stem}.post_attention_layernorm.weight", (hidden,))]
    if not rank:
        out.append(("model.norm.weight", (hidden,)))
    return [(n, torch.full(s, float(version), dtype=torch.bfloat16)) for n, s in out]


def lora_vs_full(name: str, shapes: list[str], rank: int, relays: int) -> list[dict]:
    rows = []
    for label in shapes:
        shape = tiny_shape() if label == "tiny" else SHAPES[label]
        for r in (0, rank):
            res = asyncio.run(
                broadcast(name, relays, 0, None, weights=partial(version_tensors, shape, r))
            )
            rows.append(
                {
                    "model": label,
                    "version": f"LoRA r={r}" if r else "full",
                    "tensors": len(version_tensors(shape, r, 0)),
                    **res,
                }
            )
            say(f"  ... {label} {rows[-1]['version']}: {res['bytes']} B, {res['seconds']:.4f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1024, help="model size in MiB (default 1 GiB)")
    ap.add_argument("--relays", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--transports", nargs="+", default=["nccl", "rdma"])
    ap.add_argument("--pipeline-relays", type=int, default=4, help="relays for (d)")
    ap.add_argument("--slot-mb", type=float, default=8.0, help="relay.rdma.slot_mb for NIXL")
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    ap.add_argument(
        "--lora-shapes", nargs="+", default=["tiny", "0.5b"], help="(e): tiny, 0.5b, 1.5b"
    )
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--only-lora", action="store_true", help="run (e) alone")
    args = ap.parse_args()
    total = int(args.mb * (1 << 20))
    out: dict = {"model_bytes": total, "transports": {}}
    if not args.only_lora:
        run_a_to_d(args, total, out)
    name = args.transports[0]
    say(
        f"\n(e) a version: full model vs LoRA rank {args.lora_rank} (all seven projections), "
        f"bf16, {name}, 1 relay (steady state: median of versions 3-5)"
    )
    rows = lora_vs_full(name, args.lora_shapes, args.lora_rank, 1)
    out["lora"] = rows
    table_rows = []
    for r in rows:
        full = next(x for x in rows if x["model"] == r["model"] and x["version"] == "full")
        table_rows.append(
            [
                r["model"],
                r["version"],
                str(r["tensors"]),
                f"{r['bytes'] / 1e6:.3f}",
                f"{full['bytes'] / r['bytes']:.0f}x",
                f"{r['seconds']:.4f}",
                f"{r['trainer_stall_seconds']:.4f}",
                f"{full['seconds'] / r['seconds']:.1f}x",
            ]
        )
    say(
        table(
            table_rows,
            ["model", "version", "tensors", "MB", "fewer bytes", "sync s", "stall s", "faster"],
        )
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        say(f"\nwrote {args.json}")


def run_a_to_d(args, total: int, out: dict) -> None:
    say(f"(a) raw loopback bandwidth ({os.cpu_count()} cores)")
    sock = socket_gbps(min(total, 2 * GiB))
    mem = memcpy_gbps()
    say(
        table(
            [["TCP socket, 1 stream", f"{sock:.2f}"], ["memcpy (numpy)", f"{mem:.2f}"]],
            ["medium", "GB/s"],
        )
    )
    out["link"] = {"socket_gbps": sock, "memcpy_gbps": mem}

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


if __name__ == "__main__":
    main()
