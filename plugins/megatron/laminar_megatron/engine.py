"""``MegatronTrainerEngine``: one rank of a megatron-core trainer group (TP x PP x DP).

The model is megatron-core's ``GPTModel`` (Transformer Engine layers on GPU when TE is
installed, megatron's local layers otherwise) built from a Hugging Face ``config.json`` and
loaded from its safetensors, wrapped in megatron's ``DistributedDataParallel`` and driven by
its ``DistributedOptimizer``, ``OptimizerParamScheduler`` and pipeline schedules
(``get_forward_backward_func``). Megatron computes logits; core defines the objective:
log-probs come from the vocabulary-parallel logits (:mod:`laminar_megatron.logprobs`, the
vocabulary is never gathered) and the loss is ``laminar_core.algorithms.policy_loss_terms``, the
same as laminar-fsdp's, on the same micro-batch split.

Every rank gets the whole ``TrainBatch``: trajectories go to data-parallel ranks by token
balance, then into micro-batches of ``micro_batch_tokens``; the TP and PP ranks of one
replica run the same micro-batches. Weights are exported in Hugging Face naming
(:mod:`laminar_megatron.hf`); checkpoints are ``megatron.core.dist_checkpointing``
(model, optimizer, scheduler, version), loadable under another TP/PP layout.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import warnings
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from laminar_core import (
    BuildContext,
    TrainBatch,
    TrainerContext,
    TrainerEngine,
    Trajectory,
    add_logprob_agreement,
    free_port,
    model_dir,
    to_device,
)
from laminar_core.algorithms import compute_advantages, metric_floats, policy_loss_terms
from laminar_megatron import cpu_compat
from laminar_megatron.batching import (
    MicroBatch,
    assign_ranks,
    collate,
    empty_micro_batch,
    pack_micro_batches,
    trainable,
)
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


# megatron-core announces its fallbacks from Apex / Transformer Engine to torch at import and
# at model build (expected without them, said once in the README), and warns about a
# deprecated value that is its own default.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=_message, module=r"megatron\.")


class MegatronTrainerEngine(TrainerEngine):
    Options = MegatronOptions

    @classmethod
    def from_config(cls, ctx: BuildContext) -> MegatronTrainerEngine:
        return cls(ctx.config, ctx.options or MegatronOptions())

    def __init__(self, config: Any, options: MegatronOptions | None = None) -> None:
        self.cfg = config
        self.opt = options or MegatronOptions()
        self.version = 0  # optimiser steps taken (the weight version held, unless
        # a restarted run republished them under a newer one: ``_held``)
        self._held = 0
        self.rank, self.world = 0, 1
        self.model: Any = None  # megatron DDP around the GPTModel (one model chunk)
        self._recomputed: dict[str, torch.Tensor] = {}

    # -- threads -----------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking megatron work off the event loop (under the CPU shim when on CPU)."""
        return await asyncio.to_thread(self._scoped, fn, *args)

    @staticmethod
    def _scoped(fn: Callable[..., Any], *args: Any) -> Any:
        with cpu_compat.scope():
            return fn(*args)

    # -- setup -------------------------------------------------------------------------------
    async def setup(self, ctx: TrainerContext) -> None:
        self.rank, self.world, self.algo = ctx.rank, ctx.world_size, ctx.algorithm
        self.tp, self.pp, self.dp = self.opt.layout(self.world)
        self.sequence_parallel = self.opt.sequence_parallel and self.tp > 1
        path = model_dir(self.cfg.model.path, f"trainer rank {self.rank}")
        self.arch = read_arch(path)
        check_layout(self.arch, self.tp, self.pp)
        if not torch.cuda.is_available():
            cpu_compat.apply()
        await self._call(self._setup, ctx, path)

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
        labels = to_device(mb.labels, self.device)
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

    def _plan(self, trajs: list[Trajectory], chunk: list[int]) -> list[MicroBatch]:
        """This data-parallel rank's micro-batches over ``chunk`` (indices into ``trajs``);
        at least one (an empty one if the rank has no trajectories)."""
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        per_rank = assign_ranks([lengths[i] for i in chunk], self.dp)
        mine = [chunk[j] for j in per_rank[self.dp_rank]]
        groups = pack_micro_batches(lengths, mine, self.opt.micro_batch_tokens)
        return [collate(trajs, idx, self.pad_id) for idx in groups] or [
            empty_micro_batch(self.pad_id)
        ]

    @property
    def _reports(self) -> bool:
        """Whether this rank reports a replica's figures (last stage, TP rank 0)."""
        return self.last_stage and self.tp_rank == 0

    # -- log-probs ---------------------------------------------------------------------------
    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return await self._call(self._compute_logprobs, batch)

    @torch.no_grad()
    def _compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        trajs = trainable(batch.trajectories)
        self._recomputed.clear()
        got: list[tuple[MicroBatch, torch.Tensor]] = []

        def keep(mb: MicroBatch, output: torch.Tensor):
            lp = self._token_logprobs(output, mb)
            got.append((mb, lp))
            return lp.sum() * 0.0, torch.ones((), dtype=torch.int), {}

        if trajs:
            self._schedule(self._plan(trajs, list(range(len(trajs)))), keep, forward_only=True)
        # One flat vector of every trajectory's response log-probs: the reporting rank of
        # the replica that computed a trajectory fills its slot, a sum over ranks gathers.
        sizes = [len(t.response_ids) for t in trajs]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        if self._reports:
            for mb, lp in got:
                for row, i in enumerate(mb.index):
                    p, n = len(trajs[i].prompt_ids), sizes[i]
                    flat[starts[i] : starts[i] + n] = lp[row, p - 1 : p - 1 + n]
        if self.world > 1 and flat.numel():
            dist.all_reduce(flat)
        flat = flat.cpu()
        for i, t in enumerate(trajs):
            self._recomputed[t.traj_id] = flat[starts[i] : starts[i] + sizes[i]].clone()
        return [
            self._recomputed[t.traj_id].tolist() if t.traj_id in self._recomputed else []
            for t in batch.trajectories
        ]

    def _recomputed_like(self, trajs: list[Trajectory], mb: MicroBatch) -> torch.Tensor | None:
        if self.algo.off_policy == "none":
            return None
        out = torch.zeros_like(mb.behaviour)
        for row, i in enumerate(mb.index):
            t = trajs[i]
            got = self._recomputed.get(t.traj_id)
            if got is None:
                raise RuntimeError(
                    f"off_policy={self.algo.off_policy!r} needs compute_logprobs before "
                    f"train_step (trajectory {t.traj_id} has no recomputed log-probs)"
                )
            p = len(t.prompt_ids)
            out[row, p - 1 : p - 1 + len(got)] = got
        return to_device(out, self.device)

    # -- training ----------------------------------------------------------------------------
    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return await self._call(self._train_step, batch)

    def _train_step(self, batch: TrainBatch) -> dict[str, float]:
        trajs = trainable(batch.trajectories)
        sums: dict[str, float] = {}
        diff = [0.0, 0.0, 0.0]  # max |Δlogp|, sum |Δlogp|, tokens
        # the version these weights were published as: the run's (``batch.version``) can run
        # ahead of the optimiser steps taken after a trainer restart; a bare batch: ours
        self._held = batch.version if batch.version >= 0 else self.version
        lr = self.optim.param_groups[0]["lr"]
        n_chunks = max(1, min(self.cfg.trainer.mini_batches, len(trajs))) if trajs else 1
        if trajs:
            advantages = self._advantages(trajs)
            for c, chunk in enumerate(_split(len(trajs), n_chunks)):
                lr = self.optim.param_groups[0]["lr"]
                self._update(trajs, chunk, advantages, sums, diff if c == 0 else None)
        # The reporting ranks hold the figures (one per DP replica): combine them everywhere.
        parts: list[Any] = [(sums, diff)]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, (sums, diff))
        total: dict[str, float] = {}
        dmax = dsum = dtok = 0.0
        for s, d in parts:
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
            dmax, dsum, dtok = max(dmax, d[0]), dsum + d[1], dtok + d[2]
        out = {k: v / n_chunks for k, v in sorted(total.items())}
        out["lr"] = lr
        out["trained_trajectories"] = float(len(trajs))
        if dtok:
            out["logprob_abs_diff_max"] = dmax
            out["logprob_abs_diff_mean"] = dsum / dtok
            out["logprob_diff_tokens"] = dtok
        self.version += 1
        return out

    def _advantages(self, trajs: list[Trajectory]) -> torch.Tensor:
        groups: dict[str, int] = {}
        gids = torch.tensor([groups.setdefault(t.group_id, len(groups)) for t in trajs])
        rewards = torch.tensor([float(t.reward) for t in trajs])
        kw = {"eps": self.algo.adv_eps} if self.algo.advantage in ("grpo", "reinforce_pp") else {}
        return compute_advantages(self.algo.advantage, rewards, gids, **kw)

    def _update(
        self,
        trajs: list[Trajectory],
        chunk: list[int],
        advantages: torch.Tensor,
        sums: dict[str, float],
        diff: list[float] | None,
    ) -> None:
        token_level = self.algo.loss_agg == "token_mean"
        # only generated tokens count (``Trajectory.loss_mask``); a sequence with none does
        # not count as a sequence either
        counts = {i: sum(trajs[i].response_mask()) for i in chunk}
        total = max(
            1, sum(counts.values()) if token_level else sum(1 for c in counts.values() if c)
        )
        one = torch.ones((), dtype=torch.int)
        # the micro-batches' metric sums and log-prob agreement stay on the device until
        # the optimiser step: a host read per micro-batch would make the host wait for the GPU
        terms: dict[str, torch.Tensor] = {}
        agree = torch.zeros(3, dtype=torch.float64, device=self.device)  # max, sum, tokens

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            lp = self._token_logprobs(output, mb)
            if not mb.index:
                return lp.sum() * 0.0, one, {}
            mask = to_device(mb.mask, self.device)
            behaviour = to_device(mb.behaviour, self.device)
            recomputed = self._recomputed_like(trajs, mb)
            loss, metrics = policy_loss_terms(
                self.algo,
                lp,
                behaviour,
                to_device(advantages[mb.index], self.device),
                mask,
                old_logprobs=recomputed,
                proximal_logprobs=recomputed,
                max_len=self.cfg.rollout.max_tokens,
            )
            # The mini-batch's objective is the sum of these over micro-batches and DP ranks
            # (megatron sums: calculate_per_token_loss, no token-count division).
            seqs = sum(1 for i in mb.index if counts[i])
            frac = (mb.num_tokens if token_level else seqs) / total
            if self._reports:
                for k, v in metrics.items():
                    terms[k] = terms.get(k, 0.0) + v.double() * frac
                if diff is not None:
                    # against the version the run published these weights as (``self._held``)
                    rows = [trajs[i].generated_only_by(self._held) for i in mb.index]
                    add_logprob_agreement(agree, lp.detach(), behaviour, mask, rows)
            return loss * frac, one, {}

        self.model.zero_grad_buffer()
        self.optim.zero_grad()
        self._schedule(self._plan(trajs, chunk), loss_fn, forward_only=False)
        _, norm, _ = self.optim.step()
        self.sched.step(1)
        for k, v in metric_floats(terms).items():  # one host read for the mini-batch
            sums[k] = sums.get(k, 0.0) + v
        if diff is not None and self._reports:
            top, total, tokens = agree.tolist()
            diff[0], diff[1], diff[2] = max(diff[0], top), diff[1] + total, diff[2] + tokens
        if self._reports and norm is not None:
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm) / self.dp

    # -- weights -----------------------------------------------------------------------------
    async def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Full tensors in Hugging Face naming, one megatron parameter at a time (a fused
        QKV or gate/up yields its three or two tensors), cast to ``model.dtype`` on CPU.

        Collective: every rank iterates it in lock-step (TP all-gathers; under PP the
        owning stage broadcasts to the others) and every rank yields the same tensors.
        Vocabulary padding is trimmed; a tied head is not exported.
        """
        for m in self._exports:
            for name, tensor in await self._call(self._export_one, m):
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

    # -- checkpoints -------------------------------------------------------------------------
    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()  # DDP would prefix "module."
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
        await self._call(self._save, directory)

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
        await self._call(self._load, directory)

    def _load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        if not Path(directory, _STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{directory} is not a laminar-megatron checkpoint (no {_STATE_FILE})"
            )
        state = dist_checkpointing.load(self._sharded_state(loading=True), directory)
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optimizer"])
        self.sched.num_steps = 0  # megatron's load *adds* the saved step count to it
        self.sched.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    async def close(self) -> None:
        await self._call(self._close)

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


def _split(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` in ``parts`` contiguous chunks of near-equal size."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out
