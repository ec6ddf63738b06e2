"""LoRA adapters on a transformers model, in PEFT's format: the layers, the names, the files.

Laminar's own adapter layer rather than PEFT's (which is not a dependency): ``LoRALinear``
*is* an ``nn.Linear`` (the base ``weight``/``bias`` keep their names and Parameter objects)
with two more linear maps, ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``. So a
trainer that shards, checkpoints or gathers by parameter name (FSDP2's ``fully_shard`` per
decoder layer, gradient checkpointing of whole layers, the chunked log-prob head reading the
LM head's weight) sees the same model plus the adapter parameters; nothing wraps the model.

Names follow PEFT's files: an adapter tensor of module ``model.layers.0.self_attn.q_proj``
is ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``peft_name``), and
``adapter_config.json`` holds ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``:
what ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load. A weight version of
a LoRA run is exactly these tensors, in this naming (``adapter_tensors``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    """What an adapter is: rank, scale, dropout and the module-name suffixes it targets."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, lora: Any) -> LoRASpec | None:
        """From ``trainer.lora`` (``LoRAConfig`` or a mapping); ``None`` when rank is 0."""
        get = lora.get if isinstance(lora, dict) else lambda k, d=None: getattr(lora, k, d)
        rank = int(get("rank", 0) or 0)
        if rank <= 0:
            return None
        targets = tuple(str(t) for t in get("target_modules", ()))
        return cls(rank, float(get("alpha", 16.0)), float(get("dropout", 0.0)), targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str = "") -> dict[str, Any]:
        """``adapter_config.json`` as PEFT writes it for this adapter."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }


class LoRALinear(nn.Linear):
    """``y = base(x) + scaling * lora_B(lora_A(dropout(x)))`` (see the module docstring).

    Dropout applies only while gradients are recorded in training mode: the log-probs a
    trainer recomputes without gradients (and the rollout engines') use no dropout.
    """

    def __init__(self, base: nn.Linear, spec: LoRASpec) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, **kw)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, **kw)
        self.scaling = spec.scaling
        self.lora_dropout = spec.dropout
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as PEFT
        nn.init.zeros_(self.lora_B.weight)  # the adapter starts as the base model

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        h = x
        if self.lora_dropout and self.training and torch.is_grad_enabled():
            h = nn.functional.dropout(h, self.lora_dropout)
        return out + self.lora_B(self.lora_A(h.to(self.lora_A.weight.dtype))) * self.scaling

    def merged_weight(self) -> Tensor:
        """The base weight with the adapter folded in (plain tensors)."""
        delta = self.lora_B.weight @ self.lora_A.weight
        return self.weight + delta.to(self.weight.dtype) * self.scaling


def _matches(name: str, targets: Iterable[str]) -> bool:
    """PEFT's rule: the module's full name is a target or ends in ``.target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _linear_suffixes(model: nn.Module) -> list[str]:
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n}
    )


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Replace every targeted ``nn.Linear`` of ``model`` by a ``LoRALinear`` and freeze all
    but the adapters; returns the adapted modules' names.

    One-line ``ValueError`` s name the fix: a target that matches no linear layer (listing
    the model's), a rank above a targeted layer's width, a target that is the output head
    (the log-prob head reads its weight directly).
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    chosen = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head and n and _matches(n, spec.target_modules)
    ]
    for t in spec.target_modules:
        if not any(_matches(n, [t]) for n, _ in chosen):
            raise ValueError(
                f"trainer.lora.target_modules: '{t}' matches no linear layer of the model; "
                f"its linear layers are {', '.join(_linear_suffixes(model))} (the output head "
                "cannot take an adapter)"
            )
    for n, m in chosen:
        width = min(m.in_features, m.out_features)
        if spec.rank > width:
            raise ValueError(
                f"trainer.lora.rank={spec.rank} is above the width of {n} ({m.in_features} -> "
                f"{m.out_features}); use a rank <= {width}"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    for n, m in chosen:
        parent_name, _, leaf = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(m, spec))
    return [n for n, _ in chosen]


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """A model parameter's name as PEFT's ``adapter_model.safetensors`` keys it."""
    return PEFT_PREFIX + name


def adapter_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(PEFT name, parameter)`` of every adapter tensor of ``model``, in module order."""
    return [(peft_name(n), p) for n, p in model.named_parameters() if is_adapter(n)]


def merge_into(
    base: Iterator[tuple[str, Tensor]] | Iterable, adapter: dict[str, Tensor], spec: LoRASpec
):
    """Yield ``base``'s ``(name, tensor)`` with each adapted weight replaced by
    ``W + scaling * B @ A`` (``adapter`` keyed by PEFT names)."""
    for name, w in base:
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        a = adapter.get(peft_name(f"{stem}.lora_A.weight")) if stem else None
        if a is None:
            yield name, w
            continue
        b = adapter[peft_name(f"{stem}.lora_B.weight")]
        delta = (b.float() @ a.float()) * spec.scaling
        yield name, (w.float() + delta).to(w.dtype)


def write_adapter(
    directory: str | Path,
    tensors: Iterable[tuple[str, Tensor]],
    spec: LoRASpec,
    base_model: str = "",
) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    from ``(PEFT name, tensor)`` pairs; returns the directory."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().to("cpu").contiguous() for n, t in tensors}
    save_file(state, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (d / ADAPTER_CONFIG).write_text(json.dumps(spec.peft_config(base_model), indent=2))
    return d


def read_adapter(directory: str | Path) -> tuple[LoRASpec, dict[str, Tensor]]:
    """A PEFT adapter directory's spec and tensors (PEFT names)."""
    from safetensors.torch import load_file

    d = Path(directory)
    conf = json.loads((d / ADAPTER_CONFIG).read_text())
    spec = LoRASpec(
        int(conf["r"]),
        float(conf["lora_alpha"]),
        float(conf.get("lora_dropout", 0.0)),
        tuple(conf["target_modules"]),
    )
    return spec, load_file(str(d / ADAPTER_WEIGHTS))
