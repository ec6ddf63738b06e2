"""docs/config.md is generated from the config dataclasses: it must match the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from laminar_core.cli import config_reference
from laminar_core.config import reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.read_text() == config_reference(), (
        "docs/config.md is out of date: run `laminar config reference --out docs/config.md`"
    )


@dataclasses.dataclass
class _Inner:
    depth: int = 3  # how deep


@dataclasses.dataclass
class _Sample:
    """A sample section."""

    # the comment above
    # spans two lines
    name: str = "x"  # and one after
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    tags: list[str] = dataclasses.field(default_factory=lambda: ["a"])


def test_keys_come_from_the_source():
    keys = {k.path: k for k in reference.keys(_Sample, "s")}
    assert keys["s.name"].doc == "the comment above spans two lines and one after"
    assert keys["s.name"].default == "'x'"
    assert keys["s.inner.depth"].doc == "how deep"
    assert keys["s.tags"].default == "['a']"
    text = reference.render([("s", _Sample, "s", "")])
    assert "A sample section." in text and "| `s.inner.depth` | `int` | `3` | how deep |" in text
