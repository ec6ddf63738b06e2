"""GRPO on one CPU machine, a long-tailed workload: TRL's ``GRPOTrainer`` vs our schedules.

The workload is ``examples/longtail.yaml`` (``--config``): the ``small`` local model (3.2M
parameters, ``laminar tiny-model --preset small``, seed = the run's seed), the ``longtail``
task (target responses of 2 to 257 tokens, p99/p50 ~ 10), its reward, 8 prompts x 8
samples = 64 completions per optimiser step, up to ``rollout.max_tokens`` new tokens at
temperature 1, AdamW at the config's ``trainer.fsdp`` settings, GRPO advantages, PPO clip,
token-mean loss, no KL. Every arm reads those settings from the same resolved config, sees
the training prompts in our prompt pool's seeded order, and is evaluated on the same
held-out prompts (``data.eval_*``: sampled as the config says, never trained on) every
``run.eval_every`` steps and after the last. Arms, one after another, each in its own process
(never concurrently):

- ``trl``: ``trl.GRPOTrainer`` on CPU, generation with transformers (``use_vllm=False``:
  what a CPU user gets), 2 torch threads (one process: it gets both cores);
- ``trl_cb`` (not in the default list): the same with transformers' continuous-batching
  generation (``use_transformers_continuous_batching``, TRL's non-vLLM alternative);
- ``trl_async``: TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) cannot run on
  a CPU: it is listed, not run (see ``TRL_ASYNC_ON_CPU`` for why);
- ``sync``, ``one_step``, ``stale:4``: ``laminar train CONFIG schedule=...`` without repack
  (as the systems they reproduce run);
- ``laminar`` (repack on, ``best_fit``) and ``laminar_norepack`` (``repack.policy=none``).
  Ours: Ray actors, FSDP2 (2 gloo ranks), 2 vLLM-CPU replicas, ``OMP_NUM_THREADS=1``,
  every core time-shared by all of them unless ``--set runtime.trainer_cores=0 --set
  runtime.replica_cores=1`` gives the trainer and the replicas a core each (trainer and
  rollout on separate devices, as on a GPU cluster; ``sync``'s trainer core then idles while
  it generates).

Per arm (and seed), from ``metrics.jsonl`` rows (the TRL arm writes the same rows from a
``TrainerCallback``), timestamped by this script as they arrive. The loop clock
(``wall_seconds``) starts when the arm's engines are up and leaves eval rounds out:

- ``samples/s``, ``tokens/s``: completions (prompt + response tokens, unpadded) trained on
  over the loop time of the steps after the first ``WARMUP`` (2);
- ``start-up s``: process start -> loop start (imports, model load; ours also Ray, actors and
  the vLLM engines);
- ``s to target``: loop seconds until the first eval round with ``eval_reward >= --target``
  (eval rounds excluded), and the same plus start-up (``incl. start-up``); ``>cap`` if never;
- ``final eval``: the last eval round's reward; ``trainer idle``: the share of loop time the
  trainer waited for data (TRL: generating, since it trains only after generating);
  ``repack moves`` / ``moved``: best_fit's moves and the trajectories they moved (from
  ``events.jsonl``); ``log-prob gap``: mean |vLLM log-prob - trainer recompute| on
  trajectories of the trainer's current version (FSDP's ``logprob_abs_diff_*``: engine
  numerics only; none in steps where every trajectory is stale), and ``approx KL``: the
  loss's KL estimate between the trainer and the rollout log-probs over every trained token
  (numerics plus staleness); TRL generates and trains with one transformers model: no gap
  by construction;
- the step profile: median seconds per step of where the time goes (ours: waiting for data,
  training + weight push, of which the push stall; TRL: generating, training);
- ``cores busy``: the CPU seconds the arm's processes (driver, Ray, actors, engines) used
  after the warm-up steps, over the wall seconds that took (eval rounds included): on a
  machine whose cores are all busy, a schedule gains samples/s only by doing less work;
- CPU seconds per 1k tokens, by part (ours): the same CPU seconds split into the replicas,
  the trainer ranks, the relays, the zygote (``runtime.zygote``: the engines' imports, once)
  and the rest (driver, Ray's daemons), over the tokens
  generated in those steps (training and eval): where an arm's work goes, and which part
  of it a schedule makes cheaper (a replica decoding a fuller batch spends less per token).

With several ``--seeds`` an arm's figures are the mean over seeds (``final eval`` with its
min-max), ``s to target`` the median over the seeds that reached it (``k/n`` reached). Goals
(issue 12) are printed with met / missed: laminar >= 1.5x TRL's samples/s, reaches the target
>= 1.3x sooner than TRL including start-up, and >= 1.3x ``sync``'s samples/s (and, read
in tokens/s, which does not count what a run learned, the same 1.3x).

    pip install trl==1.16.0   # only for the TRL arm; pulls accelerate and datasets
    python benchmarks/grpo_vs_trl.py [--max-steps 150] [--target 0.5] [--arm-cap 900]
        [--arms trl,trl_async,sync,one_step,stale:4,laminar,laminar_norepack] [--seeds 0]
        [--config examples/longtail.yaml] [--preset small] [--set KEY=VALUE ...]
        [--work runs/grpo_vs_trl] [--json FILE]

``--json FILE`` writes ``{"arms": [one object per arm], "ratios": ..., "goals": ...,
"settings": ...}``; each arm object has at least ``arm``, ``samples_per_second``,
``tokens_per_second``, ``seconds_to_target``, ``seconds_to_target_with_startup``,
``final_eval_reward``, ``repack_moves`` (and ``runs``: one object per seed).

The internal ``--trl-worker`` mode is the TRL arm's process; do not call it by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, say, table

TRL_VERSION = "1.16.0"  # tested with transformers 5.19 / torch 2.13 (CPU)
CONFIG = ROOT / "examples" / "longtail.yaml"
WARMUP = 2  # steps left out of samples/s
ARMS = ("trl", "trl_async", "sync", "one_step", "stale:4", "laminar", "laminar_norepack")
OPTIONAL_ARMS = ("trl_cb",)  # TRL generating with transformers' continuous batching
NOT_RUNNABLE = {"trl_async"}
# Why TRL's AsyncGRPOTrainer (trl 1.16, trl/experimental/async_grpo) cannot run here: its
# trainer always loads the model with attn_implementation="tree_fa3" (async_grpo_trainer.py,
# create_model_from_path), a FlashAttention-3 varlen kernel fetched from the Hub
# (packing.py: kernels.get_kernel("kernels-community/flash-attn3")): CUDA/ROCm only, and no
# Hub here; it syncs weights to a separate `trl vllm-serve` server over NCCL
# (weight_transfer.py: NCCLWeightTransferEngine): CUDA only.
TRL_ASYNC_ON_CPU = (
    "cannot run on CPU: trl 1.16's AsyncGRPOTrainer trains with FlashAttention-3 "
    "(attn_implementation='tree_fa3', a CUDA/ROCm kernel fetched from the Hub) and syncs "
    "weights to a `trl vllm-serve` server over NCCL (CUDA only)"
)
OURS_FLAGS = {  # schedule and repack per arm (baselines run without repack, as they do)
    "sync": ["schedule=sync", "repack.policy=none"],
    "one_step": ["schedule=one_step", "repack.policy=none"],
    "stale:4": ["schedule=stale:4", "repack.policy=none"],
    "laminar": ["schedule=laminar"],
    "laminar_norepack": ["schedule=laminar", "repack.policy=none"],
}


def _resolved(config: str, model_dir: str, seed: int, overrides: list[str]):
    from laminar_core import load_config

    return load_config(config, [*overrides, f"model.path={model_dir}", f"run.seed={seed}"])


# -- the TRL arm (runs in its own process) ---------------------------------------------------
def _pool_rows(resolved, tok, n_prompts: int) -> tuple[list[dict[str, Any]], list]:
    """The first ``n_prompts`` rows our prompt pool hands out for ``resolved`` (same task,
    options, seed and shuffle as ``laminar train``, so TRL sees our prompts in our order),
    and the whole training prompt set (what the held-out set must avoid)."""
    from laminar_core.buffers import PromptPool
    from laminar_core.tasks import build_prompts

    cfg = resolved.cfg
    prompts, _ = build_prompts(resolved, tok)
    pool = PromptPool(
        prompts, cfg.data.samples_per_prompt, seed=cfg.run.seed, shuffle=cfg.data.shuffle
    )
    return [dict(pool.next_group().prompt.metadata) for _ in range(n_prompts)], prompts


def hf_eval_reward(model, tok, held: list, cfg: Any, reward: Any) -> float:
    """The TRL arm's eval round: ``data.eval_temperature`` (0: greedy) on the held-out
    prompts ``held`` with transformers' ``generate``, the mean of ``reward(text, row)``.
    Sampled rounds draw from one seed per run, ``run.seed``, the same in every round (ours
    seed request i with ``(run.seed << 20) + i``), and leave the caller's random state and
    the model's train/eval mode as they were."""
    import torch

    was_training = model.training
    model.eval()
    d = cfg.data
    sample = d.eval_temperature > 0
    scores = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        for i in range(0, len(held), 32):
            chunk = held[i : i + 32]
            width = max(len(p.ids) for p in chunk)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p.ids)) + p.ids for p in chunk])
            gen = model.generate(
                input_ids=ids,
                attention_mask=(ids != tok.pad_token_id).long(),
                max_new_tokens=d.eval_max_tokens or cfg.rollout.max_tokens,
                do_sample=sample,
                temperature=d.eval_temperature if sample else None,
                top_p=1.0,
                top_k=0 if sample else None,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            for p, seq in zip(chunk, gen[:, width:]):
                text = tok.decode(seq.tolist(), skip_special_tokens=True)
                scores.append(float(reward(text, p.metadata)))
    if was_training:
        model.train()
    return sum(scores) / len(scores)


def trl_worker(args: argparse.Namespace) -> None:
    """Train with TRL's GRPOTrainer; write ``out/metrics.jsonl`` rows like ``laminar``."""
    import torch

    torch.set_num_threads(args.threads)
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as e:
        sys.exit(f"the TRL arm needs TRL ({e}): pip install trl=={TRL_VERSION}")

    from laminar_core.loop.evaluation import build_eval_prompts
    from laminar_core.tasks import resolve_reward

    resolved = _resolved(args.config, args.model, args.seed, args.set or [])
    cfg = resolved.cfg
    fsdp = resolved.engine_options["trainer"]
    algo = cfg.algorithm
    if algo.advantage != "grpo" or algo.loss_agg != "token_mean" or algo.off_policy != "none":
        sys.exit("the TRL arm mirrors grpo / token_mean / off_policy none only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {out}", flush=True)
    metrics = (out / "metrics.jsonl").open("w")
    tok = AutoTokenizer.from_pretrained(args.model)
    group, per_step = cfg.data.samples_per_prompt, cfg.data.prompts_per_step
    n = per_step * group
    rows, train_prompts = _pool_rows(resolved, tok, args.max_steps * per_step)
    held = build_eval_prompts(resolved, tok, train_prompts)
    _, reward_fn = resolve_reward(resolved)
    options = dict(cfg.reward.options)
    keys = sorted(set(rows[0]) - {"prompt"})

    def reward(prompts: list[str], completions: list[str], **cols: Any) -> list[float]:
        """Our reward, in TRL's reward-function signature (the row's columns as kwargs)."""
        return [
            float(reward_fn(c, {k: cols[k][i] for k in keys}, **options))
            for i, c in enumerate(completions)
        ]

    clock = {"excluded": 0.0, "generate": 0.0}

    class Timed(trl.GRPOTrainer):
        """GRPOTrainer with its generation phase timed (the step profile)."""

        def _generate_and_score_completions(self, inputs):
            t = time.monotonic()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                clock["generate"] += time.monotonic() - t

    def evaluate(model) -> tuple[float, float]:
        """The held-out eval round (``hf_eval_reward``): (reward, seconds)."""
        t = time.monotonic()
        reward = hf_eval_reward(
            model, tok, held, cfg, lambda text, row: reward_fn(text, row, **options)
        )
        return reward, time.monotonic() - t

    class Rows(TrainerCallback):
        """One ``metrics.jsonl`` row per optimiser step, from the logged ``reward``."""

        t_start = prev = 0.0
        tokens_seen = 0

        def on_train_begin(self, args_, state, control, **kw):
            self.t_start = self.prev = time.monotonic()

        def on_log(self, args_, state, control, logs=None, model=None, **kw):
            if not logs or "reward" not in logs:
                return
            now = time.monotonic()
            seen = int(logs.get("num_tokens", 0))
            row = {
                "step": state.global_step - 1,
                "wall_seconds": now - self.t_start - clock["excluded"],
                "reward_mean": float(logs["reward"]),
                "trajectories": n,
                "tokens": seen - self.tokens_seen,
                "samples_per_second": n / max(now - self.prev, 1e-9),
                "completion_length": logs.get("completions/mean_length"),
                "generate_seconds": clock["generate"],
                "wait_seconds": clock["generate"],  # a synchronous trainer waits for it
            }
            self.tokens_seen, clock["generate"] = seen, 0.0
            every = cfg.run.eval_every
            if every and (state.global_step % every == 0 or state.global_step >= state.max_steps):
                row["eval_reward"], row["eval_seconds"] = evaluate(model)
                clock["excluded"] += row["eval_seconds"]
            self.prev = time.monotonic()
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    data = Dataset.from_list(rows)
    config = trl.GRPOConfig(
        output_dir=str(out / "trl"),
        # one optimiser step = prompts_per_step x samples_per_prompt, generated in one batch
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=group,
        num_iterations=1,
        max_steps=args.max_steps,
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=0,
        use_vllm=False,
        use_transformers_continuous_batching=args.cb,
        # optimiser = our trainer.fsdp settings
        learning_rate=fsdp.lr,
        lr_scheduler_type=fsdp.lr_schedule,
        warmup_steps=fsdp.warmup_steps,
        optim="adamw_torch",
        weight_decay=fsdp.weight_decay,
        adam_beta1=fsdp.beta1,
        adam_beta2=fsdp.beta2,
        adam_epsilon=fsdp.eps,
        max_grad_norm=fsdp.grad_clip,
        # loss = our algorithm: GRPO advantages (group std), PPO clip, token mean, no KL
        beta=algo.kl_coef,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        scale_rewards="group",
        loss_type="dapo",
        shuffle_dataset=False,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Rows()],
    )
    trainer.train()
    metrics.close()


