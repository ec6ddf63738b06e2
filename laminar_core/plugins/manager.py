"""Plugin discovery and lookup for Laminar engines.

A :class:`PluginManager` collects, per kind (see :data:`~laminar_core.plugins.hookspecs.KINDS`),
a mapping ``name -> factory`` from every registered plugin. Plugins come from the
``"laminar"`` entry-point group (:meth:`PluginManager.load_entry_points`) or are registered by
hand (:meth:`PluginManager.register`). Loading never raises: broken plugins, hooks that raise,
hook names that are not Laminar's (a typo such as ``laminar_rollout_engin``) and duplicate
names are recorded in :attr:`PluginManager.failures` and everything else keeps working; a
plugin that loads but provides no name is listed in :attr:`PluginManager.empty`. Lazy
``"module:Attr"`` factories are imported only by :meth:`PluginManager.get`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from laminar_core.plugins.hookspecs import KINDS, PROJECT_NAME, KindSpec, LaminarHookSpecs

_LAZY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def import_spec(spec: str) -> Any:
    """The object named by ``"package.module:attr.path"`` (import errors propagate)."""
    module_name, _, attr_path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def _one_line(exc: BaseException) -> str:
    """``"Type: first line of message"`` for an exception."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin (or one of its names) that could not be loaded.

    ``source`` says where it came from (e.g. ``"laminar-vllm (entry point 'vllm')"``),
    ``error`` is a one-line description. ``entry_point`` / ``package`` are kept (possibly
    empty) so lookups of a missing name can point at the failure that probably caused it.
    """

    source: str
    error: str
    entry_point: str = ""
    package: str = ""

    def __str__(self) -> str:
        return f"{self.source}: {self.error}"


@dataclass(frozen=True)
class PluginInfo:
    """One available ``(kind, name)``: who provides it and its factory's ``target``.

    ``target`` is the lazy import string, or ``repr`` of the factory object.
    """

    kind: str
    name: str
    package: str
    version: str
    target: str


class UnknownPluginError(KeyError):
    """No plugin of ``kind`` is named ``name``; ``str()`` is a readable one-line message."""

    def __init__(
        self,
        kind: str,
        name: str,
        known: Iterable[str],
        related_failures: Iterable[PluginLoadError] = (),
        other_failures: int = 0,
        related_empty: Iterable[PluginLoadError] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.known = sorted(known)
        self.suggestions = difflib.get_close_matches(name, self.known, n=3)
        self.related_failures = list(related_failures)
        self.other_failures = other_failures
        self.related_empty = list(related_empty)
        super().__init__(kind, name)

    def __str__(self) -> str:
        label = KINDS[self.kind].label if self.kind in KINDS else self.kind
        msg = f"unknown {label} {self.name!r}; known: {', '.join(self.known) or '(none)'}"
        if self.suggestions:
            msg += f" (did you mean {' or '.join(repr(s) for s in self.suggestions)}?)"
        for failure in self.related_failures:
            msg += f"; plugin {failure.source} failed to load: {failure.error}"
        for empty in self.related_empty:
            msg += f"; plugin {empty.source} registered nothing: {empty.error}"
        if self.other_failures:
            msg += (
                f"; {self.other_failures} plugin(s) failed to load"
                " (see `laminar plugins` for details)"
            )
        return msg


class PluginResolveError(RuntimeError):
    """A lazy factory string could not be imported (or did not name a callable)."""


@dataclass
class _Entry:
    """Registry record of one ``(kind, name)``."""

    factory: object  # callable, or lazy "module:Attr" string until resolved
    plugin: str  # pluggy plugin name
    package: str
    version: str
    target: str
    resolved: Callable[..., Any] | None = None

    @property
    def provider(self) -> str:
        return self.package or self.plugin


class PluginManager:
    """Registry of Laminar plugins, grouped by kind.

    Registration order matters: when two plugins offer the same ``(kind, name)`` the first one
    wins and the later one is recorded as a failure. Nothing here raises while loading; lookups
    (:meth:`get`, :meth:`create`) raise :class:`UnknownPluginError` / :class:`PluginResolveError`.
    """

    def __init__(self, entry_point_group: str = PROJECT_NAME) -> None:
        self.entry_point_group = entry_point_group
        self.failures: list[PluginLoadError] = []
        #: Plugins that loaded but provide no name (``error`` says why): listed by
        #: ``laminar plugins``, since a plugin that silently adds nothing looks like a typo'd
        #: engine name to its user.
        self.empty: list[PluginLoadError] = []
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(LaminarHookSpecs)
        self._entries: dict[str, dict[str, _Entry]] = {kind: {} for kind in KINDS}
        self._seen_entry_points: set[tuple[str, str]] = set()

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        """The underlying pluggy manager (for hooks beyond the factory kinds)."""
        return self._pm

    # ----------------------------------------------------------------- loading

    def load_entry_points(self) -> None:
        """Load every entry point of :attr:`entry_point_group`; never raises.

        Each entry point's value (a module or object implementing hooks) is registered under
        the entry point's name with its distribution's name and version. Entry points already
        seen by this manager are skipped, so calling this twice is harmless.
        """
        try:
            eps = list(importlib.metadata.entry_points(group=self.entry_point_group))
        except Exception as exc:
            self._fail(f"entry point group {self.entry_point_group!r}", _one_line(exc))
            return
        for ep in eps:
            dist = getattr(ep, "dist", None)
            package = str(getattr(dist, "name", None) or "")
            version = str(getattr(dist, "version", None) or "")
            key = (package, ep.name)
            if key in self._seen_entry_points:
                continue
            self._seen_entry_points.add(key)
            source = _ep_source(package, ep.name)
            try:
                obj = ep.load()
            except Exception as exc:
                self._fail(source, _one_line(exc), entry_point=ep.name, package=package)
                continue
            self._register(obj, ep.name, package, version, source, entry_point=ep.name)

    def register(
        self, obj: object, name: str | None = None, package: str = "", version: str = ""
    ) -> bool:
        """Register a module/object implementing hooks; never raises.

        Returns ``False`` when the whole plugin was rejected (pluggy refused it, a hook raised
        or returned something invalid); the reason is appended to :attr:`failures`. Names that
        collide with earlier registrations are dropped individually (also recorded) and the
        call still returns ``True``.
        """
        label = name or getattr(obj, "__name__", None) or type(obj).__name__
        source = f"{package} ({label})" if package else str(label)
        return self._register(obj, name, package, version, source)

    def _register(
        self,
        obj: object,
        name: str | None,
        package: str,
        version: str,
        source: str,
        entry_point: str = "",
    ) -> bool:
        def fail(error: str) -> bool:
            self._fail(source, error, entry_point=entry_point, package=package)
            return False

        try:
            plugin_name = self._pm.register(obj, name)
        except Exception as exc:
            return fail(_one_line(exc))
        if plugin_name is None:  # blocked in pluggy
            return fail("plugin is blocked")
        problems = _hook_problems(self._pm, obj)
        if problems:
            self._pm.unregister(name=plugin_name)
            return fail("; ".join(problems))

        # Collect everything first so a plugin is either fully present or fully absent.
        collected: list[tuple[KindSpec, dict[str, object]]] = []
        for spec in KINDS.values():
            for impl in getattr(self._pm.hook, spec.hook).get_hookimpls():
                if impl.plugin_name != plugin_name:
                    continue
                try:
                    result = _validate(spec, impl.function())
                except Exception as exc:
                    self._pm.unregister(name=plugin_name)
                    return fail(f"{spec.hook}() raised {_one_line(exc)}")
                collected.append((spec, result))

        if not any(result for _, result in collected):
            why = "its hooks returned no names" if collected else _NO_HOOKS
            self.empty.append(PluginLoadError(source, why, entry_point, package))
        for spec, result in collected:
            table = self._entries[spec.kind]
            for key, factory in result.items():
                entry = _Entry(
                    factory=factory,
                    plugin=plugin_name,
                    package=package,
                    version=version,
                    target=factory if isinstance(factory, str) else repr(factory),
                )
                first = table.get(key)
                if first is None:
                    table[key] = entry
                    continue
                new_by, old_by = entry.provider, first.provider
                if new_by == old_by:
                    new_by, old_by = f"{new_by} ({plugin_name})", f"{old_by} ({first.plugin})"
                self._fail(
                    source,
                    f"duplicate {spec.label} {key!r} from {new_by} (already provided by {old_by})",
                    entry_point=entry_point,
                    package=package,
                )
        return True

    def _fail(self, source: str, error: str, entry_point: str = "", package: str = "") -> None:
        self.failures.append(PluginLoadError(source, error, entry_point, package))

    # ----------------------------------------------------------------- lookup

    def names(self, kind: str) -> list[str]:
        """Sorted names available for ``kind``; raises ``ValueError`` for an unknown kind."""
        return sorted(self._table(kind))

    def infos(self) -> list[PluginInfo]:
        """Every available plugin name, sorted by ``(kind, name)``."""
        return sorted(
            (
                PluginInfo(kind, name, e.package, e.version, e.target)
                for kind, table in self._entries.items()
                for name, e in table.items()
            ),
            key=lambda info: (info.kind, info.name),
        )

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        """The factory for ``(kind, name)``, importing a lazy string on first use.

        Raises :class:`UnknownPluginError` (a ``KeyError``) when no plugin has that name and
        :class:`PluginResolveError` when a lazy string cannot be imported or is not callable.
        """
        table = self._table(kind)
        entry = table.get(name)
        if entry is None:
            related = [f for f in self.failures if _failure_mentions(f, name)]
            raise UnknownPluginError(
                kind,
                name,
                table,
                related,
                other_failures=len(self.failures) - len(related),
                related_empty=[e for e in self.empty if _failure_mentions(e, name)],
            )
        if entry.resolved is None:
            entry.resolved = self._resolve(KINDS[kind], name, entry)
        return entry.resolved

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """``get(kind, name)(*args, **kwargs)``."""
        return self.get(kind, name)(*args, **kwargs)

    def _table(self, kind: str) -> dict[str, _Entry]:
        try:
            return self._entries[kind]
        except KeyError:
            hint = difflib.get_close_matches(kind, list(KINDS), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}{extra}"
            ) from None

    @staticmethod
    def _resolve(spec: KindSpec, name: str, entry: _Entry) -> Callable[..., Any]:
        factory = entry.factory
        if not isinstance(factory, str):
            return factory  # type: ignore[return-value]  # validated callable at registration
        where = f"{spec.label} {name!r} from {entry.provider}"
        try:
            obj = import_spec(factory)
        except Exception as exc:
            raise PluginResolveError(
                f"cannot load {where} ({factory!r}): {_one_line(exc)}"
            ) from exc
        if not callable(obj):
            raise PluginResolveError(f"cannot load {where}: {factory!r} is not callable")
        return obj

    # ----------------------------------------------------------------- display

    def format_table(self) -> str:
        """Plain-text table (KIND, NAME, PACKAGE, VERSION) plus "failed to load:" and
        "registered nothing:" sections."""
        header = ("KIND", "NAME", "PACKAGE", "VERSION")
        rows = [(i.kind, i.name, i.package or "-", i.version or "-") for i in self.infos()]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

        def line(row: tuple[str, ...]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

        lines = [line(header), *(line(r) for r in rows)]
        if not rows:
            lines.append("(no plugins registered)")
        if self.failures:
            lines += ["", "failed to load:", *(f"  {f}" for f in self.failures)]
        if self.empty:
            lines += ["", "registered nothing:", *(f"  {e}" for e in self.empty)]
        return "\n".join(lines)


def _ep_source(package: str, ep_name: str) -> str:
    return f"{package} (entry point {ep_name!r})" if package else f"entry point {ep_name!r}"


_NO_HOOKS = "no function marked @hookimpl (from laminar_core import hookimpl)"
_HOOK_NAMES = [spec.hook for spec in KINDS.values()]


def _hook_problems(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """What is wrong with ``plugin``'s hooks, one phrase each (empty: nothing).

    A ``@hookimpl`` whose name is no Laminar hook would never be called: pluggy reports it
    only from ``check_pending()``, which this runs for the one plugin (so one bad plugin
    does not blame the others). A function named like a hook but not marked ``@hookimpl``
    is never called either.
    """
    problems = []
    marked = set()
    for caller in pm.get_hookcallers(plugin) or []:
        marked.add(caller.name)
        if caller.has_spec():
            continue
        if any(not i.optionalhook for i in caller.get_hookimpls() if i.plugin is plugin):
            problems.append(f"unknown hook {caller.name!r}{_hook_hint(caller.name)}")
    for attr in dir(plugin):
        if attr in marked or not attr.startswith("laminar_"):
            continue
        if attr not in _HOOK_NAMES and not _close_hook(attr):
            continue  # a helper that merely starts with laminar_
        try:
            value = getattr(plugin, attr)
        except Exception:
            continue
        if callable(value):
            hint = "" if attr in _HOOK_NAMES else _hook_hint(attr)
            problems.append(f"{attr!r} is not marked @hookimpl{hint}")
    return problems


def _close_hook(name: str) -> str | None:
    """The hook ``name`` is probably a typo of (every hook starts with ``laminar_``, so
    only a close match counts)."""
    close = difflib.get_close_matches(name, _HOOK_NAMES, n=1, cutoff=0.8)
    return close[0] if close else None


def _hook_hint(name: str) -> str:
    close = _close_hook(name)
    if close:
        return f" (did you mean {close!r}?)"
    return f"; Laminar's hooks are {', '.join(_HOOK_NAMES)}"


def _validate(spec: KindSpec, result: object) -> dict[str, object]:
    """Check a hook's return value: ``None`` or ``{str: callable | 'module:Attr'}``."""
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise TypeError(f"expected dict[str, factory], got {type(result).__name__}")
    for key, factory in result.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{spec.label} name must be a non-empty str, got {key!r}")
        if isinstance(factory, str):
            if not _LAZY_RE.match(factory):
                raise ValueError(
                    f"{spec.label} {key!r}: lazy factory {factory!r} is not 'module:Attr'"
                )
        elif not callable(factory):
            raise TypeError(f"{spec.label} {key!r}: factory {factory!r} is not callable")
    return dict(result)


def _failure_mentions(failure: PluginLoadError, name: str) -> bool:
    """Whether ``name`` plausibly belongs to the failed plugin (entry point or package token)."""
    wanted = name.lower()
    tokens = set(re.split(r"[-_.]", failure.package.lower())) if failure.package else set()
    return wanted == failure.entry_point.lower() or wanted in tokens


_default: PluginManager | None = None
_default_lock = threading.Lock()


def default_manager() -> PluginManager:
    """The process-wide manager, loading the ``"laminar"`` entry points on first call."""
    global _default
    with _default_lock:
        if _default is None:
            manager = PluginManager()
            manager.load_entry_points()
            _default = manager
        return _default


def reset_default_manager() -> None:
    """Forget the cached :func:`default_manager` (tests); the next call reloads."""
    global _default
    with _default_lock:
        _default = None
