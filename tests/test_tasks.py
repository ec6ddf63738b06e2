"""Tasks and rewards: datasets (bad rows skipped and counted), the ``repeat`` task, reward
shaping, the async reward wrapper, the registry, config errors, and a run with a failing
reward that goes on."""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import threading
from pathlib import Path

import pytest

from laminar_core import ConfigError, load_config
from laminar_core.cli import main
from laminar_core.plugins import default_manager
from laminar_core.runtime.local import build_local_run
from laminar_core.tasks import (
    DataError,
    RepeatTask,
    RewardError,
    build_prompts,
    build_reward,
    contains,
    exact_match,
    read_jsonl,
    read_parquet,
    repeat_reward,
    wrap_reward,
)
from laminar_core.types import FinishReason, Trajectory

ROOT = Path(__file__).resolve().parent.parent


class CharTokenizer:
    """HF-style encode/decode, one id per character (enough for the contract)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def write_jsonl(path: Path, lines: list[str | bytes]) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


BAD_AND_GOOD = [
    json.dumps({"prompt": "2+2=", "answer": "4"}),
    "{not json",
    json.dumps({"question": "no prompt key"}),
    json.dumps({"prompt": 17}),
    json.dumps({"prompt": "   "}),
    "",  # blank lines are not rows
    json.dumps(["a", "list"]),
    b"\xff\xfe not utf-8",
    json.dumps({"prompt": "3+3=", "answer": "6"}),
]


# -------------------------------------------------------------------------- datasets


def test_jsonl_bad_rows_are_skipped_counted_and_named(tmp_path: Path, caplog) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", BAD_AND_GOOD)
    with caplog.at_level(logging.WARNING, logger="laminar.tasks"):
        rows, report = read_jsonl(path)
    assert [r["answer"] for r in rows] == ["4", "6"]
    assert report.rows == 2 and report.skipped == 6
    reasons = dict(report.reasons)
    assert reasons["missing prompt key 'prompt'"] == 1
    assert reasons["prompt 'prompt' is a int, not a string"] == 1
    assert reasons["empty prompt 'prompt'"] == 1
    assert reasons["row is a list, not an object"] == 1
    assert reasons["not UTF-8 text"] == 1
    assert sum(n for r, n in reasons.items() if r.startswith("invalid JSON")) == 1
    text = caplog.text
    assert f"{path}:2: skipped bad row: invalid JSON" in text
    assert f"{path}:3: skipped bad row: missing prompt key 'prompt'" in text
    assert "6 skipped" in report.summary()


def test_jsonl_prompt_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [json.dumps({"question": "hi", "answer": "x"})])
    rows, report = read_jsonl(path, prompt_key="question")
    assert rows == [{"question": "hi", "answer": "x"}] and report.skipped == 0


def test_missing_empty_and_all_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"not found; fix data\.path"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        read_jsonl(tmp_path)
    with pytest.raises(DataError, match="it is empty"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", []))
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{x", json.dumps({"q": 1})])
    with pytest.raises(DataError) as info:
        read_jsonl(bad)
    msg = str(info.value)
    assert "no usable rows" in msg and "2 bad" in msg and "data.prompt_key='prompt'" in msg
    assert isinstance(info.value, ConfigError)  # the CLI reports it in one line, exit 2


def test_parquet_rows_and_errors(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a*2=", None, "", "b*1="], "answer": ["aa", "x", "y", "b"]})
    pq.write_table(table, path)
    rows, report = read_parquet(path)
    assert [r["answer"] for r in rows] == ["aa", "b"]
    assert report.skipped == 2 and report.reasons["empty prompt 'prompt'"] == 1
    with pytest.raises(DataError, match=r"no column 'question'.*columns: prompt, answer"):
        read_parquet(path, prompt_key="question")
    not_parquet = write_jsonl(tmp_path / "x.parquet", ["{}"])
    with pytest.raises(DataError, match=r"cannot read .* as Parquet"):
        read_parquet(not_parquet)


def test_build_prompts_from_jsonl_tokenises_and_skips_long(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "abc", "answer": "1"}),
            json.dumps({"prompt": "x" * 50, "answer": "2"}),
            "oops",
        ],
    )
    resolved = load_config(
        None, ["data.source=jsonl", f"data.path={path}", "data.max_prompt_tokens=10"]
    )
    prompts, report = build_prompts(resolved, CharTokenizer())
    assert len(prompts) == 1 and report.rows == 1 and report.skipped == 2
    p = prompts[0]
    assert p.ids == [97, 98, 99] and p.num_tokens == 3
    assert p.metadata == {"prompt": "abc", "answer": "1"}
    assert report.reasons["prompt longer than data.max_prompt_tokens=10"] == 1
    # no tokenizer (simulated engines): no ids, length in characters
    prompts, _ = build_prompts(resolved, None)
    assert prompts[0].ids == [] and prompts[0].num_tokens == 3


def test_build_prompts_nothing_fits_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "x" * 50})])
    resolved = load_config(
        None, ["data.source=jsonl", f"data.path={path}", "data.max_prompt_tokens=10"]
    )
    with pytest.raises(ConfigError, match=r"raise data\.max_prompt_tokens"):
        build_prompts(resolved, CharTokenizer())


def test_train_with_a_missing_data_file_exits_with_one_line(tmp_path: Path, capsys) -> None:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path}",
            "data.source=jsonl",
            f"data.path={tmp_path / 'missing.jsonl'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "not found; fix data.path" in err


# -------------------------------------------------------------------------- repeat task


def test_repeat_task_is_deterministic_and_well_formed() -> None:
    a, b = RepeatTask(seed=3, size=500), RepeatTask(seed=3, size=500)
    assert [a[i] for i in range(500)] == [b[i] for i in range(500)]
    assert [a[i] for i in range(50)] != [RepeatTask(seed=4, size=500)[i] for i in range(50)]
    for i in range(500):
        row = a[i]
        assert row["prompt"] == f"{row['letter']}*{row['count']}="
        assert row["answer"] == row["letter"] * row["count"] and row["letter"] in "abc"
        assert 1 <= row["count"] <= 48
    assert len(a) == 500 and a[-1] == a[499]
    with pytest.raises(IndexError):
        a[500]


def test_repeat_task_lengths_are_long_tailed() -> None:
    counts = sorted(r["count"] for r in RepeatTask(seed=0, size=5000))
    p50 = statistics.median(counts)
    p99 = counts[int(0.99 * len(counts))]
    assert 4 <= p50 <= 8
    assert 5 <= p99 / p50 <= 12
    assert max(counts) == 48  # the tail reaches the cap


def test_repeat_reward_by_hand() -> None:
    row = {"answer": "ccccc"}
    assert repeat_reward("ccccc", row) == 1.0
    assert repeat_reward("ccc", row) == pytest.approx(3 / 5)  # too short
    assert repeat_reward("ccccccc", row) == pytest.approx(5 / 7)  # too long
    assert repeat_reward("cxcxc", row) == pytest.approx(3 / 5)  # wrong letters
    assert repeat_reward("", row) == 0.0
    assert repeat_reward("aaaaa", row) == 0.0
    assert RepeatTask.reward("c", {"answer": "c"}) == 1.0


def test_exact_match_and_contains() -> None:
    assert exact_match(" 42 \n", {"answer": "42"}) == 1.0
    assert exact_match("41", {"answer": 42}) == 0.0
    assert contains("so the answer is 42.", {"answer": "42"}) == 1.0
    assert contains("no", {"sol": "yes"}, key="sol") == 0.0


def test_build_prompts_from_the_task(tmp_path: Path) -> None:
    over = ["data.source=task", "data.task_options={seed: 1, size: 64, letters: xy}"]
    prompts, report = build_prompts(load_config(None, over), CharTokenizer())
    assert len(prompts) == 64 and report.skipped == 0
    first = prompts[0]
    assert first.metadata["task"] == "repeat" and first.metadata["letter"] in "xy"
    assert CharTokenizer().decode(first.ids) == first.metadata["prompt"]


# -------------------------------------------------------------------------- rewards


def traj(response: str, **metadata) -> Trajectory:
    return Trajectory("t0", "g0", 0, response_ids=[ord(c) for c in response], metadata=metadata)


def test_build_reward_defaults_to_the_tasks_own_and_decodes() -> None:
    resolved = load_config(None, ["data.source=task"])
    fn = build_reward(resolved, CharTokenizer())
    assert fn is not None
    assert asyncio.run(fn(traj("aaa", answer="aaaa"))) == pytest.approx(0.75)
    # synthetic data and no reward.fn: no reward at all
    assert build_reward(load_config(None, []), CharTokenizer()) is None


def test_build_reward_by_name_import_path_and_options() -> None:
    fn = build_reward(load_config(None, ["reward.fn=exact_match"]), CharTokenizer())
    assert asyncio.run(fn(traj("42", answer="42"))) == 1.0
    over = ["reward.fn=laminar_core.tasks.rewards:contains", "reward.options={key: sol}"]
    fn = build_reward(load_config(None, over), CharTokenizer())
    assert asyncio.run(fn(traj("it is 7", sol="7"))) == 1.0


def test_a_reward_that_cannot_take_response_and_row_is_a_config_error() -> None:
    """A function of a whole Trajectory (or of the response alone) named as reward.fn is
    caught before the run, with the contract and where such a function goes instead."""
    over = ["reward.fn=laminar_core.tasks.tool_calling:final_answer"]
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(response, row.*reward_fn="):
        build_reward(load_config(None, over), CharTokenizer())
    over = ["reward.fn=exact_match", "reward.options={colour: red}"]
    with pytest.raises(ConfigError, match="unexpected keyword argument 'colour'"):
        build_reward(load_config(None, over), CharTokenizer())


def failing(response: str, row: dict) -> float:
    raise ValueError(f"cannot parse {response!r}")


def test_a_raising_reward_names_the_reward_and_the_cause() -> None:
    fn = wrap_reward(failing, "mine", CharTokenizer().decode, timeout_s=5)
    with pytest.raises(RewardError, match=r"reward 'mine' raised ValueError: cannot parse 'x'"):
        asyncio.run(fn(traj("x")))


def test_a_slow_reward_times_out_without_blocking_the_loop() -> None:
    release = threading.Event()

    def slow(response: str, row: dict) -> float:
        release.wait(30)
        return 1.0

    fn = wrap_reward(slow, "slow", None, timeout_s=0.05)
    try:
        with pytest.raises(RewardError, match=r"reward 'slow' timed out after 0\.05 s"):
            asyncio.run(fn(traj("")))
    finally:
        release.set()  # let the abandoned thread finish


@pytest.mark.parametrize("value", ["high", float("nan"), None])
def test_a_reward_must_return_a_finite_number(value) -> None:
    fn = wrap_reward(lambda r, row: value, "odd", None, timeout_s=5)
    with pytest.raises(RewardError, match="reward 'odd' returned"):
        asyncio.run(fn(traj("")))


def test_a_failing_reward_marks_trajectories_failed_and_the_run_goes_on() -> None:
    """Real clock (a thread-offloaded reward's timeout is wall time), simulated engines."""
    release = threading.Event()

    def flaky(response: str, row: dict) -> float:
        key = row["sample_key"]
        if key % 4 == 1:
            raise ValueError("bad answer format")
        if key % 4 == 2:
            release.wait(30)  # times out
        return 0.5

    resolved = load_config(
        ROOT / "examples/train_sim_tiny.yaml", ["run.steps=3", "reward.timeout_s=0.2"]
    )
    reward = wrap_reward(flaky, "flaky", None, timeout_s=resolved.cfg.reward.timeout_s)

    async def run_it():
        run = build_local_run(resolved, reward_fn=reward)
        run.controller.keep_batches = True
        await run.controller.run(resolved.cfg.run.steps)
        return run

    try:
        run = asyncio.run(run_it())
    finally:
        release.set()
    assert len(run.controller.records) == 3
    trajs = [t for b in run.controller.batches for t in b.trajectories]
    by_kind = {k: [t for t in trajs if t.metadata["sample_key"] % 4 == k] for k in range(4)}
    assert by_kind[1] and by_kind[2]
    for t in by_kind[1]:
        assert t.finish_reason is FinishReason.FAILED and t.reward is None
        assert "reward 'flaky' raised ValueError: bad answer format" in t.error
    for t in by_kind[2]:
        assert t.finish_reason is FinishReason.FAILED
        assert "reward 'flaky' timed out after 0.2 s" in t.error
    for t in by_kind[0] + by_kind[3]:
        assert t.finish_reason is not FinishReason.FAILED and t.reward == 0.5
    assert all(r.reward_mean == 0.5 for r in run.controller.records)


# -------------------------------------------------------------------------- registry, config


def test_registry_lists_tasks_and_rewards(capsys) -> None:
    pm = default_manager()
    assert "repeat" in pm.names("task")
    assert {"repeat", "exact_match", "contains"} <= set(pm.names("reward"))
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["task", "repeat"] for line in lines)
    assert any(line.split()[:2] == ["reward", "exact_match"] for line in lines)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.source=task", "data.task=repaet"], "data.task: unknown task 'repaet'"),
        (["data.source=task", "data.task=repaet"], "did you mean 'repeat'"),
        (["data.source=task", "data.task_options.sizee=3"], "'data.task_options.sizee'"),
        (["data.source=task", "data.task_options.size=0"], "size must be >= 1"),
        (["reward.fn=exact_mach"], "reward.fn: unknown reward 'exact_mach'"),
        (["reward.fn=exact_mach"], "did you mean 'exact_match'"),
        (["reward.fn=no_such_module:f"], "cannot import 'no_such_module:f'"),
        (["reward.timeout_s=0"], "reward.timeout_s must be > 0"),
        (["data.source=jsonl"], "data.source=jsonl needs a file: set data.path="),
        (["data.source=parquet"], "set data.path=/path/to/data.parquet"),
        (["data.source=jsnl"], "did you mean 'jsonl'"),
        (["data.max_prompt_tokens=0"], "data.max_prompt_tokens must be >= 1"),
    ],
)
def test_bad_data_and_reward_config_is_a_clear_error(overrides, expected) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_dataset_columns_do_not_replace_the_loops_own_keys(tmp_path: Path) -> None:
    """A row with a ``prompt_index`` / ``sample_key`` column keeps the loop's bookkeeping."""
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": f"p{i}", "prompt_index": "mine", "sample_key": -1})
            for i in range(8)
        ],
    )
    resolved = load_config(
        ROOT / "examples/train_sim_tiny.yaml",
        ["run.steps=2", "data.source=jsonl", f"data.path={path}"],
    )

    async def run_it():
        run = build_local_run(resolved)
        run.controller.keep_batches = True
        await run.controller.run(2)
        return run

    run = asyncio.run(run_it())
    trajs = [t for b in run.controller.batches for t in b.trajectories]
    assert trajs and all(isinstance(t.metadata["prompt_index"], int) for t in trajs)
    assert len({t.metadata["sample_key"] for t in trajs}) == len(trajs)
