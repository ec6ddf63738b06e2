"""Is our side of ``grpo_vs_trl.py`` the same algorithm as TRL's? Two checks on its workload.

    python benchmarks/trl_parity.py sampling [--model DIR] [--samples 64]
    python benchmarks/trl_parity.py loop [--model DIR] [--seed 1] [--steps 40]
        [--trainer torch|fsdp] [--sampler generate|vllm]
    python benchmarks/trl_parity.py replay RUN_DIR [--model DIR] [--seed N] [--trainer torch|fsdp]

``sampling``: responses from one model on the same 8 prompts, drawn by vLLM (what our
replicas run) and by transformers' ``generate`` (TRL's CPU path): mean length (with its
standard error), share stopped before ``max_tokens`` and mean reward. Equal distributions
give equal figures within a few standard errors.

``loop``: TRL's GRPO in plain torch, neither TRL nor Laminar: ``generate`` samples 8 x 8
responses per step, group-std advantages, one token mean over the batch (``dapo``), ratio
against the sampling policy, AdamW with the config's ``trainer.fsdp`` settings, one update
per batch; the held-out eval of ``grpo_vs_trl.py`` every 10 steps. Its eval curve is a
third reading beside the ``trl`` and ``sync`` arms (our trainer's update equals this one:
``plugins/fsdp/tests/test_fsdp_reference_update.py``). ``--trainer fsdp`` takes each update
with Laminar's FSDP engine instead (one gloo rank in this process, behaviour log-probs from
the sampler: the model's own, or vLLM's as a replica reports them; the engine's exported
weights loaded back for the next step): with the same ``--seed`` the two runs draw the same
samples for as long as their weights agree. Float differences between the two updates grow
over the steps (Adam amplifies them), so the lines match for some steps and then part;
``replay`` compares the updates exactly. ``--sampler vllm`` draws the samples with vLLM in
this process instead of ``generate``, loading each update through the replicas' worker
extension (``laminar_vllm.worker.WeightLoader``): TRL's loop with our sampler, weights
reloaded every step as a replica reloads them.

``replay``: a ``sync`` run's updates taken again from its ``rollouts.jsonl``
(``run.dump_rollouts=true``; one trainer rank, so one update per batch), starting from the
run's initial model (``--model``, the run's ``--seed``). Before each step it checks that the
batch is the prompt pool's next groups for that seed and that every reward is the task's
reward of its response, then prints the largest |replayed log-prob - the replica's log-prob|
over the step's trajectories: ``sync`` trajectories were sampled by the weights the trainer
held, so a replay whose update is the run's stays at vLLM's numerical floor (~1e-6) step
after step, and one whose update differs drifts away.

The model defaults to ``runs/small-qwen2`` (``laminar tiny-model runs/small-qwen2 --preset
small --seed N`` builds it); the workload is ``examples/longtail.yaml``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process

import torch
from _common import ROOT, say
from grpo_vs_trl import hf_eval_reward

CONFIG = ROOT / "examples" / "longtail.yaml"
Reward = Callable[[str, dict], float]


def _setup(
    model: str, seed: int
) -> tuple[Any, Any, Any, Reward, Callable[[list[int], dict], float]]:
    """The workload's resolved config, tokenizer and training prompts, and its reward both
    as ``reward(text, row)`` and as ``score(response_ids, row)``."""
    from transformers import AutoTokenizer

    from laminar_core import load_config
    from laminar_core.tasks import build_prompts, resolve_reward

    resolved = load_config(str(CONFIG), [f"model.path={model}", f"run.seed={seed}"])
    tok = AutoTokenizer.from_pretrained(model)
    prompts, _ = build_prompts(resolved, tok)
    _, reward_fn = resolve_reward(resolved)
    options = dict(resolved.cfg.reward.options)

    def reward(text: str, row: dict) -> float:
        return float(reward_fn(text, row, **options))

    def score(ids: list[int], row: dict) -> float:
        return reward(tok.decode(ids, skip_special_tokens=True), row)

    return resolved, tok, prompts, reward, score


def _generate(model, tok, batch: list[list[int]], max_new: int) -> list[list[int]]:
    """Sampled responses (temperature 1, no top-k/p), each cut after its first EOS."""
    width = max(len(ids) for ids in batch)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
    out = model.generate(
        input_ids=ids,
        attention_mask=(ids != pad).long(),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_new,
        eos_token_id=tok.eos_token_id,
        pad_token_id=pad,
    )
    responses = []
    for seq in out[:, width:].tolist():
        end = seq.index(tok.eos_token_id) + 1 if tok.eos_token_id in seq else len(seq)
        responses.append(seq[:end])
    return responses


def sampling(a: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    resolved, tok, prompts, _, score = _setup(a.model, a.seed)
    prompts = prompts[:8]
    max_tokens = resolved.cfg.rollout.max_tokens
    drawn: dict[str, list[tuple[int, float]]] = {"vllm": [], "generate": []}
    llm = _vllm_sampler(a.model, resolved, a.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    for p in prompts:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p.ids)] * a.samples, params, use_tqdm=False
        )
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            drawn["vllm"].append((len(ids), score(ids, p.metadata)))
    del llm
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in prompts:
            for ids in _generate(model, tok, [p.ids] * a.samples, max_tokens):
                drawn["generate"].append((len(ids), score(ids, p.metadata)))
    for name, rows in drawn.items():
        lengths = [n for n, _ in rows]
        se = statistics.stdev(lengths) / len(lengths) ** 0.5
        stopped = sum(n < max_tokens for n in lengths) / len(lengths)
        reward = statistics.fmean(r for _, r in rows)
        say(
            f"{name:<9} n={len(rows)}  mean length {statistics.fmean(lengths):.1f} +- {se:.1f}"
            f"  stopped {stopped:.2f}  reward {reward:.4f}"
        )


def loop(a: argparse.Namespace) -> None:

    from laminar_core.buffers import PromptPool
    from laminar_core.loop.evaluation import build_eval_prompts

    resolved, tok, prompts, reward, score = _setup(a.model, a.seed)
    cfg, fsdp = resolved.cfg, resolved.engine_options["trainer"]
    group, per_step = cfg.data.samples_per_prompt, cfg.data.prompts_per_step
    pool = PromptPool(prompts, group, seed=a.seed, shuffle=cfg.data.shuffle)
    held = build_eval_prompts(resolved, tok, prompts)
    model, optim = _model_and_optimiser(a.model, fsdp)
    engine = fsdp_engine(resolved) if a.trainer == "fsdp" else None
    llm = _vllm_sampler(a.model, resolved, a.seed) if a.sampler == "vllm" else None
    torch.manual_seed(a.seed)

    t0 = time.monotonic()
    for step in range(a.steps):
        rows = [pool.next_group().prompt for _ in range(per_step)]
        model.eval()
        with torch.no_grad():
            batch = [p.ids for p in rows for _ in range(group)]
            if llm is None:  # behaviour log-probs: the sampling model's, when needed
                out, behaviour = _generate(model, tok, batch, cfg.rollout.max_tokens), None
            else:
                out, behaviour = _vllm_generate(llm, batch, cfg.rollout.max_tokens)
        model.train()
        pairs = [(p, out[i * group + j]) for i, p in enumerate(rows) for j in range(group)]
        rewards = torch.tensor([score(ids, p.metadata) for p, ids in pairs]).view(per_step, -1)
        if engine is None:
            adv = group_advantages(rewards, cfg.algorithm.adv_eps)
            torch_update(model, optim, pairs, adv, fsdp.grad_clip)
        else:  # the same batch through Laminar's FSDP engine; its weights back into `model`
            step_on_engine(engine, step, pairs, rewards, model, behaviour)
        if llm is not None:  # the sampler takes the new weights, as a replica does
            _vllm_load(llm, model)
        mean_len = statistics.fmean(len(ids) for _, ids in pairs)
        line = (
            f"step {step:>3}  reward {rewards.mean():.3f}  length {mean_len:.0f}  "
            f"{time.monotonic() - t0:.0f}s"
        )
        if step % 10 == 9:
            line += f"  eval {hf_eval_reward(model, tok, held, cfg, reward):.3f}"
        say(line)


def _model_and_optimiser(path: str, fsdp: Any) -> tuple[Any, torch.optim.Optimizer]:
    """The transformers model at ``path`` and AdamW at the config's ``trainer.fsdp`` settings."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=fsdp.lr,
        betas=(fsdp.beta1, fsdp.beta2),
        eps=fsdp.eps,
        weight_decay=fsdp.weight_decay,
    )
    return model, optim


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """TRL's ``scale_rewards="group"``: ``rewards`` ``[groups, samples]`` centred and divided
    by each group's (unbiased) std plus ``eps``, flattened in the same order."""
    std = rewards.std(1, keepdim=True)
    return ((rewards - rewards.mean(1, keepdim=True)) / (std + eps)).view(-1)


