"""The SGLang rollout engine on SGLang's CPU engine with the tiny local model: tokens and
log-probs against transformers, abort / resume, in-place weight updates (tensors and the node
relay's shared memory, tied LM head included), stats, core's conformance kit, and a dead
SGLang scheduler surfacing as ``ReplicaFailure``.

SGLang takes 30-90 s to start here, so the module starts two engines once, concurrently
(``engines``): most tests use the first; the kit needs two and the failure test kills the
second's scheduler (it runs last).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Coroutine
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch

from laminar_core import (
    BuildContext,
    FinishReason,
    GenerationRequest,
    ReplicaFailure,
    SamplingParams,
    SharedWeights,
    TensorWeights,
    load_config,
)
from laminar_core.models import build_tiny_model
from laminar_core.testing import check_rollout_engine, require_modules, share_version

require_modules("sglang", what="laminar-sglang tests")

from laminar_sglang import SGLangOptions, SGLangRolloutEngine

OPTS = SGLangOptions(device="cpu", max_total_tokens=16384)
PROMPTS = [[72, 15, 22, 24, 34], [70, 20, 16, 11, 17, 34]]  # "c*13=", "a-27+8="
EOS = 2


class _Loop:
    """One event loop for the module's engines (their channels belong to the loop that
    started them), run in a thread; tests submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


@pytest.fixture(scope="module")
def rt():
    loop = _Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engines(rt, model_dir):
    a = SGLangRolloutEngine("a", model_dir, OPTS, model_dtype="float32")
    b = SGLangRolloutEngine("b", model_dir, OPTS, model_dtype="float32")

    async def both(method: str) -> None:
        await asyncio.gather(getattr(a, method)(), getattr(b, method)())

    try:
        rt.run(both("start"))
        yield a, b
    finally:
        rt.run(both("stop"))


@pytest.fixture(scope="module")
def engine(engines) -> SGLangRolloutEngine:
    return engines[0]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _req(tid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0):
    return GenerationRequest(
        tid,
        "g",
        prompt_ids=list(prompt),
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
        metadata={"row": 7},
    )


def _hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) of each response token: what the trainer recomputes."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _perturb(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)


async def _until(cond, timeout: float = 120.0, what: str = "condition") -> None:
    """Poll an async condition (a bounded wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- no engine needed ----------------------------------------------------------------------
def test_the_replica_names_sglangs_load_snapshot_as_sglang_does():
    """The replica computes the /dev/shm file SGLang's instance will create without
    importing SGLang: it must be the name SGLang gives it."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    from laminar_sglang.engine import snapshot_path

    for instance_id in ("15fa59d3bed7", "0123456789ab"):
        assert snapshot_path(instance_id) == shm_path_for(instance_id)


def test_options_map_to_sglang_engine_args(model_dir):
    eng = SGLangRolloutEngine("r", model_dir, OPTS, model_dtype="float32")
    kw = eng.engine_kwargs(model_dir)
    assert kw["device"] == "cpu" and kw["attention_backend"] == "torch_native"
    assert kw["dtype"] == "float32" and kw["tp_size"] == 1 and kw["max_total_tokens"] == 16384
    assert kw["incremental_streaming_output"] is True
    assert kw["custom_weight_loader"] == ["laminar_sglang.loader.load_weights"]
    assert "mem_fraction_static" not in kw  # 0: SGLang's own default
    gpu = SGLangRolloutEngine("r", model_dir, SGLangOptions(device="cuda"), gpus=4)
    assert gpu.engine_kwargs(model_dir)["tp_size"] == 4 and gpu.dtype == "bfloat16"
    assert "attention_backend" not in gpu.engine_kwargs(model_dir)
    with pytest.raises(ValueError, match="device must be one of"):
        SGLangOptions(device="tpu")
    # each replica samples from a seed of its own (rollout.sglang.seed + 1000 * run.seed + i)
    cfg = load_config(None, ["run.seed=1", "model.path=m"]).cfg
    replicas = [SGLangRolloutEngine.from_config(BuildContext(cfg, OPTS, index=i)) for i in (0, 1)]
    assert [r.engine_kwargs(model_dir)["random_seed"] for r in replicas] == [1000, 1001]
    assert OPTS.seed == 0  # the options passed in are not changed in place
    with pytest.raises(ValueError, match="stream_interval"):
        SGLangOptions(stream_interval=0)


