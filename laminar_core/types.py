"""Plain data types shared by every part of Laminar.

They cross process boundaries (Ray actors, relay processes), so they hold only builtins,
lists and tensors -- never an engine object. A simulated engine does not materialise token ids:
it leaves ``*_ids`` empty and reports lengths through ``num_prompt_tokens`` /
``num_response_tokens``; real engines fill both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why a trajectory stopped generating."""

    STOP = "stop"  # end-of-sequence or a stop string
    LENGTH = "length"  # hit max_tokens
    ABORTED = "aborted"  # cut off (repack, partial rollout, replica failure)
    FAILED = "failed"  # reward or engine error; ``Trajectory.error`` says which


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request; identical on resume so a trajectory stays one sample.

    ``stop``: strings that end generation (matched on the decoded text); ``stop_token_ids``:
    token ids that end it besides the model's end of sequence (a chat template's end-of-turn
    token, e.g. ``<|im_end|>``). Either way the token that ended it is kept, with its
    log-prob.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16384
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PartialTrajectory:
    """What an in-flight trajectory has produced so far.

    Returned by ``RolloutEngine.abort`` and ``RolloutEngine.partials``; passed back as
    ``GenerationRequest.resume`` to continue generation on any replica holding ``version``.
    """

    traj_id: str
    version: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_response_tokens: int = 0
    versions: list[int] = field(default_factory=list)  # one entry per segment, oldest first


@dataclass(slots=True)
class GenerationRequest:
    """One trajectory to generate: a prompt, its sampling params, optionally a prefix to resume."""

    traj_id: str
    group_id: str
    prompt_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    resume: PartialTrajectory | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_ids and not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prompt_ids)


@dataclass(slots=True)
class Trajectory:
    """One finished sample.

    ``version`` is the weight version that generated it. Under partial rollout (``stale:K``
    with ``partial_rollout``), or across the turns of a multi-turn (tool-calling) episode,
    several versions may have contributed; ``versions`` lists them oldest first and
    ``version`` is the oldest, which is what staleness is measured against.

    ``loss_mask`` (one entry per response token; empty: all 1) is 1 for tokens the model
    generated and 0 for tokens it did not (a tool's output appended between turns): losses
    and log-prob comparisons count only the 1s. ``logprobs`` has an entry for every response
    token (0.0 where the mask is 0).

    ``token_versions`` (one entry per response token; empty: every token is ``version``'s) is
    the weight version of the call that added each token -- that generated it, where the
    mask is 1. Filled where one sample spans calls served by different versions (an agent
    session through the gateway, ``laminar_core.gateway``).

    ``teacher_logprobs`` (one entry per response token; empty: not scored) is a teacher's
    log-prob of each response token given the same prefix (on-policy distillation,
    ``algorithm.teacher``; ``RolloutEngine.score``).
    """

    traj_id: str
    group_id: str
    version: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_response_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    versions: list[int] = field(default_factory=list)
    reward: float | None = None
    error: str | None = None
    replicas: list[str] = field(default_factory=list)  # replica history, first to last
    start_time: float = 0.0
    finish_time: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    teacher_logprobs: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_response_tokens

    def response_mask(self) -> list[int]:
        """``loss_mask``, or all 1 when the trajectory has none (a single-turn sample)."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)

    def generated_only_by(self, version: int) -> bool:
        """Whether weight version ``version`` generated every token (no other version
        contributed): the trajectories whose rollout log-probs a trainer holding
        ``version`` must reproduce."""
        return self.version == version and self.versions in ([], [version])


@dataclass(slots=True)
class EngineStats:
    """A replica's load as its scheduler sees it."""

    running: int
    waiting: int
    kv_use: float  # 0..1 share of KV capacity in use
    kv_capacity_tokens: int
    version: int


@dataclass(slots=True)
class TensorSpec:
    """Where one named tensor lives inside a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    nbytes: int


@dataclass(slots=True)
class WeightManifest:
    """Everything a receiver needs to check and unpack one weight version.

    A bucket whose ``data`` is ``None`` is *phantom*: the simulator moves only its size.
    """

    version: int
    tensors: list[TensorSpec]
    bucket_sizes: list[int]
    checksums: list[int]  # XXH3-64 per bucket (relay.packing.checksum); -1: phantom buckets

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)


# The manifest's JSON form: the relays' control plane carries it (relay.wire) and the node's
# shared weight files keep it beside the bytes (interfaces.weights).
def manifest_to_json(manifest: WeightManifest) -> str:
    return json.dumps(
        {
            "version": manifest.version,
            "tensors": [
                [s.name, list(s.shape), s.dtype, s.bucket, s.offset, s.nbytes]
                for s in manifest.tensors
            ],
            "bucket_sizes": list(manifest.bucket_sizes),
            "checksums": list(manifest.checksums),
        }
    )


def manifest_from_json(text: str | bytes) -> WeightManifest:
    d = json.loads(text)
    return WeightManifest(
        d["version"],
        [TensorSpec(n, tuple(shape), dt, b, off, nb) for n, shape, dt, b, off, nb in d["tensors"]],
        list(d["bucket_sizes"]),
        list(d["checksums"]),
    )


@dataclass(slots=True)
class Bucket:
    """One contiguous chunk of a weight version on the wire."""

    version: int
    index: int
    nbytes: int
    checksum: int = -1
    data: bytes | bytearray | memoryview | None = None


@dataclass(slots=True)
class Group:
    """The samples of one prompt (a GRPO group), released to the trainer only when all finished."""

    group_id: str
    prompt_index: int
    trajectories: list[Trajectory]
    batch_tag: int = -1  # the trainer step it was admitted for (bounded-staleness schedules)


@dataclass(slots=True)
class TrainBatch:
    """What a trainer step consumes: whole groups, in sampler order.

    ``version`` is the weight version the trainer holds while it trains this batch (the one
    it published last): trajectories of that version were generated by the trainer's
    current weights (-1: not told).
    """

    step: int
    groups: list[Group]
    version: int = -1

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for g in self.groups for t in g.trajectories)


@dataclass(slots=True)
class ReplicaState:
    """Snapshot of one replica that a ``RepackPolicy`` plans from."""

    replica_id: str
    version: int
    kv_use: float
    prev_kv_use: float
    running: int  # unfinished requests, running + waiting
    traj_ids: list[str]
    alive: bool = True


@dataclass(slots=True, frozen=True)
class Move:
    """Move ``traj_ids`` (unfinished) from ``source`` to ``destination``."""

    source: str
    destination: str
    traj_ids: tuple[str, ...]
