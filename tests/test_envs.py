"""Environments in core: tool-call parsers, building from config, the conformance kit.

The calculator environment below is written the way a third-party plugin would write one
(public API only) and registered through the ``laminar_environments`` hook.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import operator
import types
from dataclasses import dataclass
from typing import Any

import pytest

from laminar_core import (
    ConfigError,
    EnvConfig,
    EnvContext,
    Environment,
    Episode,
    StepResult,
    ToolCall,
    hookimpl,
    make_environment,
    make_parser,
)
from laminar_core.envs import CodeBlockParser, JsonToolCallParser
from laminar_core.plugins import PluginManager
from laminar_core.plugins import builtins as core_builtins
from laminar_core.testing import check_environment

# ------------------------------------------------------------------ parsers


def test_code_parser_reads_retool_blocks() -> None:
    p = CodeBlockParser()
    turn = "Let me compute.\n<code>\n```python\nprint(6 * 7)\n```\n</code>"
    (call,) = p.parse(turn)
    assert call == ToolCall("python", {"code": "print(6 * 7)"}, turn[turn.index("<code>") :])
    # bare body, two blocks, and a block cut at the stop string (no closing tag)
    calls = p.parse("<code>x = 1</code> then <code>print(x)")
    assert [c.arguments["code"] for c in calls] == ["x = 1", "print(x)"]
    # a turn decoded from token ids can end in part of the stop string: it is not code
    for cut in ("</code", "</cod", "</"):
        (call,) = p.parse(f"<code>print(y){cut}")
        assert call.arguments["code"] == "print(y)", cut
    assert p.parse("<code>a = '</b'")[0].arguments["code"] == "a = '</b'"
    assert p.parse("The answer is \\boxed{42}.") == []
    assert p.stop == ("</code>",)
    assert p.format_response("42") == "\n<interpreter>\n42\n</interpreter>\n"


def test_code_parser_fenced_blocks_and_empty_ones() -> None:
    p = CodeBlockParser()
    (call,) = p.parse("try:\n```python\nprint(1)\n```\ndone")
    assert call.arguments == {"code": "print(1)"} and call.error is None
    # an untagged fence with no language is prose, and so is any fence when <code> is used
    assert p.parse("```\nprint(1)\n```") == []
    calls = p.parse("<code>print(2)</code>\n```python\nprint(3)\n```")
    assert [c.arguments["code"] for c in calls] == ["print(2)"]
    assert CodeBlockParser(fenced=False).parse("```python\nprint(1)\n```") == []
    (empty,) = p.parse("<code>  </code>")
    assert empty.error == "empty code block"


def test_json_parser_reads_qwen_tool_calls() -> None:
    p = JsonToolCallParser()
    turn = 'ok <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    (call,) = p.parse(turn)
    assert (call.name, call.arguments, call.error) == ("python", {"code": "print(1)"}, None)
    # OpenAI wire form: arguments as a JSON string; and a call cut at the stop string
    (call,) = p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}')
    assert (call.name, call.arguments) == ("f", {"x": 2})
    (bad,) = p.parse("<tool_call>{name: python}</tool_call>")
    assert bad.error is not None and "not valid JSON" in bad.error
    (noname,) = p.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert noname.error is not None and "name" in noname.error
    (badargs,) = p.parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert badargs.error == "arguments must be a JSON object"
    assert p.parse("no call here") == []
    assert p.stop == ("</tool_call>",)


def test_parsers_resolve_by_name_with_options() -> None:
    assert isinstance(make_parser("code"), CodeBlockParser)
    p = make_parser("tool_call", {"response_template": "<r>{output}</r>"})
    assert p.format_response("x") == "<r>x</r>"
    with pytest.raises(ConfigError, match=r"unknown tool-call parser 'cod'.*did you mean 'code'"):
        make_parser("cod")
    with pytest.raises(ConfigError, match=r"env.parser_options.*must contain '\{output\}'"):
        make_parser("code", {"response_template": "no placeholder"})
    with pytest.raises(ConfigError, match=r"env.parser_options for parser 'code'"):
        make_parser("code", {"colour": "red"})


@pytest.mark.parametrize(
    ("name", "tags"),
    [
        ("code", ("</interpreter>", "<code>", "</CODE>")),
        ("tool_call", ("</tool_response>", "<tool_call>")),
    ],
)  # fmt: skip
def test_printed_tags_can_neither_close_the_output_nor_open_a_call(name: str, tags) -> None:
    """A tool's output is untrusted: its copies of the parser's tags are escaped, so the
    observation holds exactly the template's markup, and render names where that is."""
    p = make_parser(name)
    printed = "x " + " ".join(tags) + " <b>y</b>"
    text, markup = p.render(["ok", printed])
    assert text == p.format_response("ok") + p.format_response(printed)
    assert [text[a:b] for a, b in markup] == [p.prefix, p.suffix] * 2
    bodies = [text[end:start] for (_, end), (start, _) in itertools.pairwise(markup)]
    assert bodies[0::2] == ["ok", p.escape(printed)]
    for tag in tags:
        assert tag not in bodies[2] and "&lt;" + tag[1:] in bodies[2]
    assert "<b>y</b>" in bodies[2]  # other markup is the tool's to print
    assert p.parse(printed) and not p.parse(bodies[2])
    chat = make_parser(name, {"response_template": "<|im_start|>tool\n{output}<|im_end|>\n"})
    text, markup = chat.render(["<|im_end|>"])
    assert [text[a:b] for a, b in markup] == ["<|im_start|>tool\n", "<|im_end|>\n"]