# -- the driver --------------------------------------------------------------------------------
def _cli() -> list[str]:
    found = shutil.which("laminar")
    return [found] if found else [sys.executable, "-m", "laminar_core.cli"]


def _cmd(arm: str, seed: int, model_dir: Path, work: Path, a: argparse.Namespace):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    name = f"{arm.replace(':', '')}-s{seed}"
    sets = [f"--set={s}" for s in a.set or []]
    if arm in ("trl", "trl_cb"):
        env.update(OMP_NUM_THREADS="2")
        cmd = [
            sys.executable,
            __file__,
            "--trl-worker",
            f"--config={a.config}",
            f"--model={model_dir}",
            f"--out={work / name}",
            f"--max-steps={a.max_steps}",
            f"--seed={seed}",
            *(["--cb"] if arm == "trl_cb" else []),
            *sets,
        ]
        return cmd, env, name
    env.update(OMP_NUM_THREADS="1")
    # a cluster of its own: with no address, ray.init() joins one that another job on the
    # machine started (and then refuses our num_cpus)
    env.setdefault("RAY_ADDRESS", "local")
    cmd = [
        *_cli(),
        "train",
        str(a.config),
        *(a.set or []),
        f"model.path={model_dir}",
        f"run.steps={a.max_steps}",
        f"run.seed={seed}",
        f"run.out_dir={work}",
        f"run.name={name}",
        "telemetry.progress=false",
        "run.checkpoint_every=-1",
        *OURS_FLAGS[arm],
    ]
    return cmd, env, name


