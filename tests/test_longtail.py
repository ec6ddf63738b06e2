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


def test_held_out_pairs_never_reach_training_rows():
    train = LongTailTask(size=5000)
    held = LongTailTask(size=500, seed=7, split="eval")
    train_pairs = {(r["letter"], r["count"]) for r in train}
    held_pairs = {(r["letter"], r["count"]) for r in held}
    assert not train_pairs & held_pairs
    assert all(held_out(letter, count, 0.1) for letter, count in held_pairs)
    # about the held-out share of the pairs training can draw from: no seed in the split
    assert 0.03 < len(held_pairs) / (len(train_pairs) + len(held_pairs)) < 0.3
    assert LongTailTask(seed=3)[5] == LongTailTask(seed=3)[5]


def test_repeat_without_a_holdout_is_unchanged():
    task = RepeatTask()
    assert task[0]["prompt"] == "b*6=" and task[1]["prompt"] == "a*1="
    assert [task[i] for i in range(50)] == [RepeatTask(holdout=0.0)[i] for i in range(50)]


@pytest.mark.parametrize(
    "options, words",
    [
        ("{split: eval}", "holdout > 0"),
        ("{holdout: 1.5}", "holdout must be in"),
        ("{split: test}", "split must be"),
    ],
)
def test_bad_split_options_are_config_errors(options, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["data.source=task", "data.task=repeat", f"data.task_options={options}"])


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
