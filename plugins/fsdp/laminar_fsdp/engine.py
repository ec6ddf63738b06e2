"""``FSDPTrainerEngine``: one rank of a torch FSDP2 trainer group over a transformers model.

Every rank gets the whole ``TrainBatch`` and computes the same deterministic split (data-parallel
groups by token balance, then packed micro-batches of ``micro_batch_tokens`` real tokens per
rank), so the ranks never exchange trajectories. With ``sequence_parallel: N`` the N ranks of a
group share each packed row (Ulysses all-to-all around attention, ``ulysses.py``); FSDP shards
the parameters over all ranks. Core's ``ModelTrainerEngine`` drives the step (which
trajectories train, advantages, mini- and micro-batches, the loss, the metrics); this engine
runs the model: per-trajectory response log-probs without ever building ``[tokens, vocab]``
logits (``policy.py``), backward, the optimiser. Weights are exported as full tensors under the
Hugging Face names that vLLM and SGLang load, bucket by bucket (``export.py``). Checkpoints
are torch distributed checkpoints (sharded model + optimizer) plus a small JSON with the step
and the LR scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from laminar_core import (
    BatchLayout,
    BuildContext,
    MicroBatch,
    ModelTrainerEngine,
    TrainBatch,
    TrainerContext,
    free_port,
    model_dir,
    to_device,
)
from laminar_core.training import (
    LoRASpec,
    LossFn,
    adapter_tensors,
    apply_lora,
    plan_micro_batches,
    responses,
    trainable,
)
from laminar_fsdp import attention, ulysses
from laminar_fsdp.export import WeightStream, export_buckets
from laminar_fsdp.memory import SavedBytes, saved_activations
from laminar_fsdp.offload import offload_layer_inputs
from laminar_fsdp.options import FSDPOptions
from laminar_fsdp.packed_row import PackedRow
from laminar_fsdp.policy import PolicyModel, train_mode_without_dropout
from laminar_fsdp.ulysses import gather_sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_FILE = "trainer_state.json"
T = TypeVar("T")


class FSDPTrainerEngine(ModelTrainerEngine):
    Options = FSDPOptions
    trains_lora = True
    # what a rank's process imports (``TrainerEngine.preload``): a zygote imports it once
    preload = (
        "torch",
        "torch.distributed.checkpoint.state_dict",
        "torch.distributed.device_mesh",
        "torch.distributed.fsdp",
        "torch.nn.attention.flex_attention",
        "transformers",
        "transformers.models.auto.modeling_auto",
    )

    @classmethod
    def from_config(cls, ctx: BuildContext) -> FSDPTrainerEngine:
        return cls(ctx.config, ctx.options or FSDPOptions())

    def __init__(self, config: Any, options: FSDPOptions | None = None) -> None:
        super().__init__(config)
        self.opt = options or FSDPOptions()
        self.rank, self.world = 0, 1
        # sequence parallelism: ranks [dp_rank * sp, (dp_rank + 1) * sp) share a packed row
        self.sp, self.dp, self.sp_rank, self.dp_rank = 1, 1, 0, 0
        self.sp_group: dist.ProcessGroup | None = None
        self.row_kwarg = False  # the model runs attention.py's packed attention
        self.kernel = "sdpa"  # its kernel (attention.resolve_kernel)
        self.device = torch.device("cpu")
        self.model: PolicyModel | None = None
        self.lm: torch.nn.Module | None = None
        # trainer.lora: adapters on the targeted linear layers, the rest frozen (lora.py)
        self.lora = LoRASpec.of(getattr(getattr(config, "trainer", None), "lora", None))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="laminar-fsdp")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking work off the event loop, always on the engine's one worker thread: the
        CUDA device is per thread, collectives must run in one order, and DTensor caches its
        sharding decisions per thread (a fresh thread re-derives them: ~0.4 s per step for
        the tiny model's optimiser step on CPU, measured)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._on_device, fn, *args)

    def _on_device(self, fn: Callable[..., T], *args: Any) -> T:
        self._pin_device()
        return fn(*args)

    def _pin_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- setup -------------------------------------------------------------------------------
    async def setup(self, ctx: TrainerContext) -> None:
        await self.run_blocking(self._setup, ctx)

    def _setup(self, ctx: TrainerContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.rank, self.world = ctx.rank, ctx.world_size
        self.sp = self.opt.sequence_parallel
        if self.world % self.sp:
            raise ValueError(
                f"trainer.fsdp.sequence_parallel={self.sp} must divide the trainer's "
                f"{self.world} ranks (cluster.trainer_gpus); pick a divisor of {self.world}"
            )
        self.dp, self.dp_rank, self.sp_rank = self.world // self.sp, *divmod(self.rank, self.sp)
        path = model_dir(self.cfg.model.path, f"trainer rank {self.rank}")
        cuda = torch.cuda.is_available() and self.opt.backend != "gloo"
        backend = "nccl" if cuda else "gloo"
        if cuda:
            self.device = torch.device("cuda", ctx.cuda_device())
            torch.cuda.set_device(self.device)
        torch.manual_seed(int(ctx.options.get("seed", self.cfg.run.seed)))
        if not dist.is_initialized():
            init = ctx.options.get("init_method") or f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(
                backend,
                init_method=init,
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(minutes=10),
            )
        mesh = init_device_mesh(self.device.type, (self.world,))  # FSDP shards over all ranks
        if self.sp > 1:
            grid = init_device_mesh(
                self.device.type, (self.dp, self.sp), mesh_dim_names=("dp", "sp")
            )
            self.sp_group = grid.get_group("sp")
        attn = self._attention(cuda)
        self.row_kwarg = attn == attention.ATTENTION_NAME
        self.kernel = attention.resolve_kernel(self.opt.packed_attention, self.device)
        lm = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=attn
        )
        if self.sp > 1:
            conf = lm.config
            ulysses.kv_repeat(conf.num_key_value_heads, conf.num_attention_heads, self.sp)
        if self.lora is not None:
            apply_lora(lm, self.lora)  # before sharding: FSDP shards the adapters with the layers
        if self.opt.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        train_mode_without_dropout(lm)  # the mode is deliberate: see its docstring
        if self.opt.compile != "none":
            # the layer's forward, not its __call__: FSDP's and the offload's hooks stay eager.
            # Automatic dynamic shapes: the second row length recompiles with the row's length
            # symbolic, once (dynamic=True makes the head size symbolic too, which inductor's
            # flex-attention lowering rejects: torch 2.11, measured on an H100)
            for layer in _decoder_layers(lm):
                layer.forward = torch.compile(layer.forward, backend=self.opt.compile)
        policy = PolicyModel(lm)
        dtype = self.opt.param_dtype
        if dtype == "auto":
            dtype = self.cfg.model.dtype if cuda else "float32"
        mp = None
        if _DTYPES.get(dtype, torch.float32) != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)
        kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.opt.reshard_after_forward}
        if mp is not None:
            kw["mp_policy"] = mp
        for layer in _decoder_layers(lm):
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        policy.to(self.device)
        self.model, self.lm = policy, lm
        o = self.opt
        self.trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: adapters
        self.optim = torch.optim.AdamW(
            self.trained,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, self._lr_factor)
        conf = lm.config
        pad = conf.pad_token_id if conf.pad_token_id is not None else conf.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad or [0])[0])
        self.temperature = float(self.cfg.rollout.temperature) or 1.0
        self.export_dtype = _DTYPES.get(self.cfg.model.dtype, torch.float32)

    def _attention(self, cuda: bool) -> str:
        """The transformers attention implementation. Packed rows (and always under sequence
        parallelism) use the engine's own (``attention.py``: varlen FlashAttention, flex
        attention under a document mask, or SDPA per trajectory; no dense mask) unless
        ``attention`` names one of transformers'; padded rows use ``flash_attention_2`` on
        CUDA when flash-attn is installed, else SDPA."""
        if self.sp > 1 or (self.opt.pack and self.opt.attention == "auto"):
            return attention.register()
        if self.opt.attention != "auto":
            return self.opt.attention
        return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"

    def _lr_factor(self, step: int) -> float:
        o = self.opt
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.lr_schedule == "constant":
            return 1.0
        total = max(1, self.cfg.run.steps * max(1, self.cfg.trainer.mini_batches) - o.warmup_steps)
        frac = min(1.0, (step - o.warmup_steps) / total)
        decay = 1 - frac if o.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay

    # -- log-probs ---------------------------------------------------------------------------
    def _forward(
        self, mb: MicroBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-position log-probs ``[R, L]`` of ``mb.labels`` (entropy: detached, or None).

        Under sequence parallelism this rank runs its ``L / sp`` columns and the results are
        all-gathered (differentiably) so every rank of the group holds the whole row.
        """
        dev = self.device
        ids, pos, labels = mb.input_ids, mb.position_ids, mb.labels
        row = None
        if mb.packed and self.row_kwarg:
            sp = {"group": self.sp_group, "size": self.sp, "rank": self.sp_rank}
            row = PackedRow.of(mb.cu_seqlens, dev, kernel=self.kernel, **sp)
            if row.kernel == "flex":
                row.block_mask()  # once per micro-batch, outside any compiled region
        if self.sp > 1:
            width = ids.shape[1] // self.sp
            cols = slice(self.sp_rank * width, (self.sp_rank + 1) * width)
            ids, pos, labels = ids[:, cols], pos[:, cols], labels[:, cols]
        mask = to_device(mb.attention_mask, dev) if mb.attention_mask is not None else None
        lp, ent = self.model(
            to_device(ids, dev),
            to_device(pos, dev),
            to_device(labels, dev),
            mask,
            temperature=self.temperature,
            chunk=self.opt.logprob_chunk,
            with_entropy=with_entropy,
            row=row,
            compiled=self._compiled(),
        )
        if ent is not None:
            ent = ent.detach()
        if row is not None and row.size > 1:
            lp = gather_sequence(lp, row)
            ent = gather_sequence(ent, row) if ent is not None else None
        return lp, ent

    def _compiled(self) -> bool | str:
        return {"none": False, "inductor": True}.get(self.opt.compile, self.opt.compile)

    def _offload(self):
        """Activation offload around a forward and its backward, when asked for."""
        if not self.opt.activation_offload:
            return contextlib.nullcontext()
        return offload_layer_inputs(_decoder_layers(self.lm))

    # -- what core's step asks of the model -----------------------------------------------------
    def batch_layout(self) -> BatchLayout:
        """Packed rows of ``micro_batch_tokens`` real tokens per rank (x the sequence-parallel
        degree: the ranks of a group share each row) or padded ones; every data-parallel
        group runs as many micro-batches (FSDP's collectives run in each); the group's first
        rank reports (its ranks compute the same loss and metrics)."""
        return BatchLayout(
            device=self.device,
            pad_id=self.pad_id,
            token_budget=self.opt.micro_batch_tokens * self.sp,
            packed=self.opt.pack,
            row_multiple=math.lcm(self.sp, self.opt.compile_bucket)
            if self.opt.compile != "none"
            else self.sp,
            dp_size=self.dp,
            dp_rank=self.dp_rank,
            lockstep=True,
            reports=self.sp_rank == 0,
        )

    def forward(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        # every micro-batch is queued before core's one host copy waits for the GPU
        return [responses(self._forward(mb)[0], mb.spans) for mb in micro_batches]

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> None:
        self.optim.zero_grad(set_to_none=True)
        for mb in micro_batches:
            with self._offload():
                lp_rows, ent_rows = self._forward(mb, with_entropy=True)
                if not mb.index:
                    (lp_rows.sum() * 0.0).backward()  # keeps FSDP's collectives in step
                    continue
                ent = responses(ent_rows, mb.spans) if ent_rows is not None else None
                loss = loss_fn(mb, responses(lp_rows, mb.spans), ent)
                # FSDP averages gradients over all ranks; scaling by world makes the sum over
                # ranks' shares the batch-level objective (each rank of a sequence-parallel
                # group back-propagates the shared loss through its own columns only).
                (loss * self.world).backward()

    def optimizer_step(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.opt.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optim.step()
        self.sched.step()
        return norm

    def learning_rate(self) -> float:
        return self.optim.param_groups[0]["lr"]

    def saved_activation_bytes(self, batch: TrainBatch) -> SavedBytes:
        """What one micro-batch's forward keeps for backward: the micro-batch of this rank
        with the most real tokens (``memory.saved_activations``). Collective, like a step."""
        trajs = trainable(batch.trajectories)
        plan = plan_micro_batches(trajs, list(range(len(trajs))), self.batch_layout())
        mb = max(plan, key=lambda m: m.real_tokens)  # the first of the largest
        with saved_activations(_decoder_layers(self.lm)) as saved:
            lp, _ = self._forward(mb)
        (lp.sum() * 0.0).backward()  # frees the graph and keeps FSDP's collectives in step
        self.optim.zero_grad(set_to_none=True)
        return saved

    # -- weights -----------------------------------------------------------------------------
    async def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Full tensors in Hugging Face naming, cast to ``model.dtype``, bucket by bucket
        (``export_bucket_mb``; see ``export.py``): each bucket's all-gather and host copy run
        on the engine's worker thread while the event loop keeps serving.

        Collective: every rank must iterate it in step (each bucket is one all-gather); the
        runtime keeps rank 0's tensors and drops the others'. Tensors are host copies the
        consumer owns: nothing the engine does later overwrites them.
        """
        async for item in self.weight_stream():
            yield item

    def weight_stream(self) -> WeightStream:
        """The export as a stream iterable with ``async for`` (as ``export_weights``) or,
        blocking the caller, a plain ``for`` (benchmarks, tools). With ``trainer.lora`` a
        version is the adapter tensors alone, under PEFT's names (``training.lora``)."""
        named = adapter_tensors(self.lm) if self.lora else list(self.lm.named_parameters())
        size = int(self.opt.export_bucket_mb * (1 << 20))
        return WeightStream(
            lambda: export_buckets(named, self.export_dtype, self.device, size),
            self._pin_device,
            self._pool,
        )

    # -- checkpoints -------------------------------------------------------------------------
    async def save_checkpoint(self, directory: str) -> None:
        await self.run_blocking(self._save, directory)

    def _save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim, options=self._sd_options())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
        if self.rank == 0:
            state = {"version": self.version, "scheduler": self.sched.state_dict()}
            Path(directory, _STATE_FILE).write_text(json.dumps(state))
        if self.world > 1:
            dist.barrier()

    async def load_checkpoint(self, directory: str) -> None:
        await self.run_blocking(self._load, directory)

    def _load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = Path(directory, _STATE_FILE)
        if not meta.is_file():
            raise FileNotFoundError(f"{directory} is not a trainer checkpoint (no {_STATE_FILE})")
        opts = self._sd_options()
        msd, osd = get_state_dict(self.model, self.optim, options=opts)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
        saved = json.loads(meta.read_text())
        self.version = int(saved["version"])
        self.sched.load_state_dict(saved["scheduler"])

    def _sd_options(self):
        """LoRA: a checkpoint holds the adapters and their optimiser state; the frozen base
        is ``model.path``'s, loaded again at setup."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = self.lora is not None
        return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)

    async def close(self) -> None:
        if dist.is_initialized():
            await self.run_blocking(dist.destroy_process_group)
        self._pool.shutdown(wait=False)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (``model.model.layers`` for Llama/Qwen)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    return list(layers) if layers is not None else []
