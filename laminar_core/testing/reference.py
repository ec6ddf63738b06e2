"""What the rollout kit compares a real engine against: a transformers forward of the same
weights, and the engine built from config the way the runtime builds it.

``HFReference`` holds the model of ``model_dir`` in float32 on CPU (use a tiny model: the kit
keeps a few copies of it). It makes new weight versions (every tensor perturbed, so an
engine that ignores a load is caught) in the rollout's naming -- ``named_parameters()``,
which lists a tied output embedding once, as the trainer exports it -- and computes the
log-probs an engine must report: ``log_softmax(logits / temperature)`` of each sampled
token, the final end-of-sequence token included.

transformers is imported only here, only when a kit is given a ``model_dir``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from laminar_core.interfaces import BuildContext, RolloutEngine, build
from laminar_core.testing.report import require


class HFReference:
    """The reference model of ``model_dir`` (float32, CPU) and its tokenizer."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids: set[int] = set(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        self._original = self._snapshot()

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the current weights (``logprobs(..., state=)`` computes under it)."""
        return self._snapshot()

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """The current weights, as a trainer exports them (copies)."""
        return [(n, p.detach().clone()) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def perturb(self, seed: int, scale: float = 0.05) -> None:
        """Add seeded noise to every tensor: a new version no tensor of which is the old."""
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)

    @torch.no_grad()
    def restore(self) -> None:
        """Back to ``model_dir``'s weights."""
        for n, p in self.model.named_parameters():
            p.copy_(self._original[n])

    @torch.no_grad()
    def force_eos(self, prompt_ids: list[int], margin: float = 40.0) -> int | None:
        """Make the end-of-sequence token the near-certain first token after ``prompt_ids``
        (its output-embedding row becomes a scaled copy of the top token's, so its logit is
        ``margin`` times the top logit). Returns the EOS id, or ``None`` when this cannot be
        arranged (no EOS id, or a top logit that is not positive)."""
        if not self.eos_ids:
            return None
        eos = min(self.eos_ids)
        logits = self.model(torch.tensor([prompt_ids])).logits[0, -1].float()
        top = int(logits.argmax())
        if top == eos:
            return eos
        if logits[top] <= 0:
            return None
        out = self.model.get_output_embeddings().weight
        out[eos] = out[top] * margin
        return eos

    @torch.no_grad()
    def logprobs(
        self,
        prompt: list[int],
        response: list[int],
        temperature: float,
        state: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``log_softmax(logits / temperature)`` of each response token (float64), under the
        current weights or ``state`` (a ``state()`` taken earlier)."""
        if not response:
            return torch.zeros(0, dtype=torch.float64)
        ids = torch.tensor([list(prompt) + list(response)])
        if state is None:
            out = self.model(ids)
        else:
            out = torch.func.functional_call(self.model, state, (ids,))
        logits = out.logits[0, len(prompt) - 1 : -1].double()
        lp = torch.log_softmax(logits / (temperature or 1.0), -1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]

    def decode(self, ids: Iterable[int]) -> str:
        """The text a reward sees (special tokens skipped)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def engine_from_config(
    cls: type,
    options: dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
    model_dir: str | Path | None = None,
    name: str = "under_test",
) -> Callable[[str], RolloutEngine]:
    """A ``make_engine(replica_id)`` that builds ``cls`` exactly as the runtime does.

    ``cls`` is registered as rollout engine ``name`` in a fresh plugin manager (next to
    core's own engines); a config with ``rollout.engine: name``, ``rollout.<name>: options``
    and ``model.path: model_dir`` plus ``overrides`` is resolved -- so the class is checked
    against the interface and ``options`` are validated by ``cls.Options`` -- and each call
    returns ``build(cls, BuildContext(...))`` (``cls.from_config(ctx)``, else ``cls(ctx)``).
    A bad option or a missing method raises ``ConfigError`` with the line a user would see.
    """
    from laminar_core.plugins import PluginManager, builtins, hookimpl
    from laminar_core.runtime.resolve import resolve

    class _UnderTest:
        @hookimpl
        def laminar_rollout_engines(self) -> dict[str, object]:
            return {name: cls}

    pm = PluginManager()
    pm.register(builtins, name="laminar-core")
    pm.register(_UnderTest(), name="under-test")
    require(
        not pm.failures,
        f"{cls.__qualname__} could not be registered as rollout engine {name!r}: "
        f"{'; '.join(map(str, pm.failures))}",
    )
    raw: dict[str, Any] = {"rollout": {"engine": name, name: dict(options or {})}}
    if model_dir is not None:
        raw["model"] = {"path": str(model_dir)}
    resolved = resolve(raw, overrides, pm, source="check_rollout_engine")
    replicas: list[str] = []

    def make(replica_id: str) -> RolloutEngine:
        replicas.append(replica_id)
        ctx = BuildContext(
            resolved.cfg, resolved.engine_options.get("rollout"), len(replicas) - 1, replica_id
        )
        return build(cls, ctx)

    return make