def torch_update(model, optim, pairs: list, adv: torch.Tensor, grad_clip: float) -> None:
    """TRL's on-policy GRPO update in plain torch: one token mean over the batch of
    (prompt row, response ids) ``pairs``, ratio 1 against the sampling policy (its gradient
    is the policy gradient), gradient clipping, one AdamW step."""
    loss, tokens = torch.zeros(()), 0
    for a_i, (p, ids) in zip(adv, pairs, strict=True):
        lp = _response_logprobs(model, p.ids, ids)
        loss = loss - (torch.exp(lp - lp.detach()) * a_i).sum()
        tokens += len(ids)
    optim.zero_grad()
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optim.step()


def replay(a: argparse.Namespace) -> None:
    import json
    from types import SimpleNamespace

    from laminar_core.buffers import PromptPool

    resolved, _, prompts, _, score = _setup(a.model, a.seed)
    cfg, fsdp = resolved.cfg, resolved.engine_options["trainer"]
    group, per_step = cfg.data.samples_per_prompt, cfg.data.prompts_per_step
    pool = PromptPool(prompts, group, seed=a.seed, shuffle=cfg.data.shuffle)
    path = os.path.join(a.run, "rollouts.jsonl")
    if not os.path.exists(path):
        sys.exit(f"no {path}: run `laminar train ... schedule=sync run.dump_rollouts=true`")
    steps: dict[int, dict[str, list[dict]]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            steps.setdefault(r["step"], {}).setdefault(r["group_id"], []).append(r)
    model, optim = _model_and_optimiser(a.model, fsdp)
    engine = fsdp_engine(resolved) if a.trainer == "fsdp" else None
    for step, groups in sorted(steps.items()):
        rows = [pool.next_group().prompt for _ in range(per_step)]
        by_ids = {tuple(p.ids): p for p in rows}
        got = [tuple(g[0]["prompt_ids"]) for g in groups.values()]
        if sorted(got) != sorted(tuple(p.ids) for p in rows) or {
            len(g) for g in groups.values()
        } != {group}:
            sys.exit(f"step {step}: not the prompt pool's next {per_step} groups of {group}")
        trajs = [t for g in groups.values() for t in g]
        worst_reward = max(
            abs(score(t["response_ids"], by_ids[tuple(t["prompt_ids"])].metadata) - t["reward"])
            for t in trajs
        )
        with torch.no_grad():
            drift = max(
                (
                    _response_logprobs(model, t["prompt_ids"], t["response_ids"])
                    - torch.tensor(t["logprobs"])
                )
                .abs()
                .max()
                .item()
                for t in trajs
            )
        rewards = torch.tensor([[t["reward"] for t in g] for g in groups.values()])
        pairs = [(SimpleNamespace(ids=t["prompt_ids"]), t["response_ids"]) for t in trajs]
        if engine is None:
            model.train()
            adv = group_advantages(rewards, cfg.algorithm.adv_eps)
            torch_update(model, optim, pairs, adv, fsdp.grad_clip)
            model.eval()
        else:
            behaviour = [t["logprobs"] for t in trajs]
            step_on_engine(engine, step, pairs, rewards, model, behaviour)
        say(
            f"step {step:>3}  reward {rewards.mean():.3f}  |reward - task's| {worst_reward:.1g}"
            f"  |replayed - replica log-prob| max {drift:.2g}"
        )


def _response_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``model``'s log-prob of each response token after ``prompt`` (one row, no padding)."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _vllm_sampler(path: str, resolved: Any, seed: int) -> Any:
    """vLLM in this process, with Laminar's worker extension for loading new weights."""
    from vllm import LLM

    return LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=resolved.engine_options["rollout"].max_model_len,
        seed=seed,
        kv_cache_memory_bytes=128 << 20,
        worker_extension_cls="laminar_vllm.worker.WeightLoader",
    )


