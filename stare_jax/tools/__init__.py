"""Tools for multi-turn rollouts: the sandboxed Python interpreter (run_python, SandboxPool, the SandboxFusion
backend) and its config section. Standard library only: nothing here imports jax."""
from stare_jax.tools.config import ToolConfig, make_backend, make_pool
from stare_jax.tools.pool import Backend, LocalBackend, SandboxPool
from stare_jax.tools.sandbox import ExecResult, run_python, sandbox_capabilities
from stare_jax.tools.sandbox_fusion import SandboxFusionBackend

__all__ = ["Backend", "ExecResult", "LocalBackend", "SandboxFusionBackend", "SandboxPool", "ToolConfig",
           "make_backend", "make_pool", "run_python", "sandbox_capabilities"]
