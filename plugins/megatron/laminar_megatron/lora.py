"""LoRA adapters on megatron-core's linear layers, tensor-parallel, in PEFT's names.

megatron-core 0.16.1 has no LoRA of its own, so the adapters are ours. Each Hugging Face
target module (``q_proj`` ... ``down_proj``, as in ``trainer.lora.target_modules``) gets
its own adapter ``A [rank, in]``, ``B [out, rank]`` -- exactly PEFT's tensors -- attached to
the megatron layer that holds that module's weight (``hf.layer_mappings``):

- ``linear_qkv`` (q, k, v) and ``linear_fc1`` (gate, up) are ``ColumnParallelLinear``: ``A``
  is replicated and ``B`` split along its output, each TP rank holding the rows of the heads /
  FFN columns its base shard holds. The adapters' outputs are laid out like the fused
  weight's rows (q, k, v interleaved by query group; gate then up) and added to the layer's
  output. ``A``'s input gradient is summed over the TP group (``copy_to`` region), as the
  replicated ``A`` sees only this rank's share of the output.
- ``linear_proj`` (o) and ``linear_fc2`` (down) are ``RowParallelLinear``: ``A`` is split
  along its input (like the base shard), ``A x`` is summed over the TP group (``reduce_from``
  region), and ``B`` is replicated.

The base layers keep their parameters and names (loading, checkpoints and the export of the
base stay as they are); the adapter is a submodule ``lora`` of the layer plus a forward hook
that adds ``scaling * B A x``. Split tensors are marked ``tensor_model_parallel`` (the
grad norm counts them on every rank, replicated ones on TP rank 0) and are checkpointed as
TP-sharded tensors, so an adapter checkpoint reshards like the rest. ``full_adapter``
gathers a layer's adapters into PEFT's full tensors (the version the replicas hot-load).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn

from laminar_core.training import LoRASpec, peft_name

#: Hugging Face module -> (megatron layer under ``decoder.layers.N.``, how it is fused,
#: the HF parent module).
TARGETS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "qkv", "self_attn"),
    "k_proj": ("self_attention.linear_qkv", "qkv", "self_attn"),
    "v_proj": ("self_attention.linear_qkv", "qkv", "self_attn"),
    "o_proj": ("self_attention.linear_proj", "row", "self_attn"),
    "gate_proj": ("mlp.linear_fc1", "gate_up", "mlp"),
    "up_proj": ("mlp.linear_fc1", "gate_up", "mlp"),
    "down_proj": ("mlp.linear_fc2", "row", "mlp"),
}
#: The Hugging Face modules each fused layer holds, in the fused order.
PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def check_targets(spec: LoRASpec, arch: Any) -> None:
    """One-line ``ValueError`` s: a target this engine cannot adapt, a rank above a width."""
    for t in spec.target_modules:
        if t not in TARGETS:
            raise ValueError(
                f"trainer.lora.target_modules: '{t}' is not a linear layer laminar-megatron "
                f"can adapt; use some of {', '.join(TARGETS)}"
            )
    for t in spec.target_modules:
        i, o = _hf_shape(t, arch)
        if spec.rank > min(i, o):
            raise ValueError(
                f"trainer.lora.rank={spec.rank} is above the width of {t} ({i} -> {o}); use a "
                f"rank <= {min(i, o)}"
            )


def _hf_shape(target: str, arch: Any) -> tuple[int, int]:
    """(in, out) of the Hugging Face linear ``target``."""
    h, d = arch.hidden_size, arch.head_dim
    return {
        "q_proj": (h, arch.num_heads * d),
        "k_proj": (h, arch.num_kv_heads * d),
        "v_proj": (h, arch.num_kv_heads * d),
        "o_proj": (arch.num_heads * d, h),
        "gate_proj": (h, arch.ffn_hidden_size),
        "up_proj": (h, arch.ffn_hidden_size),
        "down_proj": (arch.ffn_hidden_size, h),
    }[target]


class LayerLoRA(nn.Module):
    """The adapters of one megatron linear layer (one per targeted HF module it fuses)."""

    def __init__(
        self,
        kind: str,
        targets: list[str],
        spec: LoRASpec,
        arch: Any,
        tp: int,
        tp_rank: int,
        tp_group: Any,
        generator: torch.Generator,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.kind, self.targets, self.scaling = kind, targets, spec.scaling
        self.tp, self.tp_rank, self.tp_group = tp, tp_rank, tp_group
        self.arch = arch
        for t in targets:
            i, o = _hf_shape(t, arch)
            a = torch.empty(spec.rank, i)
            # as PEFT (and laminar's LoRALinear): kaiming A, zero B; drawn in full from one
            # seeded stream on every rank, so TP ranks hold shards of the same A
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(o, spec.rank)
            a, b = self.shard(t, a, b)
            kw = {"dtype": dtype, "device": device}
            self.register_parameter(f"A_{t}", nn.Parameter(a.to(**kw)))
            self.register_parameter(f"B_{t}", nn.Parameter(b.to(**kw)))
            split = self.split_axis(t)
            if split is not None:
                p = getattr(self, split[0] + "_" + t)
                p.tensor_model_parallel = True
                p.partition_dim = split[1]
                p.partition_stride = 1

    def split_axis(self, target: str) -> tuple[str, int] | None:
        """Which of A/B is split over TP and along which axis (None with TP=1)."""
        if self.tp == 1:
            return None
        return ("A", 1) if self.kind == "row" else ("B", 0)

    def shard(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple:
        """This TP rank's (A, B) of the full PEFT tensors of ``target``."""
        if self.kind == "row":
            return a.chunk(self.tp, 1)[self.tp_rank].clone(), b.clone()
        return a.clone(), b.chunk(self.tp, 0)[self.tp_rank].clone()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B A x`` in the layer's (local) output layout."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.kind == "row":
            (t,) = self.targets
            h = x @ getattr(self, f"A_{t}").t()
            if self.tp > 1:
                h = reduce_from_tensor_model_parallel_region(h, self.tp_group)
            return (h @ getattr(self, f"B_{t}").t()) * self.scaling
        outs = []
        for t in PARTS[self.kind]:
            if t not in self.targets:
                width = _hf_shape(t, self.arch)[1] // self.tp
                outs.append(x.new_zeros(*x.shape[:-1], width))
                continue
            h = x @ getattr(self, f"A_{t}").t()
            if self.tp > 1:
                h = copy_to_tensor_model_parallel_region(h, self.tp_group)
            outs.append((h @ getattr(self, f"B_{t}").t()) * self.scaling)
        if self.kind == "gate_up":
            return torch.cat(outs, -1)
        groups = self.arch.num_kv_heads // self.tp  # this rank's query groups
        q, k, v = (y.reshape(*y.shape[:-1], groups, -1) for y in outs)
        return torch.cat([q, k, v], -1).flatten(-2)


