"""The simulated rollout engine: an event-driven model of one continuous-batching replica.

It follows the scheduler of vLLM V1 (``vllm/v1/core/sched/scheduler.py``; SGLang's is alike):

* **Decode.** Every decoding request advances one token per engine step. A step with only
  decodes takes ``decode_step_s`` up to ``roofline_batch`` requests and grows linearly above
  (decode is memory-bound: the weights are read once per step whatever the batch).
* **Chunked prefill.** A prompt -- or, for a resumed or preempted trajectory, the prompt plus
  the response so far -- is prefilled in the same steps as the decodes: a step carries every
  decoding request (one token each) plus up to ``max_num_batched_tokens - decoding`` prefill
  tokens, and takes the roofline of the two, ``max(decode step, (decoding + chunk) *
  prefill_s_per_token)`` (prefill is compute-bound; the weights are read once). Running
  requests keep decoding, more slowly, while a replica prefills new or moved work; a request's
  first token comes out of the step that completes its prefill.
* **Prefix caching** (``prefix_caching``): samples of one prompt admitted while another sample
  of it is resident reuse its prompt's KV, so a GRPO group's prompt is prefilled and held once
  per replica (vLLM's automatic prefix caching, SGLang's radix cache).
* **KV cache** (``kv_capacity_tokens``): a request is admitted when its prompt (and resumed
  prefix) fits; decoding adds one token per request per step; when the cache would overflow,
  the most recently admitted decoding request is preempted (recompute mode: its KV is dropped
  and it waits at the head of the queue, to be prefilled again with what it has generated),
  as vLLM V1 does.

Instead of simulating decode steps the engine keeps one progress counter ``P`` (tokens per
decoding sequence since the engine started) and a heap of the ``P`` at which each request
finishes: between two events the batch is fixed, so the next finish is exact and the engine
wakes only at finishes, arrivals, aborts, loads, KV overflows and prefill steps (one event per
``max_num_batched_tokens`` of prefill) -- never once per decoded token.

The engine also measures itself (what ``sim.study`` reports): busy time and periods, KV-use
and batch-occupancy integrals, trajectories started, resumed and preempted, prefill tokens,
and -- in a ``SimLedger`` shared by a run's replicas -- each trajectory's latency from its
first dispatch to its finish, wherever it was moved.

**Tool calling** (``env.name: sim_tool``, ``sim.tools``): a trajectory's output is split
into turns by the run's ``ToolPlan``; each ``generate`` call stops at the end of the current
turn and returns (the loop's episode runs the tool, appends the observation and sends the
next turn back as a resume). While the tool runs the trajectory is not in the engine: it
holds no batch slot. Its KV is released with the turn (``tool_kv: release``: the next turn
re-prefills prompt + everything so far) or kept resident, counted against the KV capacity
(``tool_kv: keep``: the next turn on this replica prefills only the observation; kept KV is
evicted oldest first under KV pressure and dropped when the replica loads new weights). A
tool turn's resume is not a move: it is counted apart (``tool_resumes``,
``tool_prefill_tokens``) and the trajectory's latency runs from its first turn to its last.

**Scoring** (a teacher of on-policy distillation, ``algorithm.teacher.engine: sim``): a
``score`` is a prefill of the prompt and the response with nothing generated. A teacher
replica scores one request after another, at the prefill rate of a full step
(``max_num_batched_tokens`` tokens per ``max(decode_step_s, max_num_batched_tokens *
prefill_s_per_token)``) and never faster than one step per request; its log-probs are 0.0.
Its scoring work is kept apart from generation (a teacher replica only scores). In a run with a
teacher the student's trajectories carry token ids (zeros where the simulated prompt has none,
one per token) so that they can be scored; without one a simulated response carries none.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections import deque
from typing import NamedTuple

from laminar_core.interfaces import (
    BuildContext,
    ReplicaFailure,
    RolloutEngine,
    WeightsRef,
)
from laminar_core.sim.agent import turn_plan
from laminar_core.sim.config import SimRolloutConfig
from laminar_core.sim.lengths import LengthModel
from laminar_core.sim.tools import ToolPlan
from laminar_core.types import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    PartialTrajectory,
    Trajectory,
)

_EPS = 1e-6
_WAITING, _PREFILL, _RUNNING = 0, 1, 2


def simulated_reward(metadata: dict, uniform_groups: float) -> float:
    """``rollout.sim.uniform_groups``' reward: a prompt drawn (from its index) into the uniform
    share scores 1.0 on every sample; any other alternates 1/0 by sample."""
    prompt = int(metadata.get("prompt_index", 0))
    if random.Random(prompt * 7919 + 17).random() < uniform_groups:
        return 1.0
    return float(int(metadata.get("sample_key", 0)) % 2)


class Finished(NamedTuple):
    """One finished trajectory, as the replicas of a run saw it."""

    traj_id: str
    dispatched: float  # first dispatch, to any replica
    finish: float
    tokens: int  # response tokens
    moved: bool  # resumed somewhere at least once (moved, redirected, partial rollout)
    versions: int = 1  # weight versions that generated it (multi-turn: a turn may be newer)

    @property
    def latency(self) -> float:
        """From the first dispatch to the finish: queueing, moves and preemptions included."""
        return self.finish - self.dispatched


class SimLedger:
    """What the replicas of one simulated run see of each trajectory, wherever it runs:
    ``first[traj_id]`` is when it was first dispatched (while it is unfinished); ``done``
    holds one ``Finished`` per finished trajectory."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.resumed: set[str] = set()
        self.done: list[Finished] = []
        # tool calling: the prefix each trajectory's next turn resumes from, and the replica
        # holding its KV while its tool runs (``tool_kv: keep``)
        self.awaiting: dict[str, int] = {}
        self.parked: dict[str, SimRolloutEngine] = {}

    def submitted(self, traj_id: str, now: float, resumed: bool) -> None:
        self.first.setdefault(traj_id, now)
        if resumed:
            self.resumed.add(traj_id)

    def finished(self, traj_id: str, now: float, tokens: int, versions: int = 1) -> None:
        t0 = self.first.pop(traj_id, None)
        if t0 is not None:  # a superseded attempt's late result is not counted again
            moved = traj_id in self.resumed
            self.resumed.discard(traj_id)
            self.done.append(Finished(traj_id, t0, now, tokens, moved, versions))


