"""The simulated rollout engine: an event-driven model of one continuous-batching replica.

Every running request advances one token per decode step, so instead of simulating steps the
engine keeps one progress counter ``P`` (tokens per sequence since the engine started) and
a heap of the ``P`` at which each request finishes. Between two events the batch is fixed,
so the next finish time is exact: the engine wakes only at finishes, arrivals, aborts and
weight loads -- never once per token.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque

from laminar_core.interfaces import (
    BuildContext,
    ReplicaFailure,
    RolloutEngine,
    WeightsRef,
)
from laminar_core.sim.config import SimRolloutConfig
from laminar_core.sim.lengths import LengthModel
from laminar_core.types import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    PartialTrajectory,
    Trajectory,
)

_EPS = 1e-6


class _Req:
    __slots__ = (
        "future",
        "kv_base",
        "prefix",
        "remaining",
        "request",
        "start_p",
        "start_time",
        "target",
        "versions",
    )

    def __init__(
        self,
        request: GenerationRequest,
        target: int,
        prefix: int,
        versions: list[int],
        future: asyncio.Future,
    ) -> None:
        self.request = request
        self.target = target
        self.prefix = prefix
        self.remaining = target - prefix
        self.kv_base = request.num_prompt_tokens + prefix
        self.versions = versions
        self.future = future
        self.start_p = 0.0
        self.start_time = 0.0


class SimRolloutEngine(RolloutEngine):
    """A simulated replica (see module docstring). ``index`` selects configured failures."""

    Options = SimRolloutConfig

    @classmethod
    def from_config(cls, ctx: BuildContext) -> SimRolloutEngine:
        opts: SimRolloutConfig = ctx.options
        cfg = ctx.config
        max_tokens = cfg.rollout.max_tokens
        if opts.lengths.kind == "lognormal":
            lengths = LengthModel.lognormal(
                opts.lengths.median, opts.lengths.p99_over_p50, max_tokens, seed=cfg.run.seed
            )
        elif opts.lengths.kind == "histogram":
            lengths = LengthModel.histogram(opts.lengths.file, max_tokens, seed=cfg.run.seed)
        else:
            raise ValueError(
                f"rollout.sim.lengths.kind: unknown '{opts.lengths.kind}'; "
                "known: histogram, lognormal"
            )
        return cls(ctx.name, opts, lengths, index=ctx.index)

    def __init__(
        self,
        replica_id: str,
        config: SimRolloutConfig,
        lengths: LengthModel,
        index: int = 0,
        version: int = 0,
    ) -> None:
        self.replica_id = replica_id
        self.cfg = config
        self.lengths = lengths
        self.version = version
        self._fail_at = [f.at_s for f in config.failures if f.replica == index]
        self._running: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._heap: list[tuple[float, str]] = []
        self._p = 0.0
        self._last = 0.0
        self._stall_until = 0.0
        self._kv_base_sum = 0
        self._start_p_sum = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._dead = False
        self._started = False
        # Utilisation integral: batch-occupancy seconds, capped at the roofline batch.
        self.occupancy_seconds = 0.0
        self.tokens_generated = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._started = True
        for at in self._fail_at:
            loop.call_at(at, self.kill)

    async def stop(self) -> None:
        self._cancel_timer()
        self._started = False

    def kill(self) -> None:
        """Simulate the replica's process dying: every pending ``generate`` raises."""
        if self._dead:
            return
        self._advance()
        self._dead = True
        self._cancel_timer()
        err = ReplicaFailure(f"replica {self.replica_id} died (simulated failure)")
        for req in [*self._running.values(), *self._waiting]:
            if not req.future.done():
                req.future.set_exception(err)
        self._running.clear()
        self._waiting.clear()
        self._heap.clear()

    def _check_alive(self) -> None:
        if self._dead:
            raise ReplicaFailure(f"replica {self.replica_id} is dead (simulated failure)")

    # -- the model ---------------------------------------------------------------------------
    def _step_time(self, n: int) -> float:
        b = self.cfg.roofline_batch
        return self.cfg.decode_step_s * (1.0 if n <= b else n / b)

    def _advance(self) -> None:
        """Bring ``P`` and the utilisation integrals up to the loop's current time."""
        now = asyncio.get_running_loop().time()
        n = len(self._running)
        if n:
            begin = max(self._last, self._stall_until)
            step = self._step_time(n)
            if step == 0 and now >= self._stall_until:
                self._p = math.inf  # zero-latency decode: all running finish at once
            elif now > begin:
                dt = now - begin
                self._p += dt / step
                self.occupancy_seconds += (
                    dt * min(n, self.cfg.roofline_batch) / (self.cfg.roofline_batch)
                )
        self._last = now

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reschedule(self) -> None:
        self._cancel_timer()
        heap = self._heap
        while heap and heap[0][1] not in self._running:
            heapq.heappop(heap)  # lazily dropped: aborted
        if not heap:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        begin = max(now, self._stall_until)
        p = 0.0 if math.isinf(self._p) else self._p
        delay = max(0.0, heap[0][0] - p) * self._step_time(len(self._running))
        self._timer = loop.call_at(begin + delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._dead:
            return
        self._advance()
        heap, now = self._heap, self._last
        if math.isinf(self._p):  # zero-latency decode: everything running finishes now
            self._p = max((f for f, _ in heap), default=0.0)
        while heap and heap[0][0] <= self._p + _EPS:
            _, tid = heapq.heappop(heap)
            req = self._running.get(tid)
            if req is not None:
                self._finish(req, now)
        self._admit()
        self._reschedule()

    def _kv_tokens(self) -> float:
        p = 0.0 if math.isinf(self._p) else self._p
        return self._kv_base_sum + len(self._running) * p - self._start_p_sum

    def _admit(self) -> None:
        cap, now = self.cfg.kv_capacity_tokens, self._last
        while self._waiting and len(self._running) < self.cfg.max_num_seqs:
            req = self._waiting[0]
            if self._running and self._kv_tokens() + req.kv_base > cap:
                break  # no KV room: wait for finishes (an empty engine always admits one)
            self._waiting.popleft()
            p = 0.0 if math.isinf(self._p) else self._p
            req.start_p, req.start_time = p, now
            self._running[req.request.traj_id] = req
            self._kv_base_sum += req.kv_base
            self._start_p_sum += p
            heapq.heappush(self._heap, (p + req.remaining, req.request.traj_id))
            self._stall_until = max(self._stall_until, now) + (
                req.kv_base * self.cfg.prefill_s_per_token
            )

    def _remove(self, req: _Req) -> int:
        """Take ``req`` out of the running set; returns the tokens it has generated so far."""
        del self._running[req.request.traj_id]
        self._kv_base_sum -= req.kv_base
        self._start_p_sum -= req.start_p
        p = self._p if not math.isinf(self._p) else req.start_p + req.remaining
        done = min(req.remaining, int(p - req.start_p + _EPS))
        self.tokens_generated += done
        return req.prefix + done

    def _finish(self, req: _Req, now: float) -> None:
        produced = self._remove(req)
        r = req.request
        reason = FinishReason.LENGTH if produced >= r.sampling.max_tokens else FinishReason.STOP
        traj = Trajectory(
            traj_id=r.traj_id,
            group_id=r.group_id,
            version=req.versions[0],
            prompt_ids=r.prompt_ids,
            num_prompt_tokens=r.num_prompt_tokens,
            num_response_tokens=produced,
            finish_reason=reason,
            versions=req.versions,
            replicas=[self.replica_id],
            start_time=req.start_time,
            finish_time=now,
            metadata={**r.metadata, "resumed_tokens": req.prefix} if req.prefix else r.metadata,
        )
        if not req.future.done():
            req.future.set_result(traj)

    def _partial(self, req: _Req) -> PartialTrajectory:
        if req.request.traj_id in self._running:
            p = self._p if not math.isinf(self._p) else req.start_p
            produced = req.prefix + min(req.remaining, int(p - req.start_p + _EPS))
        else:
            produced = req.prefix
        return PartialTrajectory(
            traj_id=req.request.traj_id,
            version=self.version,
            num_response_tokens=produced,
            versions=list(req.versions),
        )

    # -- RolloutEngine -----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Trajectory:
        self._check_alive()
        loop = asyncio.get_running_loop()
        key = request.metadata.get("sample_key", 0)
        target = min(self.lengths.sample(key), request.sampling.max_tokens)
        prefix, versions = 0, [self.version]
        if request.resume is not None:
            prefix = min(request.resume.num_response_tokens, target)
            versions = list(request.resume.versions) or [request.resume.version]
            if versions[-1] != self.version:
                versions.append(self.version)
        fut = loop.create_future()
        self._advance()
        self._waiting.append(_Req(request, target, prefix, versions, fut))
        self._admit()
        self._reschedule()
        return await fut

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        self._check_alive()
        self._advance()
        out = []
        wanted = set(traj_ids)
        waiting = {w.request.traj_id: w for w in self._waiting if w.request.traj_id in wanted}
        for tid in traj_ids:
            req = self._running.get(tid)
            if req is not None:
                part = self._partial(req)
                self._remove(req)
            else:
                req = waiting.get(tid)
                if req is None:
                    continue  # already finished: its generate call returned normally
                part = self._partial(req)
            out.append(part)
            if not req.future.done():
                req.future.set_result(
                    Trajectory(
                        traj_id=tid,
                        group_id=req.request.group_id,
                        version=req.versions[0],
                        num_prompt_tokens=req.request.num_prompt_tokens,
                        num_response_tokens=part.num_response_tokens,
                        finish_reason=FinishReason.ABORTED,
                        versions=req.versions,
                        replicas=[self.replica_id],
                    )
                )
        if waiting:
            self._waiting = deque(w for w in self._waiting if w.request.traj_id not in waiting)
        self._admit()
        self._reschedule()
        return out

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        self._check_alive()
        self._advance()
        reqs = [*self._running.values(), *self._waiting]
        if traj_ids is not None:
            wanted = set(traj_ids)
            reqs = [r for r in reqs if r.request.traj_id in wanted]
        return [self._partial(r) for r in reqs]

    async def update_weights(self, weights: WeightsRef) -> None:
        self._check_alive()
        if self._running or self._waiting:
            raise RuntimeError(
                f"replica {self.replica_id}: update_weights with trajectories in flight would "
                "mix weight versions inside one trajectory"
            )
        # a simulated engine has no parameters to overwrite: loading costs weight_load_s
        if self.cfg.weight_load_s > 0:
            await asyncio.sleep(self.cfg.weight_load_s)
        self._check_alive()
        self.version = weights.version

    async def stats(self) -> EngineStats:
        self._check_alive()
        self._advance()
        cap = self.cfg.kv_capacity_tokens
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_use=min(1.0, self._kv_tokens() / cap) if cap else 0.0,
            kv_capacity_tokens=cap,
            version=self.version,
        )
