"""Helpers shared by the benchmark scripts (not a test suite: they print figures)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "sim"

# The Laminar paper's three setups at their largest scale (arXiv 2510.12633, §8).
SETUPS = ["paper_7b_256gpu", "paper_32b_512gpu", "paper_72b_1024gpu"]
SETUP_NAMES = {
    "paper_7b_256gpu": "7B, 256 GPUs",
    "paper_32b_512gpu": "32B, 512 GPUs",
    "paper_72b_1024gpu": "72B, 1024 GPUs",
}


def table(rows: list[list[str]], header: list[str]) -> str:
    """A Markdown table (readable in a terminal too)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def say(*args: object) -> None:
    print(*args, flush=True)
    sys.stdout.flush()


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank); NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
