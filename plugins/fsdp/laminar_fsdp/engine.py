"""``FSDPTrainerEngine``: one rank of a torch FSDP2 trainer group over a transformers model.

Every rank gets the whole ``TrainBatch`` and computes the same deterministic split (ranks by
token balance, then micro-batches by ``micro_batch_tokens``), so the ranks never exchange
trajectories. The objective is core's ``policy_loss``; this engine only computes log-probs.
Weights are exported as full tensors under the Hugging Face names that vLLM and SGLang load.
Checkpoints are torch distributed checkpoints (sharded model + optimizer) plus a small JSON
with the step and the LR scheduler.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
from collections.abc import AsyncIterator, Iterator
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
    iterate_in_thread,
    model_dir,
)
from laminar_core.algorithms import compute_advantages, policy_loss
from laminar_fsdp.batching import (
    MicroBatch,
    assign_ranks,
    collate,
    empty_micro_batch,
    pack_micro_batches,
    trainable,
)
from laminar_fsdp.options import FSDPOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_FILE = "trainer_state.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FSDPTrainerEngine(TrainerEngine):
    Options = FSDPOptions

    @classmethod
    def from_config(cls, ctx: BuildContext) -> FSDPTrainerEngine:
        return cls(ctx.config, ctx.options or FSDPOptions())

    def __init__(self, config: Any, options: FSDPOptions | None = None) -> None:
        self.cfg = config
        self.opt = options or FSDPOptions()
        self.version = 0  # optimiser steps taken == weight version held
        self.rank, self.world = 0, 1
        self.model: torch.nn.Module | None = None
        self._recomputed: dict[str, torch.Tensor] = {}

    # -- setup -------------------------------------------------------------------------------
    async def setup(self, ctx: TrainerContext) -> None:
        await asyncio.to_thread(self._setup, ctx)

    def _setup(self, ctx: TrainerContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.rank, self.world, self.algo = ctx.rank, ctx.world_size, ctx.algorithm
        path = model_dir(self.cfg.model.path, f"trainer rank {self.rank}")
        cuda = torch.cuda.is_available() and self.opt.backend != "gloo"
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device("cuda" if cuda else "cpu")
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
        mesh = init_device_mesh(self.device.type, (self.world,))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        if self.opt.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        dtype = self.opt.param_dtype
        if dtype == "auto":
            dtype = self.cfg.model.dtype if cuda else "float32"
        mp = None
        if _DTYPES.get(dtype, torch.float32) != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)
        kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.opt.reshard_after_forward}
        if mp is not None:
            kw["mp_policy"] = mp
        for layer in _decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to(self.device)
        self.model = model
        o = self.opt
        self.optim = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, self._lr_factor)
        conf = model.config
        pad = conf.pad_token_id if conf.pad_token_id is not None else conf.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad or [0])[0])
        self.temperature = float(self.cfg.rollout.temperature) or 1.0
        self.export_dtype = _DTYPES.get(self.cfg.model.dtype, torch.float32)

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
    def _logprobs(self, mb: MicroBatch) -> torch.Tensor:
        out = self.model(
            input_ids=mb.input_ids.to(self.device),
            attention_mask=mb.attention_mask.to(self.device),
            use_cache=False,
        )
        logits = out.logits[:, :-1].float() / self.temperature
        labels = mb.labels.to(self.device)[..., None]
        return torch.log_softmax(logits, -1).gather(-1, labels)[..., 0]

    def _plan(self, trajs: list[Trajectory], chunk: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches over ``chunk`` (indices into ``trajs``), padded with empty
        ones to the largest count of any rank."""
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        per_rank = assign_ranks([lengths[i] for i in chunk], self.world)
        plans = [
            pack_micro_batches(lengths, [chunk[j] for j in mine], self.opt.micro_batch_tokens)
            for mine in per_rank
        ]
        n = max(len(p) for p in plans)
        mine = [collate(trajs, idx, self.pad_id) for idx in plans[self.rank]]
        return mine + [empty_micro_batch(self.pad_id)] * (n - len(mine))

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return await asyncio.to_thread(self._compute_logprobs, batch)

    @torch.no_grad()
    def _compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        trajs = trainable(batch.trajectories)
        self._recomputed.clear()
        for mb in self._plan(trajs, list(range(len(trajs)))):
            lp = self._logprobs(mb).cpu()
            for row, i in enumerate(mb.index):
                t = trajs[i]
                p, n = len(t.prompt_ids), len(t.response_ids)
                self._recomputed[t.traj_id] = lp[row, p - 1 : p - 1 + n].clone()
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
        return out.to(self.device)

    # -- training ----------------------------------------------------------------------------
    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return await asyncio.to_thread(self._train_step, batch)

    def _train_step(self, batch: TrainBatch) -> dict[str, float]:
        trajs = trainable(batch.trajectories)
        sums: dict[str, float] = {}
        diff = torch.zeros(3, dtype=torch.float64)  # max |Δlogp|, sum |Δlogp|, tokens
        if trajs:
            advantages = self._advantages(trajs)
            chunks = _split(len(trajs), max(1, min(self.cfg.trainer.mini_batches, len(trajs))))
            for c, chunk in enumerate(chunks):
                self._update(trajs, chunk, advantages, sums, diff if c == 0 else None)
        # one all-reduce for every figure: metric sums, then the log-prob agreement stats
        keys = sorted(sums)
        flat = torch.tensor([sums[k] for k in keys] + [diff[1].item(), diff[2].item()])
        dmax = diff[:1].clone()
        if self.world > 1:
            dist.all_reduce(flat)
            dist.all_reduce(dmax, op=dist.ReduceOp.MAX)
        n_chunks = max(1, min(self.cfg.trainer.mini_batches, len(trajs))) if trajs else 1
        out = {k: flat[i].item() / n_chunks for i, k in enumerate(keys)}
        out["lr"] = self.optim.param_groups[0]["lr"]
        out["trained_trajectories"] = float(len(trajs))
        tokens = flat[-1].item()
        if tokens:
            out["logprob_abs_diff_max"] = dmax.item()
            out["logprob_abs_diff_mean"] = flat[-2].item() / tokens
            out["logprob_diff_tokens"] = tokens
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
        diff: torch.Tensor | None,
    ) -> None:
        token_level = self.algo.loss_agg == "token_mean"
        total = sum(len(trajs[i].response_ids) for i in chunk) if token_level else len(chunk)
        self.optim.zero_grad(set_to_none=True)
        for mb in self._plan(trajs, chunk):
            lp = self._logprobs(mb)
            if not mb.index:
                (lp.sum() * 0.0).backward()  # keeps FSDP's collectives in step across ranks
                continue
            mask = mb.mask.to(self.device)
            behaviour = mb.behaviour.to(self.device)
            recomputed = self._recomputed_like(trajs, mb)
            loss, metrics = policy_loss(
                self.algo,
                lp,
                behaviour,
                advantages[mb.index].to(self.device),
                mask,
                old_logprobs=recomputed,
                proximal_logprobs=recomputed,
                max_len=self.cfg.rollout.max_tokens,
            )
            frac = (mb.num_tokens if token_level else len(mb.index)) / total
            # FSDP averages gradients over ranks; scaling by world makes the sum over ranks'
            # shares the batch-level mean the objective defines.
            (loss * frac * self.world).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * frac
            if diff is not None:
                self._agreement(trajs, mb, lp.detach(), behaviour, mask, diff)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opt.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm) / self.world
        self.optim.step()
        self.sched.step()

    def _agreement(self, trajs, mb, lp, behaviour, mask, diff) -> None:
        """|trainer - rollout| log-prob over tokens generated by the version held now."""
        rows = [
            r
            for r, i in enumerate(mb.index)
            if trajs[i].versions in ([], [self.version]) and trajs[i].version == self.version
        ]
        if not rows:
            return
        d = ((lp[rows] - behaviour[rows]).abs() * mask[rows]).double().cpu()
        diff[0] = max(diff[0].item(), d.max().item())
        diff[1] += d.sum()
        diff[2] += mask[rows].sum().item()

    # -- weights -----------------------------------------------------------------------------
    def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Full tensors in Hugging Face naming, one parameter at a time, each gathered on a
        worker thread (the event loop keeps serving).

        Collective: every rank must iterate it in step (each parameter is all-gathered);
        the runtime keeps rank 0's tensors and drops the others'.
        """
        return iterate_in_thread(self._full_tensors())

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach().to("cpu", self.export_dtype)

    # -- checkpoints -------------------------------------------------------------------------
    async def save_checkpoint(self, directory: str) -> None:
        await asyncio.to_thread(self._save, directory)

    def _save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
        if self.rank == 0:
            state = {"version": self.version, "scheduler": self.sched.state_dict()}
            Path(directory, _STATE_FILE).write_text(json.dumps(state))
        if self.world > 1:
            dist.barrier()

    async def load_checkpoint(self, directory: str) -> None:
        await asyncio.to_thread(self._load, directory)

    def _load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = Path(directory, _STATE_FILE)
        if not meta.is_file():
            raise FileNotFoundError(f"{directory} is not a trainer checkpoint (no {_STATE_FILE})")
        msd, osd = get_state_dict(self.model, self.optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        saved = json.loads(meta.read_text())
        self.version = int(saved["version"])
        self.sched.load_state_dict(saved["scheduler"])

    async def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (``model.model.layers`` for Llama/Qwen)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    return list(layers) if layers is not None else []


def _split(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` in ``parts`` contiguous chunks of near-equal size."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out
