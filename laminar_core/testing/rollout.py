"""The ``RolloutEngine`` contract."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from laminar_core.interfaces import ModelOnly, RolloutEngine
from laminar_core.types import FinishReason, GenerationRequest, SamplingParams


def _request(tid: str, prompt_ids: list[int], max_tokens: int, key: int) -> GenerationRequest:
    return GenerationRequest(
        traj_id=tid,
        group_id="contract",
        prompt_ids=list(prompt_ids),
        num_prompt_tokens=len(prompt_ids) or 8,
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=key),
        metadata={"sample_key": key},
    )


async def check_rollout_engine(
    make_engine: Callable[[str], RolloutEngine],
    prompt_ids: list[int] | None = None,
    max_tokens: int = 64,
    settle_s: float = 0.05,
    expect_partial: bool = False,
) -> None:
    """Run the lifecycle of ``RolloutEngine`` against two engines from ``make_engine``.

    Checks: ``start`` then ``stats`` reports a version and no load; concurrent ``generate``
    calls each return their own finished trajectory within ``max_tokens``; ``abort``
    returns what a running trajectory produced and its ``generate`` returns ``ABORTED``;
    the partial resumes on a second engine and keeps its prefix; ``update_weights`` with
    nothing in flight changes the reported version; ``stop``. ``expect_partial`` makes a
    long trajectory that finished before its abort a failure (deterministic engines).
    """
    prompt_ids = prompt_ids or []
    a, b = make_engine("contract-a"), make_engine("contract-b")
    await a.start()
    await b.start()
    st = await a.stats()
    assert st.running == 0 and st.waiting == 0, f"fresh engine reports load: {st}"
    v0 = st.version

    outs = await asyncio.gather(
        *(a.generate(_request(f"t{i}", prompt_ids, max_tokens, i)) for i in range(4))
    )
    assert [t.traj_id for t in outs] == [f"t{i}" for i in range(4)], "results mixed up"
    for t in outs:
        assert t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), t.finish_reason
        assert 1 <= t.num_response_tokens <= max_tokens, t.num_response_tokens
        assert t.version == v0 and t.versions == [v0], "trajectory not tagged with the version"
        if t.response_ids:
            assert len(t.response_ids) == t.num_response_tokens == len(t.logprobs)

    long_req = _request("long", prompt_ids, max_tokens * 64, 10_000)
    task = asyncio.ensure_future(a.generate(long_req))
    await asyncio.sleep(settle_s)
    parts = await a.abort(["long"])
    done = await task
    assert parts or not expect_partial, "abort returned nothing for a running trajectory"
    if parts:  # it may legitimately have finished before the abort landed
        (p,) = parts
        assert p.traj_id == "long" and p.version == v0
        assert done.finish_reason is FinishReason.ABORTED, "aborted generate did not say so"
        resumed_req = _request("long", prompt_ids, max_tokens * 64, 10_000)
        resumed_req.resume = p
        if (await b.stats()).version == v0:
            resumed = await b.generate(resumed_req)
            assert resumed.num_response_tokens >= p.num_response_tokens, "resume lost the prefix"
            if p.response_ids:
                assert resumed.response_ids[: len(p.response_ids)] == p.response_ids
                assert resumed.logprobs[: len(p.logprobs)] == p.logprobs, "prefix logprobs lost"

    await a.update_weights(ModelOnly(v0 + 1))
    assert (await a.stats()).version == v0 + 1, "update_weights did not change the version"
    await a.stop()
    await b.stop()
