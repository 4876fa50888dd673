"""stare_jax.distributed: the helpers in one process (identities), and their cross-process behaviour in a REAL
3-process jax.distributed launch (uneven shares, sums, a stop flag raised by one process only, a global array
fetched to every host). The 2 x 4 vs 1 x 8 runs of the whole train step / RL loop are in test_multihost.py."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]

WORKER = r"""
import json, sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=3, process_id=int(sys.argv[2]))
from stare_jax import distributed as d
from stare_jax.models.sharding import make_mesh

k = jax.process_index()
lo, hi = d.process_share(7)                      # 7 items over 3 processes: 2, 2, 3
shares = d.gather_shares(np.arange(lo, hi) * 10, 7)
sums = d.sum_across_processes({"n_timeout": k + 1} if k != 1 else {}, ("n_timeout", "n_crash"))
stop = d.any_process(k == 2)
mesh = make_mesh({"data": 3, "fsdp": 2})
host = np.arange(12 * 2, dtype=np.int32).reshape(12, 2)
g = d.global_batch({"x": host}, mesh)["x"]        # every process feeds its own rows
back = d.fetch_global({"x": g})["x"]
# a host value every process holds, placed by each process on its own devices (split rows, and replicated)
rows = d.global_from_host(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
rep = d.global_from_host(np.int32(7), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
mixed = d.fetch_global((rows, rep, host[:2], jax.numpy.ones(3)))  # global arrays gathered, local leaves copied
sent = d.broadcast_from_process0({"from": k, "text": "é" * (k + 2)} if k == 0 else None)
d.barrier("done")
print("RESULT" + json.dumps({"share": [lo, hi], "shares": shares.tolist(), "sums": sums, "stop": stop,
                             "roundtrip": bool((back == host).all()), "global": not g.is_fully_addressable,
                             "from_host": bool((mixed[0] == host).all()) and not rows.is_fully_addressable,
                             "rep": int(mixed[1]), "local": [mixed[2].tolist(), mixed[3].tolist()],
                             "sent": sent}))
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_helpers_across_three_real_processes():
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(REPO)
    )
    addr = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, addr, str(i)],
            env=env,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(3)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        finally:
            for q in procs:
                if q.poll() is None and p.returncode not in (None, 0):
                    q.kill()
        assert p.returncode == 0, out[-3000:]
        outs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:]))
    assert [o["share"] for o in outs] == [[0, 2], [2, 4], [4, 7]]
    for o in outs:  # every process ends with the same global values
        assert o["shares"] == [0, 10, 20, 30, 40, 50, 60]
        assert o["sums"] == {"n_timeout": 1.0 + 3.0, "n_crash": 0.0}
        assert o["stop"] is True and o["roundtrip"] is True and o["global"] is True
        assert o["from_host"] is True and o["rep"] == 7 and o["local"] == [[[0, 1], [2, 3]], [1.0, 1.0, 1.0]]
        assert o["sent"] == {"from": 0, "text": "éé"}  # process 0's value on every process


def test_helpers_in_one_process_are_identities():
    import jax

    from stare_jax import distributed as d
    from stare_jax.models.sharding import make_mesh

    assert not d.is_multiprocess() and d.process_share(5) == (0, 5)
    np.testing.assert_array_equal(d.gather_shares(np.arange(5), 5), np.arange(5))
    assert d.sum_across_processes({"a": 2}, ("a", "b")) == {"a": 2.0, "b": 0.0}
    assert d.any_process(False) is False and d.any_process(True) is True
    d.barrier("noop")
    if jax.device_count() >= 8:
        mesh = make_mesh({"data": 2, "fsdp": 4})
        x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
        g = d.global_batch({"x": x}, mesh)["x"]
        np.testing.assert_array_equal(d.fetch_global(g), x)


def test_global_from_host_and_broadcast_in_one_process():
    """One process: global_from_host is device_put into the sharding, broadcast_from_process0 the identity,
    fetch_global copies host values and local arrays as they are."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stare_jax import distributed as d
    from stare_jax.models.sharding import make_mesh

    n = min(jax.device_count(), 2)
    mesh = make_mesh({"data": n}, devices=jax.devices()[:n])
    x = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    for spec in (P("data"), P()):
        g = d.global_from_host(x, NamedSharding(mesh, spec))
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2) and g.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(g), x)
    s = d.global_from_host(np.float32(2.5), NamedSharding(mesh, P()))
    assert s.shape == () and float(s) == 2.5
    value = {"a": [1, "é"], "b": None}
    assert d.broadcast_from_process0(value) is value
    back = d.fetch_global({"host": x, "device": jax.numpy.asarray(x)})
    assert all(isinstance(v, np.ndarray) for v in back.values())
    np.testing.assert_array_equal(back["host"], x)
    np.testing.assert_array_equal(back["device"], x)
