"""An agent written with the plain ``openai`` client, trained unmodified by Laminar.

The task is the tiny model's ``repeat`` (``"c*13="`` asks for thirteen ``c``). The agent
asks the model, checks the answer with a counting tool of its own and, when the count is
off, tells the model what the tool found and asks again (at most ``ROUNDS`` times): a small
tool loop of several model calls, all in one session. It answers with the reply whose count
the tool found closest to the one asked for, and returns that answer's score (the task's
own reward) as the episode's reward.

Why the agent scores the answer it keeps rather than leaving ``reward.fn`` to score the
session's last call: nearly every early episode takes both rounds (an exact count is rare),
and every sampled token of the session trains with the episode's reward, so scoring only
the second reply rewarded the first reply's tokens for an answer they did not write. Scoring
the kept answer rewards each reply by a score it can change, and two tries double the
chance that a group holds any reward at all while the model is still random.

    laminar tiny-model runs/tiny-qwen2
    laminar train examples/agents/openai_agent.yaml
"""

from __future__ import annotations

import openai

from laminar_core.tasks.repeat import repeat_reward

ROUNDS = 2


def count_tool(answer: str, letter: str) -> int:
    """The agent's tool: how many of ``letter`` the answer holds."""
    return answer.count(letter)


async def run(base_url: str, api_key: str, row: dict) -> float | None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=3)
    letter, want = row["letter"], row["count"]
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    answers: list[str] = []
    for _ in range(ROUNDS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0
        )
        answer = response.choices[0].message.content or ""
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
        found = count_tool(answer, letter)
        if found == want:
            break
        messages.append({"role": "user", "content": f"count: {found} {letter}. {row['prompt']}"})
    await client.close()
    kept = min(answers, key=lambda a: abs(count_tool(a, letter) - want))  # first on a tie
    return repeat_reward(kept, row)
