"""``laminar export RUN_DIR [--merge]``: a run's checkpoint as files other tools load.

The run's own trainer engine (from ``RUN_DIR/config.yaml``) is built as a group of one rank,
loads the checkpoint and exports its weights exactly as it sends a version to the replicas;
so this works for any trainer engine and checkpoint layout (a checkpoint written by N ranks
is resharded on load). What is written:

* a LoRA run (``trainer.lora``): a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``, PEFT's key names) that ``peft.PeftModel.from_pretrained``
  and vLLM's ``LoRARequest`` load over ``model.path``;
* with ``--merge`` (LoRA), or for a full fine-tuning run: a Hugging Face model directory
  (``model.path``'s config and tokenizer files, the weights in ``model.safetensors``) that
  ``AutoModelForCausalLM.from_pretrained`` and vLLM load.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from laminar_core.interfaces import BuildContext, TrainerContext, build
from laminar_core.loop.checkpoint import TRAINER_DIR, find_checkpoint
from laminar_core.plugins import default_manager
from laminar_core.runtime.resolve import load_config
from laminar_core.training.lora import LoRASpec, merge_into, write_adapter


def export_checkpoint(path: str | Path, out: str | Path | None = None, merge: bool = False) -> Path:
    """Export ``path`` (a run directory: its latest checkpoint; or a checkpoint directory)
    to ``out`` (default ``RUN_DIR/export/step_N[-merged]``); returns the directory."""
    ckpt = find_checkpoint(path)
    run_dir = ckpt.parent.parent
    resolved = load_config(run_dir / "config.yaml", ["run.resume="])
    cfg = resolved.cfg
    spec = LoRASpec.of(cfg.trainer.lora)
    target = Path(out) if out else run_dir / "export" / (ckpt.name + ("-merged" if merge else ""))
    tensors = asyncio.run(_export(resolved, ckpt / TRAINER_DIR))
    if spec is not None and not merge:
        return write_adapter(target, tensors, spec, base_model=str(cfg.model.path))
    if spec is not None:
        adapter = dict(tensors)
        tensors = list(merge_into(_base_weights(Path(cfg.model.path)), adapter, spec))
    return _write_model(Path(cfg.model.path), target, tensors)


async def _export(resolved, directory: Path) -> list[tuple[str, torch.Tensor]]:
    from laminar_core.net import free_port

    cfg = resolved.cfg
    options = resolved.engine_options.get("trainer")
    factory = default_manager().get("trainer", cfg.trainer.engine)
    engine = build(factory, BuildContext(cfg, options, 0, "trainer", 1, {}))
    init = {"init_method": f"tcp://127.0.0.1:{free_port()}", "seed": cfg.run.seed}
    await engine.setup(TrainerContext(0, 1, options, cfg.algorithm, init))
    try:
        await engine.load_checkpoint(str(directory))
        return [(n, t.detach().to("cpu").clone()) async for n, t in engine.export_weights()]
    finally:
        await engine.close()


def _base_weights(model: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path {model} holds no *.safetensors to merge into")
    for f in files:
        yield from load_file(str(f)).items()


def _write_model(base: Path, target: Path, tensors: list[tuple[str, torch.Tensor]]) -> Path:
    """``base``'s non-weight files (config, tokenizer) and ``tensors`` as one safetensors."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, target / f.name)
    state = {n: t.contiguous() for n, t in tensors}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
