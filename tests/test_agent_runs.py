"""Agent runs for real: ``laminar train``'s runtime with ``agent.entrypoint`` set, on Ray with
an FSDP trainer and two replicas, vLLM or SGLang (one run each); the agent
(``agent_run_support``) uses the ``openai`` client over HTTP against the gateway the run
started in its driver.

Per engine, one run of a few steps, during which episodes crash, hang past their wall clock, return
without a call, fork their session, and a replica actor is killed while agent calls run on
it. Checked: every episode is written to the buffer exactly once (as its samples, or as one
failed trajectory after ``agent.max_attempts`` runs), a crashed or hung run's session is
never trained, the audit (``rollouts.jsonl``) says what happened to each episode, the
killed replica's calls were generated again on the other replica and the run went on (on
vLLM by the backend's retry; on SGLang, with ``agent.call_retries=0``, as a 503 with
``Retry-After`` and OpenAI's body that the agent's client retried), each trained trajectory
holds whole calls only and records per-token versions, and the eval rounds ran the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from laminar_core import FinishReason, load_config
from laminar_core.testing import require_modules

require_modules("laminar_fsdp", "laminar_vllm", "vllm", "openai", what="agent-run tests")

ray = pytest.importorskip("ray")

import agent_run_support as agent

from laminar_core.models import build_tiny_model
from laminar_core.runtime.train import close_run, make_run_dir, start_run
from laminar_core.testing.audit import audit_run

ROOT = Path(__file__).resolve().parents[1]
# Per engine: the run's steps and its overrides of the example. vLLM (as the example
# ships): a call on the killed replica is generated again on the other by the backend
# (``agent.call_retries``). SGLang, kept small (2 steps, fewer episodes): with
# ``agent.call_retries=0`` the killed replica's calls are answered 503 with Retry-After,
# and the agents' own clients (``max_retries``) send them again, to a live replica.
ENGINES = {
    "vllm": (3, []),
    "sglang": (
        2,
        [
            "rollout.engine=sglang",
            "rollout.sglang.dtype=float32",
            "rollout.sglang.max_total_tokens=4096",
            "rollout.sglang.context_length=256",
            "agent.call_retries=0",
        ],
    ),
}


@dataclass
class AgentRun:
    engine: str
    steps: int
    run: Any
    run_dir: Path
    killed: dict


@pytest.fixture(scope="module", params=list(ENGINES))
def agent_run(request, ray_cluster, tmp_path_factory) -> AgentRun:
    engine = request.param
    if engine == "sglang":
        require_modules("laminar_sglang", "sglang", what="the agent run on SGLang")
    steps, overrides = ENGINES[engine]
    for record in (agent.RUNS, agent.SESSIONS, agent.CALLS, agent.UNAVAILABLE):
        record.clear()  # the other engine's run used the same agent module
    model = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)
    out = tmp_path_factory.mktemp("runs")
    resolved = load_config(
        ROOT / "examples" / "agents" / "openai_agent.yaml",
        [
            f"model.path={model}",
            f"run.out_dir={out}",
            f"run.steps={steps}",
            "run.eval_every=-1",
            "data.eval_size=4",
            "run.dump_rollouts=true",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=8",  # agent_run_support's eight kinds of episode
            "agent.entrypoint=agent_run_support:run",
            "agent.timeout_s=20",
            "agent.max_attempts=2",
            "telemetry.progress=false",
            *overrides,
        ],
    )
    killed: dict = {}

    async def kill_a_replica_mid_call(run) -> None:
        """Kill r1's actor the moment an agent call runs on it (a crash, not a stop)."""
        slot = run.manager.slots[1]
        while True:
            if any(t.startswith("agent:") for t in slot.inflight):
                killed["inflight"] = sorted(slot.inflight)
                ray.kill(run.runtime.replica_handles[1], no_restart=True)
                return
            await asyncio.sleep(0.005)

    async def go():
        run_dir = make_run_dir(resolved)
        run = await start_run(resolved, run_dir)
        run.controller.keep_batches = True
        killer = asyncio.ensure_future(kill_a_replica_mid_call(run))
        try:
            await run.controller.run(steps)
        finally:
            killer.cancel()
            with contextlib.suppress(BaseException):
                await killer
            run.events.write_jsonl(run_dir / "events.jsonl")  # what laminar train writes
            await close_run(run)
        return run, run_dir

    run, run_dir = asyncio.run(go())
    return AgentRun(engine, steps, run, run_dir, killed)


def _trained(run):
    return [t for b in run.controller.batches for g in b.groups for t in g.trajectories]


def _check_consistent(t) -> None:
    """``t``'s ids are its calls' and nothing else, in order: each call's prompt is the
    sample so far plus what it observed, its completion the loss-mask-1 ids that follow
    (no call half-appended, none from a failed attempt)."""
    calls = t.metadata["gateway"]["calls"]
    at = len(t.prompt_ids)
    assert calls[0]["prompt_tokens"] == at == calls[0]["observed_tokens"]
    mask = []
    for i, c in enumerate(calls):
        if i:
            at += c["observed_tokens"]
            mask += [0] * c["observed_tokens"]
        assert c["prompt_tokens"] == at, (t.traj_id, calls)
        at += c["completion_tokens"]
        mask += [1] * c["completion_tokens"]
    assert at == len(t.prompt_ids) + len(t.response_ids) and t.loss_mask == mask, t.traj_id
    indices = [c["call"] for c in calls]
    assert indices == sorted(set(indices)), indices