def _processes() -> list[tuple[int, str, int, float, int]]:
    """(pid, name, session id, CPU seconds so far, parent pid) of every process, from
    ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        name, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :]
        f = rest.split()
        # utime + stime
        out.append((int(d), name, int(f[3]), (int(f[11]) + int(f[12])) / tick, int(f[1])))
    return out


# which part of an arm a process is, by its name (``/proc/PID/stat``'s 15-character ``comm``:
# Ray names an actor's process ``ray::<Class>``; a host forked from the zygote
# (``runtime.zygote``) is named for its class, and the zygote ``laminar-zygote``); the rest
# are the driver and Ray's daemons
PART_OF = {
    "ray::RolloutHos": "replicas",
    "ray::TrainerHos": "trainer",
    "ray::RelayActor": "relay",
    "RolloutHost": "replicas",
    "TrainerHost": "trainer",
    "laminar-zygote": "zygote",
}
PARTS = ["replicas", "trainer", "relay", "zygote", "driver_ray"]


class _Cpu:
    """CPU seconds, sampled from ``/proc`` every 2 s while an arm runs.

    ``arm``: (monotonic time, CPU seconds so far by part of the arm, :data:`PART_OF`) of
    the arm itself, the processes of its session (it runs in its own,
    ``start_new_session``: its driver, Ray daemons, actors and vLLM workers), from the last
    sample that found any of them alive. ``total``/``top``: processes
    outside the arm and outside this script (another job on the machine), which skew the
    figures and are reported.
    """

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.arm: tuple[float, dict[str, float]] = (0.0, {})
        self.next_at = 0.0
        self.sampled = False
        self.mine = os.getsid(0)

    def sample(self, arm_sid: int) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + 2.0
        alive, parts = False, dict.fromkeys(PARTS, 0.0)
        procs = _processes()
        # the arm: its session, and what its processes started in sessions of their own
        # (the zygote and the hosts it forks)
        arm = {pid for pid, _, sid, _, _ in procs if sid == arm_sid}
        grew = True
        while grew:
            new = {pid for pid, _, _, _, ppid in procs if ppid in arm and pid not in arm}
            arm |= new
            grew = bool(new)
        for pid, name, sid, cpu, _ in procs:
            if pid in arm:
                alive = True
                parts[PART_OF.get(name, "driver_ray")] += cpu
                continue
            if sid == self.mine:
                continue
            # a process first seen after the first sample started during the arm: from 0
            self.first.setdefault(pid, 0.0 if self.sampled else cpu)
            self.last[pid] = (name, cpu)
        if alive:  # an arm that has ended has no CPU left to read
            self.arm = (time.monotonic(), parts)
        self.sampled = True

    def _used(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for pid, (name, cpu) in self.last.items():
            used[name] = used.get(name, 0.0) + cpu - self.first[pid]
        return used

    def total(self) -> float:
        return round(sum(self._used().values()), 1)

    def top(self) -> str:
        used = sorted(self._used().items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{n} {c:.0f} s" for n, c in used if c >= 0.5) or "none"


def _follow(
    proc: subprocess.Popen, cpu: _Cpu, run_dir: list[Path], name: str, t0: float, cap_s: float
) -> tuple[list[dict], bool]:
    """Sample the arm's CPU and read its metrics rows until it exits (stopped at ``cap_s``).

    Returns the rows with their arrival times and whether the cap stopped it.
    """
    rows: list[dict] = []
    capped = False
    buf = ""
    fh = None
    while True:
        done = proc.poll() is not None
        cpu.sample(proc.pid)
        if fh is None and run_dir and (run_dir[0] / "metrics.jsonl").exists():
            fh = (run_dir[0] / "metrics.jsonl").open()
        if fh is not None:
            buf += fh.read()
            *lines, buf = buf.split("\n")
            now = time.monotonic() - t0
            for line in lines:
                if line.strip():
                    r = {
                        **json.loads(line),
                        "arrival_seconds": now,
                        "arm_cpu_at": cpu.arm,
                    }
                    rows.append(r)
                    ev = r.get("eval_reward")
                    say(
                        f"    {name} step {r['step']:>3}  reward {r['reward_mean'] or 0:.3f}  "
                        + (f"eval {ev:.3f}  " if ev is not None else "")
                        + f"{r['wall_seconds']:6.1f} s loop  {now:6.1f} s total"
                    )
        if done:
            break
        if time.monotonic() - t0 > cap_s and not capped:
            capped = True
            say(f"    {name}: wall cap {cap_s:.0f} s reached, stopping it (SIGINT)")
            _stop(proc)
        time.sleep(0.2)
    if fh is not None:
        fh.close()
    return rows, capped


def _stop(proc: subprocess.Popen) -> None:
    """Stop an arm's session as a user's Ctrl-C would (the run shuts down cleanly), then kill."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_arm(arm: str, seed: int, model_dir: Path, work: Path, a: argparse.Namespace) -> dict:
    """Run one arm to completion (or to ``--arm-cap``); rows with their arrival times."""
    cmd, env, name = _cmd(arm, seed, model_dir, work, a)
    cpu = _Cpu()
    log_path = work / f"{name}.log"
    run_dir: list[Path] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def pump() -> None:
        with log_path.open("w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                if line.startswith("run directory:") and not run_dir:
                    run_dir.append(ROOT / line.split(":", 1)[1].strip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rows, capped = _follow(proc, cpu, run_dir, name, t0, a.arm_cap)
    finally:
        # the arm runs in a session of its own, so a Ctrl-C or SIGTERM meant for this script
        # never reaches it: stop it here, or its Ray cluster and /dev/shm files outlive us
        if proc.poll() is None:
            _stop(proc)
    reader.join(5)
    total = time.monotonic() - t0
    if cpu.total() > 0.05 * total:
        say(
            f"    warning: other processes used {cpu.total():.0f} CPU s during {name}: "
            f"{cpu.top()}; its figures are skewed"
        )
    if proc.returncode not in (0, None) and not capped:
        tail = log_path.read_text().splitlines()[-15:]
        say(f"    {name} exited with {proc.returncode}; last lines of {log_path}:")
        for line in tail:
            say(f"      {line}")
    return {
        "arm": arm,
        "seed": seed,
        "rows": rows,
        "run_dir": str(run_dir[0]) if run_dir else None,
        "capped": capped,
        "returncode": proc.returncode,
        "process_seconds": total,
        "log": str(log_path),
        "other_cpu_seconds": cpu.total(),
        "other_cpu_top": cpu.top(),
    }


def _repack(run_dir: str | None) -> tuple[int | None, int | None]:
    """best_fit's moves and the trajectories they moved, from ``events.jsonl``."""
    path = Path(run_dir or "") / "events.jsonl"
    if not run_dir or not path.exists():
        return None, None
    from laminar_core.telemetry.events import RepackMove, read_events

    moves = read_events(path).of(RepackMove)
    return len(moves), sum(e.n for e in moves)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarise(res: dict, target: float) -> dict:
    """The figures of one run (see the module docstring for their definitions)."""
    rows = sorted(res["rows"], key=lambda r: r["step"])
    out: dict[str, Any] = {
        "arm": res["arm"],
        "seed": res["seed"],
        "steps": len(rows),
        "capped": res["capped"],
        "returncode": res["returncode"],
        "process_seconds": round(res["process_seconds"], 1),
        "other_cpu_seconds": res["other_cpu_seconds"],
        "other_cpu_top": res["other_cpu_top"],
        "target": target,
        "samples_per_second": None,
        "tokens_per_second": None,
        "seconds_to_target": None,
        "seconds_to_target_with_startup": None,
        "final_eval_reward": None,
        "repack_moves": None,
    }
    if not res["arm"].startswith("trl"):
        out["repack_moves"], out["repack_moved_trajectories"] = _repack(res["run_dir"])
    if not rows:
        return out
    r0 = rows[0]
    startup = r0["arrival_seconds"] - r0["wall_seconds"] - (r0.get("eval_seconds") or 0.0)
    out["startup_seconds"] = round(startup, 1)
    if len(rows) > WARMUP:
        timed = rows[WARMUP:]
        span = timed[-1]["wall_seconds"] - rows[WARMUP - 1]["wall_seconds"]
        out["samples_per_second"] = round(sum(r["trajectories"] for r in timed) / span, 2)
        out["tokens_per_second"] = round(sum(r["tokens"] for r in timed) / span, 1)
        out["trainer_idle_share"] = round(sum(r["wait_seconds"] for r in timed) / span, 3)
        prev = {r["step"]: r["wall_seconds"] for r in rows}
        periods = [r["wall_seconds"] - prev.get(r["step"] - 1, 0.0) for r in timed]
        waits = [r["wait_seconds"] for r in timed]
        stalls = [r.get("stall_seconds", 0.0) for r in timed]
        profile = {"step": _median(periods), "waiting_for_data": _median(waits)}
        if res["arm"].startswith("trl"):
            profile["generating"] = profile.pop("waiting_for_data")
            profile["training"] = _median([p - w for p, w in zip(periods, waits)])
        else:
            profile["training_and_push"] = _median([p - w for p, w in zip(periods, waits)])
            profile["of_which_push_stall"] = _median(stalls)
        out["step_profile_seconds"] = profile
        # how much of the machine the arm kept busy over the same steps (eval rounds
        # included): on a machine whose cores are full, a schedule gains only by doing less work
        (t1, p1), (t2, p2) = rows[WARMUP - 1]["arm_cpu_at"], timed[-1]["arm_cpu_at"]
        used = {k: p2.get(k, 0.0) - p1.get(k, 0.0) for k in PARTS}
        if sum(used.values()) > 0 and t2 > t1:
            out["cores_busy"] = round(sum(used.values()) / (t2 - t1), 2)
        # the same CPU seconds by part, per 1k tokens generated over those steps (training
        # and eval rounds' tokens both: the CPU counted includes the eval rounds)
        tokens = sum(
            r["tokens"] + (r.get("eval_samples") or 0) * (r.get("eval_response_tokens_mean") or 0)
            for r in timed
        )
        if p1 and tokens and not res["arm"].startswith("trl"):
            per = {k: 1000 * v / tokens for k, v in used.items()}
            per["total"] = sum(per.values())
            out["cpu_seconds_per_1k_tokens"] = {k: round(v, 3) for k, v in per.items()}
    out["reward_mean_last5"] = round(
        statistics.fmean(r["reward_mean"] for r in rows[-5:] if r["reward_mean"] is not None), 4
    )
    evals = [(r["step"], r["wall_seconds"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    out["eval_curve"] = [[s, round(w, 1), round(e, 4)] for s, w, e in evals]
    out["eval_seconds_total"] = round(sum(r.get("eval_seconds") or 0.0 for r in rows), 1)
    if evals:
        out["final_eval_reward"] = round(evals[-1][2], 4)
    for step, wall, reward in evals:
        if reward >= target:
            out["steps_to_target"] = step + 1
            out["seconds_to_target"] = round(wall, 1)
            out["seconds_to_target_with_startup"] = round(startup + wall, 1)
            break
    kls = [r["approx_kl"] for r in rows if "approx_kl" in r]
    if kls:  # trainer vs rollout log-probs on every trained token, staleness included
        out["approx_kl_mean"] = round(statistics.fmean(kls), 6)
    gaps = [r["logprob_abs_diff_mean"] for r in rows if "logprob_abs_diff_mean" in r]
    if gaps:
        out["logprob_gap_mean"] = round(statistics.fmean(gaps), 5)
        out["logprob_gap_max"] = round(
            max(r["logprob_abs_diff_max"] for r in rows if "logprob_abs_diff_max" in r), 5
        )
    return out


def _mean_parts(runs: list[dict]) -> dict[str, float] | None:
    """``cpu_seconds_per_1k_tokens`` averaged over the runs that have it, part by part."""
    have = [r["cpu_seconds_per_1k_tokens"] for r in runs if r.get("cpu_seconds_per_1k_tokens")]
    if not have:
        return None
    return {k: round(statistics.fmean(h[k] for h in have), 3) for k in have[0]}


def aggregate(arm: str, runs: list[dict]) -> dict:
    """One object per arm: means over seeds (time to target: median over seeds reaching it)."""

    def mean(key: str) -> float | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return round(statistics.fmean(xs), 3) if xs else None

    reached = [r["seconds_to_target"] for r in runs if r.get("seconds_to_target") is not None]
    reached_all = [
        r["seconds_to_target_with_startup"]
        for r in runs
        if r.get("seconds_to_target_with_startup") is not None
    ]
    finals = [r["final_eval_reward"] for r in runs if r.get("final_eval_reward") is not None]
    out = {
        "arm": arm,
        "seeds": [r["seed"] for r in runs],
        "samples_per_second": mean("samples_per_second"),
        "tokens_per_second": mean("tokens_per_second"),
        "startup_seconds": mean("startup_seconds"),
        "seconds_to_target": _median(reached) if len(reached) == len(runs) else None,
        "seconds_to_target_with_startup": (
            _median(reached_all) if len(reached_all) == len(runs) else None
        ),
        "reached_target": f"{len(reached)}/{len(runs)}",
        "final_eval_reward": round(statistics.fmean(finals), 4) if finals else None,
        "final_eval_reward_range": [min(finals), max(finals)] if finals else None,
        "trainer_idle_share": mean("trainer_idle_share"),
        "cores_busy": mean("cores_busy"),
        "cpu_seconds_per_1k_tokens": _mean_parts(runs),
        "repack_moves": mean("repack_moves"),
        "repack_moved_trajectories": mean("repack_moved_trajectories"),
        "logprob_gap_mean": mean("logprob_gap_mean"),
        "approx_kl_mean": mean("approx_kl_mean"),
        "runs": runs,
    }
    if arm == "trl_async":
        out["status"] = TRL_ASYNC_ON_CPU
    return out


def _fmt(v: Any, spec: str = ".1f", missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None, inverse: bool = False) -> float | None:
    if a is None or b is None or (b if not inverse else a) == 0:
        return None
    return round(b / a if inverse else a / b, 2)


def report(arms: dict[str, dict], target: float) -> tuple[dict, dict]:
    """Print the tables; return the ratios and the goals."""
    ran = [s for s in arms.values() if "status" not in s]
    say(
        table(
            [
                [
                    s["arm"],
                    _fmt(s["samples_per_second"]),
                    _fmt(s["tokens_per_second"], ".0f"),
                    _fmt(s["startup_seconds"]),
                    _fmt(s["seconds_to_target"], missing=">cap"),
                    _fmt(s["seconds_to_target_with_startup"], missing=">cap"),
                    s["reached_target"],
                    _fmt(s["final_eval_reward"], ".3f")
                    + (
                        f" ({s['final_eval_reward_range'][0]:.2f}-"
                        f"{s['final_eval_reward_range'][1]:.2f})"
                        if s["final_eval_reward_range"] and len(s["seeds"]) > 1
                        else ""
                    ),
                    _fmt(s["trainer_idle_share"], ".2f"),
                    _fmt(s["cores_busy"], ".2f"),
                    _fmt(s["repack_moves"], ".0f", "n/a")
                    + (
                        f" / {s['repack_moved_trajectories']:.0f}"
                        if s["repack_moved_trajectories"]
                        else ""
                    ),
                    _fmt(s["logprob_gap_mean"], ".4f", "n/a")
                    + " / "
                    + _fmt(s["approx_kl_mean"], ".4f", "n/a"),
                ]
                for s in ran
            ],
            [
                "arm",
                "samples/s",
                "tokens/s",
                "start-up s",
                f"s to eval {target} (loop)",
                "s to target (incl. start-up)",
                "reached",
                "final eval",
                "trainer idle",
                "cores busy",
                "repack moves / moved",
                "log-prob gap / approx KL",
            ],
        )
    )
    for s in arms.values():
        if "status" in s:
            say(f"{s['arm']}: {s['status']}")
    say("\nwhere a step's time goes (median seconds per step, first seed):")
    for s in ran:
        prof = s["runs"][0].get("step_profile_seconds") if s["runs"] else None
        if prof:
            say(f"  {s['arm']:<17} " + "  ".join(f"{k} {v:.2f}" for k, v in prof.items()))
    parts = [s for s in ran if s.get("cpu_seconds_per_1k_tokens")]
    if parts:
        say("\nCPU seconds per 1k tokens generated, by part (after the warm-up, eval included):")
        cols = [*PARTS, "total"]
        say(
            table(
                [
                    [s["arm"], *(f"{s['cpu_seconds_per_1k_tokens'][k]:.3f}" for k in cols)]
                    for s in parts
                ],
                ["arm", "replicas", "trainer", "relay", "zygote", "driver + Ray", "total"],
            )
        )
    ratios: dict[str, dict] = {}
    for a, b in [
        ("laminar", "trl"),
        ("laminar", "sync"),
        ("laminar", "one_step"),
        ("laminar", "stale:4"),
        ("laminar", "laminar_norepack"),
        ("sync", "trl"),
    ]:
        if a in arms and b in arms and "status" not in arms[a] and "status" not in arms[b]:
            ra, rb = arms[a], arms[b]
            ratios[f"{a}/{b}"] = {
                "samples_per_second": _ratio(ra["samples_per_second"], rb["samples_per_second"]),
                "tokens_per_second": _ratio(ra["tokens_per_second"], rb["tokens_per_second"]),
                "time_to_target": _ratio(
                    ra["seconds_to_target"], rb["seconds_to_target"], inverse=True
                ),
                "time_to_target_with_startup": _ratio(
                    ra["seconds_to_target_with_startup"],
                    rb["seconds_to_target_with_startup"],
                    inverse=True,
                ),
            }
    if ratios:
        say("\nratios (time to target: the other arm's time over the first's, > 1 = faster):")
        say(
            table(
                [[k, *(_fmt(v[c], ".2f", "n/a") for c in v)] for k, v in ratios.items()],
                ["ratio", "samples/s", "tokens/s", "time to target", "incl. start-up"],
            )
        )
    goals: dict[str, dict] = {}
    for key, ratio, field, bound in [
        ("laminar >= 1.5x TRL samples/s", "laminar/trl", "samples_per_second", 1.5),
        (
            "laminar reaches the target >= 1.3x sooner than TRL, incl. start-up",
            "laminar/trl",
            "time_to_target_with_startup",
            1.3,
        ),
        ("laminar >= 1.3x sync samples/s", "laminar/sync", "samples_per_second", 1.3),
        # samples/s also counts what a run learned (shorter responses: more samples per
        # second); tokens/s does not, so the same goal is read in both
        ("laminar >= 1.3x sync tokens/s", "laminar/sync", "tokens_per_second", 1.3),
    ]:
        got = ratios.get(ratio, {}).get(field)
        # met None: not measured (an arm of the ratio was not run, or never got that figure)
        met = None if got is None else got >= bound
        goals[key] = {"of": ratio, "ratio": got, "goal": bound, "met": met}
    if goals:
        say("\ngoals:")
        for k, g in goals.items():
            if g["met"] is None:
                say(f"  {k}: no {g['of']} ratio (an arm not run or without the figure)")
            else:
                say(f"  {k}: {g['ratio']:.2f}x -> {'met' if g['met'] else 'MISSED'}")
    return ratios, goals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--target", type=float, default=0.5, help="eval reward to reach")
    ap.add_argument(
        "--arm-cap", type=float, default=900.0, help="wall seconds per run, start-up included"
    )
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0", help="comma-separated; model and prompt order")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--preset", default="small", help="laminar tiny-model --preset")
    ap.add_argument(
        "--set", action="append", help="KEY=VALUE config override for every arm (repeatable)"
    )
    ap.add_argument("--work", default="runs/grpo_vs_trl", help="models, run dirs, logs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--cb", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        trl_worker(a)
        return
    # SIGTERM unwinds like Ctrl-C, so the running arm is stopped too (run_arm's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    arms = [x for x in a.arms.split(",") if x]
    if unknown := set(arms) - set(ARMS) - set(OPTIONAL_ARMS):
        sys.exit(f"--arms: unknown {sorted(unknown)}; known: {', '.join(ARMS + OPTIONAL_ARMS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    a.config = str(Path(a.config).resolve())
    from laminar_core import ConfigError

    try:  # a bad config or override fails here, before any arm starts
        cfg = _resolved(a.config, "/nonexistent", seeds[0], a.set or []).cfg
    except ConfigError as e:
        sys.exit(f"--config / --set: {e}")
    if not cfg.run.eval_every:
        sys.exit(
            "the comparison is on eval_reward: the config needs run.eval_every (and data.eval_*)"
        )
    if {"trl", "trl_cb"} & set(arms):
        try:
            import trl
        except ImportError:
            sys.exit(
                f"the TRL arm needs TRL: pip install trl=={TRL_VERSION} "
                "(or leave it out: --arms sync,laminar)"
            )
        say(f"TRL {trl.__version__}")
    t_all = time.monotonic()
    work = (ROOT / a.work).resolve() / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    say(
        f"work dir {work}; config {a.config} ({a.preset} model); {a.max_steps} steps max, "
        f"{a.arm_cap:.0f} s cap per run, target eval_reward {a.target}, seeds {seeds}"
    )
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:
        model_dir = work / f"model-s{seed}"
        subprocess.run(
            [*_cli(), "tiny-model", str(model_dir), "--seed", str(seed), "--preset", a.preset],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        for arm in arms:
            if arm in NOT_RUNNABLE:
                continue
            # each run gets its own copy of the same (seeded) model directory
            arm_model = work / f"model-{arm.replace(':', '')}-s{seed}"
            shutil.copytree(model_dir, arm_model)
            say(f"  {arm} seed {seed} ...")
            res = run_arm(arm, seed, arm_model, work, a)
            runs[arm].append(summarise(res, a.target))
            say(f"  {arm} seed {seed}: {json.dumps(runs[arm][-1])}")
    summary = {arm: aggregate(arm, runs[arm]) for arm in arms}
    say()
    ratios, goals = report(summary, a.target)
    wall = time.monotonic() - t_all
    say(f"\nbenchmark wall time {wall:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "arms": list(summary.values()),
                    "ratios": ratios,
                    "goals": goals,
                    "wall_seconds": round(wall, 1),
                    "settings": {
                        "config": a.config,
                        "preset": a.preset,
                        "overrides": a.set or [],
                        "max_steps": a.max_steps,
                        "target": a.target,
                        "warmup": WARMUP,
                        "arm_cap_seconds": a.arm_cap,
                        "seeds": seeds,
                        "eval_every": cfg.run.eval_every,
                        "eval_size": cfg.data.eval_size,
                        "prompts_per_step": cfg.data.prompts_per_step,
                        "samples_per_prompt": cfg.data.samples_per_prompt,
                        "max_tokens": cfg.rollout.max_tokens,
                    },
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
