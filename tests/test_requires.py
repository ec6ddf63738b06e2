"""laminar_core.testing.require_modules: skip where an engine is missing, fail in CI."""

import pytest

from laminar_core.testing import require_modules


def test_installed_modules_pass():
    require_modules("json", "torch", what="this test")


def test_a_missing_module_skips_or_fails_under_require_real(monkeypatch):
    monkeypatch.delenv("LAMINAR_REQUIRE_REAL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed: no_such_engine_xyz"):
        require_modules("json", "no_such_engine_xyz", what="the x tests")
    monkeypatch.setenv("LAMINAR_REQUIRE_REAL", "1")
    with pytest.raises(
        ImportError, match=r"the x tests need no_such_engine_xyz: run scripts/install\.sh"
    ):
        require_modules("json", "no_such_engine_xyz", what="the x tests")
