"""Entry point of laminar-sandbox: registers the ``python_sandbox`` environment."""

from __future__ import annotations

from laminar_core import hookimpl


@hookimpl
def laminar_environments() -> dict[str, object]:
    return {"python_sandbox": "laminar_sandbox.env:PythonSandboxEnv"}
