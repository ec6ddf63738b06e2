"""``MegatronTrainerEngine``: one rank of a megatron-core trainer group (TP x PP x DP).

The model is megatron-core's ``GPTModel`` (Transformer Engine layers on GPU when TE is
installed, megatron's local layers otherwise) built from a Hugging Face ``config.json`` and
loaded from its safetensors, wrapped in megatron's ``DistributedDataParallel`` and driven by
its ``DistributedOptimizer``, ``OptimizerParamScheduler`` and pipeline schedules
(``get_forward_backward_func``). Core's ``ModelTrainerEngine`` drives the step (which
trajectories train, advantages, mini- and micro-batches, the loss, the metrics), the same as
laminar-fsdp's; this engine runs the model: log-probs come from the vocabulary-parallel
logits (:mod:`laminar_megatron.logprobs`, the vocabulary is never gathered), through
megatron's pipeline schedule.

Every rank gets the whole ``TrainBatch``: trajectories go to data-parallel ranks by token
balance, then into padded micro-batches of ``micro_batch_tokens``; the TP and PP ranks of one
replica run the same micro-batches. Weights are exported in Hugging Face naming
(:mod:`laminar_megatron.hf`); checkpoints are ``megatron.core.dist_checkpointing``
(model, optimizer, scheduler, version), loadable under another TP/PP layout.

With ``trainer.lora`` the base model is frozen and adapters sit on its linear layers
(:mod:`laminar_megatron.lora`, TP-aware); the optimiser holds only them, a version is their
full tensors under PEFT's names (what the FSDP trainer sends, what vLLM and SGLang hot-load)
and a checkpoint holds them and their optimiser state, not the base.
"""

from __future__ import annotations

import asyncio
import functools
import json
import warnings
from collections.abc import AsyncIterator, Callable
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
    TrainerContext,
    free_port,
    model_dir,
    to_device,
)
from laminar_core.training import LoRASpec, LossFn, responses
from laminar_megatron import cpu_compat
from laminar_megatron import lora as mlora
from laminar_megatron.hf import (
    HFCheckpoint,
    Mapping,
    check_layout,
    globalize,
    layer_of,
    mappings,
    output_layer_mapping,
    padded_vocab,
    read_arch,
    to_hf,
    to_shard,
)
from laminar_megatron.logprobs import vocab_parallel_logprobs
from laminar_megatron.options import MegatronOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_FILE = "laminar_megatron.json"
T = TypeVar("T")


# megatron-core announces its fallbacks from Apex / Transformer Engine to torch at import and
# at model build (expected without them, said once in the README), and warns about a
# deprecated value that is its own default.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=_message, module=r"megatron\.")


