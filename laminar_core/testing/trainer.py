"""The ``TrainerEngine`` contract, against transformers on the same weights.

:func:`check_trainer_engine` drives an engine (one rank, or every rank of a multi-rank group
in spawned processes over gloo) through a short life on a local Hugging Face model and a
fixed GRPO batch, and checks what the rest of Laminar relies on:

- **log-probs**: ``compute_logprobs`` equals a transformers forward on the same weights
  (``log_softmax(logits / rollout.temperature)``), before and after a step;
- **export**: ``export_weights()`` (a sync or an async iterator; every rank iterates it)
  yields exactly the checkpoint's tensor names and shapes, equal to its values before any
  step; after a step the exported tensors load into ``AutoModelForCausalLM`` (no unexpected
  keys; a missing key only where transformers ties it to a loaded one), differ from the
  initial ones, and give the engine's own log-probs;
- **checkpoints**: ``save_checkpoint`` after a step, another step, ``load_checkpoint``: the
  log-probs are those from before that step, and re-running the step reproduces its
  metrics and exported weights (optimizer and scheduler state restored);
- **metrics**: ``train_step`` returns finite ``loss``, ``pg_loss``, ``grad_norm``, ``lr``
  and ``trained_trajectories`` (the batch's one failed trajectory left out).

Use it from pytest::

    def test_contract(tmp_path):
        asyncio.run(check_trainer_engine("my_engine", model_dir, tmp_path, world_size=2,
                                         overrides=["trainer.my_engine.tp=2"]))
"""

from __future__ import annotations

import asyncio
import math
import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laminar_core.interfaces import BuildContext, TrainerContext, TrainerEngine, build
from laminar_core.net import free_port
from laminar_core.types import FinishReason, Group, TrainBatch, Trajectory

__all__ = ["REQUIRED_METRICS", "check_trainer_engine", "contract_batch"]

EngineFactory = Callable[[int, int], TrainerEngine]
REQUIRED_METRICS = ("loss", "pg_loss", "grad_norm", "lr", "trained_trajectories")


def contract_batch(vocab: int, version: int = 0, seed: int = 0) -> TrainBatch:
    """Three GRPO groups of four trajectories (prompts of 3-6 tokens, responses of 1-12,
    rewards 0..3) plus one failed trajectory that a trainer must leave out. Behaviour
    log-probs are a uniform policy's, so PPO ratios start near 1."""
    rng = random.Random(seed)
    uniform = -math.log(vocab)
    groups = []
    for g in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        trajs = []
        for j in range(4):
            n = rng.randint(1, 12)
            trajs.append(
                Trajectory(
                    f"g{g}-{j}",
                    f"g{g}",
                    version,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[uniform] * n,
                    num_prompt_tokens=len(prompt),
                    num_response_tokens=n,
                    finish_reason=FinishReason.STOP,
                    reward=float(j),
                )
            )
        groups.append(Group(f"g{g}", g, trajs))
    groups[0].trajectories.append(
        Trajectory(
            "g0-failed",
            "g0",
            version,
            prompt_ids=[3],
            response_ids=[4],
            logprobs=[uniform],
            finish_reason=FinishReason.FAILED,
            error="reward: boom",
        )
    )
    return TrainBatch(0, groups)


