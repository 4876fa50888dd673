"""Shared by several tests: moved from tests/system/test_multihost.py (which imports them back)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(local_devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(REPO / ".cache" / "jax")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class Launch:
    """`num_processes` processes of `cmd` (8 / num_processes CPU devices each; with several processes the
    jax.distributed flags --coordinator-address/--num-processes/--process-id are appended), output to files."""

    def __init__(self, name: str, logdir: pathlib.Path, num_processes: int, cmd: list[str]):
        self.name, self.procs, self.logs = name, [], []
        port = _free_port()
        for i in range(num_processes):
            argv = list(cmd)
            if num_processes > 1:
                argv += [
                    "--num-processes",
                    str(num_processes),
                    "--process-id",
                    str(i),
                    "--coordinator-address",
                    f"127.0.0.1:{port}",
                ]
            log = logdir / f"{name}_p{i}.log"
            self.logs.append(log)
            with open(log, "wb") as fh:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        env=_env(8 // num_processes),
                        cwd=REPO,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )

    def _tails(self, n: int = 4000) -> str:
        parts = []
        for i, (p, log) in enumerate(zip(self.procs, self.logs)):
            text = log.read_text(errors="replace") if log.exists() else "<no log>"
            text = "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))
            parts.append(f"--- {self.name} process {i} (rc={p.returncode}), last {n} chars of {log}:\n{text[-n:]}")
        return "\n".join(parts)

    def _kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def wait(self, timeout_s: float = TIMEOUT_S) -> float:
        """Wait for every worker; a failing worker makes the others be killed at once (they would hang in a
        collective), and so does the deadline. Raises AssertionError with every worker's log tail."""
        t0 = time.time()
        deadline = t0 + timeout_s
        while True:
            rcs = [p.poll() for p in self.procs]
            if all(rc == 0 for rc in rcs):
                return time.time() - t0
            if any(rc not in (None, 0) for rc in rcs):
                self._kill_all()
                raise AssertionError(f"{self.name}: a worker failed (exit codes {rcs})\n{self._tails()}")
            if time.time() > deadline:
                self._kill_all()
                raise AssertionError(
                    f"{self.name}: workers still running after {timeout_s} s (killed)\n{self._tails()}"
                )
            time.sleep(0.2)