class _Req:
    __slots__ = (
        "admitted",
        "cache_key",
        "cached",
        "cached_prompt",
        "final",
        "future",
        "heap_key",
        "kv_base",
        "obs_before",
        "preempted",
        "prefill_left",
        "prefix",
        "remaining",
        "request",
        "resumed",
        "seq",
        "start_p",
        "start_time",
        "state",
        "submit_time",
        "target",
        "tool_resume",
        "turn",
        "versions",
    )

    def __init__(
        self,
        request: GenerationRequest,
        target: int,
        prefix: int,
        versions: list[int],
        future: asyncio.Future,
        now: float,
    ) -> None:
        self.request = request
        self.target = target
        self.versions = versions
        self.future = future
        self.resumed = request.resume is not None  # until its first new token here
        self.preempted = False
        self.cache_key = (request.group_id, request.num_prompt_tokens)
        self.submit_time = now
        self.start_time = now
        self.state = _WAITING
        self.admitted = False
        self.seq = 0
        self.heap_key = -1
        self.start_p = 0.0
        self.prefill_left = 0
        # tool calling: response tokens still resident from the previous turn (kept KV), the
        # turn's index, observation tokens before it, and whether it is the last turn
        self.cached = 0
        self.cached_prompt = False
        self.turn = 0
        self.obs_before = 0
        self.final = True
        self.tool_resume = False
        self.set_prefix(prefix)

    def set_prefix(self, prefix: int) -> None:
        """Response tokens held so far (a resumed prefix, or what a preempted request made)."""
        self.prefix = prefix
        self.remaining = self.target - prefix
        self.kv_base = prefix  # its own KV at decode start; the prompt's is counted apart


