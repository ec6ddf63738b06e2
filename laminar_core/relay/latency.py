"""The pipelined-chain latency model from the Laminar paper.

Broadcasting a model of ``M`` bytes down a chain of ``p`` relays in ``k`` chunks takes
``T = (p + k - 2) * (M / k * t_byte + t_start)``: the first chunk crosses ``p - 1`` hops, the
other ``k - 1`` follow one chunk-time apart. Minimising over ``k`` gives
``k* = sqrt((p - 2) * M * t_byte / t_start)``.
"""

from __future__ import annotations

import math


def chain_latency(
    relays: int, model_bytes: float, chunks: int, t_byte: float, t_start: float
) -> float:
    """Predicted seconds for the last relay of the chain to hold the whole model."""
    if relays <= 1:
        return 0.0
    k = max(1, chunks)
    return (relays + k - 2) * (model_bytes / k * t_byte + t_start)


def optimal_chunks(
    relays: int, model_bytes: float, t_byte: float, t_start: float, max_chunks: int = 4096
) -> int:
    """``k*`` rounded to the better neighbouring integer, within ``[1, max_chunks]``."""
    if relays <= 2 or t_start <= 0:
        return 1 if t_start > 0 or relays <= 2 else max_chunks
    k = math.sqrt((relays - 2) * model_bytes * t_byte / t_start)
    lo, hi = max(1, math.floor(k)), max(1, math.ceil(k))
    best = min((lo, hi), key=lambda c: chain_latency(relays, model_bytes, c, t_byte, t_start))
    return min(max_chunks, best)
