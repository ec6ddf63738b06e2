"""Tests for laminar_core.config: loading, overrides, round trip and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from laminar_core import ConfigError, LaminarConfig, load_config
from laminar_core.runtime.resolve import resolve, schedule_of
from laminar_core.sim.config import SimRolloutConfig

# A study list without any stale:K schedule, so partial_rollout cannot be "used" by a study.
NO_STALE = "study.schedules=[laminar,sync]"


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def err(overrides: list[str], raw: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(raw or {}, overrides)
    return str(info.value)


# --- loading and overrides -----------------------------------------------------------------


def test_defaults_load() -> None:
    r = load_config(None)
    assert isinstance(r.cfg, LaminarConfig)
    assert r.cfg == LaminarConfig()
    assert r.cfg.schedule == "laminar"
    assert r.cfg.rollout.engine == "sim"
    # the chosen engine's options are validated and defaulted too
    assert r.engine_options["rollout"] == SimRolloutConfig()
    assert r.engine_options["relay"] is not None
    assert r.to_dict()["rollout"]["sim"]["decode_step_s"] == SimRolloutConfig().decode_step_s


def test_empty_yaml_file_is_defaults(tmp_path: Path) -> None:
    r = load_config(write(tmp_path, ""))
    assert r.cfg == LaminarConfig()


def test_yaml_file_plus_typed_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "run:\n  steps: 7\n  name: mine\nrollout:\n  temperature: 0.7\n"
        "  sim:\n    decode_step_s: 0.5\n",
    )
    r = load_config(
        path,
        [
            "run.seed=42",
            "rollout.top_p=0.9",
            "data.shuffle=false",
            "study.schedules=[sync,stale:3]",
            "rollout.sim.roofline_batch=32",
            "run.steps=9",  # override beats the file
        ],
    )
    c = r.cfg
    assert c.run.name == "mine"
    assert c.run.steps == 9 and isinstance(c.run.steps, int)
    assert c.run.seed == 42 and isinstance(c.run.seed, int)
    assert c.rollout.temperature == 0.7
    assert c.rollout.top_p == 0.9 and isinstance(c.rollout.top_p, float)
    assert c.data.shuffle is False
    assert list(c.study.schedules) == ["sync", "stale:3"]
    opts = r.engine_options["rollout"]
    assert opts.decode_step_s == 0.5
    assert opts.roofline_batch == 32
    assert r.source == str(path)


def test_int_given_for_float_field_is_accepted() -> None:
    r = resolve({}, ["rollout.temperature=1", "model.params_b=70"])
    assert r.cfg.rollout.temperature == 1.0
    assert r.cfg.model.params_b == 70.0


def test_list_of_dataclasses_override() -> None:
    r = resolve({}, ["rollout.sim.failures=[{replica: 2, at_s: 30.5}]"])
    (f,) = r.engine_options["rollout"].failures
    assert (f.replica, f.at_s) == (2, 30.5)


def test_override_without_equals_is_rejected() -> None:
    assert "key=value" in err(["run.steps"])


def test_config_show_round_trip(tmp_path: Path) -> None:
    first = load_config(
        write(tmp_path, "schedule: stale:2\nrollout:\n  partial_rollout: true\n"),
        ["run.steps=5", "rollout.sim.lengths.median=300", "relay.sim.link_gbps=100"],
    )
    text = first.to_yaml()
    again = load_config(write(tmp_path, text, "shown.yaml"))
    assert again.to_dict() == first.to_dict()
    assert again.cfg == first.cfg
    assert again.engine_options == first.engine_options
    assert yaml.safe_load(text)["rollout"]["sim"]["lengths"]["median"] == 300


# --- unknown keys --------------------------------------------------------------------------


def test_unknown_top_level_key() -> None:
    msg = err(["rolout.max_tokens=5"])
    assert "'rolout'" in msg
    assert "did you mean 'rollout'" in msg


def test_unknown_top_level_key_in_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key 'sched'"):
        load_config(write(tmp_path, "sched: sync\n"))


def test_unknown_nested_key_names_full_path_and_close_match() -> None:
    msg = err(["rollout.max_concurent=4"])
    assert "'rollout.max_concurent'" in msg
    assert "did you mean 'rollout.max_concurrent'" in msg


def test_unknown_key_in_engine_options() -> None:
    msg = err(["rollout.sim.decode_stepp_s=0.1"])
    assert "'rollout.sim.decode_stepp_s'" in msg
    assert "rollout.sim.decode_step_s" in msg


def test_unknown_key_deep_in_engine_options() -> None:
    msg = err(["rollout.sim.lengths.medain=10"])
    assert "'rollout.sim.lengths.medain'" in msg
    assert "rollout.sim.lengths.median" in msg


def test_unknown_key_inside_list_item_names_index() -> None:
    msg = err(["rollout.sim.failures=[{replica: 0, at_s: 1}, {replca: 1}]"])
    assert "'rollout.sim.failures[1].replca'" in msg
    assert "rollout.sim.failures[1].replica" in msg


def test_section_that_is_not_a_mapping() -> None:
    msg = err(["run=3"])
    assert "'run'" in msg and "mapping" in msg


def test_engine_options_section_that_is_not_a_mapping() -> None:
    for value in ["3", "0", "[1, 2]"]:
        msg = err([f"rollout.sim={value}"])
        assert "'rollout.sim'" in msg and "mapping" in msg


def test_options_for_an_engine_without_options() -> None:
    msg = err(["relay.transport=inprocess", "relay.inprocess.x=1"])
    assert "relay.inprocess" in msg and "takes no options" in msg


# --- types and names -----------------------------------------------------------------------


def test_wrong_type_names_the_key() -> None:
    msg = err(["rollout.max_tokens=abc"])
    assert "'rollout.max_tokens'" in msg
    assert "abc" in msg


def test_wrong_type_in_engine_options_names_the_key() -> None:
    assert "'relay.sim.link_gbps'" in err(["relay.sim.link_gbps=fast"])


def test_float_for_int_and_bad_bool() -> None:
    assert "'run.steps'" in err(["run.steps=1.5"])
    assert "'data.shuffle'" in err(["data.shuffle=maybe"])


def test_unknown_engine_lists_known_names() -> None:
    msg = err(["rollout.engine=vlm"])
    assert msg.startswith("rollout.engine")
    assert "'vlm'" in msg
    assert "sim" in msg.partition("known: ")[2]


def test_unknown_transport_lists_known_names() -> None:
    msg = err(["relay.transport=ncc"])
    assert "relay.transport" in msg
    assert "inprocess" in msg and "sim" in msg


def test_unknown_lengths_kind_fails_at_config_time() -> None:
    msg = err(["rollout.sim.lengths.kind=gauss"])
    assert "rollout.sim" in msg and "gauss" in msg
    assert "histogram" in msg and "lognormal" in msg


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.sim.roofline_batch=0", "roofline_batch"),
        ("rollout.sim.max_num_seqs=-1", "max_num_seqs"),
        ("rollout.sim.decode_step_s=-0.1", "decode_step_s"),
        ("rollout.sim.lengths.median=0", "median"),
        ("relay.sim.link_gbps=0", "link_gbps"),
    ],
)
def test_sim_options_out_of_range(override: str, field: str) -> None:
    msg = err([override])
    assert override.split(".")[0] + ".sim" in msg
    assert field in msg


def test_histogram_lengths_without_file() -> None:
    assert "lengths.file" in err(["rollout.sim.lengths.kind=histogram"])


# --- schedules -----------------------------------------------------------------------------


def test_unknown_schedule_lists_known() -> None:
    msg = err(["schedule=fast"])
    assert "'fast'" in msg
    for name in ("laminar", "one_step", "stale", "sync"):
        assert name in msg


def test_unknown_schedule_in_study_list() -> None:
    assert "'nope'" in err(["study.schedules=[laminar,nope]"])


@pytest.mark.parametrize("spec", ["stale", "stale:-1", "stale:x"])
def test_stale_needs_non_negative_k(spec: str) -> None:
    msg = err([f"schedule={spec}"])
    assert msg.startswith("schedule:")
    assert "stale:2" in msg  # the example of the right form


def test_schedule_without_argument_rejects_one() -> None:
    assert "takes no argument" in err(["schedule=sync:1"])


def test_stale_zero_is_fine() -> None:
    assert schedule_of(resolve({}, ["schedule=stale:0"])).max_lag == 0


# --- semantic checks -----------------------------------------------------------------------


def test_negative_batch_size() -> None:
    msg = err(["data.prompts_per_step=-4"])
    assert "data.prompts_per_step" in msg and "-4" in msg


def test_trainer_gpus_must_leave_rollout_gpus() -> None:
    msg = err(["cluster.gpus=8", "cluster.trainer_gpus=8"])
    assert "cluster.trainer_gpus" in msg and "cluster.gpus" in msg
    assert "cluster.trainer_gpus" in err(["cluster.gpus=8", "cluster.trainer_gpus=9"])
    resolve({}, ["cluster.gpus=8", "cluster.trainer_gpus=7"])  # one rollout GPU is enough


def test_partial_rollout_rejected_without_stale() -> None:
    msg = err(["rollout.partial_rollout=true", "schedule=laminar", NO_STALE])
    assert "rollout.partial_rollout" in msg and "stale" in msg


def test_partial_rollout_with_stale_is_fine() -> None:
    r = resolve({}, ["rollout.partial_rollout=true", "schedule=stale:1", NO_STALE])
    assert schedule_of(r).partial_rollout is True


def test_fifo_sampler_rejected_for_bounded_schedules() -> None:
    for spec in ["sync", "one_step", "stale:2"]:
        msg = err(["buffer.sampler=fifo", f"schedule={spec}", f"study.schedules=[{spec}]"])
        assert "buffer.sampler=fifo" in msg and spec in msg
    resolve({}, ["buffer.sampler=fifo", "schedule=laminar", "study.schedules=[laminar]"])


def test_unknown_sampler() -> None:
    msg = err(["buffer.sampler=lifo"])
    assert "buffer.sampler" in msg and "by_batch" in msg and "fifo" in msg


def test_algorithm_error_names_field() -> None:
    msg = err(["algorithm.off_policy=foo"])
    assert "algorithm.off_policy" in msg and "'foo'" in msg
    assert "decoupled" in msg and "tis" in msg
    assert "algorithm.clip_low" in err(["algorithm.clip_low=1.5"])


def test_unknown_repack_policy() -> None:
    msg = err(["repack.policy=worst_fit"])
    assert "repack.policy" in msg and "best_fit" in msg


# --- files ---------------------------------------------------------------------------------


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  steps: 3\n  name: [unclosed\nschedule: sync\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "malformed YAML" in msg
    assert "line 4" in msg


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_top_level_list_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "- run\n- schedule\n")
    with pytest.raises(ConfigError, match="mapping") as info:
        load_config(path)
    assert str(path) in str(info.value) and "list" in str(info.value)


def test_errors_are_single_line() -> None:
    for overrides in (["rollout.max_concurent=4"], ["rollout.max_tokens=abc"], ["schedule=x"]):
        assert "\n" not in err(overrides)


def test_unknown_data_source_is_a_config_error() -> None:
    msg = err(["data.source=csv"])
    assert "data.source" in msg and "'csv'" in msg and "synthetic" in msg and "jsonl" in msg


def test_unknown_model_dtype_is_a_config_error() -> None:
    msg = err(["model.dtype=bf16"])
    assert "model.dtype" in msg and "did you mean 'bfloat16'" in msg


def test_unknown_runtime_kind_is_named_with_a_close_match() -> None:
    msg = err(["runtime.kind=rayy"])
    assert "runtime.kind: unknown 'rayy'" in msg and "did you mean 'ray'" in msg


def test_negative_runtime_resources_are_refused() -> None:
    assert "runtime.cpus_per_replica must be >= 0" in err(["runtime.cpus_per_replica=-1"])


def test_core_lists_are_parsed_and_bad_ones_are_named() -> None:
    from laminar_core.config.checks import parse_cores

    assert parse_cores("0-2,5") == {0, 1, 2, 5} and parse_cores(" 3 ") == {3}
    ok = load_config(
        None, ["runtime.kind=ray", "runtime.trainer_cores=0", "runtime.replica_cores=1-3"]
    )
    assert (ok.cfg.runtime.trainer_cores, ok.cfg.runtime.replica_cores) == ("0", "1-3")
    msg = err(["runtime.kind=ray", "runtime.replica_cores=1-0"])
    assert "runtime.replica_cores" in msg and "runs backwards" in msg
    msg = err(["runtime.kind=ray", "runtime.trainer_cores=0;1"])
    assert "runtime.trainer_cores" in msg and "'0,2,4-7'" in msg
    # the local runtime runs everything in the driver: there is nothing to place
    msg = err(["runtime.trainer_cores=0"])
    assert "needs runtime.kind: ray" in msg


def test_pinning_moves_running_threads_and_what_starts_later() -> None:
    """In a process of its own (pinning this one would pin the rest of the test session): a
    thread that was already running, one started after, and a child process all end up on
    the chosen core."""
    import os
    import subprocess
    import sys

    core = min(os.sched_getaffinity(0))
    script = f"""
import os, subprocess, sys, threading
from laminar_core.runtime.ray_calls import pin_cores
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
pin_cores("{core}", "runtime.trainer_cores")
after = threading.Thread(target=stop.wait); after.start()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout.strip()
print(sorted(os.sched_getaffinity(before.native_id)), sorted(os.sched_getaffinity(after.native_id)),
      sorted(os.sched_getaffinity(0)), child)
stop.set()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [f"[{core}]"] * 4, out


def test_pinning_to_a_core_the_node_lacks_names_the_cores_it_has() -> None:
    import os

    from laminar_core.runtime.ray_calls import pin_cores

    allowed = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError) as info:
        pin_cores(f"0,{max(allowed) + 1}", "runtime.replica_cores")
    msg = str(info.value)
    assert "runtime.replica_cores" in msg and f"[{max(allowed) + 1}]" in msg
    assert "may use" in msg and "leave the key empty" in msg
    assert os.sched_getaffinity(0) == allowed  # nothing was pinned
