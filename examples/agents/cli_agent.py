"""A command-line agent: an ordinary program that reads OPENAI_BASE_URL / OPENAI_API_KEY.

Laminar runs it once per episode (``agent.command``) with the row in ``LAMINAR_ROW`` (JSON);
it scores its own answer and prints ``LAMINAR_REWARD=<number>`` (it could write the number
to ``$LAMINAR_REWARD_FILE`` instead). Nothing else in it knows about Laminar: the same
program runs against any OpenAI-compatible server. It speaks HTTP with the standard library
(a program per episode should start fast; the ``openai`` client works the same way).

    laminar tiny-model runs/tiny-qwen2
    laminar train examples/agents/cli_agent.yaml
"""

from __future__ import annotations

import json
import os
import urllib.request

MODEL = os.environ.get("OPENAI_MODEL", "policy")  # the run's agent.model


def score(answer: str, target: str) -> float:
    """Correct characters over the longer of answer and target (the repeat task's)."""
    matches = sum(a == b for a, b in zip(answer, target, strict=False))
    return matches / max(len(target), len(answer), 1)


def chat(messages: list[dict]) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": MODEL, "messages": messages}).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def main() -> None:
    row = json.loads(os.environ["LAMINAR_ROW"])
    answer = chat([{"role": "user", "content": row["prompt"]}])
    print(f"LAMINAR_REWARD={score(answer, row['answer'])}")


if __name__ == "__main__":
    main()
