"""``trainer.lora`` on the megatron-core trainer at TP=2 (two gloo ranks) against laminar-fsdp
with the same adapter and batch: the log-probs agree (and with transformers + the adapter),
one step moves the adapters to the same tensors (PEFT names, full shapes), only adapters
train, the base stays as loaded, and a checkpoint (adapters and their optimiser state, no
base) round-trips."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_megatron_engine import TOL, _gpus_for

from laminar_core import BuildContext, FinishReason, TrainerContext, load_config
from laminar_core.models import build_tiny_model
from laminar_core.plugins import default_manager
from laminar_core.testing import contract_batch, run_ranks
from laminar_core.training import LoRASpec, adapter_tensors, apply_lora

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # partial qkv / gate_up
LORA = [
    "model.dtype=float32",
    "rollout.temperature=0.7",
    "run.steps=4",
    "trainer.mini_batches=2",
    "rollout.engine=sglang",
    "cluster.gpus=3",
    "cluster.trainer_gpus=2",
    "trainer.lora.rank=4",
    f"trainer.lora.target_modules=[{','.join(TARGETS)}]",
    "trainer.megatron.lr=1e-3",
    "trainer.megatron.micro_batch_tokens=40",
    "trainer.megatron.tp=2",
    "trainer.fsdp.lr=1e-3",
    "trainer.fsdp.micro_batch_tokens=40",
]
SPEC = LoRASpec(4, 16.0, 0.0, tuple(TARGETS))


def _adapter(model_dir: str) -> dict[str, torch.Tensor]:
    """A seeded non-zero adapter (B too, so both A and B get gradients), PEFT names."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_lora(lm, SPEC)
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in adapter_tensors(lm)}


def _set(eng, adapter: dict[str, torch.Tensor]) -> None:
    if eng.__class__.__name__ == "MegatronTrainerEngine":
        from laminar_megatron import lora as mlora

        for key, lora in eng._adapters.items():
            layer = int(key.split(".")[2])
            for t in lora.targets:
                a, b = (adapter[n] for n in mlora.hf_names(layer, t))
                mlora.set_adapter(lora, t, a, b)
        return
    with torch.no_grad():  # FSDP, one rank: the local shard is the whole tensor
        for n, p in adapter_tensors(eng.lm):
            p.to_local().copy_(adapter[n])


def _rank(rank: int, world: int, port: int, engine: str, model_dir: str, ckpt: str, out) -> None:
    torch.set_num_threads(1)
    resolved = load_config(None, [f"model.path={model_dir}", f"trainer.engine={engine}", *LORA])
    cfg, options = resolved.cfg, resolved.engine_options.get("trainer")
    factory = default_manager().get("trainer", engine)

    async def main() -> dict:
        from laminar_core.interfaces import build

        eng = build(factory, BuildContext(cfg, options, rank, "trainer", 1, {}))
        init = {"init_method": f"tcp://127.0.0.1:{port}", "seed": 0}
        await eng.setup(TrainerContext(rank, world, options, cfg.algorithm, init))
        model = eng.model if engine == "megatron" else eng.lm
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
        _set(eng, _adapter(model_dir))
        batch = contract_batch(cfg_vocab(model_dir))
        lp0 = await eng.compute_logprobs(batch)
        metrics = await eng.train_step(batch)
        after = {n: t.clone() async for n, t in eng.export_weights()}
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        base_same = all(
            torch.equal(base[n], p.detach()) for n, p in model.named_parameters() if n in base
        )
        await eng.save_checkpoint(ckpt)
        await eng.train_step(batch)
        await eng.load_checkpoint(ckpt)
        restored = {n: t async for n, t in eng.export_weights()}
        await eng.close()
        return {
            "lp0": lp0,
            "metrics": {k: metrics[k] for k in ("loss", "grad_norm")},
            "after": after,
            "trained": trained,
            "base_same": base_same,
            "restored": all(torch.equal(after[k], restored[k]) for k in after),
        }

    out[rank] = asyncio.run(main())


def cfg_vocab(model_dir: str) -> int:
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    # 4 query heads in 2 groups: TP=2 splits whole groups (GQA)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, heads=4, kv_heads=2))


def _hf_logprobs(model_dir: str, adapter: dict[str, torch.Tensor]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    apply_lora(lm, SPEC)
    with torch.no_grad():
        for n, p in adapter_tensors(lm):
            p.copy_(adapter[n])
        out = []
        for t in contract_batch(cfg_vocab(model_dir)).trajectories:
            if t.finish_reason is FinishReason.FAILED or not t.response_ids:
                out.append([])
                continue
            ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
            lp = torch.log_softmax(lm(ids).logits[0, :-1] / 0.7, -1)
            lp = lp.gather(-1, ids[0, 1:, None])[:, 0][len(t.prompt_ids) - 1 :]
            out.append(lp.tolist())
    return out


def _lp_diff(a, b) -> float:
    """Largest gap over the trajectories both have log-probs of (a failed one has none)."""
    pairs = [(p, q) for p, q in zip(a, b, strict=True) if p and q]
    assert len(pairs) > 4
    return max(abs(x - y) for p, q in pairs for x, y in zip(p, q, strict=True))


def test_megatron_tp2_lora_agrees_with_fsdp_lora(tiny, tmp_path):
    _gpus_for(2)
    ckpt = str(tmp_path / "mckpt")
    meg = run_ranks(_rank, 2, "megatron", tiny, ckpt)
    fsdp = run_ranks(_rank, 1, "fsdp", tiny, str(tmp_path / "fckpt"))[0]
    m0, m1 = meg[0], meg[1]
    ref = _hf_logprobs(tiny, _adapter(tiny))
    merged = [a or b for a, b in zip(m0["lp0"], m1["lp0"], strict=True)]
    figures = {
        "megatron_vs_hf": _lp_diff(merged, ref),
        "fsdp_vs_hf": _lp_diff(fsdp["lp0"], ref),
        "adapter_after_step": max(
            (m0["after"][k] - fsdp["after"][k]).abs().max().item() for k in fsdp["after"]
        ),
    }
    print("megatron TP=2 vs fsdp LoRA:", figures, m0["metrics"], fsdp["metrics"])
    assert figures["megatron_vs_hf"] < TOL and figures["fsdp_vs_hf"] < TOL
    # the same tensors, names and shapes as FSDP's version: PEFT's, full
    assert list(m0["after"]) == list(fsdp["after"]) or set(m0["after"]) == set(fsdp["after"])
    assert all(m0["after"][k].shape == fsdp["after"][k].shape for k in fsdp["after"])
    assert figures["adapter_after_step"] < TOL  # one step moves both to the same adapter
    assert any(not torch.equal(m0["after"][k], _adapter(tiny)[k]) for k in m0["after"])
    for k in ("loss", "grad_norm"):
        assert m0["metrics"][k] == pytest.approx(fsdp["metrics"][k], abs=TOL), k
    assert all(".lora." in n for n in m0["trained"]) and m0["trained"]
    assert m0["base_same"] and m1["base_same"]
    assert all(torch.equal(m0["after"][k], m1["after"][k]) for k in m0["after"])
    assert m0["restored"] and m1["restored"]
    model_bytes = (Path(tiny) / "model.safetensors").stat().st_size
    ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
    assert ckpt_bytes < model_bytes / 2  # adapters + their Adam moments, no base weights
