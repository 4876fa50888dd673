"""A REAL multi-process run of the STARE train step: 2 local processes x 4 CPU devices (jax.distributed with gloo
collectives) on a data 2 x fsdp 4 mesh, each process feeding only its own rows of the global batch, give the
same STARE-O1 steps as 1 process x 8 devices on the same mesh; an orbax checkpoint saved by both processes is
restored by a second 2-process launch and training continues exactly like the uninterrupted reference.

The processes run tests/_multihost_worker.py (see its docstring for what it writes). Hung workers are killed
after TIMEOUT_S; a failing launch reports every worker's stderr tail.

Tolerance: the sharded programs are the same, but cross-process all-reduces (gloo) sum in another order than
the in-process ones, so float32 values differ by a few ulps (measured: <= 3e-6 on per-token log-probs of
magnitude ~4-10, <= 3e-7 on losses/metrics, <= 1e-7 on parameters). Continuous values are compared with
|a - b| <= 1e-6 + 1e-6 * |b| (absolute 1e-6 below 1, relative 1e-6 ~ 8 float32 ulps above); the discrete
ones (token weights omega, selection counts, the gate, W, M, masks) must be exactly equal.
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_multihost_worker.py"
TIMEOUT_S = 300
STEPS = 3
ATOL = RTOL = 1e-6
EXACT = ("debug/omega", "debug/loss_mask", "gate_on", "stare_w", "stare_m", "response_tokens", "stare/n_pos",
         "stare/n_neg", "stare/gate_frac", "skipped_updates", "num_updates", "state/gate_on", "state/w", "state/m")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(local_devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class Launch:
    """`num_processes` worker processes (8 / num_processes CPU devices each), stdout+stderr to files."""

    def __init__(self, name: str, logdir: pathlib.Path, num_processes: int, *worker_args: str):
        self.name, self.procs, self.logs = name, [], []
        port = _free_port()
        cache = REPO / ".cache" / "jax"
        for i in range(num_processes):
            cmd = [sys.executable, str(WORKER), *worker_args, "--compile-cache", str(cache)]
            if num_processes > 1:
                cmd += ["--num-processes", str(num_processes), "--process-id", str(i),
                        "--coordinator", f"127.0.0.1:{port}"]
            log = logdir / f"{name}_p{i}.log"
            self.logs.append(log)
            with open(log, "wb") as fh:
                self.procs.append(subprocess.Popen(cmd, env=_env(8 // num_processes), cwd=REPO, stdout=fh,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

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
                raise AssertionError(f"{self.name}: workers still running after {timeout_s} s (killed)\n"
                                     f"{self._tails()}")
            time.sleep(0.2)


def _load(path: pathlib.Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference (1 process x 8 devices, STEPS + 1 steps) and 2 x 4 training (STEPS steps + checkpoint) run
    concurrently; then a 2 x 4 launch restores the checkpoint and runs one more step."""
    d = tmp_path_factory.mktemp("multihost")
    ckpt = d / "ckpt"
    t0 = time.time()
    ref = Launch("reference_1x8", d, 1, "--phase", "train", "--out", str(d / "ref"), "--steps", str(STEPS + 1))
    mp = Launch("train_2x4", d, 2, "--phase", "train", "--out", str(d / "mp"), "--steps", str(STEPS),
                "--ckpt", str(ckpt))
    mp.wait()
    ref.wait(max(TIMEOUT_S - (time.time() - t0), 1.0))
    rs = Launch("restore_2x4", d, 2, "--phase", "restore", "--out", str(d / "rs"), "--ckpt", str(ckpt))
    rs.wait()
    print(f"multihost launches took {time.time() - t0:.1f} s")
    return {"ref": _load(d / "ref" / "result.npz"), "mp": _load(d / "mp" / "result.npz"),
            "rs": _load(d / "rs" / "result.npz"), "dir": d}


