"""The ``python_sandbox`` environment: each model turn's code runs in a sandbox (ReTool).

Per turn: the parser reads the turn's calls (``<code>`` blocks by default); each call of
tool ``python`` runs in a fresh sandbox (the local pool, or a SandboxFusion service), and the
observation is what it printed -- stdout, then stderr -- followed by a note naming any limit
it hit (timeout, memory, CPU time, output), all rendered by the parser (``<interpreter>``
... ``</interpreter>`` for ReTool's format). A turn with no call is the model's answer: the
episode is done. So is a call after ``max_turns`` tool turns (not run). Every call runs in a
new sandbox: nothing (variables, files) carries over from one call to the next.

Two options shape what runs: ``prelude_key`` names a field of the prompt's row holding code
that runs before each call, hidden from the model (a task's private state: the
``tool_calling`` task's secret number); ``print_last`` prints the value of a call's last
line when it is an expression (as Jupyter shows it, and as ReTool's executor does).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from laminar_core import EnvContext, Environment, Episode, StepResult
from laminar_sandbox.cgroup import MODES as CGROUP_MODES
from laminar_sandbox.isolation import ISOLATIONS
from laminar_sandbox.pool import Limits, SandboxPool
from laminar_sandbox.remote import SandboxFusionClient
from laminar_sandbox.result import CodeExecutor, RunResult

log = logging.getLogger("laminar.sandbox")

BACKENDS = ("local", "sandbox_fusion")
TOOL = "python"


@dataclass
class SandboxOptions:
    """``env.options`` of ``python_sandbox``.

    ``backend``: ``local`` (sandboxes on this machine) or ``sandbox_fusion`` (a remote
    service at ``url``). ``isolation`` (local): ``auto`` | ``bwrap`` | ``namespaces`` |
    ``none`` (no namespaces: trusted code only). ``workers``: runs at once (warm local
    sandboxes, or requests in flight). The limits apply per run (see the README);
    ``memory_mb`` is also sent to SandboxFusion. ``cgroup`` (local): ``auto`` (a cgroup v2
    budget per sandbox where the host gives one), ``required`` (refuse without one), ``off``;
    ``cpus``: its CPU budget in cores (0: none). ``python``: the interpreter inside local
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
    files: int = 10_000
    open_files: int = 256
    output_bytes: int = 16384
    output_kill_bytes: int = 8 << 20
    python: str = ""
    preload: list[str] = field(default_factory=list)
    ro_paths: list[str] = field(default_factory=list)
    startup_timeout_s: float = 60.0
    cgroup: str = "auto"
    cpus: float = 0.0
    url: str = ""
    language: str = "python"
    retries: int = 3
    prelude_key: str = ""
    print_last: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"isolation must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.cgroup not in CGROUP_MODES:
            raise ValueError(
                f"cgroup must be one of {', '.join(CGROUP_MODES)}, got {self.cgroup!r}"
            )
        if self.cpus < 0:
            raise ValueError(f"cpus must be >= 0 (0: no CPU budget), got {self.cpus}")
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


#: Code longer than this is sent as written (``print_last`` parses it on the host).
PRINT_LAST_MAX_CHARS = 100_000


def print_last_value(code: str) -> str:
    """``code`` with its last statement wrapped so its value is printed, when that statement
    is an expression other than a ``print(...)`` call and its value is not ``None``; else
    ``code`` unchanged (also when it does not parse: the sandbox reports the syntax error).
    Line numbers are kept."""
    if len(code) > PRINT_LAST_MAX_CHARS:
        return code
    try:
        body = ast.parse(code).body
    except Exception:  # SyntaxError, or a parser limit (deep nesting): run it as written
        return code
    last_stmt = body[-1] if body else None
    if not isinstance(last_stmt, ast.Expr):
        return code
    value = last_stmt.value
    func = value.func if isinstance(value, ast.Call) else None
    if isinstance(func, ast.Name) and func.id == "print":
        return code
    # the statement's span (a parenthesised expression's parentheses included)
    lines = code.splitlines(keepends=True)
    first, last = last_stmt.lineno - 1, (last_stmt.end_lineno or last_stmt.lineno) - 1
    end_col = last_stmt.end_col_offset or 0
    # col offsets count UTF-8 bytes
    start = len(lines[first].encode()[: last_stmt.col_offset].decode(errors="ignore"))
    end = len(lines[last].encode()[:end_col].decode(errors="ignore"))
    head = "".join(lines[:first]) + lines[first][:start]
    expr = "".join(lines[first : last + 1])
    expr = expr[start : len(expr) - len(lines[last]) + end]
    tail = lines[last][end:] + "".join(lines[last + 1 :])
    return f"{head}__laminar_v = ({expr}); __laminar_v is None or print(repr(__laminar_v)){tail}"


class SandboxEpisode(Episode):
    def __init__(self, env: PythonSandboxEnv, prelude: str = "", bad_prelude: str = "") -> None:
        self.env = env
        self.prelude = prelude
        self.bad_prelude = bad_prelude  # why the row's prelude cannot run (each call says so)
        self.turns = 0
        self.finished = False

    def program(self, code: str) -> str:
        """What runs for a call of ``code``: the prelude, then the code (``print_last``
        applied). The prelude shifts the code's line numbers by its own line count."""
        if self.env.options.print_last:
            code = print_last_value(code)
        return f"{self.prelude}\n{code}" if self.prelude else code

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
            elif self.bad_prelude:
                outputs.append(f"[{self.bad_prelude}]")
                info["error"] = "prelude"
            else:
                result = await self.env.executor.run(self.program(code), ctx.timeout_s)
                outputs.append(render(result))
                info["tool_seconds"] = round(info["tool_seconds"] + result.wall_s, 4)
                if result.truncated:
                    info["truncated"] = True
                if result.status != "ok":
                    info["error"] = "exception" if result.status == "error" else result.status
        # the outputs are untrusted: the parser escapes its tags in them and names its own
        # markup, so the loop tokenises only that with control tokens
        observation, markup = ctx.parser.render(outputs)
        return StepResult(observation, False, info=info, markup=markup)

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
            cgroup=o.cgroup,
            cpus=o.cpus,
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
        prelude, bad = "", ""
        key = self.options.prelude_key
        if key:
            prelude = row.get(key) or ""
            if not isinstance(prelude, str):  # a data problem: every call of the row says so
                bad = (
                    f"the task's prelude (row field {key!r}, env.options.prelude_key) is a "
                    f"{type(prelude).__name__}, not code; the call was not run"
                )
                log.warning("python_sandbox: %s", bad)
                prelude = ""
        episode = SandboxEpisode(self, prelude, bad)
        self._episodes.add(episode)
        return episode

    async def close(self) -> None:
        for episode in list(self._episodes):
            await episode.close()
        await self.executor.close()
