"""``laminar export``: a LoRA run's checkpoint as a PEFT adapter directory (PEFT's files and
key names, the trained adapter's values) and, with ``--merge``, as a Hugging Face model that
transformers loads and that computes what the base model plus the adapter computes, and that a
vLLM replica serves with the same log-probs. (The adapter directory is written by the same
``write_adapter`` the vLLM and SGLang replicas hot-load every LoRA version from.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from laminar_core.testing import require_modules

require_modules("laminar_fsdp", what="the export test")

from laminar_core import TrainerContext, free_port, load_config
from laminar_core.models import build_tiny_model
from laminar_core.training import adapter_tensors, apply_lora, read_adapter

LORA = [
    "trainer.engine=fsdp",
    "rollout.engine=vllm",
    "cluster.gpus=2",
    "cluster.trainer_gpus=1",
    "model.dtype=float32",
    "trainer.lora.rank=4",
    "trainer.lora.target_modules=[q_proj,up_proj]",
]


def _trained_checkpoint(model: str, run_dir: str, out: dict) -> None:
    """A run directory as a LoRA run leaves it: config.yaml and checkpoints/step_000001 with
    the trainer's checkpoint of an adapter with non-zero values."""
    from pathlib import Path

    from laminar_core.loop.checkpoint import begin, checkpoint_dir, commit
    from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

    torch.set_num_threads(1)
    resolved = load_config(None, [f"model.path={model}", *LORA])
    Path(run_dir, "config.yaml").write_text(resolved.to_yaml())

    async def main() -> None:
        eng = FSDPTrainerEngine(resolved.cfg, FSDPOptions(backend="gloo"))
        init = {"init_method": f"tcp://127.0.0.1:{free_port()}", "seed": 0}
        await eng.setup(TrainerContext(0, 1, eng.opt, resolved.cfg.algorithm, init))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, p in adapter_tensors(eng.lm):
                p.to_local().copy_(torch.randn(p.to_local().shape, generator=g) * 0.1)
        out["adapter"] = {n: t.clone() async for n, t in eng.export_weights()}
        final = checkpoint_dir(Path(run_dir), 1)
        tmp = begin(final)
        await eng.save_checkpoint(str(tmp / "trainer"))
        commit(tmp, final, {"step": 1})
        await eng.close()

    asyncio.run(main())


def _export(run_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "laminar_core.cli", "export", str(run_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A LoRA run's checkpoint exported twice (``laminar export`` and ``--merge``), shared by
    the module's tests: ``(work, model, run_dir, trained adapter)``."""
    work = tmp_path_factory.mktemp("export")
    model = str(build_tiny_model(work / "m", seed=0))
    run_dir = work / "run"
    run_dir.mkdir()
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    p = ctx.Process(target=_trained_checkpoint, args=(model, str(run_dir), out))
    p.start()
    p.join(timeout=300)
    assert p.exitcode == 0
    trained = dict(out["adapter"])
    for args in ((), ("--merge",)):
        res = _export(run_dir, *args)
        assert res.returncode == 0, res.stderr[-2000:]
    return work, model, run_dir, trained


def test_export_writes_a_peft_adapter_and_a_merged_model(exported):
    work, model, run_dir, trained = exported
    adapter_dir = run_dir / "export" / "step_000001"
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4
    assert sorted(conf["target_modules"]) == ["q_proj", "up_proj"]
    spec, tensors = read_adapter(adapter_dir)
    assert set(tensors) == set(trained)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert all(torch.equal(tensors[n], trained[n]) for n in trained)

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export" / "step_000001-merged")
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    apply_lora(reference, spec)
    reference.load_state_dict(
        {n.removeprefix("base_model.model."): t for n, t in trained.items()}, strict=False
    )
    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    with torch.no_grad():
        got, want = merged.eval()(ids).logits, reference.eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(model).eval()(ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter is in it

    bad = subprocess.run(  # a path without a checkpoint: one line, exit 2
        [sys.executable, "-m", "laminar_core.cli", "export", str(work / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no checkpoint there" in bad.stderr


def test_vllm_serves_the_merged_export(exported):
    """The merged export is a model directory a vLLM replica loads as any other: its
    log-probs on its own samples match transformers' on the same directory."""
    require_modules("laminar_vllm", "vllm", what="vLLM loading the merged export")
    from transformers import AutoModelForCausalLM

    from laminar_core.testing.lora import PROMPT, logprob_gap
    from laminar_core.types import GenerationRequest, SamplingParams
    from laminar_vllm import VLLMOptions, VLLMRolloutEngine

    merged = exported[2] / "export" / "step_000001-merged"
    opts = VLLMOptions(kv_cache_mb=32, max_model_len=256, max_num_seqs=4)

    async def main():
        eng = VLLMRolloutEngine("r0", str(merged), opts, model_dtype="float32")
        await eng.start()
        try:
            req = GenerationRequest(
                "m", "g", prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=24)
            )
            return await eng.generate(req)
        finally:
            await eng.stop()

    t = asyncio.run(main())
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert t.response_ids and logprob_gap(hf, PROMPT, t.response_ids, t.logprobs) < 1e-4
