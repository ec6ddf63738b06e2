"""An agent written with the plain ``openai`` client, trained unmodified by Laminar.

The task is the tiny model's ``repeat`` (``"c*13="`` asks for thirteen ``c``). The agent
asks the model, then checks the answer with a counting tool of its own and, when the count
is off, tells the model what the tool found and asks again (at most ``ROUNDS`` times): a
small tool loop of several model calls, all in one session. It returns ``None``, so the
run's ``reward.fn`` (the task's own) scores the session's final answer.

    laminar tiny-model runs/tiny-qwen2
    laminar train examples/agents/openai_agent.yaml
"""

from __future__ import annotations

import openai

ROUNDS = 2


def count_tool(answer: str, letter: str) -> str:
    """The agent's tool: how many of ``letter`` the answer holds."""
    return f"{answer.count(letter)} {letter}"


async def run(base_url: str, api_key: str, row: dict) -> float | None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=3)
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(ROUNDS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0
        )
        answer = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        found = count_tool(answer, row["letter"])
        if found == f"{row['count']} {row['letter']}":
            break
        messages.append({"role": "user", "content": f"count: {found}. {row['prompt']}"})
    await client.close()
    return None  # reward.fn scores the final answer
