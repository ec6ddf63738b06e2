"""Repack policies: which long-tail trajectories to consolidate onto fewer rollout replicas."""

from laminar_core.repack.best_fit import BestFitPolicy
from laminar_core.repack.none import NoRepack

__all__ = ["BestFitPolicy", "NoRepack"]
