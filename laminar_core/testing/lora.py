"""The LoRA kit: a rollout engine that hot-loads adapters (``hot_loads_lora``) serves each
version with *that* version's adapter.

``check_lora_versions`` loads two random (non-zero) adapters of ``spec`` in turn, the first
as tensors in memory and the second through a node relay's shared memory (the relay tier's
path), and compares the log-probs the replica reports with a transformers forward of the base
model plus the same adapter (``laminar_core.training.apply_lora``). Each version must agree
with its own adapter within ``tol`` and disagree with the other one by far more, so a replica
that keeps serving the previous adapter, or the base model, fails. With ``adapter_files`` it
also checks that the replaced adapter's files are gone.

transformers is imported only when the kit runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from laminar_core.interfaces import RolloutEngine
from laminar_core.interfaces.weights import TensorWeights
from laminar_core.testing.relay import share_version
from laminar_core.testing.report import require
from laminar_core.training.lora import LoRASpec, adapter_tensors, apply_lora
from laminar_core.types import GenerationRequest, SamplingParams

PROMPT = [72, 15, 22, 24, 34]


def adapted_model(model_dir: str | Path, spec: LoRASpec, seed: int, scale: float = 0.2):
    """The model of ``model_dir`` (float32) with a seeded random adapter of ``spec``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    apply_lora(lm, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_tensors(lm):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return lm.eval()


@torch.no_grad()
def logprob_gap(model, prompt: list[int], response: list[int], logprobs: list[float]) -> float:
    """Largest |model's log-prob - reported log-prob| over ``response`` (temperature 1)."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1 :]
    return (lp - torch.tensor(logprobs)).abs().max().item()


async def check_lora_versions(
    engine: RolloutEngine,
    model_dir: str | Path,
    spec: LoRASpec,
    shm_root: str | Path,
    tol: float = 1e-4,
    adapter_files: Callable[[], list[str]] | None = None,
    max_tokens: int = 24,
) -> dict[str, float]:
    """Drive a started ``engine`` (built with ``lora=spec`` on ``model_dir``) through two
    adapter versions; returns the log-prob gaps (``v1``/``v2``: to its own adapter;
    ``v1_vs_v2``/``v2_vs_v1``: to the other one). Raises ``ContractError`` naming the rule."""
    v1, v2 = adapted_model(model_dir, spec, 1), adapted_model(model_dir, spec, 2)
    name = type(engine).__name__
    gaps: dict[str, float] = {}

    async def run(tid: str, version: int, own, other, key: str) -> None:
        req = GenerationRequest(
            tid, "g", prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=max_tokens)
        )
        t = await engine.generate(req)
        require(t.versions == [version] and t.response_ids, f"{name}: {t.versions=}")
        gaps[key] = logprob_gap(own, PROMPT, t.response_ids, t.logprobs)
        gaps[f"{key}_vs_other"] = logprob_gap(other, PROMPT, t.response_ids, t.logprobs)
        require(
            gaps[key] < tol,
            f"{name}: version {version}'s log-probs are {gaps[key]:.2e} from its adapter's "
            f"(tolerance {tol:.0e}): the replica does not apply the adapter it was sent",
        )
        require(
            gaps[f"{key}_vs_other"] > 100 * tol,
            f"{name}: version {version}'s log-probs also match the other adapter's: the two "
            "versions cannot be told apart (a larger adapter scale or a longer response)",
        )

    await engine.update_weights(
        TensorWeights(1, [(n, p.detach().clone()) for n, p in adapter_tensors(v1)])
    )
    await run("lora-a", 1, v1, v2, "v1")
    before = set(adapter_files()) if adapter_files else set()
    # the relay's path: the version in shared memory, adapter tensors only
    shared = share_version(shm_root, 0, 2, [(n, p.detach()) for n, p in adapter_tensors(v2)])
    await engine.update_weights(shared)
    await run("lora-b", 2, v2, v1, "v2")  # the new adapter, not the old one
    if adapter_files:
        left = before & set(adapter_files())
        require(not left, f"{name}: the replaced adapter's files are still there: {sorted(left)}")
    return gaps