def _hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.lora.delta(x).to(out.dtype), bias


def _sharded_state_dict(module: nn.Module, cls_method: Any) -> Any:
    """The layer's checkpoint entries with its split adapter tensors TP-sharded (megatron's
    own method treats every tensor it does not know as replicated)."""

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        out = cls_method(module, prefix, sharded_offsets, metadata)
        lora: LayerLoRA = module.lora
        for t in lora.targets:
            split = lora.split_axis(t)
            if split is None:
                continue
            key = f"{prefix}lora.{split[0]}_{t}"
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                getattr(lora, f"{split[0]}_{t}"),
                key,
                split[1],
                prepend_offsets=sharded_offsets,
                tp_group=module.tp_group,
                dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )
        return out

    return sharded_state_dict


def apply_lora(
    gpt: nn.Module,
    spec: LoRASpec,
    arch: Any,
    layer_offset: int,
    tp: int,
    tp_rank: int,
    tp_group: Any,
    seed: int,
) -> dict[str, LayerLoRA]:
    """Freeze ``gpt`` and attach ``spec``'s adapters to this stage's targeted layers;
    returns them by their megatron layer's global name. Adapter ``A`` s are drawn from
    ``seed`` layer by layer (the same on every rank and for every TP/PP layout)."""
    for p in gpt.parameters():
        p.requires_grad_(False)
    by_layer: dict[str, list[str]] = {}
    for t in spec.target_modules:
        by_layer.setdefault(TARGETS[t][0], []).append(t)
    out: dict[str, LayerLoRA] = {}
    for i, layer in enumerate(gpt.decoder.layers):
        g = layer_offset + i
        for sub, targets in sorted(by_layer.items()):
            linear = layer.get_submodule(sub)
            kind = TARGETS[targets[0]][1]
            ordered = [t for t in PARTS.get(kind, targets) if t in targets]
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{g}:{sub}".encode()))
            w = linear.weight
            linear.lora = LayerLoRA(
                kind, ordered, spec, arch, tp, tp_rank, tp_group, gen, w.dtype, w.device
            )
            linear.register_forward_hook(_hook, with_kwargs=True)
            linear.sharded_state_dict = _sharded_state_dict(linear, type(linear).sharded_state_dict)
            out[f"decoder.layers.{g}.{sub}"] = linear.lora
    return out


def hf_names(layer: int, target: str) -> tuple[str, str]:
    """PEFT's names of ``target``'s A and B in decoder layer ``layer``."""
    stem = f"model.layers.{layer}.{TARGETS[target][2]}.{target}"
    return peft_name(f"{stem}.lora_A.weight"), peft_name(f"{stem}.lora_B.weight")


def full_adapter(lora: LayerLoRA, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``target``'s full (A, B) on every TP rank (collective over the TP group)."""
    import torch.distributed as dist

    a, b = getattr(lora, f"A_{target}").detach(), getattr(lora, f"B_{target}").detach()
    split = lora.split_axis(target)
    if split is None:
        return a, b
    local = a if split[0] == "A" else b
    shards = [torch.empty_like(local) for _ in range(lora.tp)]
    dist.all_gather(shards, local.contiguous(), group=lora.tp_group)
    full = torch.cat(shards, split[1])
    return (full, b) if split[0] == "A" else (a, full)


@torch.no_grad()
def set_adapter(lora: LayerLoRA, target: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Load PEFT's full (A, B) of ``target`` into this rank's shards."""
    a_local, b_local = lora.shard(target, a, b)
    getattr(lora, f"A_{target}").copy_(a_local)
    getattr(lora, f"B_{target}").copy_(b_local)