def _vllm_generate(
    llm: Any, batch: list[list[int]], max_new: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Sampled responses (temperature 1, no top-k/p), EOS included, and their tokens'
    log-probs as vLLM reports them (a replica's behaviour log-probs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_new, logprobs=0)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False
    )
    done = [o.outputs[0] for o in outs]
    logprobs = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)] for c in done]
    return [list(c.token_ids) for c in done], logprobs


def _vllm_load(llm: Any, model) -> None:
    """``model``'s weights into ``llm`` through a safetensors file (the replicas' loader)."""
    import tempfile

    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors.pop("lm_head.weight", None)  # tied to the embedding
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        save_file(tensors, f.name)
        llm.collective_rpc("laminar_load_weights", args=(f.name,))


def fsdp_engine(resolved: Any) -> Any:
    """Laminar's FSDP trainer engine, one gloo rank in this process, set up on the model."""
    from laminar_core import BuildContext, TrainerContext
    from laminar_fsdp.engine import FSDPTrainerEngine

    cfg, opt = resolved.cfg, resolved.engine_options["trainer"]
    engine = FSDPTrainerEngine.from_config(BuildContext(cfg, opt, 0, "trainer"))
    ctx = TrainerContext(0, 1, opt, cfg.algorithm, {"seed": cfg.run.seed})
    _LOOP.run_until_complete(engine.setup(ctx))
    return engine


