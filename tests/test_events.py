"""``telemetry.events``: one class per event kind, one file format, one reader."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from laminar_core.telemetry import events as ev


def _value(tp: typing.Any, i: int) -> typing.Any:
    """A distinct JSON-able value of type ``tp``."""
    tp = typing.get_args(tp)[0] if typing.get_origin(tp) in (typing.Union, type(int | None)) else tp
    if typing.get_origin(tp) is list:
        return [_value(typing.get_args(tp)[0], i), _value(typing.get_args(tp)[0], i + 1)]
    return {int: i, float: i + 0.5, str: f"s{i}", bool: bool(i % 2)}[tp]


def _every_kind() -> list[ev.Event]:
    out = []
    for i, cls in enumerate(ev.KINDS.values()):
        if cls is ev.SchemaLine:
            continue
        hints = typing.get_type_hints(cls)
        own = {f.name: _value(hints[f.name], i) for f in dataclasses.fields(cls)}
        out.append(cls(**{**own, "t": 100.0 + i, "actor": f"r{i}", "duration": 0.25 * (i % 3)}))
    return out


def test_every_kind_round_trips_through_events_jsonl(tmp_path: Path) -> None:
    log = ev.EventLog()
    for e in _every_kind():
        log.record(e)
    path = tmp_path / ev.EVENTS_FILE
    log.write_jsonl(path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kind"] == "schema" and lines[0]["version"] == ev.SCHEMA_VERSION
    # the line layout: t, kind, actor, duration, then the kind's fields in declaration order
    for line, e in zip(lines[1:], log.events):
        assert list(line) == ["t", "kind", "actor", "duration", *e.fields()]
    back = ev.read_events(path)
    assert back.version == ev.SCHEMA_VERSION and not back.cut_off
    assert back.events == log.events
    assert {e.kind for e in back.events} == set(ev.KINDS) - {"schema"}
    # the Chrome trace carries the same fields as each event's args
    log.write_chrome_trace(tmp_path / "trace.json")
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [x["args"] for x in spans if x["ph"] != "M"] == [e.fields() for e in log.events]


def test_an_unknown_kind_or_field_names_the_line(tmp_path: Path) -> None:
    log = ev.EventLog()
    log.record(ev.WaitData(t=1.0, actor="trainer", duration=1.0, step=0))
    path = tmp_path / ev.EVENTS_FILE
    log.write_jsonl(path)
    good = path.read_text()
    path.write_text(good + json.dumps({"t": 2.0, "kind": "wait_dat", "actor": "trainer"}) + "\n")
    with pytest.raises(ev.EventsError, match="line 3: unknown event kind 'wait_dat'"):
        ev.read_events(path)
    bad = {"t": 2.0, "kind": "wait_data", "actor": "trainer", "duration": 1.0, "stp": 1}
    path.write_text(good + json.dumps(bad) + "\n")
    with pytest.raises(ev.EventsError, match=r"line 3: a 'wait_data' event lacks field\(s\) step"):
        ev.read_events(path)
    path.write_text(good + good.splitlines()[0] + "\n")
    with pytest.raises(ev.EventsError, match="line 3: a schema line after the first line"):
        ev.read_events(path)


def test_the_log_counts_what_it_does_not_keep() -> None:
    log = ev.EventLog(enabled=False)
    log.record(ev.RelayFailed(t=1.0, actor="relay1"))
    assert log.events == [] and log.counts == {"relay_failed": 1}


def test_docs_events_md_lists_every_kind_and_field() -> None:
    """``docs/events.md`` is the reference: one table row per kind naming each field."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "events.md").read_text()
    rows = {
        cells[1].strip("` "): cells
        for line in doc.splitlines()
        if line.startswith("| `") and len(cells := line.split("|")) > 5
    }
    for kind, cls in ev.KINDS.items():
        if cls is ev.SchemaLine:
            assert f'"version": {ev.SCHEMA_VERSION}' in doc
            continue
        assert kind in rows, f"docs/events.md has no row for {kind!r}"
        assert f"`{cls.__name__}`" in rows[kind][2]
        for name in ev._OWN[cls]:
            assert f"`{name}`" in rows[kind][5], f"docs/events.md: {kind} lacks field {name}"
