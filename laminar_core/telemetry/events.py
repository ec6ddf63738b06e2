"""Events: what happened in a run, when and where; one dataclass per kind, one file format.

Every writer (the controller, the rollout manager and its replica supervisor, eval rounds)
constructs one of the classes below and hands it to :meth:`EventLog.record`; nothing else
defines an event's kind or fields. ``events.jsonl`` (the run directory) and the Chrome /
Perfetto ``trace.json`` are written from the log, and :func:`read_events` parses
``events.jsonl`` back into the same classes, so the report (``telemetry.report``), the audit
(``testing.audit``) and the chaos suite read fields by name on typed objects. A field renamed
here fails at once where it is written (``TypeError``: no such keyword), where it is read
(``AttributeError``; a type checker sees both), and in files written before the rename
(:class:`EventsError` naming the line and the field), instead of leaving a plot empty.

``events.jsonl``, schema version :data:`SCHEMA_VERSION`: one JSON object per line, the first
``{"t": 0.0, "kind": "schema", "actor": "", "duration": 0.0, "version": 1}``, then one per
event in the order they were recorded: ``{"t", "kind", "actor", "duration", <the kind's
fields, in the order its class declares them>}``. ``t`` is the loop clock in seconds (the
event loop's ``time()``; virtual seconds in the simulator) at the end of the event, and
``duration`` its length (0 for an instant). A file without the schema line was written
before there was one; its lines are read as version 1 (the fields were the same).

Recording is an append (it sits on the per-trajectory hot path); formatting happens once,
when a run directory is written.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

SCHEMA_VERSION = 1
EVENTS_FILE = "events.jsonl"


class EventsError(ValueError):
    """``events.jsonl`` cannot be read as this Laminar's events; the message names the file,
    the line and what is wrong with it."""


@dataclass(slots=True, kw_only=True)
class Event:
    """Something that happened at loop time ``t`` (the end of it, if it took ``duration``
    seconds) on ``actor``: a replica id (``r3``), ``trainer``, ``relay2`` or ``node1``."""

    kind: ClassVar[str] = ""
    t: float
    actor: str
    duration: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The kind's own fields (all but ``t``, ``actor``, ``duration``), in order."""
        return {name: getattr(self, name) for name in _OWN[type(self)]}

    def to_json(self) -> dict[str, Any]:
        """The event as one line of ``events.jsonl`` holds it."""
        return {
            "t": self.t,
            "kind": self.kind,
            "actor": self.actor,
            "duration": self.duration,
            **self.fields(),
        }


# -- the file's own line ---------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class SchemaLine(Event):
    """The first line of ``events.jsonl``: which schema version the rest follows."""

    kind: ClassVar[str] = "schema"
    version: int


# -- rollouts (the rollout manager) ----------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class GroupFiltered(Event):
    """Dynamic sampling dropped the finished group ``group_id`` of prompt ``prompt`` (admitted
    for step ``tag``) before the experience buffer: its prompt was sampled and is never
    trained on; a new prompt took its slot. ``rewards``: the group's rewards."""

    kind: ClassVar[str] = "group_filtered"
    group_id: str
    prompt: int
    tag: int
    rewards: list[float]


@dataclass(slots=True, kw_only=True)
class TrajectoryDone(Event):
    """A trajectory was written to the experience buffer (``actor``: the replica of its last
    turn; ``duration``: from its first dispatch). ``version``: the weights that started it;
    ``versions``: every version that generated part of it, oldest first."""

    kind: ClassVar[str] = "trajectory"
    id: str
    version: int
    versions: list[int]
    tokens: int  # response tokens


@dataclass(slots=True, kw_only=True)
class WeightPull(Event):
    """A replica loaded ``version`` (``duration``: the load). ``others_inflight``: the
    trajectories the other replicas generated meanwhile; ``node_local``: loaded from its node's
    shared memory rather than from tensors sent to it."""

    kind: ClassVar[str] = "weight_pull"
    version: int
    others_inflight: int
    node_local: bool


@dataclass(slots=True, kw_only=True)
class RepackMove(Event):
    """Repack moved ``n`` trajectories (``ids``) from replica ``actor`` to replica ``to``."""

    kind: ClassVar[str] = "repack"
    to: str
    n: int
    ids: list[str]


# -- the replica lifecycle (``loop.supervisor``) and recovery (``loop.recovery``) -------------


@dataclass(slots=True, kw_only=True)
class ReplicaTransition(Event):
    """A replica's lifecycle state changed from ``previous`` to ``state`` (the values of
    ``loop.supervisor.ReplicaPhase``), for ``reason``."""

    kind: ClassVar[str] = "replica_state"
    previous: str
    state: str
    reason: str


