"""Admission: when the rollout manager may hand out the next GRPO group, and to whom.

One object per run, built from its schedule (``Schedule.admission``), holding the rule and
its counters; the rollout manager asks it before every admission and tells it of every
group admitted and every batch consumed. The simulator runs the same manager, so simulated
and real runs admit by the same rule.

Groups are tagged with the trainer step they are admitted for: ``tag = admitted // G``
(``G`` groups per step). With ``admitted`` groups handed out and ``consumed`` trained on:

* ``LagAdmission(K)`` -- ``sync`` (K = 0), ``one_step`` (K = 1), ``stale:K`` (AReaL's bounded
  staleness): the group for step ``tag`` goes only to a replica holding version
  ``>= tag - K``, so every trajectory of batch ``s`` is at most ``K`` versions old when step
  ``s`` trains on it. Equivalently (AReaL's staleness manager): at trainer version ``v`` at
  most ``(v + K + 1) * G`` groups may have been admitted.
* ``WindowAdmission(W)`` -- ``laminar``: any replica, any version, while
  ``admitted - consumed < W * G`` (``buffer.max_ahead_batches``): staleness is not bounded
  by a knob, only the run-ahead of rollouts over the trainer is.

Dynamic sampling (``algorithm.dynamic_sampling``): a group dropped when it finished gives its
slot back (:meth:`Admission.on_filtered`): the next admission is a new prompt for the same
step ``tag``, at once (the rule's gate does not apply: the slot was already counted), so
every step still gets ``G`` groups and staleness bounds hold as before.
"""

from __future__ import annotations

import abc
from collections import deque


class Admission(abc.ABC):
    """The admission rule of one run (see module docstring) and its counters."""

    def __init__(self, groups_per_step: int) -> None:
        self.groups_per_step = groups_per_step
        self.admitted = 0  # group slots handed out
        self.consumed = 0  # groups the trainer took
        self.refill: deque[int] = deque()  # tags of slots whose groups were filtered out

    @property
    def outstanding(self) -> int:
        """Groups admitted and not yet trained on (in flight or buffered)."""
        return self.admitted - self.consumed

    @property
    def next_tag(self) -> int:
        """The trainer step the next group is admitted for (a refilled slot's first)."""
        return self.refill[0] if self.refill else self.admitted // self.groups_per_step

    def may_admit(self) -> bool:
        """May the next group be admitted: a slot to refill, or the rule is open."""
        return bool(self.refill) or self.open()

    def on_filtered(self, tag: int) -> None:
        """A group admitted for step ``tag`` was dropped by dynamic sampling: its slot goes to
        a new prompt (module docstring)."""
        self.refill.append(tag)

    @abc.abstractmethod
    def open(self) -> bool:
        """May another group be admitted at all (before looking at replicas)?"""

    @abc.abstractmethod
    def min_version(self, tag: int) -> int | None:
        """The oldest weight version a replica may hold to take a group for step ``tag``
        (``None``: any)."""

    def room(self) -> float | None:
        """Groups that may still be admitted before the rule closes (``None``: no bound)."""
        return None

    def on_admitted(self) -> None:
        if self.refill:
            self.refill.popleft()
        else:
            self.admitted += 1

    def on_consumed(self, consumed: int) -> None:
        """The trainer has taken ``consumed`` groups in all."""
        self.consumed = consumed

    def resume_at(self, step: int) -> None:
        """Continue a run whose trainer has done ``step`` steps (nothing outstanding: groups
        in flight at the checkpoint are re-issued)."""
        self.admitted = self.consumed = step * self.groups_per_step
        self.refill.clear()


class LagAdmission(Admission):
    """Groups for step ``tag`` need a replica at version ``>= tag - max_lag``."""

    def __init__(self, groups_per_step: int, max_lag: int) -> None:
        super().__init__(groups_per_step)
        self.max_lag = max_lag

    def open(self) -> bool:
        return True

    def min_version(self, tag: int) -> int | None:
        return tag - self.max_lag


class WindowAdmission(Admission):
    """Any replica, while fewer than ``max_ahead_batches`` steps' worth of groups are
    outstanding."""

    def __init__(self, groups_per_step: int, max_ahead_batches: float) -> None:
        super().__init__(groups_per_step)
        self.max_ahead_batches = max_ahead_batches

    def open(self) -> bool:
        return self.outstanding < self.max_ahead_batches * self.groups_per_step

    def room(self) -> float | None:
        return max(0.0, self.max_ahead_batches * self.groups_per_step - self.outstanding)

    def min_version(self, tag: int) -> int | None:
        return None
