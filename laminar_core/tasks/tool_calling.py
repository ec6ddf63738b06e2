"""``tool_calling``: a task the tiny model can only solve by calling its Python tool.

Each row hides a random number in a variable that exists only inside the sandbox: the row's
``prelude`` (``x = 7``) runs before the model's code, in the sandbox, and is never shown
to the model. The prompt names the variable (``What is x?``); the model must call the tool
to read it and then answer with it::

    What is x?                             <- prompt
    <code>print(x)</code>                  <- the model's tool call
    <interpreter>\\n7\\n</interpreter>       <- the tool's output (loss mask 0)
    7<eos>                                 <- the model's answer

The number is drawn per row (``digits`` long, 1 by default), so it cannot be memorised:
guessing it is a ``10**-digits`` chance. One digit is what the 0.3M-parameter tiny model
learns to copy from the tool's output in a warm start of a minute (measured: 600 steps at
``tool_share`` 0.5 copy 1 digit every time; 4 digits were not copied after 3000 steps at
``tool_share`` 1.0, since copying several digits needs an induction circuit the tiny model
does not form that fast). Bigger models: raise ``digits``.

The reward (:func:`tool_calling_reward`) is 1 for the right final answer (the last word the
model itself wrote: the tool's output is not read), with
``tool_credit`` of partial credit for a trajectory that called the tool and answered wrong
(ReTool's reward nudges towards tool calls the same way).

Learnable from scratch? A random-init char model practically never writes ``<code>`` by
chance, so ``laminar tiny-model DIR --warmup tool_calling`` first fits the model, in about a
minute of CPU, to synthetic demonstrations (:func:`demonstrations`: their own random
numbers, a separate random stream from any run's rows) of which only a share
(``tool_share``, half by default) call the tool and copy its output; the rest answer with a
guess. The RL run thus starts from a model that knows the format and calls the tool some of
the time, and learns that calling it is what pays (ReTool's recipe: a cold-start SFT, then RL).

Rows are a pure function of ``(seed, index)``: the same options give the same dataset.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from laminar_core.envs.parsers import CodeBlockParser

#: The call a demonstration makes, in core's ``code`` parser's format (its output comes back
#: as that parser renders it: ``\n<interpreter>\n7\n</interpreter>\n``).
CALL = "<code>print({name})</code>"


@dataclass(frozen=True)
class ToolCallingOptions:
    """``data.task_options`` of the ``tool_calling`` task.

    ``digits``: length of the hidden number; ``names``: the variable names a prompt may ask
    for (one letter each); ``prompt``: the prompt's template (``{name}`` is the variable).
    """

    seed: int = 0
    size: int = 10_000
    digits: int = 1
    names: str = "xyz"
    prompt: str = "What is {name}?\n"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1 (got {self.size})")
        if not 1 <= self.digits <= 12:
            raise ValueError(f"digits must be in 1..12 (got {self.digits})")
        if not self.names or any(c not in string.ascii_lowercase for c in self.names):
            raise ValueError(f"names must be lowercase ASCII letters (got {self.names!r})")
        if "{name}" not in self.prompt:
            raise ValueError(f"prompt must contain '{{name}}' (got {self.prompt!r})")


def make_row(rng: random.Random, o: ToolCallingOptions) -> dict[str, Any]:
    """One row drawn from ``rng`` (see :class:`ToolCallingTask`)."""
    name = rng.choice(o.names)
    low = 10 ** (o.digits - 1) if o.digits > 1 else 0
    secret = str(rng.randrange(low, 10**o.digits))
    return {
        "prompt": o.prompt.format(name=name),
        "answer": secret,
        "name": name,
        "prelude": f"{name} = {secret}",
        "task": ToolCallingTask.name,
    }


class ToolCallingTask(Sequence[dict[str, Any]]):
    """A deterministic, indexable dataset of ``tool_calling`` rows.

    Each row: ``{"prompt": "What is x?\\n", "answer": "7", "name": "x", "prelude":
    "x = 7", "task": "tool_calling"}``. The ``python_sandbox`` environment runs
    ``prelude`` before each call with ``env.options.prelude_key: prelude``.
    """

    name = "tool_calling"
    Options = ToolCallingOptions

    def __init__(self, **options: Any) -> None:
        self.options = ToolCallingOptions(**options)

    def __len__(self) -> int:
        return self.options.size

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        o = self.options
        if not -o.size <= i < o.size:
            raise IndexError(i)
        i %= o.size
        return make_row(random.Random(o.seed * 1_000_003 + i), o)

    @staticmethod
    def reward(response: str, row: dict[str, Any]) -> float:
        return tool_calling_reward(response, row)


def final_answer(response: str) -> str:
    """The response's last whitespace-separated word: what the model answered last. A
    ``Response`` (what rewards get) is the model's own text, so no word of the tool's output
    can be the answer."""
    words = response.split()
    return words[-1] if words else ""


def tool_calling_reward(response: str, row: dict[str, Any], tool_credit: float = 0.1) -> float:
    """1.0 when the final answer (:func:`final_answer`) is ``row["answer"]``; else
    ``tool_credit`` when the trajectory called the tool (``row["env"]["tool_calls"]``, which
    the loop records for a multi-turn trajectory), else 0."""
    if final_answer(response) == str(row["answer"]):
        return 1.0
    env = row.get("env") or {}
    return float(tool_credit) if env.get("tool_calls", 0) > 0 else 0.0


@dataclass(frozen=True)
class Demonstration:
    """A warm-up example: the prompt, then the response as ``(text, trained)`` segments
    (the tool's output is not trained on, as in RL), ending with end-of-sequence."""

    prompt: str
    segments: tuple[tuple[str, bool], ...]
    calls_tool: bool


def demonstrations(
    seed: int, tool_share: float, options: ToolCallingOptions | None = None
) -> Iterator[Demonstration]:
    """Endless synthetic demonstrations of the format, from their own random stream.

    A share ``tool_share`` calls the tool (``<code>print(x)</code>``, the tool's output as
    the sandbox renders it, then the number); the rest answer with a random number of the
    same length without calling it. The numbers are drawn afresh for each demonstration.
    """
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1] (got {tool_share})")
    o = options or ToolCallingOptions()
    parser = CodeBlockParser()
    rng = random.Random(f"tool_calling-demonstrations-{seed}")  # never a task row's stream
    while True:
        row = make_row(rng, o)
        if rng.random() < tool_share:
            segments = (
                (CALL.format(name=row["name"]), True),
                (parser.format_response(row["answer"]), False),
                (row["answer"], True),
            )
            yield Demonstration(row["prompt"], segments, True)
        else:
            guess = make_row(rng, o)["answer"]
            yield Demonstration(row["prompt"], ((guess, True),), False)
