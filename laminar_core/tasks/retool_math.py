"""``retool_math``: ReTool's task -- math problems with integer answers, solved with a code
interpreter -- for real models (GPU users).

Rows come from a local JSONL file (``path``), one problem a line: ``{"problem": "...",
"answer": 42}`` (DAPO-Math-17k's shape: integer answers, so scoring is exact). The prompt
is ReTool's instruction (write Python between ``<code>`` and ``</code>``, read its output
between ``<interpreter>`` and ``</interpreter>``, put the final answer in ``\\boxed{}``)
followed by the problem; with ``tokenizer`` (a Hugging Face model directory, usually the
run's ``${model.path}``) it is wrapped in that model's chat template as the user's message,
ready for the assistant's turn. Nothing is fetched: the file is the dataset.

The reward, :func:`boxed_integer`, is 1 when the last ``\\boxed{...}`` the model wrote holds
the answer as an integer. It reads the model's own turns only (the loss mask tells them from
the tool's output: nothing a tool prints counts, whatever tags it prints).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from laminar_core.tasks.datasets import DataError, read_jsonl
from laminar_core.tasks.response import model_turns

INSTRUCTION = (
    "Solve the following math problem. You can run Python code: write it between <code> and "
    "</code>, and its output comes back between <interpreter> and </interpreter>. Use the "
    "code interpreter to check your reasoning and compute exact values. Put the final "
    "answer, an integer, in \\boxed{{}}.\n\nProblem: {problem}"
)

#: The model's code, and interpreter blocks (core's ``code`` parser's format), in a turn of the
#: model: skipped when looking for its answer (a box in its code is not its answer; a plain
#: string holding a whole transcript has the tool's output in interpreter blocks).
OBSERVATION = re.compile(
    r"<interpreter>.*?(?:</interpreter>|\Z)|<code>.*?(?:</code>|\Z)", re.DOTALL
)
_NUMBER = re.compile(r"^[+-]?\d+(?:\.0*)?$")


@dataclass(frozen=True)
class RetoolMathOptions:
    """``data.task_options`` of ``retool_math``.

    ``path``: the JSONL file (``problem``, ``answer`` per line); ``tokenizer``: a model
    directory whose chat template wraps each prompt (empty: the plain instruction text);
    ``instruction``: the prompt's template (``{problem}`` is the problem; literal braces
    doubled); ``system``: a system message for the chat template (empty: none).
    """

    path: str = ""
    tokenizer: str = ""
    instruction: str = INSTRUCTION
    system: str = ""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path is required: a JSONL file of {problem, answer} rows")
        if "{problem}" not in self.instruction:
            raise ValueError("instruction must contain '{problem}'")


class RetoolMathTask(Sequence[dict[str, Any]]):
    """The rows of ``path``: ``{"prompt": <rendered>, "problem": ..., "answer": 42, ...}``
    (the file's other fields are kept). A row whose answer is not an integer is an error
    naming the line, since the reward could never score it."""

    name = "retool_math"
    Options = RetoolMathOptions

    def __init__(self, **options: Any) -> None:
        self.options = o = RetoolMathOptions(**options)
        raw, _ = read_jsonl(o.path, prompt_key="problem")
        template = _chat_template(o.tokenizer) if o.tokenizer else None
        self.rows: list[dict[str, Any]] = []
        for i, row in enumerate(raw, 1):
            answer = _integer(str(row.get("answer", "")))
            if answer is None:
                raise DataError(
                    f"data.task_options.path: {o.path}: problem {i} has answer "
                    f"{row.get('answer')!r}, not an integer; retool_math scores integers only"
                )
            text = o.instruction.format(problem=row["problem"].strip())
            if template is not None:
                text = template(text, o.system)
            self.rows.append({**row, "prompt": text, "answer": answer, "task": self.name})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return self.rows[i]

    @staticmethod
    def reward(response: str, row: dict[str, Any]) -> float:
        return boxed_integer(response, row)


def _chat_template(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError(f"tokenizer needs transformers ({e})") from None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} ({e})") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer: {path!r} has no chat template; set tokenizer: ''")

    def render(user: str, system: str) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    return render


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or
    ``None``."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
        start = text.rfind("\\boxed{", 0, start)  # unclosed (cut off): an earlier one
    return None


def _integer(text: str) -> int | None:
    """``text`` as an integer (``$``, spaces, ``\\,`` and thousands commas ignored;
    ``42.0`` is 42), or ``None``."""
    s = text.strip().strip("$").replace("\\,", "").replace("\\!", "").replace("{,}", "")
    s = s.replace(",", "").replace(" ", "")
    m = re.fullmatch(r"\\(?:text|mathrm)\{(.*)\}", s)
    if m:
        s = m.group(1)
    if not _NUMBER.match(s):
        return None
    return int(float(s)) if "." in s else int(s)


def boxed_integer(
    response: str, row: dict[str, Any], key: str = "answer", tool_credit: float = 0.0
) -> float:
    """1.0 when the last ``\\boxed{...}`` the model wrote is ``row[key]`` as an integer.

    Only the model's turns are read (``response.turns`` of a ``Response``; a plain string is
    one turn): the tool's output is not the model's writing, and a boxed value its code
    prints is not its answer. In each turn its code (``<code>...</code>``, to the turn's end
    when unclosed) is skipped. Otherwise ``tool_credit`` when the trajectory called the tool
    (``row["env"]["tool_calls"]``: ReTool nudges towards tool use this way), else 0.
    """
    boxed = None
    for turn in model_turns(response):  # each on its own: an unclosed <code> ends with it
        found = last_boxed(OBSERVATION.sub("", turn))
        boxed = found if found is not None else boxed
    want = _integer(str(row[key]))
    if boxed is not None and want is not None and _integer(boxed) == want:
        return 1.0
    env = row.get("env") or {}
    return float(tool_credit) if env.get("tool_calls", 0) > 0 else 0.0
