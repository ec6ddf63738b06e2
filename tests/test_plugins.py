"""Tests for laminar_core.plugins (discovery, lazy factories, errors, table)."""

from __future__ import annotations

import collections
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from laminar_core import BuildContext, load_config, plugins
from laminar_core.interfaces import RolloutEngine
from laminar_core.plugins import (
    KINDS,
    PluginInfo,
    PluginLoadError,
    PluginManager,
    PluginResolveError,
    UnknownPluginError,
    hookimpl,
)

FIXTURES = Path(__file__).parent / "fixtures" / "plugins"
LAZY_MODULE = "laminar_test_lazy_target"


class SimEngine:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs


class CorePlugin:
    @hookimpl
    def laminar_rollout_engines(self) -> dict[str, object]:
        return {"sim": SimEngine, "vllm": "collections:OrderedDict"}

    @hookimpl
    def laminar_transports(self) -> dict[str, object]:
        return {"inproc": dict}


class OtherPlugin:
    @hookimpl
    def laminar_rollout_engines(self) -> dict[str, object]:
        return {"vllm": SimEngine, "sglang": SimEngine}


class RaisingPlugin:
    @hookimpl
    def laminar_transports(self) -> dict[str, object]:
        return {"nccl": SimEngine}

    @hookimpl
    def laminar_schedules(self) -> dict[str, object]:
        raise RuntimeError("boom\nsecond line")


def make_module(name: str, **hooks: Any) -> types.ModuleType:
    """A throwaway module whose attributes are ``@hookimpl`` functions returning ``hooks``."""
    module = types.ModuleType(name)
    for hook, result in hooks.items():
        setattr(module, hook, hookimpl(lambda result=result: result))
    return module


class FakeDist:
    def __init__(self, name: str | None, version: str | None) -> None:
        self.name = name
        self.version = version


class FakeEntryPoint:
    def __init__(self, name: str, dist: FakeDist | None, load: Any) -> None:
        self.name = name
        self.value = f"fake_{name}"
        self.group = "laminar"
        self.dist = dist
        self._load = load

    def load(self) -> object:
        return self._load()


def missing_vllm() -> object:
    raise ImportError("No module named 'vllm'")


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, eps: list[FakeEntryPoint]) -> list[str]:
    """Make ``importlib.metadata.entry_points`` return ``eps``; returns a log of groups asked."""
    calls: list[str] = []

    def entry_points(*, group: str) -> list[FakeEntryPoint]:
        calls.append(group)
        return eps if group == "laminar" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return calls


@pytest.fixture
def pm() -> PluginManager:
    manager = PluginManager()
    assert manager.register(CorePlugin(), name="core", package="laminar-core", version="0.1.0")
    return manager


def test_kinds_table_and_public_api() -> None:
    assert list(KINDS) == [
        *("trainer", "rollout", "transport", "repack", "schedule", "task", "reward"),
        *("env", "parser"),
    ]
    assert KINDS["rollout"].hook == "laminar_rollout_engines"
    for name in plugins.__all__:
        assert getattr(plugins, name) is not None
    # every kind has a hookspec in the pluggy manager
    hooks = PluginManager().pluggy_manager.hook
    for spec in KINDS.values():
        assert getattr(hooks, spec.hook).spec is not None


def test_names_per_kind_and_infos(pm: PluginManager) -> None:
    assert pm.register(make_module("extra", laminar_repack_policies={"best_fit": SimEngine}))
    assert pm.names("rollout") == ["sim", "vllm"]
    assert pm.names("transport") == ["inproc"]
    assert pm.names("repack") == ["best_fit"]
    assert pm.names("trainer") == []
    assert pm.failures == []
    infos = pm.infos()
    assert [(i.kind, i.name) for i in infos] == [
        ("repack", "best_fit"),
        ("rollout", "sim"),
        ("rollout", "vllm"),
        ("transport", "inproc"),
    ]
    assert infos[2] == PluginInfo(
        "rollout", "vllm", "laminar-core", "0.1.0", "collections:OrderedDict"
    )
    assert infos[1].target == repr(SimEngine)
    assert infos[0].package == "" and infos[0].version == ""
    with pytest.raises(ValueError, match="did you mean 'rollout'"):
        pm.names("rollouts")


