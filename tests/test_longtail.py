"""The long-tail workload: the ``longtail`` task, repeat's held-out split, the ``small``
model preset, and ``examples/longtail.yaml`` (what ``benchmarks/grpo_vs_trl.py`` runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar_core import ConfigError, load_config
from laminar_core.loop.evaluation import build_eval_prompts
from laminar_core.models import build_tiny_model
from laminar_core.models.tiny import PRESETS
from laminar_core.tasks import LongTailTask, RepeatTask, build_prompts, held_out

ROOT = Path(__file__).resolve().parents[1]


def _percentile(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_longtail_target_lengths_are_long_tailed():
    task = LongTailTask()
    lengths = [task[i]["count"] + 1 for i in range(len(task))]  # + end-of-sequence
    assert _percentile(lengths, 0.99) / _percentile(lengths, 0.50) >= 8
    assert max(lengths) >= 257
    assert min(lengths) <= 3
    row = task[0]
    assert row["answer"] == row["letter"] * row["count"] and row["task"] == "longtail"


def test_longtail_eval_split_holds_out_one_letter_per_count():
    train = LongTailTask(size=5000)
    held = LongTailTask(size=2000, seed=7, split="eval")
    train_pairs = {(r["letter"], r["count"]) for r in train}
    held_pairs = {(r["letter"], r["count"]) for r in held}
    assert not train_pairs & held_pairs
    # every count and every letter is trained on; each count has one held-out letter
    counts = LongTailTask().options.counts
    assert {c for _, c in train_pairs} == {c for _, c in held_pairs} == set(counts)
    assert {letter for letter, _ in train_pairs} == set("abc")
    assert len(held_pairs) == len(counts)
    # and both splits have the same length distribution
    t = sorted(r["count"] for r in train)
    h = sorted(r["count"] for r in held)
    assert _percentile(t, 0.5) == _percentile(h, 0.5)
    assert LongTailTask(seed=3)[5] == LongTailTask(seed=3)[5]


def test_repeat_holdout_splits_pairs_by_a_seedless_hash():
    train = RepeatTask(size=3000, holdout=0.2)
    held = RepeatTask(size=300, seed=9, holdout=0.2, split="eval")
    pairs = {(r["letter"], r["count"]) for r in held}
    assert pairs and not pairs & {(r["letter"], r["count"]) for r in train}
    assert all(held_out(letter, count, 0.2) for letter, count in pairs)


def test_repeat_without_a_holdout_is_unchanged():
    task = RepeatTask()
    assert task[0]["prompt"] == "b*6=" and task[1]["prompt"] == "a*1="
    assert [task[i] for i in range(50)] == [RepeatTask(holdout=0.0)[i] for i in range(50)]


@pytest.mark.parametrize(
    "task, options, words",
    [
        ("repeat", "{split: eval}", "holdout > 0"),
        ("repeat", "{holdout: 1.5}", "holdout must be in"),
        ("longtail", "{split: test}", "split must be"),
        ("longtail", "{counts: [2, 4]}", "as long as each other"),
    ],
)
def test_bad_task_options_are_config_errors(task, options, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["data.source=task", f"data.task={task}", f"data.task_options={options}"])


def test_small_preset_is_a_few_million_parameters_with_vllm_cpu_heads(tmp_path):
    out = build_tiny_model(tmp_path / "small", preset="small")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM's CPU attention
    from safetensors.torch import load_file

    params = sum(t.numel() for t in load_file(out / "model.safetensors").values())
    assert 2_500_000 < params < 5_000_000
    assert PRESETS["tiny"]["hidden_size"] == 128  # the quickstart's model is unchanged


def test_example_resolves_with_a_held_out_eval_set():
    resolved = load_config(ROOT / "examples" / "longtail.yaml", ["model.path=/nonexistent"])
    cfg = resolved.cfg
    assert cfg.data.task == "longtail" and cfg.run.eval_every > 0
    assert cfg.rollout.max_tokens >= 257  # the longest target fits
    train, _ = build_prompts(resolved, None)
    held = build_eval_prompts(resolved, None, train)
    assert len(held) == cfg.data.eval_size
    assert not {p.metadata["prompt"] for p in train} & {p.metadata["prompt"] for p in held}
