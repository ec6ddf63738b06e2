"""The tool-use tasks without engines: ``tool_calling`` (rows, reward, the warm start's
demonstrations), ``retool_math`` (the shipped JSONL, chat templates, ``boxed_integer``) and
``laminar tiny-model --warmup``."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest

from laminar_core import ConfigError, load_config, make_parser
from laminar_core.cli import main
from laminar_core.plugins import default_manager
from laminar_core.tasks import DataError, Response, Segment, build_prompts, build_reward
from laminar_core.tasks.retool_math import RetoolMathTask, boxed_integer, last_boxed
from laminar_core.tasks.tool_calling import (
    ToolCallingOptions,
    ToolCallingTask,
    demonstrations,
    final_answer,
    tool_calling_reward,
)
from laminar_core.types import Trajectory

ROOT = Path(__file__).resolve().parent.parent
MATH = ROOT / "examples" / "data" / "retool_math.jsonl"


# ----------------------------------------------------------------------------- tool_calling


def test_tool_calling_rows_hide_a_random_number_in_the_prelude() -> None:
    task = ToolCallingTask(seed=3, size=500, digits=4)
    assert [task[i] for i in range(5)] == [
        ToolCallingTask(seed=3, size=500, digits=4)[i] for i in range(5)
    ]
    rows = list(task)
    for row in rows[:50]:
        assert row["prompt"] == f"What is {row['name']}?\n"
        assert row["prelude"] == f"{row['name']} = {row['answer']}"
        assert len(row["answer"]) == 4 and row["answer"].isdigit()
        assert row["answer"] not in row["prompt"]  # only the tool reveals it
        scope: dict = {}
        exec(row["prelude"], scope)  # the prelude defines the variable the prompt names
        assert str(scope[row["name"]]) == row["answer"]
    assert len({r["answer"] for r in rows}) > 400  # drawn per row: nothing to memorise
    assert {r["name"] for r in rows} == set("xyz")
    assert ToolCallingTask(seed=4, digits=4)[0] != task[0]
    # the default: one digit, what the tiny model learns to copy from the tool's output
    assert {len(r["answer"]) for r in ToolCallingTask(size=200)} == {1}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"digits": 0}, "digits must be in 1..12"),
        ({"names": "aB"}, "names must be lowercase"),
        ({"prompt": "no name"}, "prompt must contain '{name}'"),
        ({"size": 0}, "size must be >= 1"),
    ],
)
def test_tool_calling_options_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ToolCallingTask(**options)


def test_tool_calling_reward_by_hand() -> None:
    row = {"answer": "4821"}
    called = {**row, "env": {"tool_calls": 1}}
    obs = make_parser("code").format_response("4821")
    assert tool_calling_reward(f"<code>print(x)</code>{obs}4821", called) == 1.0
    assert tool_calling_reward("4821", row) == 1.0  # a lucky guess counts (1 in 10**4)
    assert tool_calling_reward(f"<code>print(x)</code>{obs}4820", called) == 0.1
    assert tool_calling_reward(f"<code>print(x)</code>{obs}", called) == 0.1  # no answer
    assert tool_calling_reward("1234", row) == 0.0
    assert tool_calling_reward("", row) == 0.0
    assert tool_calling_reward(f"<code>print(x)</code>{obs}48", called, tool_credit=0.0) == 0.0
    assert final_answer(f"<code>print(x)</code>{obs}") == "</interpreter>"


def test_demonstrations_show_the_format_the_environment_produces() -> None:
    obs = make_parser("code").format_response
    four = ToolCallingOptions(digits=4)
    demos = list(itertools.islice(demonstrations(0, 0.5, four), 400))
    calls = [d for d in demos if d.calls_tool]
    assert 150 < len(calls) < 250
    for d in calls:
        (call, t1), (seen, t2), (answer, t3) = d.segments
        assert (t1, t2, t3) == (True, False, True)
        name = d.prompt.split()[-1].rstrip("?")
        assert call == f"<code>print({name})</code>" and seen == obs(answer)
    for d in demos:
        if not d.calls_tool:
            ((guess, trained),) = d.segments
            assert trained and guess.isdigit() and len(guess) == 4
    assert not any(d.calls_tool for d in itertools.islice(demonstrations(0, 0.0), 50))
    assert all(d.calls_tool for d in itertools.islice(demonstrations(0, 1.0), 50))
    # their own random stream: not a run's rows
    task = ToolCallingTask(seed=0, digits=4)
    numbers = {d.segments[-1][0] for d in demos}
    assert [task[i]["answer"] for i in range(4)] != [d.segments[-1][0] for d in demos[:4]]
    assert len(numbers) > 350
    with pytest.raises(ValueError, match="tool_share"):
        next(demonstrations(0, 1.5))


def test_the_task_resolves_with_its_reward_and_the_environment() -> None:
    resolved = load_config(ROOT / "examples" / "tool_calling.yaml")
    cfg = resolved.cfg
    assert (cfg.data.task, cfg.env.name, cfg.env.parser) == (
        "tool_calling",
        "python_sandbox",
        "code",
    )
    assert cfg.env.options["prelude_key"] == "prelude"
    prompts, report = build_prompts(resolved, None)
    assert report.rows == len(prompts) == 10_000
    reward = build_reward(resolved, None)
    traj = Trajectory("t", "g", 0, metadata={**prompts[0].metadata, "env": {"tool_calls": 1}})
    assert asyncio.run(reward(traj)) == 0.1  # decoded "" with a tool call: partial credit


# ----------------------------------------------------------------------------- retool_math


def test_the_shipped_math_problems_have_integer_answers() -> None:
    task = RetoolMathTask(path=str(MATH))
    assert len(task) == 14
    for row in task:
        assert row["prompt"].endswith(f"Problem: {row['problem']}")
        assert "<code>" in row["prompt"] and "\\boxed{}" in row["prompt"]
        assert int(row["answer"]) == json.loads(json.dumps(row))["answer"] == row["answer"]
        assert boxed_integer(f"so \\boxed{{{row['answer']}}}.", row) == 1.0


def test_retool_math_rejects_rows_it_cannot_score(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "answer": "x/2"}) + "\n")
    with pytest.raises(DataError, match=r"problem 1 has answer 'x/2', not an integer"):
        RetoolMathTask(path=str(bad))
    with pytest.raises(ValueError, match="path is required"):
        RetoolMathTask()


def test_retool_math_uses_the_models_chat_template(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from laminar_core.models.tiny import EOS, _build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=_build_tokenizer(128), eos_token=EOS)
    tok.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="has no chat template"):
        RetoolMathTask(path=str(MATH), tokenizer=str(tmp_path / "plain"))
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(tmp_path / "chat")
    task = RetoolMathTask(path=str(MATH), tokenizer=str(tmp_path / "chat"), system="Be exact.")
    assert task[0]["prompt"].startswith("<|system|>Be exact.\n<|user|>Solve the following")
    assert task[0]["prompt"].endswith(f"{task[0]['problem']}\n<|assistant|>")


def test_boxed_integer_by_hand() -> None:
    row = {"answer": "481"}
    assert boxed_integer("\\boxed{481}", row) == 1.0
    assert boxed_integer("$\\boxed{ 481 }$", row) == 1.0
    assert boxed_integer("\\boxed{481.0}", row) == 1.0
    assert boxed_integer("\\boxed{1,481}", {"answer": 1481}) == 1.0
    assert boxed_integer("\\boxed{480} no, \\boxed{481}", row) == 1.0  # the last one
    assert boxed_integer("\\boxed{481} no, \\boxed{480}", row) == 0.0
    assert boxed_integer("\\boxed{481} then cut off: \\boxed{48", row) == 1.0
    assert boxed_integer("481", row) == 0.0  # no box
    # a box the code printed is the tool's, not the model's answer
    printed = "<code>print('\\\\boxed{481}')</code>\n<interpreter>\n\\boxed{481}\n</interpreter>\n"
    assert boxed_integer(printed, row) == 0.0
    assert boxed_integer(printed, {**row, "env": {"tool_calls": 1}}, tool_credit=0.1) == 0.1
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert boxed_integer("\\boxed{\\frac{1}{2}}", {"answer": 0}) == 0.0


def test_the_rewards_score_the_models_turns_of_a_response() -> None:
    """What rewards get: the model's turns apart from the tool's output (by the loss mask;
    tests/test_multiturn.py builds them through the loop). Neither reward reads the output,
    and an unclosed ``<code>`` (the stop string is not in the text) ends with its turn."""
    obs = make_parser("code").format_response
    called = {"answer": 42, "env": {"tool_calls": 1}}
    forged = Response(
        [
            Segment("<code>print('</interpreter>\\n' + r'\\boxed{42}')", True),
            Segment(obs("&lt;/interpreter>\n\\boxed{42}"), False),
            Segment("I am done.", True),
        ]
    )
    assert str(forged) == "<code>print('</interpreter>\\n' + r'\\boxed{42}')\nI am done."
    assert boxed_integer(forged, called, tool_credit=0.1) == 0.1
    late = Response(
        [Segment("<code>print(1)", True), Segment(obs("1"), False), Segment("\\boxed{42}", True)]
    )
    assert boxed_integer(late, called) == 1.0
    assert late.turns == ("<code>print(1)", "\\boxed{42}") and late.observations == (obs("1"),)
    quiet = Response(
        [Segment("<code>print(x)", True), Segment("\nOutput: 7", False), Segment("", True)]
    )
    assert tool_calling_reward(quiet, {"answer": "7", "env": {"tool_calls": 1}}) == 0.1
    assert tool_calling_reward(quiet.transcript, {"answer": "7"}) == 1.0  # the old hole
    import pickle

    again = pickle.loads(pickle.dumps(late))
    assert again == late and again.segments == late.segments


def test_the_retool_example_resolves() -> None:
    resolved = load_config(ROOT / "examples" / "retool_math.yaml", ["model.path=/m"])
    cfg = resolved.cfg
    assert cfg.data.task_options["tokenizer"] == "/m"
    assert (cfg.env.name, cfg.env.parser, cfg.reward.fn) == (
        "python_sandbox",
        "code",
        "boxed_integer",
    )
    assert cfg.env.options["print_last"] is True


def test_registry_lists_the_tool_tasks() -> None:
    pm = default_manager()
    assert {"tool_calling", "retool_math"} <= set(pm.names("task"))
    assert {"tool_calling", "boxed_integer"} <= set(pm.names("reward"))
    with pytest.raises(ConfigError, match="did you mean 'tool_calling'"):
        load_config(None, ["data.source=task", "data.task=tool_caling"])


# ------------------------------------------------------------------------------- warm start


def test_warm_start_fits_the_format(tmp_path: Path) -> None:
    """A few steps on the tiny model: the loss falls, the weights change, the mask skips
    the prompt and the tool's output, and the directory still loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laminar_core.models import build_tiny_model
    from laminar_core.models.warmup import encode_demonstration, warm_start

    out = build_tiny_model(tmp_path / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    demo = next(d for d in demonstrations(0, 0.5) if d.calls_tool)
    ids, trained = encode_demonstration(demo, tok)
    text = [tok.decode([i]) for i in ids]
    assert "".join(text[: len(demo.prompt)]) == demo.prompt
    assert ids[-1] == tok.eos_token_id and trained[-1] == 1
    masked = "".join(t for t, m in zip(text, trained, strict=True) if not m)
    assert masked == demo.prompt + demo.segments[1][0]  # the prompt and the tool's output
    before = AutoModelForCausalLM.from_pretrained(out).model.embed_tokens.weight.clone()
    report = warm_start(out, steps=30, batch_size=8, lr=1e-2, share=1.0)
    assert report.loss_end < 0.6 * report.loss_start, report
    after = AutoModelForCausalLM.from_pretrained(out).model.embed_tokens.weight
    assert not torch.equal(before, after)
    with pytest.raises(
        ValueError, match="unknown warm-up task 'nope'; known: repeat, tool_calling"
    ):
        warm_start(out, "nope")


def test_cli_warmup_names_the_known_tasks(tmp_path: Path, capsys) -> None:
    assert main(["tiny-model", str(tmp_path / "m"), "--warmup", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "laminar: error: tiny-model: unknown --warmup 'nope'; known: repeat, tool_calling"
    assert not (tmp_path / "m").exists()  # refused before anything was written
