"""On-policy distillation (``algorithm.teacher`` / ``algorithm.distill_coef``): the per-token
advantage against a plain reference, the trainer's use of the teacher's log-probs, and the
config-time errors (one line each). The end-to-end run (a tiny student distilled from a tiny
teacher, real vLLM + FSDP on CPU) is ``tests/test_distill_run.py``; the figures are
``benchmarks/distill.py``'s."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from laminar_core import load_config
from laminar_core.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    distill_advantages,
    reverse_kl,
)
from laminar_core.config.loader import ConfigError
from laminar_core.config.schema import TeacherConfig
from laminar_core.models import build_tiny_model
from laminar_core.testing import contract_batch
from laminar_core.training import BatchLayout, TrainStep


def _reference(adv, student, teacher, mask, coef):
    """Token by token, as the formula reads: A_t = A + coef * (teacher_t - student_t)."""
    rows = []
    for b in range(len(student)):
        a = adv[b]
        row = []
        for t in range(len(student[b])):
            at = a[t] if isinstance(a, list) else a
            kl = (student[b][t] - teacher[b][t]) if mask[b][t] else 0.0
            row.append(at - coef * kl)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("coef", [0.0, 0.5, 2.0])
def test_distill_advantages_match_the_plain_reference(per_token, coef):
    rng = random.Random(7)
    B, T = 4, 6
    student = [[rng.uniform(-5, 0) for _ in range(T)] for _ in range(B)]
    teacher = [[rng.uniform(-5, 0) for _ in range(T)] for _ in range(B)]
    mask = [[int(rng.random() > 0.3) for _ in range(T)] for _ in range(B)]
    if per_token:
        adv = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    else:
        adv = [rng.uniform(-1, 1) for _ in range(B)]
    got = distill_advantages(
        torch.tensor(adv), torch.tensor(student), torch.tensor(teacher), torch.tensor(mask), coef
    )
    want = _reference(adv, student, teacher, mask, coef)
    assert got.shape == (B, T)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    kl = reverse_kl(torch.tensor(student), torch.tensor(teacher), torch.tensor(mask))
    assert float(kl[torch.tensor(mask) == 0].abs().sum()) == 0.0


def test_distill_advantages_refuse_bad_shapes_and_coefficients():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=">= 0"):
        distill_advantages(torch.zeros(2), x, x, x, -1.0)
    with pytest.raises(ValueError, match=r"\[B\] or \[B, T\]"):
        distill_advantages(torch.zeros(3), x, x, x, 1.0)
    with pytest.raises(ValueError, match="same"):
        distill_advantages(torch.zeros(2), x, torch.zeros(2, 4), x, 1.0)


def test_advantage_none_is_zero():
    r = torch.tensor([1.0, 0.0, 0.5])
    assert torch.equal(compute_advantages("none", r, torch.tensor([0, 0, 1])), torch.zeros(3))


def _step(coef: float, teacher: bool = True) -> tuple[TrainStep, list]:
    batch = contract_batch(32, 0, 0)
    rng = random.Random(0)
    for t in batch.trajectories:
        t.logprobs = [rng.uniform(-4.0, -3.0) for _ in t.response_ids]
        if teacher:
            t.teacher_logprobs = [rng.uniform(-4.0, -1.0) for _ in t.response_ids]
        t.reward = rng.random()
    algo = AlgorithmConfig(
        distill_coef=coef, teacher=TeacherConfig(model="teacher" if coef else "")
    )
    layout = BatchLayout(torch.device("cpu"), 0, token_budget=4096, packed=False)
    step = TrainStep(batch, algo, layout, mini_batches=1, max_len=64, held_version=0, recomputed={})
    return step, step.micro_batches(0)


def test_the_trainer_adds_the_teachers_reverse_kl_to_each_tokens_advantage():
    step, mbs = _step(0.5)
    for mb in mbs:
        trajs = [step.trajs[i] for i in mb.index]
        want = [
            [
                float(step.advantages[i]) + 0.5 * (t.teacher_logprobs[k] - t.logprobs[k])
                for k in range(len(t.response_ids))
            ]
            for i, t in zip(mb.index, trajs, strict=True)
        ]
        for row, w in zip(mb.advantages, want, strict=True):
            torch.testing.assert_close(row[: len(w)].double(), torch.tensor(w).double())
    # the loss reports the reverse KL it mixed in
    fn = step.loss_fn(0)
    for mb in mbs:
        fn(mb, mb.behaviour_logprobs.clone().requires_grad_(True))
    diffs = [s - t for tr in step.trajs for s, t in zip(tr.logprobs, tr.teacher_logprobs)]
    want_kl = sum(diffs) / len(diffs)  # token mean of student - teacher
    assert step.finish(1e-3)["distill_reverse_kl"] == pytest.approx(want_kl, abs=1e-5)
    # without distillation the advantages stay one per trajectory
    _, plain = _step(0.0)
    assert all(mb.advantages.dim() == 1 for mb in plain)


def test_a_trajectory_without_teacher_scores_is_a_clear_error():
    with pytest.raises(RuntimeError, match="teacher's log-probs"):
        _step(1.0, teacher=False)


# -- config-time errors ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    student = build_tiny_model(root / "student", seed=0)
    teacher = build_tiny_model(root / "teacher", seed=1)
    other = root / "other"  # the teacher, with a tokenizer that maps two ids the other way
    shutil.copytree(teacher, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    return Path(student), Path(teacher), other


REAL = ["trainer.engine=fsdp", "rollout.engine=vllm", "cluster.gpus=2", "cluster.trainer_gpus=1"]


def test_a_teacher_config_resolves_with_its_own_model_and_engine(models):
    student, teacher, _ = models
    r = load_config(
        None,
        [
            *REAL,
            f"model.path={student}",
            f"algorithm.teacher.model={teacher}",
            "algorithm.teacher.engine=sglang",
            "algorithm.teacher.replicas=2",
            "algorithm.distill_coef=1",
            "rollout.sglang={mem_fraction_static: 0.5}",
        ],
    )
    assert r.teacher is not None
    assert r.teacher.cfg.model.path == str(teacher)
    assert r.teacher.cfg.rollout.engine == "sglang"
    assert r.teacher.engine_options["rollout"].mem_fraction_static == 0.5
    assert r.teacher.teacher is None and r.teacher.cfg.trainer.lora.rank == 0
    assert load_config(None, [*REAL, f"model.path={student}"]).teacher is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["algorithm.distill_coef=1"], r"needs a teacher to distill from: set algorithm\.teacher"),
        (["algorithm.teacher.model=TEACHER"], r"distill_coef is 0, so its scores would not"),
        (["algorithm.advantage=none"], r"'none' learns nothing from the reward"),
        (["algorithm.distill_coef=-1", "algorithm.teacher.model=TEACHER"], r"must be >= 0"),
        (
            ["algorithm.distill_coef=1", "algorithm.teacher.model=TEACHER",
             "algorithm.teacher.engine=sim"],
            r"'sim' only models scoring time .*simulated student.*can score \(sglang, vllm\)",
        ),
        (
            ["algorithm.distill_coef=1", "algorithm.teacher.model=TEACHER",
             "algorithm.teacher.engine=vlm"],
            r"algorithm\.teacher\.engine: unknown rollout engine 'vlm'.*did you mean 'vllm'",
        ),
        (
            ["algorithm.distill_coef=1", "algorithm.teacher.model=OTHER"],
            r"has another tokenizer than the student",
        ),
        (
            ["algorithm.distill_coef=1", "algorithm.teacher.model=/nonexistent/teacher"],
            r"is not a Hugging Face model directory",
        ),
        (
            ["algorithm.distill_coef=1", "algorithm.teacher.model=TEACHER",
             "algorithm.teacher.replicas=0"],
            r"teacher\.replicas: must be >= 1",
        ),
    ],
)  # fmt: skip
def test_bad_distillation_settings_are_one_line_errors(models, extra, message):
    student, teacher, other = models
    extra = [x.replace("TEACHER", str(teacher)).replace("OTHER", str(other)) for x in extra]
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [*REAL, f"model.path={student}", *extra])
    assert "\n" not in str(err.value)


def test_a_teacher_engine_that_cannot_score_is_refused_naming_those_that_can():
    from laminar_core.plugins import PluginManager, builtins, hookimpl
    from laminar_core.sim.rollout import SimRolloutEngine

    class NoScore(SimRolloutEngine):
        scores_tokens = False

    class Plugin:
        @hookimpl
        def laminar_rollout_engines(self) -> dict[str, object]:
            return {"noscore": NoScore}

    pm = PluginManager()
    pm.register(builtins, name="core")
    pm.register(Plugin(), name="under-test")
    teacher = ["algorithm.distill_coef=1", "algorithm.teacher.model=t"]
    refused = r"'noscore' cannot score tokens .*can \(none installed\)"
    with pytest.raises(ConfigError, match=refused):
        load_config(None, [*teacher, "algorithm.teacher.engine=noscore"], pm=pm)
    # the simulator's teacher (scoring time only) serves a simulated student
    assert load_config(None, [*teacher, "algorithm.teacher.engine=sim"], pm=pm).teacher
