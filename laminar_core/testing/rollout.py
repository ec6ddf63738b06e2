"""The ``RolloutEngine`` contract: what training relies on, checked against an engine.

``check_rollout_engine`` drives two replicas of the engine (one after the other, never both
at once, so a GPU engine fits) through the lifecycle the rollout manager drives, and raises
``ContractError`` (an ``AssertionError``, raised explicitly: the kit checks the same under
``python -O``) naming the broken rule and the fix. It returns a ``KitReport`` of what it
checked and what it skipped, and why: nothing is skipped silently.

Given ``model_dir`` (the Hugging Face directory the engine serves; use a tiny model, e.g.
``laminar_core.build_tiny_model``), it also checks the engine against a transformers
forward of the same weights: log-probs are ``log_softmax(logits / temperature)`` of the
sampled token; weights loaded as ``TensorWeights`` and as ``SharedWeights`` are the ones it
then generates with (an engine that ignores a load fails); a version it cannot load raises
and changes nothing; the end-of-sequence token ends the response and is kept in it; stop
strings stop it; a resumed trajectory continues from prompt + prefix.

While trajectories are generating, a watchdog measures how long the engine's code holds the
event loop at a time (``generate`` itself, or a background task that decodes for it): more
than ``max_block_s`` fails, naming the code; so does a long trajectory that could not be
caught in flight because the engine held the loop for most of its life.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
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
from laminar_core.testing.loopwatch import LoopWatch, Stall
from laminar_core.testing.report import ContractError, KitReport, require
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
# A long trajectory that finished unseen while engine code held the loop for at least this
# share of its life (and at least BLOCKED_MIN_S) was hidden by the engine, not too short.
BLOCKED_SHARE = 0.5
BLOCKED_MIN_S = 0.05
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
    max_block_s: float = 0.5,
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
    ``max_block_s``: the longest the engine's code may hold the event loop at a time while
    trajectories are generating.
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
        max_block_s,
    )
    kit.watch.start()
    try:
        await kit.run(expect_partial)
    finally:
        kit.watch.stop()
        kit.cleanup()
    if strict and kit.report.skipped:
        raise ContractError(f"strict: checks were skipped\n{kit.report}")
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
        max_block_s: float,
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
        self.max_block_s = max_block_s
        self.watch = LoopWatch()
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
            raise ContractError(
                f"{what} did not return within {self.timeout_s:g} s (timeout_s): a call that "
                "hangs stalls the replica's driver"
            ) from None

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[_Watched]:
        """Fail when the engine's code holds the event loop longer than ``max_block_s`` at a
        time during the block (not nested: the kit's own work runs outside); the longest
        stall is the yielded object's ``stall`` after it."""
        watched = _Watched()
        self.watch.arm()
        try:
            yield watched
        finally:
            stall = watched.stall = self.watch.disarm()
            if stall.held_s > self.max_block_s:
                raise self.blocking(
                    f"during {what}, code on the event loop held it for {stall.held_s:.2f} s "
                    f"(max_block_s={self.max_block_s:g})",
                    stall,
                )

    @staticmethod
    def blocking(what: str, stall: Stall, more: str = "") -> ContractError:
        return ContractError(
            f"{what} without yielding ({stall.at()}): the engine blocks the event loop (the "
            "manager, the heartbeats and the other replicas stop meanwhile, and abort and "
            "partials wait); run the model off the loop (asyncio.to_thread, or a worker "
            f"process), also in a background task that decodes for generate{more}"
        )

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
        require(
            isinstance(t, Trajectory),
            f"generate({tid}) returned {type(t).__name__}: return a laminar_core.Trajectory",
        )
        require(
            t.traj_id == tid and t.group_id == req.group_id,
            f"generate({tid}) returned trajectory {t.traj_id!r} of group {t.group_id!r}: "
            f"copy the request's traj_id and group_id ({tid!r}, {req.group_id!r})",
        )
        require(
            t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH),
            f"{tid}: finish_reason {t.finish_reason} (a trajectory nobody aborted ends STOP or "
            f"LENGTH){': ' + t.error if t.error else ''}",
        )
        limit = req.sampling.max_tokens
        require(
            t.num_response_tokens >= 1,
            f"{tid}: no response tokens; a finished trajectory has at least one (a response "
            "that ended on EOS keeps the EOS token, with its log-prob)",
        )
        require(
            t.num_response_tokens <= limit,
            f"{tid}: {t.num_response_tokens} response tokens; max_tokens is {limit} (it bounds "
            "the whole response, a resumed prefix included)",
        )
        require(
            t.finish_reason is not FinishReason.LENGTH or t.num_response_tokens == limit,
            f"{tid}: finish_reason LENGTH after {t.num_response_tokens} of {limit} tokens "
            "(LENGTH means max_tokens was reached; an end-of-sequence token or a stop string "
            "is STOP)",
        )
        require(
            t.version == version and t.versions == [version],
            f"{tid}: tagged version={t.version}, versions={t.versions}; the engine holds "
            f"version {version} (tag every trajectory with the version that generated it)",
        )
        missing = {k: v for k, v in req.metadata.items() if t.metadata.get(k, _NONE) != v}
        require(
            not missing,
            f"{tid}: Trajectory.metadata lacks the request's {sorted(missing)}: copy "
            "request.metadata into the Trajectory (the reward reads the prompt's row from it; "
            "without it every reward fails and nothing trains)",
        )
        if t.response_ids:
            self.real = True
        if not (self.real or self.ref is not None):
            return
        require(t.response_ids, f"{tid}: no response_ids (a real engine returns its tokens)")
        require(
            len(t.response_ids) == t.num_response_tokens == len(t.logprobs),
            f"{tid}: {len(t.response_ids)} response_ids, num_response_tokens "
            f"{t.num_response_tokens}, {len(t.logprobs)} logprobs: one log-prob per token",
        )
        require(
            list(t.prompt_ids) == list(req.prompt_ids),
            f"{tid}: prompt_ids differ from the request's: return the request's prompt_ids "
            "(the trainer scores prompt + response)",
        )
        bad = [x for x in t.logprobs if not (math.isfinite(x) and x <= 1e-6)]
        require(
            not bad,
            f"{tid}: log-probs must be finite and <= 0, got {bad[:3]}: report "
            "log_softmax(logits / temperature) of each sampled token",
        )

    async def generate_all(
        self, engine: RolloutEngine, reqs: list[GenerationRequest], version: int, what: str
    ) -> list[Trajectory]:
        with self.watching(what):
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
        reference = self.ref
        if reference is None:  # the kit's own bug, not the engine's
            raise RuntimeError("check_logprobs needs model_dir")

        def gap(temp: float, state: dict[str, torch.Tensor] | None = None) -> float:
            worst = 0.0
            for t in trajs:
                ref = reference.logprobs(list(t.prompt_ids), list(t.response_ids), temp, state)
                got = torch.tensor(t.logprobs, dtype=torch.float64)
                worst = max(worst, float((ref - got).abs().max()))
            return worst

        diff = gap(temperature)
        if diff <= self.atol:
            if before is not None:
                require(
                    gap(temperature, before) > self.atol,
                    f"logprob_atol={self.atol:g} is too large to tell the versions apart: "
                    "pass a smaller one",
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
        raise ContractError(
            f"{what}: the engine's log-probs differ from a transformers forward of those "
            f"weights by up to {diff:.3g} (logprob_atol={self.atol:g}); {hint}"
        )

    async def load(self, engine: RolloutEngine, weights: WeightsRef) -> None:
        kind = type(weights).__name__
        await self.call(f"update_weights({kind})", engine.update_weights(weights))
        got = (await self.call("stats", engine.stats())).version
        require(
            got == weights.version,
            f"after update_weights({kind} v{weights.version}) stats().version is {got}: the "
            "engine holds weights.version once update_weights returns",
        )

    # -- the lifecycle -----------------------------------------------------------------------
    async def run(self, expect_partial: bool) -> None:
        a = self.make("contract-a")
        await self.call("start", a.start())
        try:
            st = await self.call("stats", a.stats())
            require(
                st.running == 0 and st.waiting == 0 and 0.0 <= st.kv_use <= 1.0,
                f"a fresh engine reports {st}: running and waiting count the trajectories in "
                "flight (none yet), kv_use is the share of the KV cache in use, in [0, 1]",
            )
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
            raise ContractError(
                "the engine returns token ids, so the kit must check that it loads weights and "
                "reports the right log-probs: pass model_dir= (the Hugging Face directory it "
                "serves; laminar_core.build_tiny_model makes one), or model_only=True "
                "for an engine that only models weights"
            )
        if self.ref is not None:
            self.check_logprobs(outs, temp, "the weights of model_dir")
            self.report.ok("log-probs are log_softmax(logits / temperature) of the sampled tokens")
        else:
            self.report.skip("log-probs", "no model_dir: the engine's numbers are not checked")
        await self.scoring(a, outs)

    async def scoring(self, a: RolloutEngine, outs: list[Trajectory]) -> None:
        """The optional ``score`` (``scores_tokens``): one log-prob per response token, each
        ``log_softmax(logits)`` (temperature 1) of that token after the same prefix, as a
        transformers forward computes it; concurrent calls are each their own."""
        rule = "score(): log_softmax(logits) of each given token after its prefix"
        if not getattr(a, "scores_tokens", False):
            self.report.skip(rule, "scores_tokens is False (an optional capability)")
            return
        if self.ref is None:
            self.report.skip(rule, "no model_dir: the engine's numbers are not checked")
            return
        trajs = [t for t in outs if t.response_ids]
        got = await self.call(
            "score",
            asyncio.gather(*(a.score(list(t.prompt_ids), list(t.response_ids)) for t in trajs)),
        )
        worst = 0.0
        for t, lps in zip(trajs, got, strict=True):
            require(
                len(lps) == len(t.response_ids),
                f"score() returned {len(lps)} log-probs for {len(t.response_ids)} response "
                "tokens: one per response token (the prompt's own are not scored)",
            )
            ref = self.ref.logprobs(list(t.prompt_ids), list(t.response_ids), 1.0)
            worst = max(worst, float((ref - torch.tensor(lps, dtype=torch.float64)).abs().max()))
        require(
            worst <= self.atol,
            f"score(): the log-probs differ from a transformers forward of the same weights by "
            f"up to {worst:.3g} (logprob_atol={self.atol:g}); each is log_softmax(logits) of "
            "the given token at temperature 1, under the weights the engine holds",
        )
        self.report.ok(rule)

    async def abort_and_resume(
        self, a: RolloutEngine, v0: int, expect_partial: bool
    ) -> tuple[GenerationRequest, PartialTrajectory] | None:
        finished: list[str] = []
        for attempt in range(ATTEMPTS):
            req = self.request(f"long{attempt}", self.long_tokens, 1.0, key=10_000 + attempt)
            with self.watching(f"the {self.long_tokens}-token request {req.traj_id}") as watched:
                began = time.monotonic()
                caught = await self.catch_and_abort(a, req, v0)
                life = time.monotonic() - began
            if isinstance(caught, PartialTrajectory):
                self.report.ok("partials() reports progress without stopping the trajectory")
                self.report.ok("abort() returns what was produced; its generate returns ABORTED")
                self.report.ok("stats() counts a running trajectory, and no longer once aborted")
                await self.resume(a, req, caught, v0)
                self.report.ok("a partial resumes (prompt + prefix re-prefilled, prefix kept)")
                return req, caught
            finished.append(caught)
            stall = watched.stall
            if stall.held_s >= max(BLOCKED_MIN_S, BLOCKED_SHARE * life):
                raise self.blocking(
                    f"the {self.long_tokens}-token request {req.traj_id} ended ({caught}) "
                    "before the kit could see it in flight: code on the event loop held the "
                    f"loop for {stall.held_s:.2f} s of its {life:.2f} s",
                    stall,
                    "; giving long_tokens room would not help",
                )
        why = (
            f"the long trajectory finished before the abort in each of {ATTEMPTS} attempts "
            f"({'; '.join(finished)})"
        )
        if expect_partial:
            raise ContractError(
                f"{why}, so abort and resume were not checked; the trajectories had finished, "
                f"abort did not fail. Give them room: long_tokens (now {self.long_tokens}) "
                "within the engine's context"
            )
        self.report.skip("abort / partials / resume", why)
        return None

    async def catch_and_abort(
        self, a: RolloutEngine, req: GenerationRequest, v0: int
    ) -> PartialTrajectory | str:
        """Catch the long request in flight and abort it: its partial, checked, or how it
        ended before that (it finished first)."""
        tid = req.traj_id
        task = asyncio.ensure_future(a.generate(req))
        await asyncio.sleep(0)  # generate runs up to its first await
        if task.done() and task.exception() is None:
            raise ContractError(
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
                require(
                    len(parts) == 1 and parts[0].traj_id == tid,
                    f"partials([{tid!r}]) returned {[p.traj_id for p in parts]}: one snapshot "
                    "per id asked for that is in flight",
                )
                _check_growth(seen, parts[0], "partials()")
                seen = parts[0]
                if seen.num_response_tokens >= 2:
                    break
            await asyncio.sleep(wait)
            wait = min(2 * wait, self.poll_s)
        if task.done():
            t = task.result()
            return f"{t.finish_reason.value} after {t.num_response_tokens} tokens"
        st = await self.call("stats", a.stats())
        require(
            st.running + st.waiting >= 1,
            f"stats() reports no load while {tid} is in flight: {st} (the manager and repack "
            "read running/waiting/kv_use: count the trajectories in flight)",
        )
        everyone = await self.call("partials", a.partials(None))
        require(
            tid in [p.traj_id for p in everyone],
            f"partials(None) omits {tid}, which is in flight: None asks for every one",
        )
        parts = await self.call("abort", a.abort([tid]))
        done = await self.call(f"the aborted generate({tid})", task)
        if not parts:
            require(
                done.finish_reason is not FinishReason.ABORTED,
                f"abort([{tid!r}]) returned nothing, yet its generate returned ABORTED: abort "
                "returns a partial for every trajectory it stopped",
            )
            return f"{done.finish_reason.value} before the abort landed"
        require(len(parts) == 1, f"abort([{tid!r}]) returned {len(parts)} partials, not 1")
        p = parts[0]
        require(
            p.traj_id == tid and p.version == v0,
            f"abort's partial: traj_id {p.traj_id!r}, version {p.version}; want {tid!r} and "
            f"{v0}, the version that generated its tokens",
        )
        _check_growth(seen, p, "abort()")
        require(
            done.finish_reason is FinishReason.ABORTED,
            f"abort([{tid!r}]) returned its partial but generate returned "
            f"{done.finish_reason.value}: an aborted trajectory's generate returns "
            "finish_reason=ABORTED (the manager resumes it elsewhere)",
        )
        require(
            list(done.response_ids) == list(p.response_ids),
            "the ABORTED trajectory's tokens differ from abort's partial: abort waits for the "
            "last tokens the engine hands back, and both hold everything produced",
        )
        st = await self.call("stats", a.stats())
        require(
            st.running == 0 and st.waiting == 0,
            f"stats() after the abort: {st}: an aborted trajectory is no longer counted",
        )
        return p

    async def resume(
        self, engine: RolloutEngine, req: GenerationRequest, p: PartialTrajectory, version: int
    ) -> None:
        r = dataclasses.replace(req, resume=p)
        what = f"generate({req.traj_id}, resume=...)"
        with self.watching(what):
            t = await self.call(what, engine.generate(r))
        self.check_traj(t, r, version)
        n = len(p.response_ids)
        require(
            t.num_response_tokens >= p.num_response_tokens
            and list(t.response_ids[:n]) == list(p.response_ids)
            and list(t.logprobs[:n]) == list(p.logprobs),
            f"the resumed trajectory does not start with its prefix ({p.num_response_tokens} "
            "tokens): with request.resume, return the prefix's tokens and log-probs as they "
            "were, then the continuation",
        )
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
        require(
            got == ids[: len(got)],
            "two greedy (temperature 0) generations of one prompt differ: temperature 0 "
            f"is greedy decoding ({ids[:8]}... vs {got[:8]}...)",
        )
        require(
            s.finish_reason is FinishReason.STOP,
            f"with stop=[{stop!r}] the greedy response {text!r} ended {s.finish_reason.value}",
        )
        cut = self.ref.decode(got)
        require(
            stop in cut and stop not in self.ref.decode(got[:-1]),
            f"with stop=[{stop!r}] the response must end at the token that completes the "
            f"first {stop!r} (that token kept), got {cut!r} from greedy {text!r}",
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
            raise ContractError(
                "update_weights(SharedWeights of a version the relay does not share) returned "
                "normally: it must raise (iterating the reference raises LookupError) and keep "
                "the weights it has"
            )
        held = (await self.call("stats", a.stats())).version
        require(
            held == v0 + 2,
            f"a failed update_weights changed the version to {held} (it was {v0 + 2}): raise "
            "before changing anything",
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
            require(
                t.finish_reason is FinishReason.STOP and list(t.response_ids) == [eos],
                f"with weights that make EOS (id {eos}) the first token, the response is "
                f"{list(t.response_ids)[:8]} ({t.finish_reason.value}): the engine stops at "
                "EOS and keeps it in response_ids with its log-prob (the trainer learns to "
                "stop from it)",
            )
            self.report.ok(rule)

        await self.load(a, ModelOnly(v0 + 4))
        self.report.ok("update_weights(ModelOnly) sets the version")


_NONE = object()


class _Watched:
    """What ``_Kit.watching`` saw: the longest stall, once its block ended."""

    def __init__(self) -> None:
        self.stall = Stall()


def _check_growth(seen: PartialTrajectory | None, p: PartialTrajectory, who: str) -> None:
    """A later snapshot of one trajectory extends the earlier one."""
    require(
        len(p.response_ids) == len(p.logprobs)
        and (not p.response_ids or len(p.response_ids) == p.num_response_tokens),
        f"{who}: a snapshot of {len(p.response_ids)} response_ids, {len(p.logprobs)} logprobs, "
        f"num_response_tokens {p.num_response_tokens}: one log-prob per token, counted (a "
        "decode thread appending meanwhile: snapshot the tokens that have their log-prob)",
    )
    if seen is None:
        return
    n = len(seen.response_ids)
    require(
        p.num_response_tokens >= seen.num_response_tokens
        and list(p.response_ids[:n]) == list(seen.response_ids),
        f"{who}: a snapshot of {p.num_response_tokens} tokens does not extend the earlier one "
        f"of {seen.num_response_tokens}: a trajectory's snapshots only grow",
    )
