"""What a conformance kit checked and what it could not (with why), and how it fails."""

from __future__ import annotations

from dataclasses import dataclass, field


class ContractError(AssertionError):
    """A conformance kit found a broken rule; the message names it and the likely fix.

    Raised explicitly, never by an ``assert`` statement, so a kit checks the same under
    ``python -O`` (which strips asserts). An ``AssertionError``: pytest reports it as a
    failed test, and ``pytest.raises(AssertionError)`` still catches it.
    """


def require(ok: object, message: str) -> None:
    """Raise ``ContractError(message)`` unless ``ok``: a kit's check, kept under ``-O``."""
    if not ok:
        raise ContractError(message)


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
