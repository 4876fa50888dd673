"""SandboxFusion over HTTP: the same interface as the local sandbox, for users who run a SandboxFusion server.

SandboxFusion's documented code-runner endpoint (its API reference; also the request / response models of the
`sandbox-fusion` client on PyPI):

    POST {url}/run_code   {"code": ..., "language": "python", "run_timeout": s, "compile_timeout": s,
                           "memory_limit_MB": mb, "stdin": "", "files": {}, "fetch_files": []}
    ->  {"status": "Success" | "Failed" | "SandboxError", "message": str,
         "compile_result": null | {...},
         "run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time": s,
                        "return_code": int | null, "stdout": str, "stderr": str}, ...}

This is a small standard-library (urllib) client of that endpoint rather than the `sandbox-fusion` package, which
installs from PyPI but brings requests, pydantic, aiohttp and tenacity for what is one JSON POST here. Every
failure (connection refused, HTTP error, timeout, a body that is not that JSON, SandboxError) is an ExecResult
with `error`, never an exception.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from stare_jax.tools.sandbox import ExecResult

__all__ = ["SandboxFusionBackend"]


def _cut(text: str, max_bytes: int) -> tuple[str, bool]:
    """`text` cut to at most max_bytes of UTF-8 (not inside a character), and whether it was cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text, False
    return raw[:max_bytes].decode("utf-8", "ignore"), True


class SandboxFusionBackend:
    """Runs code on a SandboxFusion server. `url`: the server (http://host:8080) or its /run_code endpoint."""

    name = "sandbox_fusion"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 16384,
        request_timeout_s: float | None = None,
        language: str = "python",
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"SandboxFusionBackend: url must be http(s)://..., got {url!r}")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/run_code") else base + "/run_code"
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.request_timeout_s = request_timeout_s if request_timeout_s is not None else self.timeout_s + 30.0
        self.language = language

    def payload(self, code: str) -> dict:
        return {
            "code": code,
            "language": self.language,
            "run_timeout": self.timeout_s,
            "compile_timeout": self.timeout_s,
            "memory_limit_MB": self.memory_mb,
            "stdin": "",
            "files": {},
            "fetch_files": [],
        }

    def run(self, code: str) -> ExecResult:
        t0 = time.monotonic()

        def failed(msg: str) -> ExecResult:
            return ExecResult(
                "",
                "",
                None,
                False,
                False,
                error=f"sandbox_fusion: {msg}",
                wall_s=time.monotonic() - t0,
                isolation=self.name,
            )

        req = urllib.request.Request(
            self.endpoint,
            data=json.dumps(self.payload(code)).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                body = resp.read(64 * 1024 * 1024 + 1)
        except urllib.error.HTTPError as e:
            return failed(f"HTTP {e.code} from {self.endpoint}: {e.read(500).decode('utf-8', 'replace')}")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            return failed(f"request to {self.endpoint} failed: {e}")
        try:
            data = json.loads(body)
            status = data["status"]
        except (ValueError, KeyError, TypeError):
            return failed(f"not a run_code response: {body[:300]!r}")
        run = data.get("run_result") or {}
        if status == "SandboxError" or not isinstance(run, dict) or "status" not in run:
            compile_res = data.get("compile_result") or {}
            detail = data.get("message") or (compile_res.get("stderr") if isinstance(compile_res, dict) else "")
            return failed(f"{status}: {detail or 'no run_result'}")
        stdout, cut_out = _cut(str(run.get("stdout") or ""), self.max_output_bytes)
        stderr, cut_err = _cut(str(run.get("stderr") or ""), self.max_output_bytes)
        timed_out = run["status"] == "TimeLimitExceeded"
        code_ = run.get("return_code")
        exit_code = int(code_) if isinstance(code_, int) else (-9 if timed_out else None)
        error = None if exit_code is not None else f"sandbox_fusion: run status {run['status']} without a return code"
        return ExecResult(
            stdout,
            stderr,
            exit_code,
            timed_out,
            cut_out or cut_err,
            error=error,
            killed_by="timeout" if timed_out else None,
            wall_s=time.monotonic() - t0,
            isolation=self.name,
        )