class SimRolloutEngine(RolloutEngine):
    """A simulated replica (see module docstring). ``index`` selects configured failures."""

    Options = SimRolloutConfig
    scores_tokens = True  # a modelled prefill (``score``), for teachers on the virtual clock
    loads_model = False  # nothing is read from model.path

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
        ledger = ctx.shared.setdefault("sim_ledger", SimLedger())
        tools = turn_plan(cfg)
        engine = cls(ctx.name, opts, lengths, index=ctx.index, ledger=ledger, tools=tools)
        engine.token_ids = bool(cfg.algorithm.teacher.model)  # its trajectories get scored
        return engine

    def __init__(
        self,
        replica_id: str,
        config: SimRolloutConfig,
        lengths: LengthModel,
        index: int = 0,
        version: int = 0,
        ledger: SimLedger | None = None,
        tools: ToolPlan | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.cfg = config
        self.lengths = lengths
        self.version = version
        self.ledger = ledger
        self.tools = tools
        self._turns = ledger if ledger is not None else SimLedger()  # awaiting / parked
        self._parked: dict[str, _Req] = {}  # kept KV of trajectories whose tool runs, oldest first
        self._plans: dict[int, tuple[list[int], list[int]]] = {}  # tool calling: per sample
        self._fail_at = [f.at_s for f in config.failures if f.replica == index]
        self._waiting: deque[_Req] = deque()
        self._prefill: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._heap: list[tuple[float, int, _Req]] = []
        self._keys = itertools.count()
        self._p = 0.0
        self._last = 0.0
        self._kv_fixed = 0  # KV of admitted requests at their decode start, prompts once
        self._start_p_sum = 0.0
        self._prompts: dict[tuple[str, int], int] = {}  # cached prompt -> requests holding it
        self._prefill_tokens = 0  # prefill still to compute, all admitted requests
        # the prefill step under way (None: decode-only, fluid): end time, length, P at start,
        # prefill tokens it carries
        self._step_end: float | None = None
        self._step_dur = 0.0
        self._step_p0 = 0.0
        self._step_chunk = 0
        self._timer: asyncio.TimerHandle | None = None
        self._dead = False
        self._started = False
        self.token_ids = False  # trajectories carry response_ids (zeros): a teacher scores them
        self._score_free_at = 0.0  # when this replica's scoring queue is next free
        # -- what the engine measures of itself (``sim.study`` reads these) --
        self.occupancy_seconds = 0.0  # batch occupancy, capped at the roofline batch
        self.kv_seconds = 0.0  # integral of KV use (0..1) over time
        self.busy_seconds = 0.0  # time with any request admitted
        self.busy_periods: list[list[float]] = []  # [start, end]; end = inf while busy
        self.starts: list[float] = []  # first dispatch of each new trajectory here
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prefill computed (prompts, resumed and preempted prefixes)
        self.resumes = 0  # trajectories resumed here (moved, redirected, partial rollout)
        self.resume_prefill_tokens = 0
        self.resume_seconds = 0.0  # from a resume's arrival to its first new token
        self.preemptions = 0
        self.kv_peak = 0.0
        self.tool_turns = 0  # model turns that ended at a tool call
        self.tool_resumes = 0  # turns after a tool call started here
        self.tool_prefill_tokens = 0  # prefill those turns computed (re-prefill, observations)
        self.tool_kv_hits = 0  # turns that found their KV kept here
        self.tool_kv_evictions = 0  # kept KV evicted for room
        self.tool_kv_drops = 0  # kept KV dropped: new weights, or the turn went elsewhere
        self.scored_tokens = 0  # prompt + response tokens prefilled by ``score``
        self.score_seconds = 0.0  # time this replica spent scoring

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._started = True
        for at in self._fail_at:
            loop.call_at(at, self.kill)

    async def stop(self) -> None:
        self._advance()
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
        for req in [*self._running.values(), *self._prefill, *self._waiting]:
            if not req.future.done():
                req.future.set_exception(err)
        self._running.clear()
        self._prefill.clear()
        self._waiting.clear()
        self._heap.clear()
        for tid in self._parked:
            if self._turns.parked.get(tid) is self:
                del self._turns.parked[tid]
        self._parked.clear()
        self._mark_busy()

    def _check_alive(self) -> None:
        if self._dead:
            raise ReplicaFailure(f"replica {self.replica_id} is dead (simulated failure)")

    # -- the model ---------------------------------------------------------------------------
    def _step_time(self, n: int) -> float:
        """The weights' part of a step with ``n`` decoding requests (flat up to the roofline
        batch, linear above)."""
        b = self.cfg.roofline_batch
        return self.cfg.decode_step_s * (1.0 if n <= b else n / b)

    def _kv_tokens(self) -> float:
        p = 0.0 if math.isinf(self._p) else self._p
        return self._kv_fixed + len(self._running) * p - self._start_p_sum

    def _rates(self) -> tuple[float, float, float]:
        """A decode-only step at progress ``P`` takes ``max(a + b * P, e)``: the memory time
        (weights, plus the KV read, which grows as the running requests grow) or the compute
        time of one token per running request."""
        n = len(self._running)
        kv_s = self.cfg.kv_read_s_per_token
        a = self._step_time(n) + kv_s * (self._kv_fixed - self._start_p_sum)
        return a, kv_s * n, n * self.cfg.prefill_s_per_token

    def _time_to(self, p0: float, p1: float) -> float:
        """Seconds of decode-only steps to take ``P`` from ``p0`` to ``p1``."""
        if p1 <= p0:
            return 0.0
        a, b, e = self._rates()

        def mem(x0: float, x1: float) -> float:  # the integral of a + b * P
            return (x1 - x0) * (a + 0.5 * b * (x0 + x1))

        if b <= 0:
            return (p1 - p0) * max(a, e)
        cross = (e - a) / b  # below it the steps are compute-bound, above memory-bound
        if cross <= p0:
            return mem(p0, p1)
        if cross >= p1:
            return (p1 - p0) * e
        return (cross - p0) * e + mem(cross, p1)

    def _p_after(self, p0: float, dt: float) -> float:
        """``P`` after ``dt`` seconds of decode-only steps from ``p0``."""
        a, b, e = self._rates()
        if b <= 0:
            step = max(a, e)
            return math.inf if step <= 0 else p0 + dt / step
        cross = (e - a) / b
        if cross > p0:
            t_cross = (cross - p0) * e
            if dt <= t_cross:
                return p0 + dt / e
            p0, dt = cross, dt - t_cross
        s0 = a + b * p0  # memory-bound: the step grows linearly in P; solve the quadratic
        return p0 + (math.sqrt(s0 * s0 + 2 * b * dt) - s0) / b

    def _advance(self) -> None:
        """Bring ``P`` and the integrals up to the loop's current time."""
        now = asyncio.get_running_loop().time()
        dt = now - self._last
        if self._step_end is None and self._running and not math.isinf(self._p):
            a, b, e = self._rates()
            if a <= 0 and b <= 0 and e <= 0:  # zero-latency decode: all running finish now
                self._p = math.inf
        if dt > 0:
            n = len(self._running)
            admitted = n or self._prefill
            cap = self.cfg.kv_capacity_tokens
            held = admitted or self._parked
            kv0 = self._kv_tokens() if held else 0.0
            if self._step_end is not None:  # a prefill step: P moves 1 per step length
                self._p += dt / self._step_dur
            elif n and not math.isinf(self._p):
                # zero-latency decode (a step of 0 s) makes P infinite: all running finish
                self._p = self._p_after(self._p, dt)
            if n:
                b = self.cfg.roofline_batch
                self.occupancy_seconds += dt * min(n, b) / b
            if admitted:
                self.busy_seconds += dt
            if held:
                kv1 = self._kv_tokens()
                if cap > 0 and not math.isinf(kv1):
                    self.kv_seconds += dt * min(1.0, (kv0 + kv1) / (2 * cap))
                    self.kv_peak = max(self.kv_peak, min(1.0, kv1 / cap))
        self._last = now

    def _mark_busy(self) -> None:
        """Open or close a busy period when the engine goes from idle to busy or back."""
        busy = bool(self._running or self._prefill)
        periods = self.busy_periods
        open_ = bool(periods) and math.isinf(periods[-1][1])
        if busy and not open_:
            periods.append([self._last, math.inf])
        elif not busy and open_:
            periods[-1][1] = self._last

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reschedule(self) -> None:
        """Arm the timer for the next event: the end of the prefill step under way (or a new
        one), else the next finish or KV overflow of the fluid decode."""
        self._cancel_timer()
        self._mark_busy()
        loop = asyncio.get_running_loop()
        if self._step_end is None and self._prefill:
            self._begin_step()
        if self._step_end is not None:
            self._timer = loop.call_at(self._step_end, self._on_timer)
            return
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)  # lazily dropped: aborted, preempted
        n = len(self._running)
        if not n:
            return
        if math.isinf(self._p):  # zero-latency decode: finish them now
            self._timer = loop.call_at(self._last, self._on_timer)
            return
        p = self._p
        delay = self._time_to(p, heap[0][0]) if heap else math.inf
        cap = self.cfg.kv_capacity_tokens
        if cap > 0 and (n > 1 or self._parked):
            # when the cache first overflows by a token (preemption then makes room)
            p_hit = (cap + 1 - self._kv_fixed + self._start_p_sum) / n
            delay = min(delay, self._time_to(p, p_hit))
        if not math.isinf(delay):
            self._timer = loop.call_at(self._last + delay, self._on_timer)

    def _begin_step(self) -> None:
        """Start a prefill step: every decoding request plus a chunk of the prefill queue."""
        n = len(self._running)
        chunk = max(1, min(self._prefill_tokens, self.cfg.max_num_batched_tokens - n))
        memory = self._step_time(max(n, 1)) + self.cfg.kv_read_s_per_token * self._kv_tokens()
        dur = max(memory, (n + chunk) * self.cfg.prefill_s_per_token)
        if math.isinf(self._p):  # zero-latency decode: what runs is done
            self._p = max((e[0] for e in self._heap if self._valid(e)), default=0.0)
        self._step_p0 = self._p
        self._step_dur = dur
        self._step_chunk = chunk
        self._step_end = self._last + dur

    def _valid(self, entry: tuple[float, int, _Req]) -> bool:
        req = entry[2]
        return req.state == _RUNNING and req.heap_key == entry[1]

    def _on_timer(self) -> None:
        self._timer = None
        if self._dead:
            return
        self._advance()
        now = self._last
        if self._step_end is not None and now >= self._step_end - _EPS:
            self._end_step()
        heap = self._heap
        if math.isinf(self._p):  # zero-latency decode: everything running finishes now
            self._p = max((f for f, _, _ in heap), default=0.0)
        while heap and heap[0][0] <= self._p + _EPS:
            entry = heapq.heappop(heap)
            if self._valid(entry):
                self._finish(entry[2], now)
        self._relieve_kv()
        self._admit()
        self._reschedule()

    def _end_step(self) -> None:
        """A prefill step ended: every decoding request made one token, and the chunk's
        prefill is done (requests whose prefill completed made their first token)."""
        self._p = self._step_p0 + 1.0
        self._step_end = None
        chunk = self._step_chunk
        self.prefill_tokens += chunk
        while chunk > 0 and self._prefill:
            head = self._prefill[0]
            take = min(chunk, head.prefill_left)
            head.prefill_left -= take
            self._prefill_tokens -= take
            chunk -= take
            if head.prefill_left <= 0:
                self._prefill.popleft()
                self._start_decode(head, self._p - 1.0)  # its first token: this step's

    def _start_decode(self, req: _Req, start_p: float) -> None:
        req.state = _RUNNING
        req.start_p = start_p
        req.heap_key = next(self._keys) + 1
        self._running[req.request.traj_id] = req
        self._start_p_sum += start_p
        heapq.heappush(self._heap, (start_p + req.remaining, req.heap_key, req))
        if req.resumed:  # a resume's first new token: the move (or redirect) is done
            self.resume_seconds += self._last - req.submit_time
            req.resumed = False

    def _prompt_cost(self, req: _Req) -> tuple[int, bool]:
        """Prompt tokens ``req`` adds to the KV cache and prefill: 0 if its prompt is cached
        (another sample of it is resident); and whether it holds a prompt reference."""
        if not self.cfg.prefix_caching:
            return req.request.num_prompt_tokens, False
        held = self._prompts.get(req.cache_key, 0)
        return (0 if held else req.request.num_prompt_tokens), True

    def _admit(self) -> None:
        cap, now = self.cfg.kv_capacity_tokens, self._last
        free_prefill = self.cfg.prefill_s_per_token == 0
        while self._waiting and len(self._running) + len(self._prefill) < self.cfg.max_num_seqs:
            req = self._waiting[0]
            prompt, ref = self._prompt_cost(req)
            busy = self._running or self._prefill or self._parked
            if busy and self._kv_tokens() + prompt + req.kv_base > cap:
                if self._parked:  # kept KV of a waiting tool call gives way first
                    self._evict_parked()
                    continue
                break  # no KV room: wait for finishes (an empty engine always admits one)
            self._waiting.popleft()
            req.seq = next(self._keys)
            if ref:
                self._prompts[req.cache_key] = self._prompts.get(req.cache_key, 0) + 1
            self._kv_fixed += prompt + req.kv_base
            if not req.admitted:  # first time in this engine (not back from a preemption)
                req.admitted = True
                req.start_time = now
            prefill = prompt + req.prefix
            if req.cached or req.cached_prompt:  # its KV was kept while its tool ran
                prefill = (0 if req.cached_prompt else prompt) + req.prefix - req.cached
                req.cached, req.cached_prompt = 0, False
            if req.tool_resume and not req.preempted:
                self.tool_prefill_tokens += max(1, prefill)
            if free_prefill:
                p = 0.0 if math.isinf(self._p) else self._p
                self._start_decode(req, p)
                continue
            req.state = _PREFILL
            req.prefill_left = max(1, prefill)  # a fully cached prompt still computes one
            self._prefill_tokens += req.prefill_left
            if req.resumed and not req.preempted:
                self.resume_prefill_tokens += req.prefill_left
            self._prefill.append(req)

    def _release(self, req: _Req) -> None:
        """Give back ``req``'s KV (its own, and its prompt reference)."""
        self._kv_fixed -= req.kv_base
        if not self.cfg.prefix_caching:
            self._kv_fixed -= req.request.num_prompt_tokens
            return
        held = self._prompts.get(req.cache_key, 0) - 1
        if held <= 0:
            self._prompts.pop(req.cache_key, None)
            self._kv_fixed -= req.request.num_prompt_tokens
        else:
            self._prompts[req.cache_key] = held

    def _produced(self, req: _Req) -> int:
        """Response tokens ``req`` holds now (its prefix plus what it decoded here)."""
        if req.state != _RUNNING:
            return req.prefix
        p = self._p if not math.isinf(self._p) else req.start_p + req.remaining
        return req.prefix + max(0, min(req.remaining, int(p - req.start_p + _EPS)))

    def _remove(self, req: _Req) -> int:
        """Take ``req`` out of the engine; returns the response tokens it holds."""
        produced = self._produced(req)
        if req.state == _RUNNING:
            del self._running[req.request.traj_id]
            self._start_p_sum -= req.start_p
            # what the KV held beyond kv_base is the tokens decoded here: drop it with it
            self.tokens_generated += produced - req.prefix
            self._release(req)
        elif req.state == _PREFILL:
            self._prefill.remove(req)
            self._prefill_tokens -= req.prefill_left
            self._release(req)
        else:
            self._waiting.remove(req)
        req.state = _WAITING
        return produced

    def _relieve_kv(self) -> None:
        """Preempt the most recently admitted decoding requests while the KV cache overflows
        (recompute mode: each waits at the head of the queue with what it has generated)."""
        cap = self.cfg.kv_capacity_tokens
        while (len(self._running) > 1 or self._parked) and self._kv_tokens() > cap + _EPS:
            if self._parked:  # kept KV of a waiting tool call gives way first
                self._evict_parked()
                continue
            victim = max(self._running.values(), key=lambda r: r.seq)
            produced = self._remove(victim)
            victim.set_prefix(produced)
            victim.preempted = True
            self._waiting.appendleft(victim)
            self.preemptions += 1

    def _park(self, req: _Req, produced: int) -> None:
        """Keep ``req``'s KV (its prompt reference and ``produced`` tokens) while its tool
        runs (``tool_kv: keep``)."""
        prompt, ref = self._prompt_cost(req)
        if ref:
            self._prompts[req.cache_key] = self._prompts.get(req.cache_key, 0) + 1
        self._kv_fixed += prompt + produced
        req.kv_base = produced
        tid = req.request.traj_id
        self._parked[tid] = req
        self._turns.parked[tid] = self

    def _unpark(self, tid: str) -> int:
        """Give back a kept KV; returns the response tokens it held."""
        req = self._parked.pop(tid)
        if self._turns.parked.get(tid) is self:
            del self._turns.parked[tid]
        self._release(req)
        return req.kv_base

    def _evict_parked(self) -> None:
        self._unpark(next(iter(self._parked)))
        self.tool_kv_evictions += 1

    def drop_kept(self, tid: str) -> None:
        """The trajectory's next turn runs elsewhere: free the KV kept for it here."""
        if tid in self._parked and not self._dead:
            self._advance()
            self._unpark(tid)
            self.tool_kv_drops += 1
            self._admit()
            self._reschedule()

    def _finish(self, req: _Req, now: float) -> None:
        produced = self._remove(req)
        r = req.request
        if not req.final and produced < r.sampling.max_tokens and self.tools is not None:
            # a turn that ends at a tool call: the loop runs the tool, then resumes it
            key = r.metadata.get("sample_key", 0)
            obs = self._turn_plan(key)[1][req.turn + 1] - req.obs_before
            self._turns.awaiting[r.traj_id] = produced + obs
            self.tool_turns += 1
            if self.cfg.tool_kv == "keep":
                self._park(req, produced)
        reason = FinishReason.LENGTH if produced >= r.sampling.max_tokens else FinishReason.STOP
        resumed_from = r.resume.num_response_tokens if r.resume is not None else 0
        traj = Trajectory(
            traj_id=r.traj_id,
            group_id=r.group_id,
            version=req.versions[0],
            prompt_ids=(r.prompt_ids or [0] * r.num_prompt_tokens)
            if self.token_ids
            else r.prompt_ids,
            num_prompt_tokens=r.num_prompt_tokens,
            num_response_tokens=produced,
            response_ids=[0] * produced if self.token_ids else [],
            finish_reason=reason,
            versions=req.versions,
            replicas=[self.replica_id],
            start_time=req.start_time,
            finish_time=now,
            metadata={**r.metadata, "resumed_tokens": resumed_from} if resumed_from else r.metadata,
        )
        if self.cfg.uniform_groups is not None and req.final:
            traj.reward = simulated_reward(r.metadata, self.cfg.uniform_groups)
        if req.final:
            self._plans.pop(r.metadata.get("sample_key", 0), None)
        if self.ledger is not None and req.final:
            self.ledger.finished(r.traj_id, now, produced - req.obs_before, len(req.versions))
        if not req.future.done():
            req.future.set_result(traj)

    def _partial(self, req: _Req) -> PartialTrajectory:
        return PartialTrajectory(
            traj_id=req.request.traj_id,
            version=self.version,
            num_response_tokens=self._produced(req),
            versions=list(req.versions),
        )

    def _find(self, traj_id: str) -> _Req | None:
        req = self._running.get(traj_id)
        if req is not None:
            return req
        for q in (self._prefill, self._waiting):
            for r in q:
                if r.request.traj_id == traj_id:
                    return r
        return None

    def _turn_plan(self, key: int) -> tuple[list[int], list[int]]:
        """Sample ``key``'s turn ends and the observation tokens before each turn (cached
        while the trajectory is unfinished here; a pure function of the key)."""
        plan = self._plans.get(key)
        if plan is None:
            assert self.tools is not None
            ends = self.tools.turn_ends(key, self.lengths.sample(key))
            sums = [0]
            for j in range(len(ends) - 1):
                sums.append(sums[-1] + self.tools.observation_tokens(key, j))
            plan = self._plans[key] = (ends, sums)
        return plan

    # -- RolloutEngine -----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Trajectory:
        self._check_alive()
        loop = asyncio.get_running_loop()
        key = request.metadata.get("sample_key", 0)
        tid = request.traj_id
        max_tokens = request.sampling.max_tokens
        resume = request.resume
        have = resume.num_response_tokens if resume is not None else 0
        turn, obs_before, final = 0, 0, True
        if self.tools is None:
            target = min(self.lengths.sample(key), max_tokens)
        else:  # this turn ends at the first turn end past what the trajectory holds
            ends, obs_sums = self._turn_plan(key)
            turn = next((j for j, e in enumerate(ends) if e > have), len(ends) - 1)
            obs_before = obs_sums[turn]
            target = min(ends[turn], max_tokens)
            final = turn == len(ends) - 1 or target >= max_tokens
        # a tool turn's resume (not a move): the trajectory comes back from its tool
        tool_resume = resume is not None and self._turns.awaiting.pop(tid, None) == have
        prefix, versions = 0, [self.version]
        if resume is not None:
            prefix = min(have, target)
            versions = list(resume.versions) or [resume.version]
            if versions[-1] != self.version:
                versions.append(self.version)
            if tool_resume:
                self.tool_resumes += 1
            else:
                self.resumes += 1
        fut = loop.create_future()
        self._advance()
        now = self._last
        if resume is None:
            self.starts.append(now)
        if self.ledger is not None:
            self.ledger.submitted(tid, now, resume is not None and not tool_resume)
        req = _Req(request, target, prefix, versions, fut, now)
        req.turn, req.obs_before, req.final = turn, obs_before, final
        if tool_resume:
            req.resumed = False
            req.tool_resume = True
        kept = self._turns.parked.get(tid)
        if kept is self:  # its KV stayed here while the tool ran
            req.cached = min(self._unpark(tid), prefix)
            req.cached_prompt = True
            self._waiting.appendleft(req)
        else:
            if kept is not None:
                kept.drop_kept(tid)
            self._waiting.append(req)
        self._admit()
        if req.state == _WAITING and (req.cached or req.cached_prompt):
            # no room even for the observation: what was kept is gone (it waits like any)
            req.cached, req.cached_prompt = 0, False
            self.tool_kv_evictions += 1
        elif kept is self:
            self.tool_kv_hits += 1
        self._reschedule()
        return await fut

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        self._check_alive()
        self._advance()
        out = []
        for tid in traj_ids:
            req = self._find(tid)
            if req is None:
                continue  # already finished: its generate call returned normally
            part = self._partial(req)
            self._remove(req)
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
        self._admit()
        self._reschedule()
        return out

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        self._check_alive()
        self._advance()
        reqs = [*self._running.values(), *self._prefill, *self._waiting]
        if traj_ids is not None:
            wanted = set(traj_ids)
            reqs = [r for r in reqs if r.request.traj_id in wanted]
        return [self._partial(r) for r in reqs]

    async def update_weights(self, weights: WeightsRef) -> None:
        self._check_alive()
        if self._running or self._prefill or self._waiting:
            raise RuntimeError(
                f"replica {self.replica_id}: update_weights with trajectories in flight would "
                "mix weight versions inside one trajectory"
            )
        if self._parked:  # KV computed by the old weights is worthless under the new ones
            self._advance()
            for tid in list(self._parked):
                self._unpark(tid)
                self.tool_kv_drops += 1
            self._mark_busy()
        # a simulated engine has no parameters to overwrite: loading costs weight_load_s
        if self.cfg.weight_load_s > 0:
            await asyncio.sleep(self.cfg.weight_load_s)
        self._check_alive()
        self.version = weights.version

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """A teacher's score on the virtual clock (module docstring): waits its turn in this
        replica's scoring queue, then the prefill of ``prompt_ids + response_ids``."""
        self._check_alive()
        cfg = self.cfg
        tokens = len(prompt_ids) + len(response_ids)
        step = max(cfg.decode_step_s, cfg.max_num_batched_tokens * cfg.prefill_s_per_token)
        cost = max(cfg.decode_step_s, tokens * step / cfg.max_num_batched_tokens)
        now = asyncio.get_running_loop().time()
        done = max(now, self._score_free_at) + cost
        self._score_free_at = done
        self.scored_tokens += tokens
        self.score_seconds += cost
        await asyncio.sleep(done - now)
        self._check_alive()
        return [0.0] * len(response_ids)

    async def stats(self) -> EngineStats:
        self._check_alive()
        self._advance()
        cap = self.cfg.kv_capacity_tokens
        return EngineStats(
            running=len(self._running) + len(self._prefill),
            waiting=len(self._waiting),
            kv_use=min(1.0, self._kv_tokens() / cap) if cap else 0.0,
            kv_capacity_tokens=cap,
            version=self.version,
        )
