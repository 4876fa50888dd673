"""ToolConfig: the code interpreter's options (`tool.*` keys), declared once with stare_jax.config.options.

The run config's `tool` section (stare_jax/config/loader.py); with `enabled` the RL loop collects multi-turn rollouts
(stare_jax/tools/rollout.py).
`make_pool(cfg)` builds the SandboxPool it describes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import ConfigError, option, validate_fields
from stare_jax.tools.calls import CODE_TOOL_SCHEMA
from stare_jax.tools.pool import Backend, LocalBackend, SandboxPool
from stare_jax.tools.sandbox_fusion import SandboxFusionBackend

__all__ = ["ToolConfig", "make_backend", "make_pool"]


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """Multi-turn tool use: the sandboxed Python interpreter and the call format."""

    enabled: bool = option(False, "multi-turn rollouts with the code interpreter tool")
    format: Literal["hermes", "retool"] = option(
        "hermes",
        "tool-call format: Qwen2.5's <tool_call>{json}</tool_call> with <tool_response> turns, or "
        "ReTool's <code>...</code> / <interpreter>...</interpreter>",
    )
    max_turns: int = option(4, "tool calls per response; a call past it gets an observation saying so", lo=0)
    backend: Literal["local", "sandbox_fusion"] = option(
        "local", "where code runs: this machine's sandbox (stare_jax.tools.sandbox) or a SandboxFusion server"
    )
    sandbox_fusion_url: str | None = option(
        None, "SandboxFusion server (http://host:8080) or its /run_code URL; needed with backend: sandbox_fusion"
    )
    timeout_s: float = option(
        5.0, "wall-clock limit of one call (the process tree is killed at it)", lo=0.0, lo_open=True
    )
    memory_mb: int = option(1024, "address-space limit (RLIMIT_AS) of the code's processes, MiB", lo=64)
    max_output_bytes: int = option(16384, "kept bytes per output stream (stdout, stderr); the rest is cut", lo=0)
    max_workers: int = option(4, "sandboxed calls running at once", lo=1)
    max_file_mb: int = option(16, "largest file the code may write, and the size of its private /tmp, MiB", lo=1)
    max_processes: int = option(32, "processes + threads of one call (RLIMIT_NPROC of its uid)", lo=1)
    tool_bonus: float = option(
        0.0,
        "ReTool-style reward bonus for a correct answer whose response ran the tool at least once (0 = off)",
        lo=0.0,
    )
    format_penalty: float = option(
        0.0,
        "reward penalty for a response with a malformed or refused tool call "
        "(invalid JSON, unknown tool, bad arguments, empty code, past max_turns; "
        "0 = off)",
        lo=0.0,
    )
    isolation: Literal["auto", "namespaces", "rlimits"] = option(
        "auto",
        "auto: the strongest this machine allows (sandbox_capabilities()); namespaces: fail the calls "
        "where they are not available; rlimits: the fallback only",
    )
    eval_without_tool: bool = option(
        False,
        "each periodic evaluation also runs with the tool disabled "
        "(eval_notool/*: a call gets no reply), the ablation that shows the task "
        "needs the tool",
    )

    def __post_init__(self):
        validate_fields(self, "tool")
        if self.backend == "sandbox_fusion" and not self.sandbox_fusion_url:
            raise ConfigError("tool: 'backend' = 'sandbox_fusion' needs 'sandbox_fusion_url' (http://host:port)")
        if self.sandbox_fusion_url is not None and not self.sandbox_fusion_url.startswith(("http://", "https://")):
            raise ConfigError(f"tool: 'sandbox_fusion_url' = {self.sandbox_fusion_url!r} is not an http(s) URL")

    def prompt_tools(self) -> list[dict] | None:
        """The tool schemas a chat-template prompt lists: [the code interpreter] when enabled in the hermes format
        (Qwen2.5's template writes them into its tool-use system prompt), else None."""
        return [CODE_TOOL_SCHEMA] if self.enabled and self.format == "hermes" else None


def make_backend(cfg: ToolConfig) -> Backend:
    """The Backend `cfg` names, with its limits."""
    if cfg.backend == "sandbox_fusion":
        assert cfg.sandbox_fusion_url is not None  # checked in __post_init__
        return SandboxFusionBackend(
            cfg.sandbox_fusion_url,
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            max_output_bytes=cfg.max_output_bytes,
        )
    return LocalBackend(
        timeout_s=cfg.timeout_s,
        memory_mb=cfg.memory_mb,
        max_output_bytes=cfg.max_output_bytes,
        max_file_mb=cfg.max_file_mb,
        max_processes=cfg.max_processes,
        isolation=cfg.isolation,
    )


def make_pool(cfg: ToolConfig) -> SandboxPool:
    """A SandboxPool with cfg.max_workers running through make_backend(cfg)."""
    return SandboxPool(cfg.max_workers, backend=make_backend(cfg))