class MegatronTrainerEngine(ModelTrainerEngine):
    Options = MegatronOptions
    trains_lora = True  # trainer.lora: adapters on the linear layers (lora.py)

    @classmethod
    def from_config(cls, ctx: BuildContext) -> MegatronTrainerEngine:
        return cls(ctx.config, ctx.options or MegatronOptions())

    def __init__(self, config: Any, options: MegatronOptions | None = None) -> None:
        super().__init__(config)
        self.opt = options or MegatronOptions()
        self.rank, self.world = 0, 1
        self.model: Any = None  # megatron DDP around the GPTModel (one model chunk)
        self._lr = 0.0  # the learning rate of the last update
        self.lora = LoRASpec.of(getattr(getattr(config, "trainer", None), "lora", None))
        self._adapters: dict[str, mlora.LayerLoRA] = {}  # by megatron layer (global name)

    # -- threads -----------------------------------------------------------------------------
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking megatron work off the event loop (under the CPU shim when on CPU)."""
        return await asyncio.to_thread(self._scoped, fn, *args)

    @staticmethod
    def _scoped(fn: Callable[..., Any], *args: Any) -> Any:
        with cpu_compat.scope():
            return fn(*args)

    # -- setup -------------------------------------------------------------------------------
    async def setup(self, ctx: TrainerContext) -> None:
        self.rank, self.world = ctx.rank, ctx.world_size
        self.tp, self.pp, self.dp = self.opt.layout(self.world)
        self.sequence_parallel = self.opt.sequence_parallel and self.tp > 1
        path = model_dir(self.cfg.model.path, f"trainer rank {self.rank}")
        self.arch = read_arch(path)
        check_layout(self.arch, self.tp, self.pp)
        if self.lora is not None:
            mlora.check_targets(self.lora, self.arch)
            if self.sequence_parallel:
                raise ValueError(
                    "trainer.lora with trainer.megatron.sequence_parallel is not supported "
                    "(the adapters take the whole sequence); set sequence_parallel to false"
                )
        if not torch.cuda.is_available():
            cpu_compat.apply()
        await self.run_blocking(self._setup, ctx, path)

    def _setup(self, ctx: TrainerContext, path: Path) -> None:
        cpu_compat.fix_torch_optimizer_resume()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        cuda = torch.cuda.is_available()
        if self.opt.backend != "auto" and self.opt.backend != ("nccl" if cuda else "gloo"):
            raise ValueError(
                f"trainer.megatron.backend={self.opt.backend}: megatron-core keeps its buffers "
                f"on the GPU when CUDA is present (NCCL) and on CPU without it (gloo); this "
                f"machine {'has' if cuda else 'has no'} CUDA: use backend=auto"
            )
        if cuda:
            torch.cuda.set_device(ctx.cuda_device())
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.device = self.device or torch.device("cpu")
        if not dist.is_initialized():
            init = ctx.options.get("init_method") or f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                init_method=init,
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(minutes=10),
            )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            distributed_timeout_minutes=10,
        )
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        seed = int(ctx.options.get("seed", self.cfg.run.seed))
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

        dtype_name = self.opt.param_dtype
        if dtype_name == "auto":
            dtype_name = self.cfg.model.dtype if cuda else "float32"
        self.param_dtype = _DTYPES.get(dtype_name, torch.float32)
        self.te = self._use_transformer_engine(cuda)
        if self.sequence_parallel and not (self.te or _have_apex()):
            raise ValueError(
                "trainer.megatron.sequence_parallel needs Transformer Engine (or Apex) layer "
                "norms: megatron's torch norm does not support it; set it to false"
            )
        self.padded_vocab = padded_vocab(
            self.arch.vocab_size, self.opt.make_vocab_size_divisible_by, self.tp
        )
        self.tcfg = self._transformer_config(cuda)
        gpt = self._build_model()
        self._load_hf(gpt, HFCheckpoint(path))
        if self.lora is not None:  # after loading: the adapters have no HF source
            self._adapters = mlora.apply_lora(
                gpt,
                self.lora,
                self.arch,
                self.layer_offset,
                self.tp,
                self.tp_rank,
                self.tp_group,
                seed,
            )
        self._wrap_and_optimise(gpt)

        conf = json.loads((path / "config.json").read_text())
        pad = conf.get("pad_token_id")
        pad = pad if pad is not None else conf.get("eos_token_id")
        self.pad_id = int(pad if isinstance(pad, int) else (pad or [0])[0])
        self.temperature = float(self.cfg.rollout.temperature) or 1.0
        self.export_dtype = _DTYPES.get(self.cfg.model.dtype, torch.float32)
        self._hf_shapes = HFCheckpoint(path).shapes()
        self._exports = mappings(self.arch, self.te)

    def _use_transformer_engine(self, cuda: bool) -> bool:
        impl = self.opt.transformer_impl
        if impl == "local":
            return False
        try:
            import transformer_engine  # noqa: F401

            have_te = True
        except ImportError:
            have_te = False
        if impl == "transformer_engine" and not (have_te and cuda):
            raise ValueError(
                "trainer.megatron.transformer_impl=transformer_engine needs CUDA and the "
                "transformer_engine package; use transformer_impl=local (or auto)"
            )
        return have_te and cuda

    def _transformer_config(self, cuda: bool) -> Any:
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        a, o = self.arch, self.opt
        recompute: dict[str, Any] = {}
        if o.recompute == "full":
            recompute = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": o.recompute_num_layers,
            }
        elif o.recompute == "selective":
            recompute = {"recompute_granularity": "selective"}
        return TransformerConfig(
            num_layers=a.num_layers,
            hidden_size=a.hidden_size,
            num_attention_heads=a.num_heads,
            num_query_groups=a.num_kv_heads,
            kv_channels=a.head_dim,
            ffn_hidden_size=a.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=a.norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=a.qkv_bias,
            qk_layernorm=a.qk_norm,
            # Train mode always (recompute only runs in training mode), so no dropout.
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # Fused kernels need Apex / TE builds; the unfused paths are exact and portable.
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=not cuda,
            perform_initialization=False,  # the weights come from the Hugging Face checkpoint
            params_dtype=self.param_dtype,
            pipeline_dtype=self.param_dtype,
            bf16=self.param_dtype == torch.bfloat16,
            fp16=self.param_dtype == torch.float16,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            sequence_parallel=self.sequence_parallel,
            # Micro-batches differ in shape; the pipeline exchanges shapes first. (megatron
            # refuses variable lengths with the default MoE dispatcher even without MoE.)
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
            # Losses are summed, not averaged over micro-batches or DP ranks: each
            # micro-batch's loss is already scaled to its share of the mini-batch.
            calculate_per_token_loss=True,
            **recompute,
        )

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel

        if self.te:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.arch.qk_norm)
        else:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            spec = get_gpt_layer_local_spec(qk_layernorm=self.arch.qk_norm, normalization="RMSNorm")
        a = self.arch
        model = GPTModel(
            self.tcfg,
            spec,
            vocab_size=self.padded_vocab,
            max_sequence_length=a.max_position_embeddings,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            parallel_output=True,  # logits stay vocabulary-parallel
            share_embeddings_and_output_weights=a.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=a.rope_theta,
            rope_scaling=a.rope_llama3_factor is not None,
            rope_scaling_factor=a.rope_llama3_factor or 8.0,
        )
        model.train()
        if self.device.type == "cuda":
            model.cuda(self.device)
        layers = model.decoder.layers
        self.layer_offset = layers[0].layer_number - 1 if len(layers) else 0
        self.layers_per_stage = len(layers)
        return model

    def _load_hf(self, model: torch.nn.Module, ckpt: HFCheckpoint) -> None:
        """Copy this rank's shard of every parameter from the Hugging Face checkpoint."""
        sources = {m.mcore: m for m in mappings(self.arch, self.te)}
        sources["output_layer.weight"] = output_layer_mapping(self.arch)
        self._params: dict[str, torch.nn.Parameter] = {}
        for local, p in model.named_parameters():
            name = globalize(local, self.layer_offset)
            m = sources.get(name)
            if m is None:
                raise RuntimeError(
                    f"laminar-megatron has no Hugging Face source for megatron parameter "
                    f"{name!r} ({self.arch.model_type})"
                )
            shard = to_shard(
                m.kind,
                [ckpt.get(n) for n in m.hf],
                self.arch,
                self.tp_rank,
                self.tp,
                self.padded_vocab,
            )
            if tuple(shard.shape) != tuple(p.shape):
                raise RuntimeError(
                    f"{name}: Hugging Face {m.hf} give a shard of shape {tuple(shard.shape)}, "
                    f"the megatron parameter is {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(shard)
            if m.kind != "replicated" and not getattr(p, "tensor_model_parallel", False):
                # megatron's linear layers mark their weights TP-sharded only when they
                # initialise them (perform_initialization); unmarked, the grad norm would
                # count them on TP rank 0 only.
                p.tensor_model_parallel = True
                p.partition_dim = 1 if m.kind == "row" else 0
                p.partition_stride = 1
            self._params[name] = p

    def _wrap_and_optimise(self, gpt: torch.nn.Module) -> None:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.opt
        module = gpt
        if self.param_dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(self.tcfg, gpt)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=o.distributed_optimizer,
        )
        self.model = DDP(config=self.tcfg, ddp_config=ddp_config, module=module)

        def finalize(model, num_tokens=None, **kw):
            # DP/TP/embedding grad reductions; no division by a token count (losses are
            # pre-scaled to the mini-batch).
            return finalize_model_grads(model, None, **kw)

        self.tcfg.finalize_model_grads_func = finalize
        self.optim = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.lr * o.min_lr_ratio,
                weight_decay=o.weight_decay,
                adam_beta1=o.beta1,
                adam_beta2=o.beta2,
                adam_eps=o.eps,
                clip_grad=o.grad_clip,
                use_distributed_optimizer=o.distributed_optimizer,
                params_dtype=self.param_dtype,
                bf16=self.param_dtype == torch.bfloat16,
                fp16=self.param_dtype == torch.float16,
            ),
            [self.model],
        )
        self.tcfg.grad_scale_func = self.optim.scale_loss  # fp16 loss scaling (1 otherwise)
        total = max(1, self.cfg.run.steps * max(1, self.cfg.trainer.mini_batches))
        self.sched = OptimizerParamScheduler(
            self.optim,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.lr * o.min_lr_ratio,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=max(total, o.warmup_steps + 1),
            lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )
        self.sched.step(1)  # update k uses the schedule at step k + 1 (no update at lr 0)
        self._lr = self.optim.param_groups[0]["lr"]

    # -- forward -----------------------------------------------------------------------------
    def _inputs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids = to_device(mb.input_ids, self.device)
        if self.sequence_parallel and ids.shape[1] % self.tp:
            # the sequence is split over TP ranks: pad it (on the right, after every real
            # token, so the causal mask keeps it out of their log-probs)
            extra = self.tp - ids.shape[1] % self.tp
            ids = torch.nn.functional.pad(ids, (0, extra), value=self.pad_id)
        b, s = ids.shape
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, -1)
        # Right padding: the causal mask alone keeps real tokens off the padding after them.
        # (True = masked, megatron's convention; TE applies its own causal mask.)
        mask = None
        if not self.te:
            mask = torch.ones(s, s, dtype=torch.bool, device=self.device).triu(1)[None, None]
        return ids, pos, mask

    def _token_logprobs(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``[B, L-1]`` log-probs of each next token from this rank's vocabulary slice."""
        logits = output[:, : mb.input_ids.shape[1] - 1].float() / self.temperature
        labels = to_device(mb.labels[:, :-1], self.device)
        group = self.tp_group if self.tp > 1 else None
        return vocab_parallel_logprobs(logits, labels, self.arch.vocab_size, group)

    def _schedule(
        self,
        mbs: list[MicroBatch],
        loss_fn: Callable[[MicroBatch, torch.Tensor], tuple],
        forward_only: bool,
    ) -> None:
        """Run ``mbs`` through megatron's pipeline schedule; ``loss_fn`` runs on the last
        stage for each micro-batch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return model(*self._inputs(mb)), functools.partial(loss_fn, mb)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(mb.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only,
        )

    @property
    def _reports(self) -> bool:
        """Whether this rank reports a replica's figures (last stage, TP rank 0)."""
        return self.last_stage and self.tp_rank == 0

    # -- what core's step asks of the model -----------------------------------------------------
    def batch_layout(self) -> BatchLayout:
        """Padded micro-batches of ``micro_batch_tokens`` (rows x longest) per data-parallel
        replica, whose TP and PP ranks run the same ones; megatron syncs gradients once per
        optimiser step, so replicas may run different numbers (at least one)."""
        return BatchLayout(
            device=self.device,
            pad_id=self.pad_id,
            token_budget=self.opt.micro_batch_tokens,
            packed=False,
            dp_size=self.dp,
            dp_rank=self.dp_rank,
            lockstep=False,
            reports=self._reports,
        )

    def forward(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        got: dict[int, torch.Tensor] = {}

        def keep(mb: MicroBatch, output: torch.Tensor):
            lp = self._token_logprobs(output, mb)
            got[id(mb)] = responses(lp, mb.spans)
            return lp.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        self._schedule(micro_batches, keep, forward_only=True)
        return [got.get(id(mb)) for mb in micro_batches]  # the last stage's only

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> None:
        one = torch.ones((), dtype=torch.int)

        def step_loss(mb: MicroBatch, output: torch.Tensor):
            lp = self._token_logprobs(output, mb)
            if not mb.index:
                return lp.sum() * 0.0, one, {}
            # the objective is the sum of these over micro-batches and DP ranks (megatron
            # sums: calculate_per_token_loss, no token-count division)
            return loss_fn(mb, responses(lp, mb.spans), None), one, {}

        self.model.zero_grad_buffer()
        self.optim.zero_grad()
        self._schedule(micro_batches, step_loss, forward_only=False)

    def optimizer_step(self) -> float | None:
        self._lr = self.optim.param_groups[0]["lr"]
        _, norm, _ = self.optim.step()
        self.sched.step(1)
        return None if norm is None else float(norm)

    def learning_rate(self) -> float:
        """The learning rate the step's last update used."""
        return self._lr

    # -- weights -----------------------------------------------------------------------------
    async def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Full tensors in Hugging Face naming, one megatron parameter at a time (a fused
        QKV or gate/up yields its three or two tensors), cast to ``model.dtype`` on CPU.

        Collective: every rank iterates it in lock-step (TP all-gathers; under PP the
        owning stage broadcasts to the others) and every rank yields the same tensors.
        Vocabulary padding is trimmed; a tied head is not exported. With ``trainer.lora``:
        the adapters' full tensors alone, under PEFT's names.
        """
        if self.lora is not None:
            for layer in range(self.arch.num_layers):
                for name, tensor in await self.run_blocking(self._export_adapters, layer):
                    yield name, tensor
            return
        for m in self._exports:
            for name, tensor in await self.run_blocking(self._export_one, m):
                yield name, tensor

    def _stage_of(self, m: Mapping) -> int:
        layer = layer_of(m.mcore)
        if layer is not None:
            return layer // self.layers_per_stage
        return 0 if m.mcore.startswith("embedding.") else self.pp - 1

    def _export_one(self, m: Mapping) -> list[tuple[str, torch.Tensor]]:
        owner = self._stage_of(m)
        if owner == self.pp_rank:
            local = self._params[m.mcore].detach()
            shards = [local]
            if self.tp > 1 and m.kind != "replicated":
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(shards, local.contiguous(), group=self.tp_group)
            full = [t.contiguous() for t in to_hf(m.kind, shards, self.arch)]
        else:
            full = [
                torch.empty(self._hf_shapes[n], dtype=self.param_dtype, device=self.device)
                for n in m.hf
            ]
        if self.pp > 1:
            src = dist.get_global_rank(self.pp_group, owner)
            for t in full:
                dist.broadcast(t, src, group=self.pp_group)
        return [(n, t.to("cpu", self.export_dtype)) for n, t in zip(m.hf, full, strict=True)]

    def _export_adapters(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        """Decoder layer ``layer``'s adapters in full (TP all-gather on the owning stage,
        broadcast to the other stages), in PEFT's names."""
        owner = layer // self.layers_per_stage
        out = []
        for t in self.lora.target_modules:
            sub = mlora.TARGETS[t][0]
            if owner == self.pp_rank:
                a, b = mlora.full_adapter(self._adapters[f"decoder.layers.{layer}.{sub}"], t)
                a, b = a.contiguous(), b.contiguous()
            else:
                i, o = mlora._hf_shape(t, self.arch)
                a = torch.empty(self.lora.rank, i, dtype=self.param_dtype, device=self.device)
                b = torch.empty(o, self.lora.rank, dtype=self.param_dtype, device=self.device)
            if self.pp > 1:
                src = dist.get_global_rank(self.pp_group, owner)
                for x in (a, b):
                    dist.broadcast(x, src, group=self.pp_group)
            names = mlora.hf_names(layer, t)
            out += [(n, x.to("cpu", self.export_dtype)) for n, x in zip(names, (a, b), strict=True)]
        return out

    # -- checkpoints -------------------------------------------------------------------------
    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()  # DDP would prefix "module."
        if self.lora is not None:  # the adapters; the frozen base is model.path's
            model_sd = {k: v for k, v in model_sd.items() if ".lora." in k}
        return {
            "model": model_sd,
            "optimizer": self.optim.sharded_state_dict(
                model_sd,
                is_loading=loading,
                # canonical per-parameter optimizer state: loadable under another TP/PP/DP
                metadata={"distrib_optim_sharding_type": "fully_reshardable"},
            ),
            "scheduler": self.sched.state_dict(),
            "version": self.version,
        }

    async def save_checkpoint(self, directory: str) -> None:
        await self.run_blocking(self._save, directory)

    def _save(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)
        if self.world > 1:
            dist.barrier()
        dist_checkpointing.save(self._sharded_state(loading=False), directory)
        if self.rank == 0:
            meta = {"version": self.version, "tp": self.tp, "pp": self.pp, "dp": self.dp}
            Path(directory, _STATE_FILE).write_text(json.dumps(meta))
        if self.world > 1:
            dist.barrier()

    async def load_checkpoint(self, directory: str) -> None:
        await self.run_blocking(self._load, directory)

    def _load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        if not Path(directory, _STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{directory} is not a laminar-megatron checkpoint (no {_STATE_FILE})"
            )
        state = dist_checkpointing.load(self._sharded_state(loading=True), directory)
        self.model.load_state_dict(state["model"], strict=self.lora is None)
        self.optim.load_state_dict(state["optimizer"])
        self.sched.num_steps = 0  # megatron's load *adds* the saved step count to it
        self.sched.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    async def close(self) -> None:
        await self.run_blocking(self._close)

    def _close(self) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _have_apex() -> bool:
    try:
        import apex  # noqa: F401
    except ImportError:
        return False
    return True
