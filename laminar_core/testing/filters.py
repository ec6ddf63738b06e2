"""Group filters for tests of dynamic sampling on real engines (``algorithm.dynamic_sampling:
{filter: laminar_core.testing.filters:every_third}``).

DAPO's ``zero_variance`` drops nearly every group of a random tiny model (its rewards are all
zero at first), so a real run with it samples for minutes before a step fills; a filter that
drops a fixed share whatever the rewards exercises the loop around any filter (dropped groups
counted, their slots refilled, never trained, audited once) in seconds. Importable wherever
the config is resolved (the driver and every actor), which a test module is not.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["every_third"]

_groups = itertools.count()


def every_third(rewards: Sequence[float]) -> bool:
    """Drop every third group this process sees, whatever its rewards."""
    return next(_groups) % 3 == 2
