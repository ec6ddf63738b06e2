"""Tests for the simulated rollout engine and its output-length models, on virtual time."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from laminar_core.interfaces import BuildContext, ModelOnly, ReplicaFailure
from laminar_core.runtime.resolve import resolve
from laminar_core.sim.clock import SimulationDeadlock, run_virtual
from laminar_core.sim.config import FailureSpec, SimRolloutConfig
from laminar_core.sim.lengths import LengthFileError, LengthModel, read_histogram
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.types import (
    FinishReason,
    GenerationRequest,
    PartialTrajectory,
    SamplingParams,
    Trajectory,
)

D = 0.01  # decode step seconds in most tests


class FixedLengths:
    """The engine only calls ``sample(key)``: fix every length by key."""

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths = lengths

    def sample(self, key: int) -> int:
        return self.lengths[key]


def cfg(**kw) -> SimRolloutConfig:
    base = dict(decode_step_s=D, roofline_batch=8, prefill_s_per_token=0.0, weight_load_s=0.0)
    base.update(kw)
    return SimRolloutConfig(**base)


def engine(lengths: dict[int, int], version: int = 0, index: int = 0, **kw) -> SimRolloutEngine:
    return SimRolloutEngine(f"r{index}", cfg(**kw), FixedLengths(lengths), index, version)


def req(
    key: int,
    prompt: int = 0,
    max_tokens: int = 100_000,
    resume: PartialTrajectory | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        traj_id=f"t{key}",
        group_id="g",
        num_prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        resume=resume,
        metadata={"sample_key": key},
    )


def now() -> float:
    return asyncio.get_running_loop().time()


async def at(t: float) -> None:
    await asyncio.sleep(t - now())


async def run_all(eng: SimRolloutEngine, requests: list[tuple[float, GenerationRequest]]):
    """Submit each request at its virtual time; return the trajectories in request order."""

    async def one(t: float, r: GenerationRequest) -> Trajectory:
        await at(t)
        return await eng.generate(r)

    await eng.start()
    return await asyncio.gather(*(one(t, r) for t, r in requests))


def finish_times(trajs: list[Trajectory]) -> list[float]:
    return [t.finish_time for t in trajs]


# --- the virtual clock --------------------------------------------------------------------


def test_run_virtual_jumps_time_and_cancels_leftover_tasks() -> None:
    seen: dict = {}

    async def main() -> float:
        async def forever() -> None:
            try:
                await asyncio.sleep(1e9)
            except asyncio.CancelledError:
                seen["cancelled_at"] = now()
                raise

        seen["task"] = asyncio.ensure_future(forever())
        await asyncio.sleep(3600.5)
        return now()

    assert run_virtual(main()) == 3600.5
    assert seen["task"].cancelled()
    assert seen["cancelled_at"] == 3600.5


def test_run_virtual_reports_deadlock() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever resolve it

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


# --- the decode model ----------------------------------------------------------------------


def test_single_request_finishes_at_length_times_step() -> None:
    eng = engine({1: 100})

    async def main():
        (traj,) = await run_all(eng, [(0.0, req(1, prompt=50))])
        return traj, now()

    traj, t_end = run_virtual(main())
    assert traj.finish_time == pytest.approx(100 * D, rel=1e-9)
    assert t_end == pytest.approx(100 * D, rel=1e-9)
    assert traj.num_response_tokens == 100
    assert traj.num_prompt_tokens == 50
    assert traj.finish_reason is FinishReason.STOP
    assert traj.version == 0 and traj.versions == [0]
    assert traj.replicas == ["r0"]
    assert traj.metadata == {"sample_key": 1}
    assert eng.tokens_generated == 100


def test_max_tokens_truncates_with_finish_reason_length() -> None:
    eng = engine({1: 100})
    (traj,) = run_virtual(run_all(eng, [(0.0, req(1, max_tokens=40))]))
    assert traj.num_response_tokens == 40
    assert traj.finish_reason is FinishReason.LENGTH
    assert traj.finish_time == pytest.approx(40 * D, rel=1e-9)


def test_below_roofline_step_cost_is_flat() -> None:
    eng = engine({1: 100, 2: 250, 3: 60}, roofline_batch=4)
    trajs = run_virtual(run_all(eng, [(0.0, req(1)), (0.0, req(2)), (1.5, req(3))]))
    # each at its own L * d (the third arrives at 1.5)
    assert finish_times(trajs) == pytest.approx([1.0, 2.5, 1.5 + 0.6], rel=1e-9)


def test_above_roofline_step_time_grows_linearly() -> None:
    eng = engine({1: 100, 2: 200, 3: 300}, roofline_batch=2)
    trajs = run_virtual(run_all(eng, [(0.0, req(1)), (0.0, req(2)), (0.0, req(3))]))
    # 3 running > B=2: step = d * 3/2 -> 100 steps end at 1.5; then 2 running (flat, d):
    # 100 more steps -> 2.5; then alone: 100 more -> 3.5.
    assert finish_times(trajs) == pytest.approx([1.5, 2.5, 3.5], rel=1e-9)
    assert [t.num_response_tokens for t in trajs] == [100, 200, 300]


def test_prefill_is_chunked_into_decode_steps() -> None:
    eng = engine({1: 100, 2: 100}, prefill_s_per_token=1e-3)
    trajs = run_virtual(run_all(eng, [(0.0, req(1, prompt=0)), (0.5, req(2, prompt=200))]))
    # request 1: one step computes its one prefill token and samples its first token (0.01 s),
    # then 99 decode steps. At 0.5 it has 50 tokens; request 2's 200-token prefill rides in
    # one step with request 1's decode: max(d, (1 + 200) * 1e-3) = 0.201 s, which gives
    # request 1 its 51st token and request 2 its first. Both then decode at d.
    assert finish_times(trajs) == pytest.approx([0.701 + 49 * D, 0.701 + 99 * D], rel=1e-9)
    assert trajs[1].start_time == pytest.approx(0.5)
    assert eng.prefill_tokens == 201


def test_prefill_before_first_token() -> None:
    eng = engine({1: 100}, prefill_s_per_token=1e-3)
    (traj,) = run_virtual(run_all(eng, [(0.0, req(1, prompt=1000))]))
    # one step prefills the 1000 prompt tokens and samples the first token; 99 more follow
    assert traj.finish_time == pytest.approx(1000 * 1e-3 + 99 * D, rel=1e-9)


def test_prefill_larger_than_the_step_budget_takes_several_steps() -> None:
    eng = engine({1: 10, 2: 10}, prefill_s_per_token=1e-4, max_num_batched_tokens=1000)
    trajs = run_virtual(run_all(eng, [(0.0, req(1, prompt=0)), (0.005, req(2, prompt=2500))]))
    # request 1's first step (1 prefill token): d = 0.01. Request 2 arrives during it and
    # waits for the next step. Its 2500 tokens go in chunks of 1000 - 1 (request 1 decodes
    # in each): three steps of max(d, 1000 * 1e-4) = 0.1 s, the last one carrying 502 tokens
    # (max(d, 503 * 1e-4) = 0.0503 s) -> request 2's first token at 0.01 + 0.2 + 0.0503.
    t2 = 0.01 + 0.1 + 0.1 + 0.0503
    # request 1 made 1 + 3 tokens by then; its other 6 at d (alone with request 2: flat)
    assert finish_times(trajs) == pytest.approx([t2 + 6 * D, t2 + 9 * D], rel=1e-9)


def test_kv_capacity_makes_request_wait() -> None:
    eng = engine({1: 100, 2: 40}, kv_capacity_tokens=1000)

    async def main():
        await eng.start()
        a = asyncio.ensure_future(eng.generate(req(1, prompt=250)))
        b = asyncio.ensure_future(eng.generate(req(2, prompt=800)))  # 250 + 800 > 1000
        await at(0.5)
        s = await eng.stats()
        await at(0.99)
        s2 = await eng.stats()
        return s, s2, await a, await b

    s, s2, a, b = run_virtual(main())
    assert (s.running, s.waiting) == (1, 1)
    assert s.kv_use == pytest.approx((250 + 50) / 1000)  # prompt + tokens generated so far
    assert s.kv_capacity_tokens == 1000
    assert (s2.running, s2.waiting) == (1, 1)
    assert a.finish_time == pytest.approx(1.0)
    assert b.start_time == pytest.approx(1.0)  # admitted when a finished
    assert b.finish_time == pytest.approx(1.0 + 40 * D)


def test_kv_counts_generated_tokens() -> None:
    # Same second request: at t=0 it fits (100 + 860 <= 1000, and 20 more tokens still fit);
    # at t=0.5 the first has generated 50 tokens (150 + 860 > 1000), so it waits.
    for arrive, waits in [(0.0, False), (0.5, True)]:
        eng = engine({1: 100, 2: 10}, kv_capacity_tokens=1000)
        _, b = run_virtual(run_all(eng, [(0.0, req(1, prompt=100)), (arrive, req(2, prompt=860))]))
        expected_start = 1.0 if waits else arrive
        assert b.start_time == pytest.approx(expected_start)
        assert b.finish_time == pytest.approx(expected_start + 10 * D)
        assert eng.preemptions == 0


def test_kv_overflow_preempts_the_newest_request_and_recomputes_it() -> None:
    # 100 + 895 fit at t=0, but two decoding requests overflow the cache by a token after 3
    # steps (995 + 2 * 3): the newest (request 2, 3 tokens made) is preempted, waits for
    # request 1 to finish (1.0 s), is prefilled again with its 3 tokens (free here) and
    # makes the other 7.
    eng = engine({1: 100, 2: 10}, kv_capacity_tokens=1000)
    a, b = run_virtual(run_all(eng, [(0.0, req(1, prompt=100)), (0.0, req(2, prompt=895))]))
    assert eng.preemptions == 1
    assert a.finish_time == pytest.approx(1.0)
    assert b.start_time == pytest.approx(0.0)  # first admitted at 0
    assert b.finish_time == pytest.approx(1.0 + 7 * D)
    assert b.num_response_tokens == 10 and eng.tokens_generated == 110


def test_prefix_cache_shares_a_groups_prompt() -> None:
    def group_req(key: int) -> GenerationRequest:
        return dataclasses.replace(req(key, prompt=500), group_id="g1")

    for caching, prefill in [(True, 500 + 1), (False, 2 * 500)]:
        eng = engine({1: 10, 2: 10}, prefill_s_per_token=1e-4, prefix_caching=caching)

        async def main(eng: SimRolloutEngine = eng):
            await eng.start()
            a = asyncio.ensure_future(eng.generate(group_req(1)))
            b = asyncio.ensure_future(eng.generate(group_req(2)))
            await at(0.001)
            return await eng.stats(), await a, await b

        stats, _, _ = run_virtual(main())
        # one prefill step for both; the second sample's prompt is a cache hit (one token)
        assert eng.prefill_tokens == prefill
        assert stats.kv_use == pytest.approx((prefill if not caching else 500) / 1e6)


def test_max_num_seqs_limits_running() -> None:
    eng = engine({1: 100, 2: 100, 3: 100}, max_num_seqs=2)
    trajs = run_virtual(run_all(eng, [(0.0, req(k)) for k in (1, 2, 3)]))
    assert finish_times(trajs) == pytest.approx([1.0, 1.0, 2.0], rel=1e-9)


# --- abort and resume ----------------------------------------------------------------------


def test_abort_returns_partial_and_resume_finishes_at_same_length() -> None:
    lengths = {7: 100}
    prefill = 1e-3
    first = engine(lengths, version=0, index=0, prefill_s_per_token=prefill)
    second = engine(lengths, version=3, index=1, prefill_s_per_token=prefill)

    async def main():
        await first.start()
        await second.start()
        pending = asyncio.ensure_future(first.generate(req(7, prompt=63)))
        await at(0.063 + 0.365)  # 0.063 s prefill (and the first token), 36.5 decode steps
        (part,) = await first.abort(["t7"])
        aborted = await pending
        t_abort = now()
        done = await second.generate(req(7, prompt=63, resume=part))
        return part, aborted, t_abort, done

    part, aborted, t_abort, done = run_virtual(main())
    assert part.traj_id == "t7"
    assert part.num_response_tokens == 37
    assert part.versions == [0]
    assert aborted.finish_reason is FinishReason.ABORTED
    assert aborted.num_response_tokens == 37
    # resumed: a step re-prefills prompt + prefix (63 + 37 tokens) and samples the first of
    # the 63 missing tokens; 62 decode steps follow
    assert done.num_response_tokens == 100
    assert done.finish_reason is FinishReason.STOP
    assert done.versions == [0, 3]
    assert done.version == 0  # the oldest contributing version
    assert done.finish_time == pytest.approx(t_abort + 100 * prefill + 62 * D, rel=1e-9)
    assert second.resumes == 1 and second.resume_prefill_tokens == 100
    assert first.tokens_generated == 37 and second.tokens_generated == 63


def test_resume_on_same_version_keeps_one_version() -> None:
    eng = engine({1: 100})

    async def main():
        await eng.start()
        pending = asyncio.ensure_future(eng.generate(req(1)))
        await at(0.255)
        (part,) = await eng.abort(["t1"])
        await pending
        return part, await eng.generate(req(1, resume=part))

    part, done = run_virtual(main())
    assert part.num_response_tokens == 25
    assert done.versions == [0]
    assert done.num_response_tokens == 100
    assert done.finish_time == pytest.approx(0.255 + 75 * D, rel=1e-9)


def test_abort_of_waiting_and_unknown_requests() -> None:
    eng = engine({1: 100, 2: 100}, max_num_seqs=1)

    async def main():
        await eng.start()
        a = asyncio.ensure_future(eng.generate(req(1)))
        b = asyncio.ensure_future(eng.generate(req(2)))
        await at(0.5)
        parts = await eng.abort(["t2", "nope"])
        stats = await eng.stats()
        return parts, await b, stats, await a

    parts, b, stats, a = run_virtual(main())
    assert [(p.traj_id, p.num_response_tokens) for p in parts] == [("t2", 0)]
    assert b.finish_reason is FinishReason.ABORTED
    assert (stats.running, stats.waiting) == (1, 0)
    assert a.finish_time == pytest.approx(1.0)


def test_partials_snapshot_does_not_stop() -> None:
    eng = engine({1: 100})

    async def main():
        await eng.start()
        pending = asyncio.ensure_future(eng.generate(req(1)))
        await at(0.425)
        snap = await eng.partials()
        return snap, await pending

    (snap,), done = run_virtual(main())
    assert snap.num_response_tokens == 42
    assert done.finish_reason is FinishReason.STOP and done.finish_time == pytest.approx(1.0)


# --- weights and failures ------------------------------------------------------------------


def test_update_weights_with_requests_in_flight_raises() -> None:
    eng = engine({1: 100}, weight_load_s=2.0)

    async def main():
        await eng.start()
        pending = asyncio.ensure_future(eng.generate(req(1)))
        await asyncio.sleep(0.1)
        with pytest.raises(RuntimeError, match="in flight"):
            await eng.update_weights(ModelOnly(1))
        assert (await eng.stats()).version == 0
        await pending
        t0 = now()
        await eng.update_weights(ModelOnly(1))
        return now() - t0, (await eng.stats()).version

    load_time, version = run_virtual(main())
    assert load_time == pytest.approx(2.0)
    assert version == 1


def test_kill_fails_pending_generate() -> None:
    eng = engine({1: 100, 2: 100}, max_num_seqs=1)

    async def main():
        await eng.start()
        running = asyncio.ensure_future(eng.generate(req(1)))
        waiting = asyncio.ensure_future(eng.generate(req(2)))
        await at(0.3)
        eng.kill()
        out = await asyncio.gather(running, waiting, return_exceptions=True)
        with pytest.raises(ReplicaFailure):
            await eng.generate(req(1))
        with pytest.raises(ReplicaFailure):
            await eng.stats()
        return out

    out = run_virtual(main())
    assert all(isinstance(e, ReplicaFailure) for e in out), out


def test_configured_failure_kills_at_time() -> None:
    failures = [FailureSpec(replica=1, at_s=5.0)]

    async def main(index: int):
        eng = engine({1: 1000}, index=index, failures=failures)  # would finish at 10 s
        await eng.start()
        try:
            await eng.generate(req(1))
        except ReplicaFailure:
            return "failed", now()
        return "done", now()

    assert run_virtual(main(1)) == ("failed", pytest.approx(5.0))
    assert run_virtual(main(0)) == ("done", pytest.approx(10.0))


def test_from_config_builds_seeded_engine(tmp_path: Path) -> None:
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"lengths": [33], "counts": [1]}))
    resolved = resolve(
        {},
        [
            "run.seed=5",
            "rollout.sim.lengths.kind=histogram",
            f"rollout.sim.lengths.file={hist}",
            "rollout.sim.decode_step_s=0.5",
        ],
    )
    ctx = BuildContext(resolved.cfg, resolved.engine_options["rollout"], 2, "rep2")
    eng = SimRolloutEngine.from_config(ctx)
    assert eng.replica_id == "rep2"
    assert eng.lengths.seed == 5
    (traj,) = run_virtual(run_all(eng, [(0.0, req(9))]))
    assert traj.num_response_tokens == 33
    assert traj.finish_time == pytest.approx(33 * 0.5 + 0.0)  # no prompt tokens: no prefill


# --- length models -------------------------------------------------------------------------


def test_lengths_are_deterministic_per_seed_and_key() -> None:
    a = LengthModel.lognormal(1000, 10, 100_000, seed=3)
    b = LengthModel.lognormal(1000, 10, 100_000, seed=3)
    c = LengthModel.lognormal(1000, 10, 100_000, seed=4)
    keys = list(range(200))
    forward = [a.sample(k) for k in keys]
    backward = [b.sample(k) for k in reversed(keys)][::-1]  # order does not matter
    assert forward == backward
    assert forward != [c.sample(k) for k in keys]
    assert len(set(forward)) > 150  # not a constant


def test_lognormal_tail_ratio() -> None:
    m = LengthModel.lognormal(1000, 10, 10**9, seed=0)
    xs = sorted(m.sample(k) for k in range(20_000))
    p50, p99 = xs[len(xs) // 2], xs[int(0.99 * len(xs))]
    assert p50 == pytest.approx(1000, rel=0.05)
    assert p99 / p50 == pytest.approx(10, rel=0.15)


def test_lognormal_truncated_to_max_tokens() -> None:
    m = LengthModel.lognormal(1000, 10, 2000, seed=1)
    xs = [m.sample(k) for k in range(5000)]
    assert max(xs) == 2000 and min(xs) >= 1
    assert 0.15 < xs.count(2000) / len(xs) < 0.35  # P(L > 2 * median) ~ 0.24
    tiny = LengthModel.lognormal(0.5, 10, 100)
    assert min(tiny.sample(k) for k in range(1000)) == 1


def test_lognormal_rejects_bad_parameters() -> None:
    for args in [(0, 10, 100), (100, 0.5, 100), (100, 10, 0)]:
        with pytest.raises(ValueError):
            LengthModel.lognormal(*args)


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_histogram_samples_only_listed_lengths(tmp_path: Path, fmt: str) -> None:
    if fmt == "json":
        path = tmp_path / "h.json"
        path.write_text(json.dumps({"lengths": [300, 10, 20], "counts": [2, 1, 0]}))
    else:
        path = tmp_path / "h.csv"
        path.write_text("# lengths from a math run\nlength,count\n300,2\n10,1\n\n20,0\n")
    assert read_histogram(path) == ([10, 20, 300], [1.0, 0.0, 2.0])
    m = LengthModel.histogram(path, max_tokens=1000, seed=2)
    counts = Counter(m.sample(k) for k in range(3000))
    assert set(counts) == {10, 300}  # a zero count is never drawn
    assert counts[300] / 3000 == pytest.approx(2 / 3, abs=0.05)
    assert m.sample(17) == LengthModel.histogram(path, 1000, seed=2).sample(17)
    capped = LengthModel.histogram(path, max_tokens=100, seed=2)
    assert {capped.sample(k) for k in range(500)} == {10, 100}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bad.csv", "length,count\n10,1\n20\n"),
        ("bad.csv", "10,x\n"),
        ("bad.csv", ""),
        ("bad.csv", "10,-1\n20,2\n"),
        ("bad.csv", "0,3\n"),
        ("bad.json", '{"lengths": [1, 2]}'),
        ("bad.json", '{"lengths": [1, 2], "counts": [1]}'),
        ("bad.json", "[1, 2"),
        ("bad.json", '{"lengths": [1], "counts": [0]}'),
    ],
)
def test_malformed_histogram_names_file(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LengthFileError) as info:
        LengthModel.histogram(path, max_tokens=100)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_histogram_names_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.csv"
    with pytest.raises(LengthFileError, match="cannot read") as info:
        read_histogram(path)
    assert str(path) in str(info.value)
