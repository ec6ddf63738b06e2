"""The agent the agent-run tests train (``agent.entrypoint: agent_run_support:run``).

What it does depends on the row's ``sample_key`` (its episode: ``key % 8``) and on how often
that episode ran before (``RUNS``), so each failure the gateway must survive happens on
known episodes of a real run:

* 1: raises on its first run (a crash), then behaves;
* 2: makes a call, then hangs past ``agent.timeout_s`` on its first run, then behaves;
* 3: always raises: after ``agent.max_attempts`` runs it is counted failed;
* 4: returns without calling the model on its first run, then behaves;
* 5: rewrites its history for its second call (a fork: two samples);
* the others: two calls (question, then the answer extended with a user turn).

Episodes return a reward of 1.0 when the key is even, ``None`` (``reward.fn`` scores the
session) when odd. ``SESSIONS`` records each run's session id (its key's last four chars
are not needed: the id is ``laminar.gateway``'s); ``CALLS`` each call's response header
version and replica; ``UNAVAILABLE`` each 503 an agent's HTTP client received (its
``Retry-After`` and body; the ``openai`` client then retries the call).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
import openai

RUNS: dict[int, int] = defaultdict(int)
SESSIONS: dict[int, list[str]] = defaultdict(list)
CALLS: list[tuple[int, int, str]] = []  # (sample key, version, replica)
UNAVAILABLE: list[dict] = []  # {"key", "retry_after", "body", "calls_before": len(CALLS)}


def _client(base_url: str, api_key: str, key: int) -> openai.AsyncOpenAI:
    """The agent's client, its HTTP responses watched for 503s (as the wire has them)."""

    async def watch(response: httpx.Response) -> None:
        if response.status_code == 503:
            await response.aread()
            UNAVAILABLE.append(
                {
                    "key": key,
                    "retry_after": response.headers.get("retry-after"),
                    "body": response.json(),
                    "calls_before": len(CALLS),
                }
            )

    http = httpx.AsyncClient(event_hooks={"response": [watch]})
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=4, http_client=http)


async def _call(client: openai.AsyncOpenAI, key: int, messages: list[dict]) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=messages, max_tokens=8
    )
    CALLS.append(
        (key, int(raw.headers["x-laminar-weight-version"]), raw.headers["x-laminar-replica"])
    )
    return raw.parse().choices[0].message.content or ""


async def run(base_url: str, api_key: str, row: dict) -> float | None:
    key = int(row["sample_key"])
    if row.get("eval"):
        key = 0  # eval rounds: just behave
    kind = key % 8
    RUNS[key] += 1
    first = RUNS[key] == 1
    SESSIONS[key].append(api_key.split(".")[0].removeprefix("lmn-"))
    client = _client(base_url, api_key, key)
    try:
        if kind == 3 or (kind == 1 and first):
            raise RuntimeError(f"episode {key} crashed")
        if kind == 4 and first:
            return 1.0
        question = [{"role": "user", "content": row["prompt"]}]
        answer = await _call(client, key, question)
        if kind == 2 and first:
            await asyncio.sleep(1000)
        history = [*question, {"role": "assistant", "content": answer}]
        if kind == 5:
            history = [{"role": "user", "content": "again: " + row["prompt"]}]
        else:
            history.append({"role": "user", "content": "again"})
        await _call(client, key, history)
        return 1.0 if key % 2 == 0 else None
    finally:
        await client.close()