def test_get_and_create(pm: PluginManager) -> None:
    assert pm.get("rollout", "sim") is SimEngine
    assert pm.get("rollout", "vllm") is collections.OrderedDict
    engine = pm.create("rollout", "sim", 1, 2, mode="x")
    assert isinstance(engine, SimEngine)
    assert engine.args == (1, 2) and engine.kwargs == {"mode": "x"}


def test_lazy_string_resolved_only_on_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.delitem(sys.modules, LAZY_MODULE, raising=False)
    pm = PluginManager()
    target = f"{LAZY_MODULE}:LazyEngine"
    pm.register(make_module("lazy", laminar_trainer_engines={"lazy": target}), package="pkg-lazy")

    assert pm.names("trainer") == ["lazy"]
    assert pm.infos()[0].target == target
    pm.format_table()
    assert LAZY_MODULE not in sys.modules  # listing must not import the engine

    factory = pm.get("trainer", "lazy")
    assert LAZY_MODULE in sys.modules
    assert factory is sys.modules[LAZY_MODULE].LazyEngine
    assert pm.create("trainer", "lazy", value=3).value == 3


def test_lazy_string_import_error_is_clear() -> None:
    pm = PluginManager()
    pm.register(
        make_module(
            "broken",
            laminar_rollout_engines={
                "ghost": "laminar_no_such_module_xyz.engine:Engine",
                "noattr": "collections:NoSuchThing",
                "notcallable": "sys:version",
            },
        ),
        package="laminar-ghost",
    )
    with pytest.raises(PluginResolveError) as info:
        pm.get("rollout", "ghost")
    msg = str(info.value)
    assert "laminar_no_such_module_xyz" in msg
    assert "'ghost'" in msg and "laminar-ghost" in msg and "rollout engine" in msg
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(PluginResolveError, match="NoSuchThing"):
        pm.get("rollout", "noattr")
    with pytest.raises(PluginResolveError, match="not callable"):
        pm.get("rollout", "notcallable")
    # resolve failures are not load failures
    assert pm.failures == []


def test_unknown_name_lists_known_and_suggests(pm: PluginManager) -> None:
    with pytest.raises(UnknownPluginError) as info:
        pm.get("rollout", "vlm")
    err = info.value
    assert isinstance(err, KeyError)
    assert str(err) == "unknown rollout engine 'vlm'; known: sim, vllm (did you mean 'vllm'?)"
    assert err.kind == "rollout" and err.name == "vlm" and err.known == ["sim", "vllm"]

    with pytest.raises(UnknownPluginError) as info:
        pm.create("trainer", "fsdp")
    assert str(info.value) == "unknown trainer engine 'fsdp'; known: (none)"


def test_duplicate_name_keeps_first(pm: PluginManager) -> None:
    assert pm.register(OtherPlugin(), name="other", package="pkg-b", version="2.0")
    assert pm.names("rollout") == ["sglang", "sim", "vllm"]
    assert pm.get("rollout", "vllm") is collections.OrderedDict  # first (laminar-core) wins
    assert pm.get("rollout", "sglang") is SimEngine  # non-conflicting names still added
    vllm = next(i for i in pm.infos() if i.name == "vllm")
    assert vllm.package == "laminar-core"
    assert len(pm.failures) == 1
    assert pm.failures[0].error == (
        "duplicate rollout engine 'vllm' from pkg-b (already provided by laminar-core)"
    )
    assert "pkg-b" in pm.failures[0].source


def test_duplicate_from_same_package_names_plugins() -> None:
    pm = PluginManager()
    pm.register(make_module("a", laminar_schedules={"linear": SimEngine}), name="a")
    pm.register(make_module("b", laminar_schedules={"linear": dict}), name="b")
    assert pm.get("schedule", "linear") is SimEngine
    assert [f.error for f in pm.failures] == [
        "duplicate schedule 'linear' from b (already provided by a)"
    ]


