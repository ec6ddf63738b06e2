"""No import cycle between any two modules of core or a plugin.

``lint-imports`` (pyproject.toml) checks the layers and cycles between the siblings of each
package; what it does not see is a package's ``__init__`` and a module inside it importing
each other (the module then runs against a half-initialised package). Every import counts:
module level, lazy, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

from pathlib import Path

import grimp

ROOT = Path(__file__).parents[1]
PLUGINS = sorted(p.name for p in ROOT.glob("plugins/*/laminar_*") if (p / "__init__.py").exists())


def test_no_module_imports_itself_back() -> None:
    graph = grimp.build_graph("laminar_core", *PLUGINS, cache_dir=None)
    cycles: dict[frozenset[str], str] = {}  # each cycle once, whichever module it starts at
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycles.setdefault(frozenset(back), " -> ".join((importer, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles.values())