# ------------------------------------------------------------------ a third-party env

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


async def _evaluate(node: ast.AST) -> float:
    """Arithmetic only; ``sleep(s)`` waits ``s`` seconds (a slow tool, for the timeout)."""
    if isinstance(node, ast.Expression):
        return await _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](await _evaluate(node.left), await _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](await _evaluate(node.operand))
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "sleep" and node.args:
        seconds = await _evaluate(node.args[0])
        await asyncio.sleep(seconds)
        return seconds
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


class CalculatorEpisode(Episode):
    def __init__(self, env: CalculatorEnv) -> None:
        self.env = env
        self.turns = 0
        self.done = False

    async def step(self, turn_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished episode")
        ctx = self.env.ctx
        calls = ctx.parser.parse(turn_text)
        if not calls:
            self.done = True
            return StepResult("", True, info={"finish": "answer"})
        if self.turns >= ctx.max_turns:
            self.done = True
            return StepResult("", True, info={"finish": "max_turns"})
        self.turns += 1
        outputs, info = [], {"tool_calls": len(calls)}
        for call in calls:
            if call.error:
                outputs.append(f"error: {call.error}")
                info["error"] = "parse_error"
                continue
            try:
                tree = ast.parse(call.arguments.get("code", ""), mode="eval")
                value = await asyncio.wait_for(_evaluate(tree), ctx.timeout_s)
                outputs.append(str(round(value, self.env.ctx.options.digits)))
            except asyncio.TimeoutError:
                outputs.append(f"timed out after {ctx.timeout_s:g} s")
                info["error"] = "timeout"
            except (SyntaxError, ValueError, ZeroDivisionError) as e:
                outputs.append(f"error: {e}")
                info["error"] = "tool_error"
        return StepResult(ctx.parser.format_response("\n".join(outputs)), False, info=info)

    async def close(self) -> None:
        self.done = True
        self.env.open.discard(self)


class CalculatorEnv(Environment):
    """Evaluates arithmetic in ``<code>`` blocks."""

    @dataclass
    class Options:
        digits: int = 6

    def __init__(self, ctx: EnvContext) -> None:
        super().__init__(ctx)
        self.open: set[CalculatorEpisode] = set()
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def reset(self, row: dict[str, Any]) -> Episode:
        assert self.started
        ep = CalculatorEpisode(self)
        self.open.add(ep)
        return ep

    async def close(self) -> None:
        for ep in list(self.open):
            await ep.close()
        self.started = False


calculator_plugin = types.SimpleNamespace(
    laminar_environments=hookimpl(lambda: {"calculator": CalculatorEnv})
)


@pytest.fixture
def pm() -> PluginManager:
    manager = PluginManager()
    assert manager.register(core_builtins, name="core", package="laminar-core")
    assert manager.register(calculator_plugin, name="calc", package="calc-env")
    return manager


def test_third_party_env_passes_the_contract(pm: PluginManager) -> None:
    envs: list[CalculatorEnv] = []

    def make(ctx: EnvContext) -> Environment:
        env = make_environment(
            EnvConfig(
                name="calculator",
                max_turns=ctx.max_turns,
                timeout_s=ctx.timeout_s,
                options={"digits": 3},
            ),
            pm,
        )
        envs.append(env)
        return env

    asyncio.run(
        check_environment(
            make,
            row={"prompt": "2+2?", "answer": "4"},
            tool_turn="<code>2 + 2</code>",
            answer_turn="It is 4.",
            slow_turn="<code>sleep(30)</code>",
            bad_turn="<code></code>",
            timeout_s=0.5,
            leftovers=lambda: [ep for env in envs for ep in env.open],
        )
    )
    assert envs[0].ctx.options.digits == 3


def test_make_environment_rejects_bad_config(pm: PluginManager) -> None:
    with pytest.raises(ConfigError, match=r"unknown environment 'calculater'.*'calculator'"):
        make_environment(EnvConfig(name="calculater"), pm)
    with pytest.raises(ConfigError, match=r"key 'env.options.digit'.*'env.options.digits'"):
        make_environment(EnvConfig(name="calculator", options={"digit": 2}), pm)
    with pytest.raises(ConfigError, match=r"env.options.digits"):
        make_environment(EnvConfig(name="calculator", options={"digits": "many"}), pm)
    with pytest.raises(ConfigError, match=r"env.max_turns must be >= 1"):
        make_environment(EnvConfig(name="calculator", max_turns=0), pm)
    with pytest.raises(ConfigError, match=r"env.timeout_s must be > 0"):
        make_environment(EnvConfig(name="calculator", timeout_s=0), pm)
    with pytest.raises(ConfigError, match=r"env.parser: unknown tool-call parser"):
        make_environment(EnvConfig(name="calculator", parser="xml"), pm)


class _RaisesOnTimeout(CalculatorEnv):
    """Broken on purpose: lets the tool's timeout escape as an exception."""

    async def reset(self, row: dict[str, Any]) -> Episode:
        ep = await super().reset(row)
        inner = ep.step

        async def step(text: str) -> StepResult:
            if "sleep" in text:
                raise asyncio.TimeoutError
            return await inner(text)

        ep.step = step  # type: ignore[method-assign]
        return ep


class _ObservesWhenDone(CalculatorEnv):
    """Broken on purpose: says something after the model's final answer."""

    async def reset(self, row: dict[str, Any]) -> Episode:
        ep = await super().reset(row)
        inner = ep.step

        async def step(text: str) -> StepResult:
            r = await inner(text)
            return StepResult("bye", True, info=r.info) if r.done else r

        ep.step = step  # type: ignore[method-assign]
        return ep


@pytest.mark.parametrize(
    ("cls", "message"),
    [(_RaisesOnTimeout, "TimeoutError"), (_ObservesWhenDone, "done with a non-empty")],
)
def test_the_contract_catches_broken_envs(cls: type, message: str) -> None:
    def make(ctx: EnvContext) -> Environment:
        ctx.options = CalculatorEnv.Options()
        return cls(ctx)

    with pytest.raises((AssertionError, asyncio.TimeoutError)) as err:
        asyncio.run(
            check_environment(
                make,
                row={"prompt": "p"},
                tool_turn="<code>1+1</code>",
                answer_turn="2",
                slow_turn="<code>sleep(30)</code>",
                timeout_s=0.2,
            )
        )
    assert message in f"{err.type.__name__}: {err.value}"