@dataclass(slots=True, kw_only=True)
class ReplicaFailed(Event):
    """A replica failed for ``reason``; its ``inflight`` trajectories were redirected."""

    kind: ClassVar[str] = "replica_failed"
    reason: str
    inflight: int


@dataclass(slots=True, kw_only=True)
class ReplicaRestarted(Event):
    """A failed replica was re-initialised (``duration``: the restart) holding ``version``."""

    kind: ClassVar[str] = "replica_restart"
    version: int


@dataclass(slots=True, kw_only=True)
class ReplicaEvicted(Event):
    """A replica failed too often and is out for good (``reason``: its last failure)."""

    kind: ClassVar[str] = "replica_evicted"
    reason: str


@dataclass(slots=True, kw_only=True)
class NodeEvicted(Event):
    """Every replica of node ``actor`` (``node<N>``) was evicted."""

    kind: ClassVar[str] = "node_evicted"


@dataclass(slots=True, kw_only=True)
class ReplicaAdded(Event):
    """A replica joined the run on ``node`` (``runtime.elastic``)."""

    kind: ClassVar[str] = "replica_added"
    node: int


@dataclass(slots=True, kw_only=True)
class RelayFailed(Event):
    """Node relay ``actor`` (``relay<N>``) was found dead; a new one is being started."""

    kind: ClassVar[str] = "relay_failed"


@dataclass(slots=True, kw_only=True)
class RelayRestarted(Event):
    """Node relay ``actor`` was replaced (``duration``: the restart)."""

    kind: ClassVar[str] = "relay_restart"


# -- the trainer (the controller) ------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class WaitData(Event):
    """The trainer waited ``duration`` for the batch of ``step``."""

    kind: ClassVar[str] = "wait_data"
    step: int


@dataclass(slots=True, kw_only=True)
class TrainStep(Event):
    """The trainer computed ``step`` (``duration``) on the groups of these prompt indices."""

    kind: ClassVar[str] = "train_step"
    step: int
    prompts: list[int]


@dataclass(slots=True, kw_only=True)
class WeightPush(Event):
    """The trainer published ``version`` (``duration``: its stall until the master relay held
    it)."""

    kind: ClassVar[str] = "weight_push"
    version: int


@dataclass(slots=True, kw_only=True)
class CheckpointSaved(Event):
    """A checkpoint of ``step`` was committed."""

    kind: ClassVar[str] = "checkpoint"
    step: int


@dataclass(slots=True, kw_only=True)
class TrainerRestarted(Event):
    """The trainer group failed and was restarted (``duration``) from the checkpoint of
    ``from_step`` (weights of ``restored_version``); ``lost_steps`` steps and the prompts
    ``lost_prompts`` are redone."""

    kind: ClassVar[str] = "trainer_restart"
    from_step: int
    restored_version: int
    lost_prompts: list[int]
    lost_steps: int


@dataclass(slots=True, kw_only=True)
class EvalRound(Event):
    """An eval round on ``version`` (``duration``): mean ``reward`` (``None``: no reward) over
    ``samples`` scored samples."""

    kind: ClassVar[str] = "eval"
    version: int
    reward: float | None
    samples: int


KINDS: dict[str, type[Event]] = {}
_BASE = ("t", "actor", "duration")
_OWN: dict[type[Event], tuple[str, ...]] = {}
for _cls in (
    SchemaLine,
    GroupFiltered,
    TrajectoryDone,
    WeightPull,
    RepackMove,
    ReplicaTransition,
    ReplicaFailed,
    ReplicaRestarted,
    ReplicaEvicted,
    NodeEvicted,
    ReplicaAdded,
    RelayFailed,
    RelayRestarted,
    WaitData,
    TrainStep,
    WeightPush,
    CheckpointSaved,
    TrainerRestarted,
    EvalRound,
):
    assert _cls.kind not in KINDS, f"two event classes of kind {_cls.kind!r}"
    KINDS[_cls.kind] = _cls
    _OWN[_cls] = tuple(f.name for f in fields(_cls) if f.name not in _BASE)


# -- writing ---------------------------------------------------------------------------------


