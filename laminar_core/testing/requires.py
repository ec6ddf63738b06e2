"""One rule for tests that need installed engines: skip where they are missing, fail in CI."""

from __future__ import annotations

import importlib.util
import os


def require_modules(*modules: str, what: str) -> None:
    """At a test module's top: skip it (``pytest.skip``, module level) when any of ``modules``
    cannot be imported, or raise ``ImportError`` naming them and the fix when
    ``LAMINAR_REQUIRE_REAL=1`` (CI: the real-engine tests must run, not skip)."""
    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
        raise ImportError(f"{what} need {', '.join(missing)}: run scripts/install.sh")
    pytest.skip(f"not installed: {', '.join(missing)}", allow_module_level=True)
