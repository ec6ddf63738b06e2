"""Dynamic sampling in the loop: counting the groups it drops, and stopping a run whose
groups it keeps dropping.

The filter itself runs where a group completes (``ExperienceBuffer.group_filter``; the
predicates are ``algorithms.filters``); the slot goes back to admission
(``Admission.on_filtered``: a new prompt, for the same step, at once). Here: every finished
group is counted, kept or dropped, in windows of a step's worth (``G`` groups); once more than
``max_rate`` of a window was dropped ``patience`` windows in a row, the run stops with one
line naming the cause (the task is solved, or the model cannot start it: either way more
sampling only burns rollouts). Windows count finished groups, not trainer steps, so a run whose
every group is dropped (the trainer never gets a batch) stops too.
"""

from __future__ import annotations

from laminar_core.algorithms.config import DynamicSampling


class DynamicSamplingStop(RuntimeError):
    """The run stops: dynamic sampling dropped too many groups for too long."""


class FilterWatch:
    """Counts kept and dropped groups (module docstring)."""

    def __init__(self, options: DynamicSampling, groups_per_step: int) -> None:
        self.opt = options
        self.window = max(1, groups_per_step)
        self.filtered = 0  # groups dropped, all run
        self.kept = 0  # groups kept, all run
        self._in_window = [0, 0]  # [dropped, seen] of the current window
        self._streak = 0  # windows in a row above max_rate
        self._last_rewards: list[float] = []

    def seen(self, dropped: bool, rewards: list[float]) -> None:
        """A group finished; raise ``DynamicSamplingStop`` at the bound."""
        if dropped:
            self.filtered += 1
            self._last_rewards = rewards
        else:
            self.kept += 1
        w = self._in_window
        w[0] += dropped
        w[1] += 1
        if w[1] < self.window:
            return
        rate = w[0] / w[1]
        self._in_window = [0, 0]
        self._streak = self._streak + 1 if rate > self.opt.max_rate else 0
        n = self.opt.patience
        if n and self._streak >= n:
            raise DynamicSamplingStop(
                f"dynamic sampling dropped more than {self.opt.max_rate:g} of the groups "
                f"({self.opt.filter}) for {n} steps' worth of groups in a row (last dropped "
                f"group's rewards: {self._last_rewards}): the task is solved or out of reach "
                f"for this model; change the task or its difficulty, or raise "
                f"algorithm.dynamic_sampling.max_rate / patience (patience 0: never stop)"
            )
