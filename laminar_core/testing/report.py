"""What a conformance kit checked and what it could not (with why)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KitReport:
    """Returned by ``check_rollout_engine``: the rules it checked, and the ones it skipped
    with the reason (a skipped rule passed nothing). ``str()`` is a short summary; use
    ``strict=True`` on the kit to make any skip a failure."""

    engine: str
    checked: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def ok(self, rule: str) -> None:
        self.checked.append(rule)

    def skip(self, rule: str, why: str) -> None:
        self.skipped[rule] = why

    def __str__(self) -> str:
        lines = [f"{self.engine}: {len(self.checked)} checked, {len(self.skipped)} skipped"]
        lines += [f"  ok    {rule}" for rule in self.checked]
        lines += [f"  SKIP  {rule}: {why}" for rule, why in self.skipped.items()]
        return "\n".join(lines)