def _close(name, a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    if any(name.endswith(k) for k in EXACT):
        np.testing.assert_array_equal(a, b, err_msg=name)
    else:
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _compare_step(got: dict, want: dict, i: int) -> dict:
    """Every recorded key of step i (metrics, debug arrays, controller state, parameters); max |diff| per group."""
    keys = sorted(k for k in want if k.startswith(f"s{i}/"))
    assert keys and keys == sorted(k for k in got if k.startswith(f"s{i}/")), i
    worst = {}
    for k in keys:
        group = ("params" if "/params/" in k else "omega" if k.endswith("debug/omega") else
                 "per_token" if "/debug/" in k else "loss" if k.endswith("/loss") else "metrics")
        worst[group] = max(worst.get(group, 0.0), _close(k, got[k], want[k]))
    return worst


def test_two_processes_feed_their_own_rows_of_a_sharded_state(runs):
    mp, ref, d = runs["mp"], runs["ref"], runs["dir"]
    np.testing.assert_array_equal(np.load(d / "mp" / "rows_0.npy"), np.arange(0, 8))
    np.testing.assert_array_equal(np.load(d / "mp" / "rows_1.npy"), np.arange(8, 16))
    np.testing.assert_array_equal(np.load(d / "ref" / "rows_0.npy"), np.arange(16))
    # every parameter spans both processes' devices, and some are really sharded (fsdp), not just replicated
    assert int(mp["layout/global_leaves"]) == int(mp["layout/num_leaves"]) > 0
    assert int(mp["layout/sharded_leaves"]) > 0 and int(ref["layout/sharded_leaves"]) > 0
    assert int(ref["layout/global_leaves"]) == 0  # one process: every array is fully addressable


def test_two_processes_equal_one_process_for_three_stare_steps(runs):
    mp, ref = runs["mp"], runs["ref"]
    for k in (k for k in ref if k.startswith("init/params/")):
        np.testing.assert_array_equal(mp[k], ref[k], err_msg=k)  # same seed, same sharded init
    worst = {}
    for i in range(STEPS):
        # STARE-O1 is really active: batch gate on, W = 1.5, some tokens reweighted
        assert float(mp[f"s{i}/gate_on"]) == 1.0 and float(mp[f"s{i}/stare_w"]) == 1.5
        assert float(mp[f"s{i}/stare/frac_reweighted"]) > 0 and np.any(mp[f"s{i}/debug/omega"] == 1.5)
        assert float(mp[f"s{i}/skipped_updates"]) == 0 and np.isfinite(mp[f"s{i}/loss"])
        for g, v in _compare_step(mp, ref, i).items():
            worst[g] = max(worst.get(g, 0.0), v)
    # the parameters visibly moved (lr 1e-3), far beyond the tolerance
    p_keys = [k for k in mp if k.startswith(f"s{STEPS - 1}/params/")]
    moved = max(float(np.max(np.abs(mp[k] - mp["init/params/" + k.split("/params/", 1)[1]]))) for k in p_keys)
    assert moved > 1e-3, moved
    print(f"max |2x4 - 1x8| over {STEPS} steps: {worst}; max parameter change {moved:.3g}")


def test_checkpoint_saved_by_two_processes_restores_and_continues(runs):
    mp, rs, ref = runs["mp"], runs["rs"], runs["ref"]
    assert int(rs["restored/step"]) == STEPS and int(rs["restored/train_step"]) == STEPS
    last = STEPS - 1
    p_keys = [k for k in mp if k.startswith(f"s{last}/params/")]
    for k in p_keys:  # bit-exact round trip of the sharded parameters
        np.testing.assert_array_equal(rs["restored/params/" + k.split("/params/", 1)[1]], mp[k], err_msg=k)
    for f in ("gate_on", "w", "m", "last_entropy"):
        np.testing.assert_array_equal(rs[f"restored/stare/{f}"], mp[f"s{last}/state/{f}"], err_msg=f)
    # one more step after the restore == the reference's uninterrupted step STEPS (so the optimizer state and
    # the controller state came back too)
    worst = _compare_step(rs, ref, STEPS)
    assert float(rs[f"s{STEPS}/skipped_updates"]) == 0 and np.isfinite(rs[f"s{STEPS}/loss"])
    print(f"max |restored 2x4 step {STEPS + 1} - uninterrupted 1x8|: {worst}")


def test_process_local_helpers_in_one_process():
    """stare_jax.distributed in a single process: every row is local and the global batch equals device_put."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stare_jax.distributed import global_batch_from_process_local, process_batch_rows
    from stare_jax.models.sharding import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 4})
    np.testing.assert_array_equal(process_batch_rows(mesh, 16), np.arange(16))
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    g = global_batch_from_process_local({"x": x}, mesh, 16)["x"]
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"))), 2)
    np.testing.assert_array_equal(np.asarray(g), x)
    with pytest.raises(ValueError, match="divisible"):
        process_batch_rows(mesh, 12)
    with pytest.raises(ValueError, match=r"batch\['x'\]"):
        global_batch_from_process_local({"x": x[:8]}, mesh, 16)
    assert jax.process_count() == 1