@pytest.mark.skipif(
    not any(ep.name == "sglang" for ep in entry_points(group="laminar")),
    reason="laminar-sglang is not installed (pip install -e plugins/sglang)",
)
def test_config_key_rollout_sglang_is_validated():
    resolved = load_config(None, ["rollout.engine=sglang", "rollout.sglang.max_total_tokens=4096"])
    assert resolved.engine_options["rollout"] == SGLangOptions(max_total_tokens=4096)


def test_missing_model_and_cpu_kv_size_are_clear_errors(tmp_path, model_dir):
    eng = SGLangRolloutEngine("r0", str(tmp_path / "nope"), OPTS)
    with pytest.raises(FileNotFoundError, match="laminar tiny-model"):
        asyncio.run(eng.start())
    eng = SGLangRolloutEngine("r0", model_dir, SGLangOptions(device="cpu"))
    with pytest.raises(ValueError, match=r"rollout\.sglang\.max_total_tokens must be set"):
        asyncio.run(eng.start())


# -- one engine ----------------------------------------------------------------------------
def test_tokens_and_logprobs_match_transformers(rt, engine, hf):
    async def main():
        st = await engine.stats()
        assert st.version == 0 and st.kv_capacity_tokens == 16384 and st.running == 0
        greedy = await asyncio.gather(
            *(engine.generate(_req(f"g{i}", p, 24)) for i, p in enumerate(PROMPTS))
        )
        sampled = await engine.generate(_req("s", PROMPTS[0], 40, temperature=0.7))
        eos = await asyncio.gather(
            *(engine.generate(_req(f"e{i}", PROMPTS[1], 300, temperature=1.0)) for i in range(6))
        )
        return greedy, sampled, eos

    greedy, sampled, eos = rt.run(main())
    for prompt, t in zip(PROMPTS, greedy):
        assert t.response_ids == _hf_greedy(hf, prompt, 24)
        assert len(t.logprobs) == t.num_response_tokens == len(t.response_ids)
        assert t.metadata["row"] == 7 and t.versions == [0] and t.replicas == ["a"]
        ref = _hf_logprobs(hf, prompt, t.response_ids)
        assert (ref - torch.tensor(t.logprobs)).abs().max().item() < 1e-4
    # sampled tokens carry log_softmax(logits / T): the trainer's recomputation
    ref = _hf_logprobs(hf, PROMPTS[0], sampled.response_ids, temperature=0.7)
    assert (ref - torch.tensor(sampled.logprobs)).abs().max().item() < 1e-4
    # EOS: a trajectory that stopped ends with the EOS token and its log-prob
    stopped = [t for t in eos if t.finish_reason is FinishReason.STOP]
    assert stopped, [t.finish_reason for t in eos]
    for t in stopped:
        assert t.response_ids[-1] == EOS and len(t.logprobs) == len(t.response_ids)
        ref = _hf_logprobs(hf, PROMPTS[1], t.response_ids)
        assert (ref - torch.tensor(t.logprobs)).abs().max().item() < 1e-4


def test_abort_returns_the_partial_and_resume_finishes_it(rt, engine):
    async def main():
        full = await engine.generate(_req("u", PROMPTS[0], 400))
        task = asyncio.ensure_future(engine.generate(_req("b", PROMPTS[0], 400)))

        async def some_tokens() -> bool:
            got = await engine.partials(["b"])
            return bool(got) and got[0].num_response_tokens >= 5

        await _until(some_tokens, what="5 tokens of trajectory b")
        (p,) = await engine.abort(["b"])
        aborted = await task
        resumed = await engine.generate(dataclasses.replace(_req("b", PROMPTS[0], 400), resume=p))
        return full, p, aborted, resumed

    full, p, aborted, resumed = rt.run(main())
    assert full.finish_reason is FinishReason.LENGTH and full.num_response_tokens == 400
    assert aborted.finish_reason is FinishReason.ABORTED
    assert 5 <= p.num_response_tokens < 400 and len(p.logprobs) == len(p.response_ids)
    assert aborted.response_ids == p.response_ids and aborted.logprobs == p.logprobs
    # resumed: prefix and its log-probs kept; greedy, so it ends exactly as if never stopped
    assert resumed.response_ids[: len(p.response_ids)] == p.response_ids
    assert resumed.logprobs[: len(p.logprobs)] == p.logprobs
    assert resumed.response_ids == full.response_ids
    diff = torch.tensor(resumed.logprobs) - torch.tensor(full.logprobs)
    assert diff.abs().max().item() < 1e-4
    assert resumed.metadata["resumed_tokens"] == len(p.response_ids)
    assert resumed.finish_reason is FinishReason.LENGTH