@dataclass
class EventLog:
    """The run's events, in the order they were recorded; ``enabled=False`` keeps counts
    only (studies keep no timeline)."""

    enabled: bool = True
    events: list[Event] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def record(self, event: Event) -> None:
        self.counts[event.kind] += 1
        if self.enabled:
            self.events.append(event)

    def of(self, *classes: type[Event]) -> list[Any]:
        """The recorded events of these classes, in order."""
        return [e for e in self.events if isinstance(e, classes)]

    def write_chrome_trace(self, path: str | Path) -> None:
        """A Chrome-trace / Perfetto timeline: one row per actor, spans for timed events."""
        actors: dict[str, int] = {}
        out = []
        for e in self.events:
            tid = actors.setdefault(e.actor, len(actors) + 1)
            ev: dict[str, Any] = {
                "name": e.kind,
                "ts": e.t * 1e6,
                "pid": 1,
                "tid": tid,
                "args": e.fields(),
            }
            if e.duration > 0:
                ev.update(ph="X", dur=e.duration * 1e6, ts=(e.t - e.duration) * 1e6)
            else:
                ev.update(ph="i", s="t")
            out.append(ev)
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": actor}}
            for actor, tid in actors.items()
        ]
        Path(path).write_text(json.dumps({"traceEvents": meta + out}))

    def write_jsonl(self, path: str | Path) -> None:
        """``events.jsonl`` (module docstring): the schema line, then every event."""
        with open(path, "w") as f:
            header = SchemaLine(t=0.0, actor="", version=SCHEMA_VERSION)
            f.write(json.dumps(header.to_json()) + "\n")
            for e in self.events:
                f.write(json.dumps(e.to_json()) + "\n")


# -- reading ---------------------------------------------------------------------------------


@dataclass
class EventFile:
    """``events.jsonl`` as read: its schema ``version`` (0: written before there was one)
    and its events, in file order. ``cut_off``: its last line was half-written (the run was
    killed while writing the file) and is left out."""

    path: Path
    version: int
    events: list[Event]
    cut_off: bool = False

    def of(self, *classes: type[Event]) -> list[Any]:
        """The events of these classes, in file order."""
        return [e for e in self.events if isinstance(e, classes)]


def read_events(path: str | Path) -> EventFile:
    """Parse ``events.jsonl`` into the event classes (one pass).

    One rule for a damaged file: a last line that is not JSON is taken as cut off by a kill
    mid-write and left out (``EventFile.cut_off``; what to make of that is the reader's
    call); anything else that does not match this schema -- a line that is not JSON before
    the last, an unknown kind, a missing or unknown field, a newer schema version -- raises
    :class:`EventsError` naming the line.
    """
    path = Path(path)
    events: list[Event] = []
    version: int | None = None
    unreadable: str | None = None  # the latest line that was not JSON; fatal unless last
    loads = json.loads
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if unreadable is not None:
                raise EventsError(unreadable)
            try:
                row = loads(line)
            except json.JSONDecodeError as e:
                unreadable = f"{path}: line {n} is not JSON ({e.msg}) and is not the last line"
                continue
            if not isinstance(row, dict):
                raise EventsError(f"{path}: line {n} is not a JSON object")
            kind = row.pop("kind", None)
            cls = KINDS.get(kind) if isinstance(kind, str) else None
            if cls is None or (cls is SchemaLine and version is not None):
                raise EventsError(_unknown(path, n, kind, version))
            try:
                event = cls(**row)
            except TypeError:
                raise EventsError(_mismatch(path, n, cls, row, version)) from None
            if isinstance(event, SchemaLine):
                version = event.version
                if version > SCHEMA_VERSION:
                    raise EventsError(
                        f"{path} was written with event schema version {version}; this "
                        f"Laminar reads up to version {SCHEMA_VERSION}: upgrade Laminar to "
                        "read it"
                    )
                continue
            if version is None:
                version = 0  # no schema line: written before there was one
            events.append(event)
    return EventFile(path, version or 0, events, cut_off=unreadable is not None)


def _legacy(version: int | None) -> str:
    if version:
        return ""
    return (
        " (the file has no schema line: it was written by a Laminar from before events.jsonl "
        "had a schema version; read it with the Laminar that wrote it)"
    )


def _unknown(path: Path, n: int, kind: Any, version: int | None) -> str:
    if kind == SchemaLine.kind:
        return f"{path}: line {n}: a schema line after the first line"
    known = ", ".join(k for k in KINDS if k != SchemaLine.kind)
    return (
        f"{path}: line {n}: unknown event kind {kind!r} (schema version "
        f"{version or SCHEMA_VERSION} knows {known}){_legacy(version)}"
    )


def _mismatch(path: Path, n: int, cls: type[Event], row: dict, version: int | None) -> str:
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.name != "duration"}
    extra = sorted(set(row) - names)
    missing = sorted(required - set(row))
    what = []
    if missing:
        what.append(f"lacks field(s) {', '.join(missing)}")
    if extra:
        what.append(f"has field(s) {', '.join(extra)} that the schema does not define")
    return (
        f"{path}: line {n}: a {cls.kind!r} event {' and '.join(what) or 'is malformed'} "
        f"(schema version {version or SCHEMA_VERSION}: {', '.join(f.name for f in fields(cls))})"
        f"{_legacy(version)}"
    )
