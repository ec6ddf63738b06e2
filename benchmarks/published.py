"""Published, measured figures the simulator is compared with, and where each comes from.

Only numbers a public source states are here. The Laminar paper's evaluation section could
not be read from this machine: its figures are quoted as the project's design summary
(``docs/design.md``) states them, or as a public reading note of the paper reports them
(marked "reading note"); its abstract was read directly. Where no published figure exists
for a comparison, the fidelity report says "none found".
"""

from __future__ import annotations

from dataclasses import dataclass

LAMINAR = "Laminar, arXiv 2510.12633"
LAMINAR_ABSTRACT = f"{LAMINAR}, abstract"
LAMINAR_DESIGN = f"{LAMINAR}, as summarised in DESIGN.md"
LAMINAR_NOTE = f"{LAMINAR}, §8 (reading note)"


@dataclass(frozen=True)
class Published:
    value: float
    what: str  # what was measured, in the source's terms
    source: str
    fmt: str = "{:.2f}x"

    def text(self) -> str:
        return self.fmt.format(self.value)


PUBLISHED = {
    # -- end-to-end throughput (Laminar §8.1) --
    "laminar_over_sync_max": Published(
        5.48, "Laminar over verl, up to (1024 GPUs)", LAMINAR_ABSTRACT
    ),
    "laminar_over_sync_mean": Published(
        2.56, "Laminar over verl, mean over all scales and models", LAMINAR_DESIGN
    ),
    "laminar_over_one_step_mean": Published(
        1.98, "Laminar over one-step staleness, mean over all scales and models", LAMINAR_NOTE
    ),
    "laminar_over_areal_mean": Published(
        1.39, "Laminar over AReaL, mean over all scales and models", LAMINAR_DESIGN
    ),
    "laminar_over_all_largest_mean": Published(
        3.34, "Laminar over all baselines at the largest scale, mean over models", LAMINAR_NOTE
    ),
    # -- other systems' own papers --
    "areal_over_sync_max": Published(
        2.77,
        "AReaL over synchronous systems on the same GPUs, up to",
        "AReaL, arXiv 2505.24298, abstract",
    ),
    "one_step_over_sync_mean": Published(
        1.59,
        "AsyncFlow (deferred parameter update) over the state-of-the-art baseline, mean",
        "AsyncFlow, arXiv 2507.01663, abstract",
    ),
    "fully_async_over_sync_7b": Published(
        2.35,
        "verl fully-async trainer over colocated sync, Qwen2.5-7B on 128 GPUs: 2.35-2.67x",
        "verl docs, 'Recipe: Fully Async Policy Trainer'",
    ),
    "roll_flash_agentic_over_sync": Published(
        2.72,
        "ROLL Flash (asynchronous) over synchronous training on agentic tasks, same GPUs, up to",
        "ROLL Flash, arXiv 2510.11345, abstract",
    ),
    # -- scaling, components --
    "strong_scaling_efficiency": Published(
        53.7, "Laminar strong-scaling efficiency (math)", LAMINAR_DESIGN, "{:.1f}%"
    ),
    "generation_share_sync": Published(
        83.1,
        "generation's share of a synchronous iteration, up to (reasoning)",
        f"{LAMINAR}, §1 / Fig. 1 (reading note; DESIGN.md: 'up to 83%')",
        "{:.1f}%",
    ),
    "staleness_max": Published(4, "Laminar's largest observed staleness", LAMINAR_DESIGN, "{:.0f}"),
    "repack_generation_gain": Published(
        1.26, "generation throughput with repack / without", LAMINAR_NOTE
    ),
    "repack_kv_without": Published(
        71.6, "mean KV-cache use without repack", LAMINAR_NOTE, "{:.1f}%"
    ),
    "repack_kv_with": Published(82.2, "mean KV-cache use with repack", LAMINAR_NOTE, "{:.1f}%"),
    "repack_overhead_s": Published(0.69, "repack overhead", LAMINAR_NOTE, "{:.2f} s"),
    "stall_32b_s": Published(0.64, "trainer stall per push, 32B", LAMINAR_DESIGN, "{:.2f} s"),
    "stall_72b_s": Published(1.40, "trainer stall per push, 72B", LAMINAR_DESIGN, "{:.2f} s"),
    "relay_72b_127_s": Published(
        1.6, "72B broadcast to 127 relays, under", LAMINAR_DESIGN, "{:.1f} s"
    ),
}