def test_stats_reflect_running_requests(rt, engine):
    async def main():
        tasks = [
            asyncio.ensure_future(engine.generate(_req(f"r{i}", PROMPTS[0], 1000)))
            for i in range(3)
        ]
        first = []

        async def all_in() -> bool:
            st = await engine.stats()
            first.append(st)
            return st.running + st.waiting == 3

        await _until(all_in, what="three requests in the stats")
        grown = []

        async def decoding() -> bool:
            # SGLang's scheduler view: KV tokens in use grow as the three requests decode
            st = await engine.stats()
            grown.append(st)
            return st.kv_use * st.kv_capacity_tokens >= first[-1].kv_use * 16384 + 3 * 20

        await _until(decoding, what="the KV tokens in use to grow")
        await engine.abort([f"r{i}" for i in range(3)])
        await asyncio.gather(*tasks)
        return grown[-1], await engine.stats()

    busy, idle = rt.run(main())
    assert busy.running + busy.waiting == 3 and 0 < busy.kv_use <= 1
    assert busy.kv_capacity_tokens == 16384
    assert idle.running == 0 and idle.waiting == 0 and idle.kv_use == 0.0


def test_weight_updates_load_exactly_the_new_weights(rt, engine, hf, tmp_path):
    shm = tmp_path / "shm"

    def check(t, expect_version: int) -> None:
        assert t.version == expect_version
        assert t.response_ids == _hf_greedy(hf, PROMPTS[0], 30)
        ref = _hf_logprobs(hf, PROMPTS[0], t.response_ids)
        assert (ref - torch.tensor(t.logprobs)).abs().max().item() < 1e-4

    before = rt.run(engine.generate(_req("w0", PROMPTS[0], 30)))
    # in memory: every tensor perturbed; the tied head is exported once, as the embedding
    _perturb(hf, 1)
    named = list(hf.named_parameters())
    assert "lm_head.weight" not in dict(named)
    rt.run(engine.update_weights(TensorWeights(1, named)))
    assert rt.run(engine.stats()).version == 1
    u = rt.run(engine.generate(_req("w1", PROMPTS[0], 30)))
    check(u, 1)
    assert u.response_ids != before.response_ids or u.logprobs != before.logprobs
    # straight from a node relay's shared-memory file (the Ray runtime's path)
    _perturb(hf, 2)
    shared = share_version(shm, 0, 2, list(hf.named_parameters()))
    rt.run(engine.update_weights(shared))
    check(rt.run(engine.generate(_req("w2", PROMPTS[0], 30))), 2)
    # a version the relay does not share: refused before SGLang loads anything
    with pytest.raises(LookupError):
        rt.run(engine.update_weights(SharedWeights(str(shm), 0, 3)))
    assert rt.run(engine.stats()).version == 2
    check(rt.run(engine.generate(_req("w3", PROMPTS[0], 30))), 2)

    async def while_busy():
        task = asyncio.ensure_future(engine.generate(_req("d", PROMPTS[0], 1000)))
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(RuntimeError, match="in flight"):
                await engine.update_weights(TensorWeights(3, []))
        finally:
            await engine.abort(["d"])
            await task

    rt.run(while_busy())


# -- two engines ---------------------------------------------------------------------------
def test_conformance_kit(rt, engines, model_dir, monkeypatch):
    a, b = engines

    async def started() -> None:  # the module's fixture starts and stops them
        return None

    # The kit expects fresh engines serving model_dir; earlier tests in this module loaded
    # other weights into these, so both get model_dir's weights back, at one version.
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    version = 1 + max(rt.run(e.stats()).version for e in (a, b))
    for eng in (a, b):
        rt.run(eng.update_weights(TensorWeights(version, list(fresh.named_parameters()))))
        monkeypatch.setattr(eng, "start", started)
        monkeypatch.setattr(eng, "stop", started)
    by_name = {"contract-a": a, "contract-b": b}
    report = rt.run(
        check_rollout_engine(
            lambda name: by_name[name],
            prompt_ids=PROMPTS[0],
            max_tokens=16,
            expect_partial=True,
            model_dir=model_dir,  # the kit checks weight loading and log-probs against it
        )
    )
    # the optional capability a distillation teacher needs (algorithm.teacher) was checked
    assert any(rule.startswith("score()") for rule in report.checked), report


