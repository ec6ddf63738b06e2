"""The ``python_sandbox`` environment: each model turn's code runs in a sandbox (ReTool).

Per turn: the parser reads the turn's calls (``<code>`` blocks by default); each call of
tool ``python`` runs in a fresh sandbox (the local pool, or a SandboxFusion service), and the
observation is what it printed -- stdout, then stderr -- followed by a note naming any limit
it hit (timeout, memory, CPU time, output), all rendered by the parser (``<interpreter>``
... ``</interpreter>`` for ReTool's format). A turn with no call is the model's answer: the
episode is done. So is a call after ``max_turns`` tool turns (not run). Every call runs in a
new sandbox: nothing (variables, files) carries over from one call to the next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from laminar_core import EnvContext, Environment, Episode, StepResult
from laminar_sandbox.isolation import ISOLATIONS
from laminar_sandbox.pool import Limits, SandboxPool
from laminar_sandbox.remote import SandboxFusionClient
from laminar_sandbox.result import CodeExecutor, RunResult

BACKENDS = ("local", "sandbox_fusion")
TOOL = "python"


@dataclass
class SandboxOptions:
    """``env.options`` of ``python_sandbox``.

    ``backend``: ``local`` (sandboxes on this machine) or ``sandbox_fusion`` (a remote
    service at ``url``). ``isolation`` (local): ``auto`` | ``bwrap`` | ``namespaces`` |
    ``none`` (no namespaces: trusted code only). ``workers``: runs at once (warm local
    sandboxes, or requests in flight). The limits apply per run (see the README);
    ``memory_mb`` is also sent to SandboxFusion. ``python``: the interpreter inside local
    sandboxes (default: the one running Laminar); ``preload``: modules it imports while
    warming; ``ro_paths``: more host paths the code may read.
    """

    backend: str = "local"
    isolation: str = "auto"
    workers: int = 4
    memory_mb: int = 1024
    cpu_s: int = 30
    processes: int = 64
    file_size_mb: int = 16
    disk_mb: int = 64
    open_files: int = 256
    output_bytes: int = 16384
    output_kill_bytes: int = 8 << 20
    python: str = ""
    preload: list[str] = field(default_factory=list)
    ro_paths: list[str] = field(default_factory=list)
    startup_timeout_s: float = 60.0
    url: str = ""
    language: str = "python"
    retries: int = 3

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"isolation must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.backend == "sandbox_fusion" and not self.url:
            raise ValueError("backend sandbox_fusion needs url (e.g. http://host:8080/run_code)")
        self.limits()  # checks every limit is a positive integer

    def limits(self) -> Limits:
        names = {f.name for f in dataclasses.fields(Limits)}
        return Limits(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


def render(result: RunResult) -> str:
    """The observation's text: stdout, stderr, then a note for any limit or truncation."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append(result.stderr.rstrip("\n"))
    notes = []
    if result.message:
        notes.append(result.message)
    if result.truncated:
        notes.append(
            f"output truncated: showing {len(result.stdout.encode())} of "
            f"{result.stdout_bytes} bytes of stdout and the last "
            f"{len(result.stderr.encode())} of {result.stderr_bytes} bytes of stderr"
        )
    parts += [f"[{n}]" for n in notes]
    return "\n".join(parts) if parts else "[no output]"


class SandboxEpisode(Episode):
    def __init__(self, env: PythonSandboxEnv) -> None:
        self.env = env
        self.turns = 0
        self.finished = False

    async def step(self, turn_text: str) -> StepResult:
        if self.finished:
            raise RuntimeError("python_sandbox: step() on a finished or closed episode")
        ctx = self.env.ctx
        assert ctx.parser is not None
        calls = ctx.parser.parse(turn_text)
        if not calls:
            self.finished = True
            return StepResult("", True, info={"finish": "answer", "tool_calls": 0})
        if self.turns >= ctx.max_turns:
            self.finished = True
            return StepResult("", True, info={"finish": "max_turns", "tool_calls": 0})
        self.turns += 1
        outputs: list[str] = []
        info: dict[str, Any] = {"tool_calls": len(calls), "tool_seconds": 0.0}
        for call in calls:
            code = call.arguments.get("code")
            if call.error:
                outputs.append(f"[tool call error: {call.error}]")
                info["error"] = "parse_error"
            elif call.name != TOOL:
                outputs.append(f"[unknown tool {call.name!r}; the only tool is {TOOL!r}]")
                info["error"] = "unknown_tool"
            elif not isinstance(code, str):
                outputs.append(f"[tool {TOOL!r} needs a string argument 'code']")
                info["error"] = "parse_error"
            else:
                result = await self.env.executor.run(code, ctx.timeout_s)
                outputs.append(render(result))
                info["tool_seconds"] = round(info["tool_seconds"] + result.wall_s, 4)
                if result.truncated:
                    info["truncated"] = True
                if result.status != "ok":
                    info["error"] = "exception" if result.status == "error" else result.status
        observation = "".join(ctx.parser.format_response(o) for o in outputs)
        return StepResult(observation, False, info=info)

    async def close(self) -> None:
        self.finished = True
        self.env._episodes.discard(self)


class PythonSandboxEnv(Environment):
    """ReTool's code interpreter as an environment (see the module docstring)."""

    Options = SandboxOptions

    def __init__(self, ctx: EnvContext) -> None:
        if ctx.parser is None:
            from laminar_core import make_parser

            ctx.parser = make_parser("code")
        super().__init__(ctx)
        self.options: SandboxOptions = ctx.options or SandboxOptions()
        self.executor: CodeExecutor = self._executor(self.options)
        self._episodes: set[SandboxEpisode] = set()

    @staticmethod
    def _executor(o: SandboxOptions) -> CodeExecutor:
        if o.backend == "sandbox_fusion":
            return SandboxFusionClient(
                o.url,
                workers=o.workers,
                language=o.language,
                memory_mb=o.memory_mb,
                output_bytes=o.output_bytes,
                retries=o.retries,
            )
        return SandboxPool(
            o.limits(),
            isolation=o.isolation,
            workers=o.workers,
            python=o.python,
            preload=o.preload,
            ro_paths=o.ro_paths,
            startup_timeout_s=o.startup_timeout_s,
        )

    def tool_specs(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": TOOL,
                    "description": (
                        "Run Python 3 code in a sandbox and return what it prints (stdout, "
                        "then stderr). No network; nothing persists between calls."
                    ),
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "description": "the code"}},
                        "required": ["code"],
                    },
                },
            }
        ]

    async def start(self) -> None:
        await self.executor.start()

    async def reset(self, row: dict[str, Any]) -> Episode:
        episode = SandboxEpisode(self)
        self._episodes.add(episode)
        return episode

    async def close(self) -> None:
        for episode in list(self._episodes):
            await episode.close()
        await self.executor.close()
