"""Tools for multi-turn rollouts: the sandboxed Python interpreter (run_python, SandboxPool, the SandboxFusion
backend), tool calls in model text (parse, stop condition, observation) and the `tool` config section. Standard
library only: nothing here imports jax. The multi-turn rollout over the engine is `stare_jax.tools.rollout` (jax:
not imported here; the sandbox runs under the system interpreter as an unprivileged user, without the venv)."""

from stare_jax.tools.calls import (
    CallStatus,
    ToolCall,
    ends_with_call,
    observation,
    parse_call,
    result_status,
    status_counts,
    stop_strings,
)
from stare_jax.tools.config import ToolConfig, make_backend, make_pool
from stare_jax.tools.pool import Backend, LocalBackend, SandboxPool
from stare_jax.tools.sandbox import ExecResult, run_python, sandbox_capabilities
from stare_jax.tools.sandbox_fusion import SandboxFusionBackend

__all__ = [
    "Backend",
    "CallStatus",
    "ExecResult",
    "LocalBackend",
    "SandboxFusionBackend",
    "SandboxPool",
    "ToolCall",
    "ToolConfig",
    "ends_with_call",
    "make_backend",
    "make_pool",
    "observation",
    "parse_call",
    "result_status",
    "run_python",
    "sandbox_capabilities",
    "status_counts",
    "stop_strings",
]
