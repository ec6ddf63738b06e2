"""The ``RolloutEngine`` contract: what training relies on, checked against an engine.

``check_rollout_engine`` drives two replicas of the engine (one after the other, never both
at once, so a GPU engine fits) through the lifecycle the rollout manager drives, and raises
``AssertionError`` naming the broken rule and the fix. It returns a ``KitReport`` of what it
checked and what it skipped, and why: nothing is skipped silently.

Given ``model_dir`` (the Hugging Face directory the engine serves; use a tiny model, e.g.
``laminar_core.models.build_tiny_model``), it also checks the engine against a transformers
forward of the same weights: log-probs are ``log_softmax(logits / temperature)`` of the
sampled token; weights loaded as ``TensorWeights`` and as ``SharedWeights`` are the ones it
then generates with (an engine that ignores a load fails); a version it cannot load raises
and changes nothing; the end-of-sequence token ends the response and is kept in it; stop
strings stop it; a resumed trajectory continues from prompt + prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from laminar_core.interfaces import (
    ModelOnly,
    RolloutEngine,
    SharedWeights,
    TensorWeights,
    WeightsRef,
)
from laminar_core.testing.report import KitReport
from laminar_core.types import (
    FinishReason,
    GenerationRequest,
    PartialTrajectory,
    SamplingParams,
    Trajectory,
)

T = TypeVar("T")

CHECK_TEMPERATURE = 0.7  # the log-prob checks sample at this temperature: scaling must show
ATTEMPTS = 3  # tries at catching a long trajectory before it finishes
DEFAULT_TEXT = "The kit asks: 12+7="  # the prompt when none is given (with model_dir)


async def check_rollout_engine(
    engine: type[RolloutEngine] | Callable[[str], RolloutEngine],
    prompt_ids: list[int] | None = None,
    max_tokens: int = 64,
    settle_s: float = 0.05,
    expect_partial: bool = False,
    *,
    model_dir: str | Path | None = None,
    model_only: bool = False,
    options: dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
    long_tokens: int | None = None,
    logprob_atol: float = 1e-3,
    timeout_s: float = 300.0,
    strict: bool = False,
) -> KitReport:
    """Check ``engine`` against the ``RolloutEngine`` contract; returns a ``KitReport``.

    ``engine``: the engine *class* -- it is then built the way the runtime builds it
    (``engine_from_config``: ``options`` become the config's ``rollout.<name>`` section and
    are validated by ``cls.Options``, ``cls.from_config(BuildContext)`` makes each replica,
    ``overrides`` are extra ``key=value`` config lines) -- or a ``make_engine(replica_id)``
    callable (then ``from_config``/``Options`` are not checked, and the report says so).

    ``prompt_ids``: the prompt (default: ``DEFAULT_TEXT`` encoded, or none for a model-only
    engine). ``max_tokens``: the short requests' limit. ``long_tokens`` (default
    ``4 * max_tokens``): the trajectory that is aborted mid-way; prompt + ``long_tokens``
    must fit the engine's context. ``settle_s``: how often the kit polls ``partials()``.

    ``model_dir``: the model the engine serves, for the checks against transformers (see
    the module docstring); the log-probs must agree within ``logprob_atol``. An engine that
    returns token ids must be given one. ``model_only``: the engine models weights only (a
    simulator: no tokens, no tensors); weight content is then not checked, and reported so.

    ``expect_partial``: fail (instead of skipping) when the long trajectory finished before
    every abort. ``strict``: fail when anything was skipped. ``timeout_s``: per call.
    """
    kit = _Kit(
        engine,
        prompt_ids,
        max_tokens,
        settle_s,
        model_dir,
        model_only,
        options,
        list(overrides),
        long_tokens or 4 * max_tokens,
        logprob_atol,
        timeout_s,
    )
    try:
        await kit.run(expect_partial)
    finally:
        kit.cleanup()
    if strict and kit.report.skipped:
        raise AssertionError(f"strict: checks were skipped\n{kit.report}")
    return kit.report


class _Kit:
    def __init__(
        self,
        engine: Any,
        prompt_ids: list[int] | None,
        max_tokens: int,
        poll_s: float,
        model_dir: str | Path | None,
        model_only: bool,
        options: dict[str, Any] | None,
        overrides: list[str],
        long_tokens: int,
        atol: float,
        timeout_s: float,
    ) -> None:
        label = getattr(engine, "__qualname__", None) or type(engine).__name__
        self.report = KitReport(label)
        if isinstance(engine, type):
            from laminar_core.testing.reference import engine_from_config

            self.make = engine_from_config(engine, options, overrides, model_dir)
            opts = getattr(engine, "Options", None)
            how = "from_config(BuildContext)" if hasattr(engine, "from_config") else "cls(ctx)"
            self.report.ok(
                f"built as the runtime builds it: resolved config (interface checked"
                f"{', options validated by ' + opts.__name__ if opts else ''}), then {how}"
            )
        else:
            if options or overrides:
                raise ValueError("options/overrides need the engine class, not a factory")
            self.make = engine
            self.report.skip(
                "from_config / Options",
                "a make_engine factory was given: pass the engine class to build it as the "
                "runtime does",
            )
        self.ref = None
        if model_dir is not None:
            from laminar_core.testing.reference import HFReference

            self.ref = HFReference(model_dir)
        self.model_only = model_only
        if prompt_ids is None:
            prompt_ids = self.ref.encode(DEFAULT_TEXT) if self.ref is not None else []
        self.prompt = list(prompt_ids)
        self.max_tokens = max_tokens
        self.long_tokens = long_tokens
        self.poll_s = poll_s
        self.atol = atol
        self.timeout_s = timeout_s
        self.shm: str | None = None
        self.real = False  # the engine returns token ids

    def cleanup(self) -> None:
        if self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------
    async def call(self, what: str, aw: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(aw, self.timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"{what} did not return within {self.timeout_s:g} s") from None

    def request(
        self,
        tid: str,
        max_tokens: int,
        temperature: float = 1.0,
        key: int = 0,
        stop: list[str] | None = None,
    ) -> GenerationRequest:
        return GenerationRequest(
            traj_id=tid,
            group_id=f"group-{tid}",
            prompt_ids=list(self.prompt),
            num_prompt_tokens=len(self.prompt) or 8,
            sampling=SamplingParams(
                temperature=temperature, max_tokens=max_tokens, seed=key, stop=list(stop or [])
            ),
            # what a reward reads: the prompt's row, nested values included
            metadata={"sample_key": key, "kit_row": {"id": tid, "answer": [key, "x"]}},
        )

    def check_traj(self, t: Trajectory, req: GenerationRequest, version: int) -> None:
        """The rules every finished trajectory keeps."""
        tid = req.traj_id
        assert isinstance(t, Trajectory), f"generate({tid}) returned {type(t).__name__}"
        assert t.traj_id == tid, f"generate({tid}) returned trajectory {t.traj_id!r}"
        assert t.group_id == req.group_id, f"{tid}: group_id {t.group_id!r} is not the request's"
        assert t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (
            f"{tid}: finish_reason {t.finish_reason} (a trajectory nobody aborted ends STOP or "
            f"LENGTH){': ' + t.error if t.error else ''}"
        )
        limit = req.sampling.max_tokens
        assert t.num_response_tokens >= 1, (
            f"{tid}: no response tokens; a finished trajectory has at least one (a response "
            "that ended on EOS keeps the EOS token, with its log-prob)"
        )
        assert t.num_response_tokens <= limit, (
            f"{tid}: {t.num_response_tokens} response tokens; max_tokens is {limit} (it bounds "
            "the whole response, a resumed prefix included)"
        )
        if t.finish_reason is FinishReason.LENGTH:
            assert t.num_response_tokens == limit, (
                f"{tid}: finish_reason LENGTH after {t.num_response_tokens} of {limit} tokens"
            )
        assert t.version == version and t.versions == [version], (
            f"{tid}: tagged version={t.version}, versions={t.versions}; the engine holds "
            f"version {version} (tag every trajectory with the version that generated it)"
        )
        missing = {k: v for k, v in req.metadata.items() if t.metadata.get(k, _NONE) != v}
        assert not missing, (
            f"{tid}: Trajectory.metadata lacks the request's {sorted(missing)}: copy "
            "request.metadata into the Trajectory (the reward reads the prompt's row from it; "
            "without it every reward fails and nothing trains)"
        )
        if t.response_ids:
            self.real = True
        if self.real or self.ref is not None:
            assert t.response_ids, f"{tid}: no response_ids (a real engine returns its tokens)"
            assert len(t.response_ids) == t.num_response_tokens == len(t.logprobs), (
                f"{tid}: {len(t.response_ids)} response_ids, num_response_tokens "
                f"{t.num_response_tokens}, {len(t.logprobs)} logprobs: one log-prob per token"
            )
            assert list(t.prompt_ids) == list(req.prompt_ids), (
                f"{tid}: prompt_ids differ from the request's (the trainer scores prompt + "
                "response)"
            )
            bad = [x for x in t.logprobs if not (math.isfinite(x) and x <= 1e-6)]
            assert not bad, f"{tid}: log-probs must be finite and <= 0, got {bad[:3]}"

    async def generate_all(
        self, engine: RolloutEngine, reqs: list[GenerationRequest], version: int, what: str
    ) -> list[Trajectory]:
        outs = await self.call(what, asyncio.gather(*(engine.generate(r) for r in reqs)))
        for t, r in zip(outs, reqs, strict=True):
            self.check_traj(t, r, version)
        return outs

    def check_logprobs(
        self,
        trajs: list[Trajectory],
        temperature: float,
        what: str,
        before: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The engine's log-probs are the reference's under the current weights; ``before``:
        the weights the engine held before a load (to name an ignored load as such)."""
        assert self.ref is not None

        def gap(temp: float, state: dict[str, torch.Tensor] | None = None) -> float:
            worst = 0.0
            for t in trajs:
                ref = self.ref.logprobs(list(t.prompt_ids), list(t.response_ids), temp, state)
                got = torch.tensor(t.logprobs, dtype=torch.float64)
                worst = max(worst, float((ref - got).abs().max()))
            return worst

        diff = gap(temperature)
        if diff <= self.atol:
            if before is not None:
                assert gap(temperature, before) > self.atol, (
                    f"logprob_atol={self.atol:g} is too large to tell the versions apart"
                )
            return
        if before is not None and gap(temperature, before) <= self.atol:
            hint = (
                "they match the weights held before the load: the engine ignored the loaded "
                "weights (load every (name, tensor) the WeightsRef yields, Hugging Face names)"
            )
        elif temperature != 1.0 and gap(1.0) <= self.atol:
            hint = (
                "they match log_softmax(logits) without the temperature: report "
                f"log_softmax(logits / temperature) (temperature {temperature} here)"
            )
        else:
            hint = (
                "a log-prob is log_softmax(logits / temperature) of the sampled token, in the "
                "weights the engine holds"
            )
        raise AssertionError(
            f"{what}: the engine's log-probs differ from a transformers forward of those "
            f"weights by up to {diff:.3g} (logprob_atol={self.atol:g}); {hint}"
        )

    async def load(self, engine: RolloutEngine, weights: WeightsRef) -> None:
        kind = type(weights).__name__
        await self.call(f"update_weights({kind})", engine.update_weights(weights))
        got = (await self.call("stats", engine.stats())).version
        assert got == weights.version, (
            f"after update_weights({kind} v{weights.version}) stats().version is {got}: the "
            "engine holds weights.version once update_weights returns"
        )

    # -- the lifecycle -----------------------------------------------------------------------
    async def run(self, expect_partial: bool) -> None:
        a = self.make("contract-a")
        await self.call("start", a.start())
        try:
            st = await self.call("stats", a.stats())
            assert st.running == 0 and st.waiting == 0, f"a fresh engine reports load: {st}"
            assert 0.0 <= st.kv_use <= 1.0, f"stats().kv_use must be in [0, 1]: {st}"
            v0 = st.version
            await self.concurrent(a, v0)
            partial = await self.abort_and_resume(a, v0, expect_partial)
            await self.stop_strings(a, v0)
            await self.weights(a, v0)
        finally:
            await self.call("stop", a.stop())
        if partial is None:
            return
        if self.ref is not None:
            self.ref.restore()  # the second replica starts from model_dir's weights
        b = self.make("contract-b")
        await self.call("start", b.start())
        try:
            vb = (await self.call("stats", b.stats())).version
            if vb != partial[1].version:
                self.report.skip(
                    "resume on another replica",
                    f"a fresh replica holds version {vb}, the partial {partial[1].version}",
                )
                return
            await self.resume(b, *partial, vb)
            self.report.ok("a partial resumes on another replica of its version")
        finally:
            await self.call("stop", b.stop())

    async def concurrent(self, a: RolloutEngine, v0: int) -> None:
        temp = CHECK_TEMPERATURE if self.ref is not None else 1.0
        reqs = [self.request(f"t{i}", self.max_tokens, temp, key=i) for i in range(4)]
        outs = await self.generate_all(a, reqs, v0, "4 concurrent generate calls")
        self.report.ok("concurrent generate calls: each its own trajectory, within max_tokens")
        self.report.ok("Trajectory.metadata carries request.metadata (rewards read it)")
        self.report.ok("trajectories tagged with the version that generated them")
        if self.real and self.ref is None and not self.model_only:
            raise AssertionError(
                "the engine returns token ids, so the kit must check that it loads weights and "
                "reports the right log-probs: pass model_dir= (the Hugging Face directory it "
                "serves; laminar_core.models.build_tiny_model makes one), or model_only=True "
                "for an engine that only models weights"
            )
        if self.ref is not None:
            self.check_logprobs(outs, temp, "the weights of model_dir")
            self.report.ok("log-probs are log_softmax(logits / temperature) of the sampled tokens")
        else:
            self.report.skip("log-probs", "no model_dir: the engine's numbers are not checked")

    async def abort_and_resume(
        self, a: RolloutEngine, v0: int, expect_partial: bool
    ) -> tuple[GenerationRequest, PartialTrajectory] | None:
        finished: list[str] = []
        for attempt in range(ATTEMPTS):
            tid = f"long{attempt}"
            req = self.request(tid, self.long_tokens, 1.0, key=10_000 + attempt)
            task = asyncio.ensure_future(a.generate(req))
            await asyncio.sleep(0)  # generate runs up to its first await
            if task.done() and task.exception() is None:
                raise AssertionError(
                    f"generate ran a {self.long_tokens}-token request to its end without once "
                    "yielding to the event loop: the engine blocks the event loop (the "
                    "manager, the heartbeats and the other replicas stop meanwhile); run the "
                    "model off the loop (asyncio.to_thread, or a worker process)"
                )
            seen: PartialTrajectory | None = None
            # poll soon, then back off to poll_s: a small model decodes a long request in
            # tens of milliseconds, and one fixed interval would let it finish unseen
            wait = 0.001
            while not task.done():
                parts = await self.call("partials", a.partials([tid]))
                if parts:
                    assert len(parts) == 1 and parts[0].traj_id == tid, (
                        f"partials([{tid!r}]) returned {[p.traj_id for p in parts]}"
                    )
                    _check_growth(seen, parts[0], "partials()")
                    seen = parts[0]
                    if seen.num_response_tokens >= 2:
                        break
                await asyncio.sleep(wait)
                wait = min(2 * wait, self.poll_s)
            if task.done():
                t = task.result()
                finished.append(f"{t.finish_reason.value} after {t.num_response_tokens} tokens")
                continue
            st = await self.call("stats", a.stats())
            assert st.running + st.waiting >= 1, (
                f"stats() reports no load while {tid} is in flight: {st} (the manager and "
                "repack read running/waiting/kv_use)"
            )
            everyone = await self.call("partials", a.partials(None))
            assert tid in [p.traj_id for p in everyone], "partials(None) omits a running one"
            parts = await self.call("abort", a.abort([tid]))
            done = await self.call(f"the aborted generate({tid})", task)
            if not parts:
                assert done.finish_reason is not FinishReason.ABORTED, (
                    f"abort([{tid!r}]) returned nothing, yet its generate returned ABORTED"
                )
                finished.append(f"{done.finish_reason.value} before the abort landed")
                continue
            assert len(parts) == 1, f"abort([{tid!r}]) returned {len(parts)} partials"
            p = parts[0]
            assert p.traj_id == tid and p.version == v0, (
                f"abort's partial: traj_id {p.traj_id!r}, version {p.version} (want {tid!r}, {v0})"
            )
            _check_growth(seen, p, "abort()")
            assert done.finish_reason is FinishReason.ABORTED, (
                f"abort([{tid!r}]) returned its partial but generate returned "
                f"{done.finish_reason.value}: an aborted trajectory's generate returns "
                "finish_reason=ABORTED (the manager resumes it elsewhere)"
            )
            if done.response_ids or p.response_ids:
                assert list(done.response_ids) == list(p.response_ids), (
                    "the ABORTED trajectory's tokens differ from abort's partial"
                )
            st = await self.call("stats", a.stats())
            assert st.running == 0 and st.waiting == 0, f"stats() after the abort: {st}"
            self.report.ok("partials() reports progress without stopping the trajectory")
            self.report.ok("abort() returns what was produced; its generate returns ABORTED")
            self.report.ok("stats() counts a running trajectory, and no longer once aborted")
            await self.resume(a, req, p, v0)
            self.report.ok("a partial resumes (prompt + prefix re-prefilled, prefix kept)")
            return req, p
        why = (
            f"the long trajectory finished before the abort in each of {ATTEMPTS} attempts "
            f"({'; '.join(finished)})"
        )
        if expect_partial:
            raise AssertionError(
                f"{why}, so abort and resume were not checked; the trajectories had finished, "
                f"abort did not fail. Give them room: long_tokens (now {self.long_tokens}) "
                "within the engine's context"
            )
        self.report.skip("abort / partials / resume", why)
        return None

    async def resume(
        self, engine: RolloutEngine, req: GenerationRequest, p: PartialTrajectory, version: int
    ) -> None:
        r = dataclasses.replace(req, resume=p)
        t = await self.call(f"generate({req.traj_id}, resume=...)", engine.generate(r))
        self.check_traj(t, r, version)
        assert t.num_response_tokens >= p.num_response_tokens, (
            f"the resumed trajectory has {t.num_response_tokens} tokens, its prefix had "
            f"{p.num_response_tokens}: resume keeps the prefix"
        )
        if p.response_ids:
            n = len(p.response_ids)
            assert list(t.response_ids[:n]) == list(p.response_ids), "resume lost the prefix"
            assert list(t.logprobs[:n]) == list(p.logprobs), "resume lost the prefix's logprobs"
        if self.ref is not None:
            self.check_logprobs([t], 1.0, "a resumed trajectory (prompt + prefix re-prefilled)")

    async def stop_strings(self, a: RolloutEngine, v0: int) -> None:
        rule = "stop strings end the response at the token that completes one"
        if self.ref is None:
            self.report.skip(rule, "no model_dir: the kit cannot decode the response")
            return
        (g,) = await self.generate_all(
            a, [self.request("greedy", self.max_tokens, 0.0)], v0, "a greedy generate"
        )
        ids = list(g.response_ids)
        text = self.ref.decode(ids)
        stop = next(
            (
                text[i : i + 2]
                for i in range(len(text) // 2, len(text) - 1)
                if text[i : i + 2].strip()
            ),
            "",
        )
        if len(text) < 4 or not stop:
            self.report.skip(rule, f"the greedy response is too short to cut: {text!r}")
            return
        (s,) = await self.generate_all(
            a,
            [self.request("stopped", self.max_tokens, 0.0, stop=[stop])],
            v0,
            "a greedy generate with a stop string",
        )
        got = list(s.response_ids)
        assert got == ids[: len(got)], (
            "two greedy (temperature 0) generations of one prompt differ: temperature 0 "
            f"is greedy decoding ({ids[:8]}... vs {got[:8]}...)"
        )
        assert s.finish_reason is FinishReason.STOP, (
            f"with stop=[{stop!r}] the greedy response {text!r} ended {s.finish_reason.value}"
        )
        cut = self.ref.decode(got)
        assert stop in cut and stop not in self.ref.decode(got[:-1]), (
            f"with stop=[{stop!r}] the response must end at the token that completes the "
            f"first {stop!r} (that token kept), got {cut!r} from greedy {text!r}"
        )
        self.report.ok(rule)
        self.report.ok("temperature 0 is greedy (reproducible)")

    async def weights(self, a: RolloutEngine, v0: int) -> None:
        if self.ref is None:
            await self.load(a, ModelOnly(v0 + 1))
            await self.generate_all(
                a, [self.request("after", self.max_tokens)], v0 + 1, "generate after a load"
            )
            self.report.ok("update_weights(ModelOnly) sets the version")
            self.report.skip(
                "weight content (TensorWeights, SharedWeights)",
                "model-only engine" if self.model_only or not self.real else "no model_dir",
            )
            return
        ref, temp = self.ref, CHECK_TEMPERATURE
        reqs = [self.request(f"w{i}", self.max_tokens, temp, key=100 + i) for i in range(2)]

        before = ref.state()
        ref.perturb(seed=1)
        await self.load(a, TensorWeights(v0 + 1, ref.weights()))
        outs = await self.generate_all(a, reqs, v0 + 1, "generate after update_weights")
        self.check_logprobs(outs, temp, "after update_weights(TensorWeights)", before)
        self.report.ok("update_weights(TensorWeights): generates with the loaded weights")

        before = ref.state()
        ref.perturb(seed=2)
        self.shm = tempfile.mkdtemp(
            prefix="laminar-kit-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
        from laminar_core.testing.relay import share_version

        await self.load(a, share_version(self.shm, 0, v0 + 2, ref.weights()))
        outs = await self.generate_all(a, reqs, v0 + 2, "generate after update_weights")
        self.check_logprobs(outs, temp, "after update_weights(SharedWeights)", before)
        self.report.ok("update_weights(SharedWeights): generates with the node relay's version")

        missing = SharedWeights(self.shm, 0, v0 + 50)
        try:
            await self.call("update_weights(SharedWeights)", a.update_weights(missing))
        except AssertionError:
            raise
        except Exception:
            pass
        else:
            raise AssertionError(
                "update_weights(SharedWeights of a version the relay does not share) returned "
                "normally: it must raise (iterating the reference raises LookupError) and keep "
                "the weights it has"
            )
        assert (await self.call("stats", a.stats())).version == v0 + 2, (
            "a failed update_weights changed the version"
        )
        outs = await self.generate_all(a, reqs, v0 + 2, "generate after a failed load")
        self.check_logprobs(outs, temp, "after a failed update_weights")
        self.report.ok("a version that cannot be loaded raises and changes nothing")

        before = ref.state()
        eos = ref.force_eos(self.prompt)
        await self.load(a, TensorWeights(v0 + 3, ref.weights()))
        rule = "the end-of-sequence token ends the response, kept with its log-prob"
        if eos is None:
            self.report.skip(rule, "the model has no EOS id the kit could make certain")
        else:
            (t,) = await self.generate_all(
                a, [self.request("eos", self.max_tokens, 1.0)], v0 + 3, "generate to EOS"
            )
            self.check_logprobs([t], 1.0, "weights that make EOS the first token", before)
            assert t.finish_reason is FinishReason.STOP and list(t.response_ids) == [eos], (
                f"with weights that make EOS (id {eos}) the first token, the response is "
                f"{list(t.response_ids)[:8]} ({t.finish_reason.value}): the engine stops at "
                "EOS and keeps it in response_ids with its log-prob (the trainer learns to "
                "stop from it)"
            )
            self.report.ok(rule)

        await self.load(a, ModelOnly(v0 + 4))
        self.report.ok("update_weights(ModelOnly) sets the version")


_NONE = object()


def _check_growth(seen: PartialTrajectory | None, p: PartialTrajectory, who: str) -> None:
    """A later snapshot of one trajectory extends the earlier one."""
    assert len(p.response_ids) == len(p.logprobs), f"{who}: one log-prob per token"
    if p.response_ids:
        assert len(p.response_ids) == p.num_response_tokens, f"{who}: num_response_tokens"
    if seen is None:
        return
    assert p.num_response_tokens >= seen.num_response_tokens, (
        f"{who}: {p.num_response_tokens} tokens after an earlier snapshot had "
        f"{seen.num_response_tokens}"
    )
    n = len(seen.response_ids)
    assert list(p.response_ids[:n]) == list(seen.response_ids), f"{who}: the prefix changed"
