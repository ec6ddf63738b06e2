"""Hugging Face <-> megatron-core ``GPTModel``: the architecture and the weight layout.

Covers the Llama family as transformers writes it (``llama``, ``mistral``, ``qwen2`` with
q/k/v biases, ``qwen3`` with per-head q/k RMSNorm): RMSNorm, SwiGLU MLP, rotary embeddings
(default or Llama-3 scaling), grouped-query attention, tied or untied output head.

Megatron fuses what Hugging Face keeps apart, and shards it over the tensor-parallel group:

- ``linear_qkv``: q, k and v interleaved by query group, ``[ng, nh/ng + 2, d, H]`` flattened
  to rows (each group's query heads, then its key head, then its value head); the rows split
  over TP by whole groups (so ``ng % tp == 0``).
- ``linear_fc1``: ``[gate_r; up_r]`` on TP rank ``r`` (each half split over TP on its own).
- ``linear_proj`` / ``linear_fc2``: split over TP along the input dimension.
- embedding / output layer: rows padded to ``padded_vocab`` (zeros) and split over TP.
- norms: replicated.

:func:`mappings` lists, for one model, each megatron parameter (global layer numbering)
with the Hugging Face tensors it holds and how they are fused (its ``kind``);
:func:`to_shard` builds one TP rank's shard from the Hugging Face tensors and
:func:`to_hf` turns the gathered TP shards back into the Hugging Face tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class HFArch:
    """What the megatron model needs from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    rope_llama3_factor: float | None
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool


