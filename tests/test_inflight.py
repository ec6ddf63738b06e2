"""The rollout engines' shared bookkeeping: ``InFlightTrajectories`` (what ``abort`` and
``partials`` return, the finished ``Trajectory``), ``ShmScratch`` (weight files in shared
memory) and ``free_port``."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar_core import (
    FinishReason,
    GenerationRequest,
    InFlightTrajectories,
    PartialTrajectory,
    SamplingParams,
    ShmScratch,
    TensorWeights,
    free_port,
)


def _request(tid: str = "t0", max_tokens: int = 8, resume=None) -> GenerationRequest:
    return GenerationRequest(
        tid,
        "g0",
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=max_tokens),
        resume=resume,
        metadata={"row": {"answer": 7}},
    )


def test_a_tracked_trajectory_is_in_flight_until_the_block_ends() -> None:
    book = InFlightTrajectories("r0")
    with pytest.raises(ValueError), book.track(_request(), 3, "t0#0") as live:
        assert "t0" in book and book.find("t0#0") is live and len(book) == 1
        live.tokens += [5, 6]
        live.logprobs += [-0.5]  # a decode thread between its two appends
        (p,) = book.partials(None)
        assert (p.response_ids, p.logprobs, p.version, p.versions) == ([5], [-0.5], 3, [3])
        assert book.held_tokens() == 5 and book.held_tokens(block_size=4) == 8
        with pytest.raises(RuntimeError, match="update_weights with 1 trajectories in flight"):
            book.require_idle()
        raise ValueError("the engine failed")
    assert live.done.is_set() and len(book) == 0 and book.find("t0#0") is None
    assert book.partials(["t0"]) == []
    book.require_idle()


def test_a_resumed_request_continues_its_prefix_and_versions() -> None:
    prior = PartialTrajectory("t0", 2, [5, 6], [-0.1, -0.2], 2, versions=[1, 2])
    book = InFlightTrajectories("r1")
    with book.track(_request(max_tokens=5, resume=prior), 4) as live:
        assert live.input_ids == [1, 2, 3, 5, 6] and live.remaining == 3
        live.tokens.append(9)
        live.logprobs.append(-0.3)
        live.finish = "stop"
        live.cached_tokens = 4  # the engine's prefix cache served 4 of the 5 prompt tokens
    t = book.trajectory(live)
    assert t.response_ids == [5, 6, 9] and t.logprobs == [-0.1, -0.2, -0.3]
    assert (t.version, t.versions, t.replicas) == (1, [1, 2, 4], ["r1"])
    assert t.finish_reason is FinishReason.STOP and t.num_response_tokens == 3
    assert t.metadata == {"row": {"answer": 7}, "resumed_tokens": 2, "cached_prompt_tokens": 4}
    assert t.prompt_ids == [1, 2, 3] and t.num_prompt_tokens == 3
    with book.track(_request(max_tokens=2, resume=prior), 2) as live:  # nothing left to do
        assert live.remaining == 0
    t = book.trajectory(live)
    assert t.finish_reason is FinishReason.LENGTH and t.versions == [1, 2]


@pytest.mark.parametrize(
    ("finish", "aborted", "reason"),
    [
        ("length", False, FinishReason.LENGTH),
        ("stop", False, FinishReason.STOP),
        ("eos", False, FinishReason.STOP),
        ("abort", False, FinishReason.ABORTED),
        ("length", True, FinishReason.ABORTED),
    ],
)
def test_finish_reasons(finish: str, aborted: bool, reason: FinishReason) -> None:
    book = InFlightTrajectories("r0")
    with book.track(_request(), 0) as live:
        live.finish, live.aborted = finish, aborted
    assert book.trajectory(live).finish_reason is reason


def test_abort_stops_the_requests_and_returns_their_last_tokens() -> None:
    async def main() -> None:
        book = InFlightTrajectories("r0")
        stopped: list[list[str]] = []
        ended = {"a": asyncio.Event(), "q": asyncio.Event()}

        async def generate(tid: str, started: bool = True):
            with book.track(_request(tid), 0, f"{tid}#x", started=started) as live:
                live.tokens.append(1)
                live.logprobs.append(-1.0)
                await ended[tid].wait()  # the engine's stream
                live.tokens.append(2)  # its last piece, handed back by the abort
                live.logprobs.append(-2.0)
            return book.trajectory(live)

        async def stop(lives) -> None:
            stopped.append([live.request_id for live in lives])
            for live in lives:
                asyncio.get_running_loop().call_later(0.01, ended[live.request.traj_id].set)

        running = asyncio.ensure_future(generate("a"))
        queued = asyncio.ensure_future(generate("q", started=False))
        await asyncio.sleep(0)
        assert await book.abort(["gone"], stop) == [] and stopped == []
        parts = await book.abort(["a", "gone"], stop)
        assert stopped == [["a#x"]]
        assert [(p.traj_id, p.response_ids) for p in parts] == [("a", [1, 2])]
        assert (await running).finish_reason is FinishReason.ABORTED
        # a trajectory not started yet: its snapshot at once, without waiting for it
        (p,) = await asyncio.wait_for(book.abort(["q"]), 5)
        assert p.response_ids == [1] and not queued.done()
        ended["q"].set()
        assert (await queued).finish_reason is FinishReason.ABORTED

    asyncio.run(main())


def test_scratch_removes_the_files_of_dead_processes_only(tmp_path: Path) -> None:
    """tmpfs is RAM: a replica killed mid-update leaves its weight file behind; the next
    engine to start on the node removes the directories of processes that are gone."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    scratch = ShmScratch("laminar-test-", root=tmp_path)
    (tmp_path / f"laminar-test-{gone}").mkdir()
    (tmp_path / f"laminar-test-{gone}" / "r0-v3-x.safetensors").write_bytes(b"w")
    mine = scratch.dir()
    (mine / "r1-v4-y.safetensors").write_bytes(b"w")
    (tmp_path / "laminar-test-notapid").mkdir()
    scratch.remove_orphans()
    assert not (tmp_path / f"laminar-test-{gone}").exists()
    assert (mine / "r1-v4-y.safetensors").exists()  # this process's own: kept
    assert (tmp_path / "laminar-test-notapid").exists()  # not ours to judge
    scratch.release()
    assert mine.exists()  # not empty: another engine of this process still uses it


def test_scratch_stages_tensors_as_safetensors_and_removes_the_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    scratch = ShmScratch("laminar-test-", root=tmp_path)
    weights = TensorWeights(5, [("w", torch.arange(6.0).reshape(2, 3).t())])  # not contiguous
    with scratch.safetensors(weights, "r0") as path:
        assert Path(path).name.startswith("r0-v5-") and Path(path).parent == scratch.path
        assert torch.equal(load_file(path)["w"], torch.arange(6.0).reshape(2, 3).t())
    assert not Path(path).exists()
    scratch.release()
    assert not scratch.path.exists()


def test_free_port_is_free() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