def test_every_episode_is_written_exactly_once(agent_run) -> None:
    run, steps = agent_run.run, agent_run.steps
    trajs = _trained(run)
    ids = [t.traj_id for t in trajs]
    assert len(ids) == len(set(ids))
    groups = {g.group_id: g for b in run.controller.batches for g in b.groups}
    assert len(groups) == 2 * steps
    for gid, g in groups.items():
        episodes = {t.traj_id.split(".")[0] for t in g.trajectories}
        assert episodes == {f"{gid}-{j}" for j in range(8)}, gid
        for t in g.trajectories:  # forks share their episode's reward and session
            main = next(m for m in g.trajectories if m.traj_id == t.traj_id.split(".")[0])
            assert t.reward == main.reward
            if t.finish_reason is not FinishReason.FAILED:
                assert t.metadata["agent"]["session"] == main.metadata["agent"]["session"]


def test_failed_runs_are_run_again_and_never_trained(agent_run) -> None:
    run, run_dir, steps = agent_run.run, agent_run.run_dir, agent_run.steps
    by_key: dict[int, list] = {}
    for t in _trained(run):
        by_key.setdefault(t.metadata["sample_key"], []).append(t)
    kinds = {1: "crashed", 2: "timeout", 4: "no_calls"}
    for key, trajs in by_key.items():
        a = trajs[0].metadata["agent"]
        if key % 8 == 3:  # always crashes: failed after two runs, never trained as a sample
            (t,) = trajs
            assert t.finish_reason is FinishReason.FAILED and not t.response_ids
            assert [f["kind"] for f in a["failures"]] == ["crashed", "crashed"]
            assert "episode" in t.error and a["attempts"] == 2
            continue
        assert all(t.finish_reason is not FinishReason.FAILED for t in trajs), key
        if key % 8 in kinds:
            assert a["failures"][0]["kind"] == kinds[key % 8], a
            assert a["attempts"] >= 2
            # what was trained is the last run's session, not the failed one's
            assert a["session"] == agent.SESSIONS[key][-1] != agent.SESSIONS[key][0]
        if key % 8 == 5:
            assert len(trajs) == 2  # the fork: a sample of its own
            assert {t.metadata["gateway"]["reason"] for t in trajs} == {
                "first",
                "history_rewritten",
            }
    # the audit: rollouts.jsonl has each trained trajectory's episode outcome
    rows = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == len(_trained(run))
    failures = [f["kind"] for r in rows for f in r["metadata"]["agent"]["failures"]]
    assert {"crashed", "timeout", "no_calls"} <= set(failures)
    # the outside observer's audit agrees: nothing lost, nothing trained twice
    assert audit_run(run_dir).problems == []
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    # counters include groups admitted ahead of the last trained step
    assert row["agent_failed_episodes"] >= steps * 2  # one always-crashing episode a group
    assert row["agent_reruns"] >= steps * 2 * 4


def test_a_replica_killed_mid_call_has_its_calls_generated_again(agent_run) -> None:
    run, killed = agent_run.run, agent_run.killed
    assert killed.get("inflight"), "no agent call ran on r1 before the run ended"
    backend = run.manager.agent_backend
    if agent_run.engine == "sglang":
        # agent.call_retries=0: the killed calls were answered 503, and the agents' clients
        # (openai, max_retries) sent them again after Retry-After
        assert backend.unavailable >= 1 and backend.retried == 0
        assert agent.UNAVAILABLE, "no agent saw a 503"
        for seen in agent.UNAVAILABLE:
            assert int(seen["retry_after"]) >= 1, seen
            err = seen["body"]["error"]
            assert set(err) == {"message", "type", "param", "code"}, seen
            assert err["type"] == "server_error" and err["code"] == "replica_unavailable"
            # the client's retry was served (by r0, or r1 restarted)
            later = agent.CALLS[seen["calls_before"] :]
            assert any(key == seen["key"] for key, _, _ in later), seen
    else:
        assert backend.retried >= 1  # the killed call, generated again on r0
    # the killed calls' sessions: each trained one holds whole calls only, the killed
    # call's from another replica (or r1 restarted)
    killed_sessions = {c.removeprefix("agent:").split(".")[0] for c in killed["inflight"]}
    trained = [
        t for t in _trained(run) if t.metadata.get("gateway", {}).get("session") in killed_sessions
    ]
    for t in trained:
        _check_consistent(t)
    assert run.manager.replica_restarts >= 1 or "r1" in run.manager.failed_replicas
    # the calls after the kill were served (by r0, or r1 restarted): the run went on
    assert len(run.controller.batches) == agent_run.steps


def test_trained_samples_record_versions_per_token(agent_run) -> None:
    run, run_dir = agent_run.run, agent_run.run_dir
    # token for token: the trainer's recompute of the captured ids (the first step's
    # samples, generated by the version it trains) gives vLLM's sampled log-probs
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = [r for r in rows if r.get("logprob_diff_tokens")]
    assert checked and max(r["logprob_abs_diff_max"] for r in checked) < 1e-3
    for t in _trained(run):
        if t.finish_reason is FinishReason.FAILED:
            continue
        assert len(t.token_versions) == len(t.response_ids) == len(t.loss_mask)
        calls = t.metadata["gateway"]["calls"]
        assert sorted({c["version"] for c in calls}) == t.versions
        assert t.replicas == [c["replica"] for c in calls]
        assert t.reward is not None
        _check_consistent(t)


def test_eval_rounds_run_the_agent(agent_run) -> None:
    row = json.loads((agent_run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["eval_samples"] == 4 and row["eval_version"] == agent_run.steps
    assert "eval_reward" in row