def read_arch(model_dir: Path) -> HFArch:
    """The architecture of the Hugging Face model in ``model_dir``, or ``ValueError`` naming
    what this engine cannot represent."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}
    kind = cfg.get("model_type", "?")
    where = f"{model_dir}/config.json"
    if kind not in SUPPORTED:
        raise ValueError(
            f"{where}: model_type {kind!r} is not supported by laminar-megatron's built-in "
            f"weight mapping (supported: {', '.join(SUPPORTED)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} (this engine builds SwiGLU, silu only)")
    if cfg.get("use_sliding_window") or (kind == "mistral" and cfg.get("sliding_window")):
        raise ValueError(f"{where}: sliding-window attention is not supported by this engine")
    if cfg.get("mlp_bias") or (kind in ("llama", "mistral") and cfg.get("attention_bias")):
        raise ValueError(f"{where}: attention_bias / mlp_bias on Llama are not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    factor = None
    if rope_type == "llama3":
        got = (
            float(rope.get("low_freq_factor", 1)),
            float(rope.get("high_freq_factor", 4)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
        if got != (1.0, 4.0, 8192):
            raise ValueError(
                f"{where}: llama3 rope scaling with (low_freq_factor, high_freq_factor, "
                f"original_max_position_embeddings) = {got}; megatron-core implements "
                f"(1, 4, 8192) only"
            )
        factor = float(rope.get("factor", 8.0))
    elif rope_type != "default":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (default, llama3)")
    return HFArch(
        model_type=kind,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_llama3_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=kind == "qwen3",
    )


def check_layout(arch: HFArch, tp: int, pp: int) -> None:
    """``ValueError`` if the model cannot be split ``tp`` x ``pp`` ways."""
    if arch.num_kv_heads % tp or arch.num_heads % tp:
        raise ValueError(
            f"trainer.megatron.tp={tp} must divide the attention heads ({arch.num_heads}) and "
            f"the key/value heads ({arch.num_kv_heads})"
        )
    if arch.ffn_hidden_size % tp:
        raise ValueError(
            f"trainer.megatron.tp={tp} must divide intermediate_size ({arch.ffn_hidden_size})"
        )
    if arch.num_layers % pp:
        raise ValueError(
            f"trainer.megatron.pp={pp} must divide the number of layers ({arch.num_layers})"
        )


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Rows of the embedding / output layer: ``vocab`` rounded up to ``divisible_by``, or to
    ``divisible_by * tp`` if ``tp`` does not divide that (the same size for every ``tp``
    that divides it, so checkpoints reshard between those)."""
    n = -(-vocab // divisible_by) * divisible_by
    if n % tp:
        n = -(-vocab // (divisible_by * tp)) * divisible_by * tp
    return n


@dataclass(frozen=True)
class Mapping:
    """One megatron parameter (global name) and the Hugging Face tensors it holds."""

    mcore: str
    hf: tuple[str, ...]
    kind: str  # replicated | vocab | row | qkv | gate_up


def layer_mappings(arch: HFArch, layer: int, te: bool) -> list[Mapping]:
    """Mappings of decoder layer ``layer`` (global, from 0). ``te``: Transformer Engine names
    (norms fused into the following linear)."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn, mlp = f"{h}self_attn.", f"{h}mlp."
    ln1 = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    ln2 = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    out = [
        Mapping(m + ln1, (h + "input_layernorm.weight",), "replicated"),
        Mapping(
            m + "self_attention.linear_qkv.weight",
            tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
    ]
    if arch.qkv_bias:
        out.append(
            Mapping(
                m + "self_attention.linear_qkv.bias",
                tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    if arch.qk_norm:
        out += [
            Mapping(
                f"{m}self_attention.{p}_layernorm.weight", (f"{attn}{p}_norm.weight",), "replicated"
            )
            for p in "qk"
        ]
    out += [
        Mapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Mapping(m + ln2, (h + "post_attention_layernorm.weight",), "replicated"),
        Mapping(
            m + "mlp.linear_fc1.weight",
            (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
            "gate_up",
        ),
        Mapping(m + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "row"),
    ]
    return out


def mappings(arch: HFArch, te: bool) -> list[Mapping]:
    """Every exported tensor's mapping, in Hugging Face order (embedding, layers, norm,
    head). A tied head is not listed: its weights are the embedding's."""
    out = [Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for layer in range(arch.num_layers):
        out += layer_mappings(arch, layer, te)
    out.append(Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not arch.tied_embeddings:
        out.append(Mapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def output_layer_mapping(arch: HFArch) -> Mapping:
    """The last pipeline stage's output layer: under PP a tied head is a copy of the
    embedding that megatron keeps in sync; it loads from the embedding."""
    src = "model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"
    return Mapping("output_layer.weight", (src,), "vocab")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def globalize(local_name: str, offset: int) -> str:
    """A stage's parameter name with its layer number made global (``+ offset``)."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)


def layer_of(mcore_name: str) -> int | None:
    m = _LAYER.match(mcore_name)
    return int(m.group(1)) if m else None


def to_shard(
    kind: str, hf: list[torch.Tensor], arch: HFArch, rank: int, tp: int, rows: int
) -> torch.Tensor:
    """TP rank ``rank``'s shard of the megatron tensor fused from the Hugging Face ``hf``.
    ``rows``: the padded vocabulary (``vocab`` kind only)."""
    if kind == "replicated":
        return hf[0]
    if kind == "vocab":
        full = hf[0]
        if full.shape[0] < rows:
            pad = full.new_zeros((rows - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad])
        return full.chunk(tp, 0)[rank]
    if kind == "row":
        return hf[0].chunk(tp, 1)[rank]
    if kind == "gate_up":
        return torch.cat([hf[0].chunk(tp, 0)[rank], hf[1].chunk(tp, 0)[rank]])
    if kind == "qkv":
        q, k, v = hf
        ng, d = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(ng, -1, d, *rest), k.reshape(ng, 1, d, *rest), v.reshape(ng, 1, d, *rest)],
            dim=1,
        )
        return fused.reshape(-1, *rest).chunk(tp, 0)[rank]
    raise ValueError(f"unknown mapping kind {kind!r}")


def to_hf(kind: str, shards: list[torch.Tensor], arch: HFArch) -> list[torch.Tensor]:
    """The Hugging Face tensors held by the megatron tensor whose TP shards (in rank order)
    are ``shards``: fused ones split, vocabulary padding trimmed."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "vocab":
        return [torch.cat(shards)[: arch.vocab_size]]
    if kind == "row":
        return [torch.cat(shards, 1)]
    if kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    if kind == "qkv":
        full = torch.cat(shards)
        ng, d = arch.num_kv_heads, arch.head_dim
        rest = full.shape[1:]
        grouped = full.reshape(ng, -1, d, *rest)
        per_group = grouped.shape[1] - 2
        q, k, v = grouped.split([per_group, 1, 1], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise ValueError(f"unknown mapping kind {kind!r}")


class HFCheckpoint:
    """Tensors of a local Hugging Face safetensors checkpoint (one file or an index),
    read one at a time."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            with safe_open(str(self.dir / "model.safetensors"), "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{self.dir}: no model.safetensors(.index.json); laminar-megatron loads "
                f"safetensors checkpoints (re-save the model with safe_serialization=True)"
            )
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        with self._open(str(self.dir / file), "pt") as f:
            return f.get_tensor(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.weight_map.values())):
            with self._open(str(self.dir / file), "pt") as f:
                names = f.keys()
                for name in names:
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out
