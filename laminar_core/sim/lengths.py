"""Output-length distributions for the simulated rollout engine.

Lengths are a property of the *sample*, not of the replica that happens to generate it: a
trajectory that is aborted and resumed elsewhere finishes at the same total length. So a
length is a pure function of ``(seed, sample_key)`` -- a 64-bit hash turned into a uniform
and pushed through the inverse CDF -- with no shared RNG state whose order could change.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

_MASK = (1 << 64) - 1
_Z99 = NormalDist().inv_cdf(0.99)


def uniform(seed: int, key: int) -> float:
    """A deterministic uniform in (0, 1) from two integers (splitmix64 finaliser)."""
    z = (key * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z + 0.5) / 2.0**64


class LengthFileError(ValueError):
    """An empirical length histogram that does not parse."""


@dataclass(frozen=True)
class LengthModel:
    """Sampled output lengths, truncated to ``[1, max_tokens]``.

    ``kind="lognormal"``: median ``median`` and tail ratio ``p99_over_p50`` (the paper
    measures about 10 on math and code). ``kind="histogram"``: inverse-CDF over the
    ``(lengths, counts)`` of an empirical file.
    """

    kind: str
    max_tokens: int
    median: float = 0.0
    sigma: float = 0.0
    lengths: tuple[int, ...] = ()
    cdf: tuple[float, ...] = ()
    seed: int = 0

    @classmethod
    def lognormal(
        cls, median: float, p99_over_p50: float, max_tokens: int, seed: int = 0
    ) -> LengthModel:
        if median <= 0 or p99_over_p50 < 1 or max_tokens < 1:
            raise ValueError(
                "lognormal lengths need median > 0, p99_over_p50 >= 1 and max_tokens >= 1 "
                f"(got {median}, {p99_over_p50}, {max_tokens})"
            )
        return cls("lognormal", max_tokens, median, math.log(p99_over_p50) / _Z99, seed=seed)

    @classmethod
    def histogram(cls, path: str | Path, max_tokens: int, seed: int = 0) -> LengthModel:
        lengths, counts = read_histogram(path)
        total = float(sum(counts))
        acc, cdf = 0.0, []
        for c in counts:
            acc += c
            cdf.append(acc / total)
        return cls("histogram", max_tokens, lengths=tuple(lengths), cdf=tuple(cdf), seed=seed)

    def sample(self, key: int) -> int:
        """The output length of sample ``key`` (deterministic)."""
        u = uniform(self.seed, key)
        if self.kind == "lognormal":
            n = self.median * math.exp(self.sigma * NormalDist().inv_cdf(u))
        else:
            n = self.lengths[min(bisect.bisect_left(self.cdf, u), len(self.lengths) - 1)]
        return max(1, min(self.max_tokens, int(n)))


def read_histogram(path: str | Path) -> tuple[list[int], list[float]]:
    """Read ``{"lengths": [...], "counts": [...]}`` JSON or ``length,count`` CSV lines.

    Raises ``LengthFileError`` naming the file and the first problem found.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise LengthFileError(f"length histogram {p}: cannot read ({e.strerror})") from None
    try:
        if p.suffix == ".json":
            obj = json.loads(text)
            lengths, counts = list(obj["lengths"]), list(obj["counts"])
        else:
            lengths, counts = [], []
            for lineno, line in enumerate(text.splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#") or line.lower().startswith("length"):
                    continue
                parts = line.split(",")
                if len(parts) != 2:
                    raise LengthFileError(
                        f"length histogram {p}:{lineno}: expected 'length,count', got {line!r}"
                    )
                lengths.append(parts[0])
                counts.append(parts[1])
        lengths = [int(x) for x in lengths]
        counts = [float(x) for x in counts]
    except LengthFileError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise LengthFileError(
            f"length histogram {p}: does not parse ({type(e).__name__}: {e}); expected JSON "
            '{"lengths": [...], "counts": [...]} or CSV lines "length,count"'
        ) from None
    if not lengths or len(lengths) != len(counts):
        raise LengthFileError(
            f"length histogram {p}: needs equally many lengths and counts, at least one"
        )
    if any(n < 1 for n in lengths) or any(c < 0 for c in counts) or sum(counts) <= 0:
        raise LengthFileError(
            f"length histogram {p}: lengths must be >= 1 and counts >= 0 with a positive total"
        )
    pairs = sorted(zip(lengths, counts))
    return [a for a, _ in pairs], [b for _, b in pairs]