async def check_trainer_engine(
    engine: str | EngineFactory,
    model_dir: str | Path,
    workdir: str | Path,
    *,
    world_size: int = 1,
    overrides: Sequence[str] = (),
    spawn: bool | None = None,
    tolerance: float = 1e-4,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run the trainer contract; raise ``AssertionError`` naming the broken rule.

    ``engine``: a registered trainer engine name (built as the runtime builds it, from a
    config with ``trainer.engine=<name>`` plus ``overrides``, e.g. its ``trainer.<name>.*``
    options), or a factory ``(rank, world_size) -> TrainerEngine`` (picklable, i.e. a
    module-level function or a ``functools.partial`` of one, when processes are spawned).
    ``model_dir``: a float32 Hugging Face model directory (safetensors), e.g. from
    ``laminar_core.models.build_tiny_model``. ``workdir``: an empty directory for the
    checkpoint. ``world_size`` ranks run as spawned processes (``spawn`` defaults to
    ``world_size > 1``; ``spawn=True`` with one rank keeps the engine's process-wide state
    out of the caller's process) meeting over a gloo rendezvous on 127.0.0.1; the engine
    sets up its own process group from ``TrainerContext.options["init_method"]``.
    ``tolerance``: the largest absolute log-prob / weight difference accepted (float32).

    ``compute_logprobs`` may fill only the trajectories a rank owns (empty lists for the
    rest), as the runtime merges ranks: the check merges them the same way.

    Returns the figures: each check's largest difference, rank 0's first-step metrics, and
    the engine's (merged) log-probs on :func:`contract_batch` before and after that step
    (so engines, or layouts of one engine, can be compared with each other).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    spec = _Spec(engine, str(model_dir), str(workdir), tuple(overrides), tolerance)
    init = f"tcp://127.0.0.1:{free_port()}"
    if not (world_size > 1 if spawn is None else spawn):
        ranks = [await _rank_body(spec, 0, 1, init)]
    else:
        ranks = await asyncio.to_thread(_spawn, spec, world_size, init, timeout_s)
    return _judge(ranks, tolerance)


def _merge(ranks: list[dict[str, Any]], key: str) -> list[list[float]]:
    """Per trajectory, the first rank's non-empty log-probs (what the runtime does)."""
    n = len(ranks[0][key])
    assert all(len(r[key]) == n for r in ranks), f"{key}: ranks return different lengths"
    return [next((r[key][i] for r in ranks if r[key][i]), []) for i in range(n)]


def _judge(ranks: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """The log-prob checks, on the ranks' merged answers."""
    first = ranks[0]
    report = dict(first["report"])
    lp0, lp1 = _merge(ranks, "lp0"), _merge(ranks, "lp1")
    loaded = _merge(ranks, "lp_loaded")
    report["logprobs_hf_max_diff"] = d = _max_diff(lp0, first["ref0"], "logprobs")
    assert d <= tol, f"compute_logprobs differs from transformers by {d:.3g} (> {tol})"
    report["logprobs_after_step_hf_max_diff"] = d = _max_diff(
        lp1, first["ref1"], "logprobs after a step"
    )
    assert d <= tol, (
        f"transformers on the exported weights differs from the engine's log-probs by "
        f"{d:.3g}: export_weights does not publish the weights the engine holds"
    )
    report["checkpoint_logprob_max_diff"] = d = _max_diff(loaded, lp1, "checkpoint")
    assert d <= tol, f"after load_checkpoint the log-probs differ by {d:.3g}"
    report.update(metrics=first["metrics"], logprobs=lp0, logprobs_after_step=lp1)
    return report


@dataclass(frozen=True)
class _Spec:
    """What every rank needs (picklable)."""

    engine: str | EngineFactory
    model_dir: str
    workdir: str
    overrides: tuple[str, ...]
    tolerance: float


def _spawn(spec: _Spec, world: int, init: str, timeout_s: float) -> list[dict[str, Any]]:
    import queue
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_process, args=(spec, r, world, init, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world and not any(not ok for ok, _ in got.values()):
            try:
                rank, ok, value = results.get(timeout=1.0)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            # a rank that died without a word (killed, crashed in C++) fails the check now
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            if dead:
                try:  # its result may still be in the pipe
                    rank, ok, value = results.get(timeout=5.0)
                    got[rank] = (ok, value)
                    continue
                except queue.Empty:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise AssertionError(
                        f"trainer contract: ranks exited without a result (exit codes {codes})"
                    ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(got))
                raise AssertionError(
                    f"trainer contract: ranks {missing} gave no result within {timeout_s:.0f} s"
                )
    finally:
        for p in procs:  # after a failure the others may wait on a collective with it
            p.join(timeout=5 if len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in sorted(got):
        ok, value = got[rank]
        if not ok:
            raise AssertionError(f"trainer contract, rank {rank}: {value}")
    return [got[r][1] for r in range(world)]


def _rank_process(spec: _Spec, rank: int, world: int, init: str, results: Any) -> None:
    try:
        results.put((rank, True, asyncio.run(_rank_body(spec, rank, world, init))))
    except AssertionError as e:
        results.put((rank, False, str(e) or traceback.format_exc()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _config(spec: _Spec) -> Any:
    from laminar_core.runtime.resolve import load_config

    base = [
        f"model.path={spec.model_dir}",
        "model.dtype=float32",
        "rollout.temperature=0.7",
        "run.steps=4",
        "trainer.mini_batches=2",
    ]
    if isinstance(spec.engine, str):
        base.append(f"trainer.engine={spec.engine}")
    return load_config(None, [*base, *spec.overrides])


def _make(spec: _Spec, rank: int, world: int) -> tuple[TrainerEngine, Any, Any]:
    resolved = _config(spec)
    cfg = resolved.cfg
    options = resolved.engine_options.get("trainer")
    if isinstance(spec.engine, str):
        from laminar_core.plugins import default_manager

        factory = default_manager().get("trainer", spec.engine)
        eng = build(factory, BuildContext(cfg, options, rank, "trainer", 1, {}))
    else:
        eng = spec.engine(rank, world)
    return eng, cfg, options


async def _export(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """Every exported tensor (a copy), from a sync or an async iterator."""
    it = engine.export_weights()
    out: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        assert name not in out, f"export_weights yielded {name!r} twice"
        out[name] = tensor.detach().to("cpu").clone()

    if hasattr(it, "__aiter__"):
        async for name, tensor in it:
            keep(name, tensor)
    else:
        for name, tensor in it:
            keep(name, tensor)
    return out


def _max_diff(a: list[list[float]], b: list[list[float]], what: str) -> float:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} trajectories"
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert len(x) == len(y), f"{what}: trajectory {i} has {len(x)} vs {len(y)} log-probs"
        for u, v in zip(x, y, strict=True):
            worst = max(worst, abs(u - v))
    return worst


def _weights_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> float:
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    worst = 0.0
    for k in a:
        assert a[k].shape == b[k].shape, f"{what}: {k} {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst


class _Reference:
    """transformers on the model's weights: the log-probs an engine must reproduce."""

    def __init__(self, model_dir: str, temperature: float) -> None:
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.temperature = temperature or 1.0
        self.saved: dict[str, torch.Tensor] = {}
        files = sorted(Path(model_dir).glob("*.safetensors"))
        assert files, f"{model_dir}: the contract needs a safetensors checkpoint"
        for f in files:
            with safe_open(str(f), "pt") as st:
                names = st.keys()
                for k in names:
                    self.saved[k] = st.get_tensor(k)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Load exported tensors; transformers' own tying is the only allowed gap."""
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected, f"exported names transformers does not know: {unexpected[:5]}"
        loaded = {p.data_ptr() for k, p in self.model.state_dict().items() if k in weights}
        untied = [k for k in missing if self.model.state_dict()[k].data_ptr() not in loaded]
        assert not untied, f"export_weights left these model tensors unset: {untied[:5]}"

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        out = []
        for t in batch.trajectories:
            if t.finish_reason is FinishReason.FAILED or not t.response_ids:
                out.append([])
                continue
            ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
            logits = self.model(input_ids=ids).logits[0, :-1].float() / self.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            p = len(t.prompt_ids)
            out.append(lp[p - 1 :].tolist())
        return out


async def _rank_body(spec: _Spec, rank: int, world: int, init: str) -> dict[str, Any]:
    """One rank's life. Weight checks run here (rank 0 holds the published tensors); the
    log-probs go back to the caller, which merges the ranks' answers (:func:`_judge`)."""
    tol = spec.tolerance
    eng, cfg, options = _make(spec, rank, world)
    batch = contract_batch(_vocab(spec.model_dir))
    ctx = TrainerContext(
        rank, world, options, cfg.algorithm, {"init_method": init, "seed": cfg.run.seed}
    )
    ckpt = str(Path(spec.workdir) / "checkpoint")
    out: dict[str, Any] = {"report": {}}
    report = out["report"]
    await eng.setup(ctx)
    try:
        ref = _Reference(spec.model_dir, float(cfg.rollout.temperature)) if rank == 0 else None
        # 1. export before any step: the checkpoint's names, shapes and values
        w0 = await _export(eng)
        if ref is not None:
            report["export_initial_max_diff"] = d = _weights_diff(w0, ref.saved, "export (start)")
            assert d <= tol, f"exported weights differ from the checkpoint's by {d:.3g}"
            out["ref0"] = ref.logprobs(batch)
        out["lp0"] = await eng.compute_logprobs(batch)
        # 2. a step: metrics, the exported weights after it (they load into transformers)
        m1 = await eng.train_step(batch)
        for k in REQUIRED_METRICS:
            assert k in m1 and math.isfinite(m1[k]), f"train_step metrics lack a finite {k!r}"
        trained = sum(1 for t in batch.trajectories if t.finish_reason is not FinishReason.FAILED)
        assert m1["trained_trajectories"] == trained, "a failed trajectory was trained on"
        assert m1["grad_norm"] > 0, "train_step computed no gradient"
        out["metrics"] = m1
        w1 = await _export(eng)
        if ref is not None:
            _weights_diff(w1, w0, "export (after a step)")
            assert any(not torch.equal(w1[k], w0[k]) for k in w1), (
                "train_step did not change any exported tensor"
            )
            ref.load(w1)
            out["ref1"] = ref.logprobs(batch)
        out["lp1"] = await eng.compute_logprobs(batch)
        # 3. checkpoint: save, step, load (-> the log-probs from before that step); the
        #    step re-run from the checkpoint reproduces its metrics and weights
        await eng.save_checkpoint(ckpt)
        m2 = await eng.train_step(batch)
        w2 = await _export(eng)
        await eng.load_checkpoint(ckpt)
        out["lp_loaded"] = await eng.compute_logprobs(batch)
        m2_again = await eng.train_step(batch)
        w2_again = await _export(eng)
        report["resumed_step_max_diff"] = d = _weights_diff(w2_again, w2, "resumed step")
        assert d <= tol, (
            f"the step re-run from the checkpoint gives weights {d:.3g} away: optimizer or "
            f"scheduler state was not restored"
        )
        for k in ("loss", "grad_norm", "lr"):
            assert abs(m2_again[k] - m2[k]) <= tol * max(1.0, abs(m2[k])), (
                f"re-run step's {k} is {m2_again[k]} (first run {m2[k]})"
            )
    finally:
        await eng.close()
    return out


def _vocab(model_dir: str) -> int:
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])