def test_dead_scheduler_is_a_replica_failure_not_a_dead_driver(rt, engines):
    """SGLang answers a child's death by killing the process that holds its engine: that is
    the replica's host process, so this process lives and the replica reports failure."""
    import psutil

    _, b = engines
    host = psutil.Process(b.host_pid)
    children = [psutil.Process(pid) for pid in b.child_pids]
    (scheduler,) = [p for p in children if "scheduler" in " ".join(p.cmdline()).lower()] or [
        children[0]
    ]

    async def main():
        task = asyncio.ensure_future(b.generate(_req("x", PROMPTS[0], 1000)))

        async def running() -> bool:
            got = await b.partials(["x"])
            return bool(got) and got[0].num_response_tokens > 0

        await _until(running, what="trajectory x to run")
        os.kill(scheduler.pid, signal.SIGKILL)
        with pytest.raises(ReplicaFailure):
            await task

        async def stats_fail() -> bool:
            try:
                await b.stats()
            except ReplicaFailure:
                return True
            return False

        await _until(stats_fail, what="stats to raise ReplicaFailure")
        with pytest.raises(ReplicaFailure):
            await b.generate(_req("y", PROMPTS[0], 10))
        await b.stop()

    rt.run(main())
    # stop() returns once SGLang's processes are gone (killed with the host's group)
    _, alive = psutil.wait_procs([host, *children], timeout=0)
    assert alive == []


# -- a start cut short (its own engines; the module's are not needed) -----------------------
def test_a_start_cut_short_leaves_no_process_and_no_shm_file(model_dir, monkeypatch):
    """SGLang cut short while it starts, after its scheduler made its load snapshot in
    /dev/shm and before it is ready: one replica stopped (a run closing while the replica
    restarts), the other's host killed (the replica sees its start fail). Neither leaves an
    SGLang process or a /dev/shm file SGLang made: the replica named SGLang's instance, so
    it knew that file before SGLang could create it."""
    import psutil

    from laminar_core import shm_files_of

    # SGLang's own test hook: the scheduler stops before it is ready (for the test's length)
    monkeypatch.setenv("SGLANG_TEST_STUCK_SCHEDULER_INIT", "3600")
    stopped = SGLangRolloutEngine("cut-stopped", model_dir, OPTS, model_dtype="float32")
    killed = SGLangRolloutEngine("cut-killed", model_dir, OPTS, model_dtype="float32")
    seen: list[str] = []
    procs: list[psutil.Process] = []

    async def snapshot_made(engine: SGLangRolloutEngine) -> bool:
        files = shm_files_of(engine.host_pid) if engine.host_pid is not None else []
        return any(os.path.basename(f).startswith("sglang_loads_") for f in files)

    def what_sglang_made(engine: SGLangRolloutEngine) -> None:
        seen.extend(shm_files_of(engine.host_pid))
        host = psutil.Process(engine.host_pid)
        procs.extend([host, *host.children(recursive=True)])

    async def main() -> None:
        starts = [asyncio.ensure_future(e.start()) for e in (stopped, killed)]
        try:
            for e in (stopped, killed):
                await _until(lambda e=e: snapshot_made(e), 600, f"{e.replica_id}'s snapshot")
            assert not any(s.done() for s in starts)  # SGLang is not ready
            for e in (stopped, killed):
                what_sglang_made(e)
            os.kill(killed.host_pid, signal.SIGKILL)
            await stopped.stop()
            for s in starts:
                with pytest.raises(RuntimeError, match="while"):
                    await s
        finally:
            for s in starts:
                s.cancel()
            await asyncio.gather(stopped.stop(), killed.stop(), return_exceptions=True)

    asyncio.run(main())
    assert any(os.path.basename(f).startswith("sglang_loads_") for f in seen)
    _, alive = psutil.wait_procs(procs, timeout=0)
    assert alive == []
    assert [f for f in seen if os.path.exists(f)] == []
