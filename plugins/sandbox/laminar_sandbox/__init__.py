"""laminar-sandbox: the ``python_sandbox`` environment and the sandboxes it runs code in.

* :class:`PythonSandboxEnv` -- the environment (plugin kind ``env``, name ``python_sandbox``).
* :class:`SandboxPool` -- local sandboxes: a warm pool of isolated processes (bwrap or Linux
  namespaces, rlimits, a per-sandbox uid).
* :class:`CommandSandbox` -- an agent program per episode (``agent.sandbox``).
* :class:`SandboxFusionClient` -- a remote SandboxFusion service (``POST /run_code``).
"""

from laminar_sandbox.command import CommandLimits, CommandSandbox
from laminar_sandbox.env import PythonSandboxEnv, SandboxOptions
from laminar_sandbox.isolation import IsolationUnavailable
from laminar_sandbox.pool import Limits, SandboxPool
from laminar_sandbox.remote import SandboxFusionClient
from laminar_sandbox.result import CodeExecutor, RunResult

__all__ = [
    "CodeExecutor",
    "CommandLimits",
    "CommandSandbox",
    "IsolationUnavailable",
    "Limits",
    "PythonSandboxEnv",
    "RunResult",
    "SandboxFusionClient",
    "SandboxOptions",
    "SandboxPool",
]