def test_raising_or_invalid_hook_rejects_whole_plugin(pm: PluginManager) -> None:
    assert not pm.register(RaisingPlugin(), name="raiser", package="pkg-raise")
    assert not pm.register(make_module("bad", laminar_transports=["not", "a", "dict"]))
    assert not pm.register(make_module("bad2", laminar_transports={"x": 42}))
    assert not pm.register(make_module("bad3", laminar_transports={"x": "no_colon"}))
    assert pm.names("transport") == ["inproc"]  # 'nccl' from the raising plugin not added
    assert pm.names("schedule") == []
    assert len(pm.failures) == 4
    raised = pm.failures[0]
    assert raised.source == "pkg-raise (raiser)"
    assert raised.error == "laminar_schedules() raised RuntimeError: boom"
    assert "\n" not in str(raised)
    assert "not callable" in pm.failures[2].error
    assert "'module:Attr'" in pm.failures[3].error
    # a rejected plugin is unregistered, so its name can be reused
    assert pm.register(make_module("ok", laminar_transports={"nccl": SimEngine}), name="raiser")
    assert pm.names("transport") == ["inproc", "nccl"]


def test_same_object_twice_is_recorded_not_raised(pm: PluginManager) -> None:
    module = make_module("twice", laminar_repack_policies={"none": SimEngine})
    assert pm.register(module, name="twice")
    assert not pm.register(module, name="twice")
    assert pm.names("repack") == ["none"]
    assert "ValueError" in pm.failures[-1].error


def test_entry_points_with_failing_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_module("laminar_good", laminar_rollout_engines={"sim": SimEngine})
    calls = fake_entry_points(
        monkeypatch,
        [
            FakeEntryPoint("vllm", FakeDist("laminar-vllm", "0.3.0"), missing_vllm),
            FakeEntryPoint("core", FakeDist("laminar-core", "0.1.0"), lambda: good),
            FakeEntryPoint("nodist", None, lambda: CorePlugin()),
        ],
    )
    pm = PluginManager()
    pm.load_entry_points()
    assert calls == ["laminar"]

    assert pm.get("rollout", "sim") is SimEngine
    infos = {(i.kind, i.name): i for i in pm.infos()}
    assert infos["rollout", "sim"].package == "laminar-core"
    assert infos["rollout", "sim"].version == "0.1.0"
    assert infos["transport", "inproc"].package == ""  # dist None -> empty
    # duplicate 'sim' from the dist-less plugin; its 'vllm' is new
    assert pm.get("rollout", "vllm") is collections.OrderedDict

    failure = pm.failures[0]
    assert failure == PluginLoadError(
        "laminar-vllm (entry point 'vllm')",
        "ImportError: No module named 'vllm'",
        entry_point="vllm",
        package="laminar-vllm",
    )
    assert str(failure) == "laminar-vllm (entry point 'vllm'): ImportError: No module named 'vllm'"
    assert pm.failures[1].error == (
        "duplicate rollout engine 'sim' from nodist (already provided by laminar-core)"
    )

    table = pm.format_table()
    head, _, failed = table.partition("\n\nfailed to load:\n")
    header, *rows = head.splitlines()
    assert header.split() == ["KIND", "NAME", "PACKAGE", "VERSION"]
    assert ["rollout", "sim", "laminar-core", "0.1.0"] in [r.split() for r in rows]
    assert ["transport", "inproc", "-", "-"] in [r.split() for r in rows]
    assert "laminar-vllm (entry point 'vllm'): ImportError: No module named 'vllm'" in failed
    assert "duplicate rollout engine 'sim'" in failed

    # loading again does not re-register (no new failures)
    before = list(pm.failures)
    pm.load_entry_points()
    assert pm.failures == before


def test_unknown_name_points_at_failed_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(
        monkeypatch,
        [
            FakeEntryPoint("vllm", FakeDist("laminar-vllm", "0.3.0"), missing_vllm),
            FakeEntryPoint("other", FakeDist("laminar-other", "1"), missing_vllm),
            FakeEntryPoint(
                "sim", None, lambda: make_module("s", laminar_rollout_engines={"sim": SimEngine})
            ),
        ],
    )
    pm = PluginManager()
    pm.load_entry_points()
    with pytest.raises(UnknownPluginError) as info:
        pm.get("rollout", "vllm")
    msg = str(info.value)
    assert msg.startswith("unknown rollout engine 'vllm'; known: sim")
    assert "plugin laminar-vllm (entry point 'vllm') failed to load" in msg
    assert "ImportError: No module named 'vllm'" in msg
    assert "1 plugin(s) failed to load" in msg  # the unrelated one is only counted
    assert [f.package for f in info.value.related_failures] == ["laminar-vllm"]


