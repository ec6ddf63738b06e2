"""The same task with the OpenAI Agents SDK, unmodified SDK code, trained by Laminar.

The SDK's ``Runner`` owns the loop; Laminar only gives it a client whose base URL and key
name the episode's session. ``set_tracing_disabled(True)``: the SDK otherwise uploads traces
to OpenAI. The episode's reward is ``None``: the run's ``reward.fn`` scores the final answer.

    laminar tiny-model runs/tiny-qwen2
    laminar train examples/agents/sdk_agent.yaml
"""

from __future__ import annotations

import agents
import openai
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner

agents.set_tracing_disabled(True)


async def run(base_url: str, api_key: str, row: dict) -> float | None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=3)
    agent = Agent(
        name="repeater",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(temperature=0),  # served at the run's temperature
    )
    await Runner.run(agent, row["prompt"], max_turns=2)
    await client.close()
    return None  # reward.fn scores the final output: the session's last answer