_LOOP = asyncio.new_event_loop()


def step_on_engine(
    engine: Any,
    step: int,
    pairs: list,
    rewards: torch.Tensor,
    model,
    behaviour: list[list[float]] | None,
) -> None:
    """One optimiser step of ``engine`` on ``pairs`` (prompt row, response ids), group after
    group, with ``rewards`` ``[groups, samples]`` and ``behaviour`` log-probs (``None``:
    ``model``'s, the weights that sampled them); then ``model`` takes the engine's new
    weights."""
    from laminar_core.types import FinishReason, Group, TrainBatch, Trajectory

    size = rewards.shape[1]
    groups = [Group(f"g{step}-{i}", i, []) for i in range(rewards.shape[0])]
    with torch.no_grad():
        for k, ((p, ids), r) in enumerate(zip(pairs, rewards.view(-1).tolist(), strict=True)):
            lp = behaviour[k] if behaviour else _response_logprobs(model, p.ids, ids).tolist()
            g = groups[k // size]
            g.trajectories.append(
                Trajectory(
                    traj_id=f"t{step}-{k}",
                    group_id=g.group_id,
                    version=step,
                    prompt_ids=list(p.ids),
                    response_ids=list(ids),
                    logprobs=lp,
                    num_prompt_tokens=len(p.ids),
                    num_response_tokens=len(ids),
                    finish_reason=FinishReason.STOP,
                    reward=float(r),
                )
            )
    _LOOP.run_until_complete(engine.train_step(TrainBatch(step, groups, step)))

    async def weights() -> dict[str, torch.Tensor]:
        return {name: t async for name, t in engine.export_weights()}

    missing, _ = model.load_state_dict(_LOOP.run_until_complete(weights()), strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing  # tied to embeddings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["sampling", "loop", "replay"])
    ap.add_argument("run", nargs="?", help="replay: the run directory")
    ap.add_argument("--model", default=str(ROOT / "runs" / "small-qwen2"))
    ap.add_argument("--seed", type=int, default=1, help="prompt order (and sampling seed)")
    ap.add_argument("--samples", type=int, default=64, help="sampling: responses per prompt")
    ap.add_argument("--steps", type=int, default=40, help="loop: optimiser steps")
    ap.add_argument(
        "--trainer",
        choices=["torch", "fsdp"],
        default="torch",
        help="loop, replay: the update in plain torch (TRL's algorithm), or Laminar's FSDP engine",
    )
    ap.add_argument(
        "--sampler",
        choices=["generate", "vllm"],
        default="generate",
        help="loop: sample with transformers' generate (TRL's CPU path) or with vLLM, "
        "reloading the weights after every update as a replica does",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    if not os.path.exists(os.path.join(a.model, "config.json")):
        sys.exit(f"no model at {a.model}: laminar tiny-model {a.model} --preset small")
    if a.part == "sampling":
        sampling(a)
    elif a.part == "replay":
        if not a.run:
            sys.exit("replay needs the run directory: trl_parity.py replay RUN_DIR --model M")
        replay(a)
    else:
        loop(a)


if __name__ == "__main__":
    main()
