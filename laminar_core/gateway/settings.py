"""What a run allows its agents: the served model name, sampling, budgets, the parser.

Sampling is the run's: an RL update is only correct for the distribution the trainer
recomputes (``log_softmax(logits / temperature)``, ``top_p`` 1), so an agent cannot choose
its own. ``on_sampling_mismatch`` says what happens when a call asks for other values:
``override`` (default) serves it with the run's ``temperature``/``top_p`` and says so in
the response (``laminar.sampling_overridden``): agents written for hosted models often
hard-code ``temperature=0`` and must run unmodified; ``reject`` answers 400 naming the
parameter, for runs that want every such agent fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GatewaySettings", "SessionBudget"]

SAMPLING_POLICIES = ("override", "reject")


@dataclass
class SessionBudget:
    """Per-session limits; a call past one is refused with the limit's name.

    ``max_calls``: model calls (chat and text completions together). ``max_total_tokens``:
    tokens of all the session's samples together (prompts, observations and generated
    tokens: what the trainer will process); a call's ``max_tokens`` is cut to what is left.
    ``max_context_tokens``: one call's prompt plus completion (400
    ``context_length_exceeded`` when the prompt alone reaches it). ``max_wall_s``: seconds
    from the session's opening; a call running past it is stopped. ``max_samples``: samples
    (a first one plus forks) one session may make.
    """

    max_calls: int = 64
    max_total_tokens: int = 65536
    max_context_tokens: int = 8192
    max_wall_s: float = 900.0
    max_samples: int = 16

    def __post_init__(self) -> None:
        for name in ("max_calls", "max_total_tokens", "max_context_tokens", "max_samples"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"budget.{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_wall_s > 0:
            raise ValueError(f"budget.max_wall_s must be > 0, got {self.max_wall_s}")


@dataclass
class GatewaySettings:
    """The gateway's settings (the run's ``agent`` section maps onto them).

    ``model``: the name agents pass as ``model`` (``GET /v1/models`` lists it; any other
    name is a 404). ``temperature`` / ``top_p``: the run's sampling; see the module
    docstring for ``on_sampling_mismatch``. ``max_tokens``: a call's completion tokens when
    it names none, and the most it may name. ``parser``/``parser_options``: the tool-call
    parser (plugin kind ``parser``) that reads the model's calls. ``chat_template``: a Jinja
    chat template to use instead of the tokenizer's.
    """

    model: str = "laminar"
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    on_sampling_mismatch: str = "override"
    parser: str = "tool_call"
    parser_options: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    budget: SessionBudget = field(default_factory=SessionBudget)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model (the served model name) must not be empty")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (RL samples), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.on_sampling_mismatch not in SAMPLING_POLICIES:
            raise ValueError(
                f"on_sampling_mismatch must be one of {', '.join(SAMPLING_POLICIES)}; "
                f"got {self.on_sampling_mismatch!r}"
            )
