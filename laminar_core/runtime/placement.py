"""Where roles go: how many GPUs train, how many replicas roll out, on which nodes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from laminar_core.config.schema import LaminarConfig
from laminar_core.loop.schedules import Schedule


@dataclass(frozen=True)
class Placement:
    trainer_gpus: int
    rollout_gpus: int
    replicas: int
    nodes: int  # rollout nodes, one relay each
    replica_node: tuple[int, ...]
    colocated: bool

    def on_nodes(self, node_of_replica: Sequence[str]) -> Placement:
        """This placement with the nodes where a cluster actually put the replicas (one
        id per replica, any hashable node name): node ``n`` is the ``n``-th distinct one."""
        index = {n: i for i, n in enumerate(dict.fromkeys(node_of_replica))}
        return dataclasses.replace(
            self, nodes=len(index), replica_node=tuple(index[n] for n in node_of_replica)
        )


def plan_placement(
    cfg: LaminarConfig, schedule: Schedule, allow_colocate: bool = True
) -> Placement:
    """Disaggregated by default; ``sync`` with ``cluster.colocate_sync`` time-shares every
    GPU between rollout and training, as verl's hybrid engine does. Real runtimes pass
    ``allow_colocate=False``: their engines do not offload to share a device."""
    c = cfg.cluster
    colocated = allow_colocate and schedule.name == "sync" and c.colocate_sync
    trainer = c.gpus if colocated else c.trainer_gpus
    rollout = c.gpus if colocated else c.gpus - c.trainer_gpus
    replicas = rollout // c.gpus_per_replica
    per_node = max(1, c.gpus_per_node // c.gpus_per_replica)
    nodes = math.ceil(replicas / per_node)
    return Placement(
        trainer, rollout, replicas, nodes, tuple(i // per_node for i in range(replicas)), colocated
    )