def test_entry_points_listing_error_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_: Any) -> list[Any]:
        raise OSError("bad metadata")

    monkeypatch.setattr(importlib.metadata, "entry_points", broken)
    pm = PluginManager()
    pm.load_entry_points()
    assert [str(f) for f in pm.failures] == ["entry point group 'laminar': OSError: bad metadata"]
    assert "(no plugins registered)" in pm.format_table()


def test_default_manager_is_cached_and_resettable(monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_module("laminar_good", laminar_transports={"inproc": dict})
    calls = fake_entry_points(
        monkeypatch, [FakeEntryPoint("core", FakeDist("laminar-core", "0.1.0"), lambda: good)]
    )
    plugins.reset_default_manager()
    try:
        first = plugins.default_manager()
        assert plugins.default_manager() is first
        assert calls == ["laminar"]
        assert first.names("transport") == ["inproc"]
        plugins.reset_default_manager()
        second = plugins.default_manager()
        assert second is not first
        assert calls == ["laminar", "laminar"]
    finally:
        plugins.reset_default_manager()


# -- hook names that would never be called; plugins that add nothing ----------------------


def test_unknown_hook_name_rejects_the_plugin_naming_the_close_match() -> None:
    pm = PluginManager()
    typo = make_module("typo", laminar_rollout_engin={"hfgen": SimEngine})
    assert not pm.register(typo, name="typo", package="laminar-hfgen")
    assert pm.names("rollout") == []
    (failure,) = pm.failures
    assert failure.error == (
        "unknown hook 'laminar_rollout_engin' (did you mean 'laminar_rollout_engines'?)"
    )
    # the user who asked for the engine is told why it is missing
    with pytest.raises(UnknownPluginError, match="unknown hook 'laminar_rollout_engin'"):
        pm.get("rollout", "hfgen")
    # far from every hook: the hooks are listed instead
    assert not pm.register(make_module("odd", laminar_widgets={"w": SimEngine}), name="odd")
    assert not pm.register(make_module("odd2", pytest_configure={"w": SimEngine}), name="odd2")
    assert "Laminar's hooks are laminar_trainer_engines, " in pm.failures[-1].error
    # the rejected plugin is gone entirely: its name can be registered again, fixed
    fixed = make_module("typo", laminar_rollout_engines={"hfgen": SimEngine})
    assert pm.register(fixed, name="typo", package="laminar-hfgen")
    assert pm.get("rollout", "hfgen") is SimEngine


def test_hook_not_marked_hookimpl_is_an_error_helpers_are_not() -> None:
    module = types.ModuleType("unmarked")
    module.laminar_rollout_engines = lambda: {"x": SimEngine}  # forgot @hookimpl
    module.laminar_version_string = lambda: "1"  # a helper, nothing like a hook
    pm = PluginManager()
    assert not pm.register(module, name="unmarked")
    assert [f.error for f in pm.failures] == ["'laminar_rollout_engines' is not marked @hookimpl"]

    helper = make_module("helper", laminar_transports={"t": SimEngine})
    helper.laminar_version_string = lambda: "1"
    assert pm.register(helper, name="helper")
    assert pm.names("transport") == ["t"]


def test_plugin_that_registers_nothing_is_listed() -> None:
    pm = PluginManager()
    assert pm.register(types.ModuleType("nohooks"), name="nohooks", package="laminar-nohooks")
    assert pm.register(make_module("emptyhooks", laminar_rollout_engines={}), name="empty")
    assert pm.failures == []
    assert [(e.source, e.error) for e in pm.empty] == [
        (
            "laminar-nohooks (nohooks)",
            "no function marked @hookimpl (from laminar_core import hookimpl)",
        ),
        ("empty", "its hooks returned no names"),
    ]
    table = pm.format_table()
    assert "registered nothing:\n  laminar-nohooks (nohooks): no function marked @hookimpl" in table
    with pytest.raises(UnknownPluginError, match=r"plugin laminar-nohooks .* registered nothing"):
        pm.get("rollout", "nohooks")


def test_unknown_hook_from_an_entry_point_is_a_load_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    typo = make_module("laminar_hfgen_plugin", laminar_rolout_engines={"hfgen": SimEngine})
    fake_entry_points(
        monkeypatch, [FakeEntryPoint("hfgen", FakeDist("laminar-hfgen", "0.1"), lambda: typo)]
    )
    pm = PluginManager()
    pm.load_entry_points()
    assert [str(f) for f in pm.failures] == [
        "laminar-hfgen (entry point 'hfgen'): unknown hook 'laminar_rolout_engines' "
        "(did you mean 'laminar_rollout_engines'?)"
    ]
    assert "failed to load:" in pm.format_table()


# -- engine classes are checked against their interface when the config is resolved -------


class _HalfRollout(RolloutEngine):
    """Subclasses the interface but leaves four methods abstract."""

    async def start(self) -> None: ...

    async def generate(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def stop(self) -> None: ...


class _DuckTrainer:
    """Does not subclass TrainerEngine and lacks most of it."""

    async def setup(self, ctx) -> None: ...  # type: ignore[no-untyped-def]


def _resolve_with(kind: str, name: str, factory: object, *overrides: str):  # type: ignore[no-untyped-def]
    from laminar_core.plugins import builtins
    from laminar_core.runtime.resolve import load_config

    pm = PluginManager()
    pm.register(builtins, name="core")
    hook = KINDS[kind].hook
    pm.register(make_module("under_test", **{hook: {name: factory}}), name="under-test")
    return load_config(None, list(overrides), pm=pm)


def test_engine_missing_methods_is_a_one_line_config_error() -> None:
    from laminar_core import ConfigError

    with pytest.raises(ConfigError) as info:
        _resolve_with("rollout", "half", _HalfRollout, "rollout.engine=half")
    assert str(info.value) == (
        f"rollout.engine: rollout engine 'half' ({__name__}:_HalfRollout) does not implement "
        "RolloutEngine: missing abort, partials, stats, update_weights (see docs/plugins.md)"
    )
    with pytest.raises(ConfigError, match=r"missing close, compute_logprobs, export_weights"):
        _resolve_with("trainer", "duck", _DuckTrainer, "trainer.engine=duck")
    with pytest.raises(ConfigError, match=r"^relay.transport: transport 'bad' .*missing"):
        _resolve_with("transport", "bad", _DuckTrainer, "relay.transport=bad")
    with pytest.raises(ConfigError, match=r"^repack.policy: repack policy 'bad' .*missing plan"):
        _resolve_with("repack", "bad", _DuckTrainer, "repack.policy=bad")
    # a name that is not chosen is not checked (nor imported); a function factory is built later
    assert _resolve_with("rollout", "half", _HalfRollout).cfg.rollout.engine == "sim"
    assert _resolve_with("rollout", "fn", lambda ctx: None, "rollout.engine=fn")


def test_the_shipped_engines_implement_their_interfaces() -> None:
    import importlib.util

    from laminar_core.plugins.builtins import (
        laminar_repack_policies,
        laminar_rollout_engines,
        laminar_trainer_engines,
        laminar_transports,
    )
    from laminar_core.plugins.manager import import_spec
    from laminar_core.runtime.resolve import INTERFACES, missing_methods

    targets = {
        "trainer": [*laminar_trainer_engines().values(), "laminar_fsdp.engine:FSDPTrainerEngine"],
        "rollout": [*laminar_rollout_engines().values(), "laminar_vllm.engine:VLLMRolloutEngine"],
        "transport": [
            *laminar_transports().values(),
            "laminar_nccl.transport:TorchDistTransport",
            "laminar_rdma.transport:NixlTransport",
        ],
        "repack": list(laminar_repack_policies().values()),
    }
    checked = 0
    for kind, specs in targets.items():
        for spec in specs:
            if importlib.util.find_spec(spec.split(".")[0]) is None:
                continue  # a plugin not installed here
            assert missing_methods(import_spec(spec), INTERFACES[kind]) == [], spec
            checked += 1
    assert checked >= 7


def test_build_context_seed_is_distinct_per_instance_and_moves_with_run_seed() -> None:
    """Replicas of one run never share a sampling stream; ``run.seed`` moves all of them."""

    def seeds(run_seed: int, base: int = 0) -> list[int]:
        cfg = load_config(None, [f"run.seed={run_seed}"]).cfg
        return [BuildContext(cfg, index=i).seed(base) for i in range(4)]

    assert seeds(0) == [0, 1, 2, 3]
    assert len(set(seeds(0) + seeds(1))) == 8
    assert seeds(1, base=5) == [1005, 1006, 1007, 1008]
    assert BuildContext(None, index=2).seed(7) == 9  # no config: the base and the index
