"""One process of the multi-process train-step test (tests/system/test_multihost.py launches it; not a pytest file).

    python tests/system/_multihost_worker.py --phase train|restore --out DIR [--ckpt DIR]
        [--num-processes N --process-id I --coordinator-address 127.0.0.1:PORT] [--steps K]

The environment (set by the launcher) gives each process its CPU devices: JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=8/N, so every run sees 8 global devices and builds the same
data 2 x fsdp 4 mesh. Every process builds the same tiny model (seed 0) and the same global batches (seeded),
feeds only its own rows (stare_jax.distributed.global_batch_from_process_local) and runs STARE-O1 train steps.

phase train:   K steps (default 3, batch seeds 100 + i); process 0 writes DIR/result.npz with, per step
               s<i>/: every scalar metric, debug/omega, debug/old_logprobs, debug/entropy, debug/loss_mask,
               state/<controller field>, params/<path> (the parameters after the step, gathered to the host).
               With --ckpt every process saves {"train_state", "stare_state"} at step K with
               stare_jax.training.checkpoint.Checkpointer (orbax, multi-host, async).
phase restore: restore the newest checkpoint of --ckpt onto the mesh's shardings (abstract state), write
               restored/params/<path> and restored/stare/<field>, then run ONE more step (batch seed 100 + K) and
               write it as s<K>/... (the same keys as a train step).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the shared helpers (support.x)

T0 = time.time()


def _log(msg):
    print(f"[worker {os.environ.get('STARE_MH_PID', '?')} +{time.time() - T0:.1f}s] {msg}", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("train", "restore"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator-address", default=None)
    ap.add_argument("--compile-cache", default=None)
    args = ap.parse_args(argv)
    os.environ["STARE_MH_PID"] = str(args.process_id)

    import jax

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.num_processes > 1:
        # CPU cross-process collectives go through gloo (jax 0.10's default; set explicitly so a changed
        # default fails loudly here instead of hanging in the first all-reduce)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )
    _log(
        f"jax {jax.__version__}: process {jax.process_index()}/{jax.process_count()}, "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices"
    )
    if jax.device_count() != 8:
        raise SystemExit(f"expected 8 global devices, got {jax.device_count()}")

    import numpy as np
    from jax.experimental import multihost_utils

    from stare_jax.distributed import global_batch_from_process_local, process_batch_rows
    from stare_jax.models import init_model
    from stare_jax.models.sharding import make_mesh
    from stare_jax.rl.stare import StareConfig, init_stare_state
    from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step, place_train_state
    from stare_jax.training.checkpoint import Checkpointer
    from support.rl import TINY_STEP_MODEL, random_train_batch

    model_cfg = TINY_STEP_MODEL
    B, L = 16, 20
    # ln(96) ~ 4.56 < 10: the batch gate is on from step 1; W = 1.5 reweights the selected tokens
    stare_cfg = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=10.0)
    cfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-3), stare=stare_cfg, logprob_chunk_size=8, debug_outputs=True)

    def global_batch(seed):
        return random_train_batch(model_cfg.vocab_size, B, L, seed)

    mesh = make_mesh({"data": 2, "fsdp": 4})
    rows = process_batch_rows(mesh, B)
    out: dict[str, np.ndarray] = {}
    _log(f"mesh {dict(mesh.shape)}; this process feeds rows {rows.tolist()}")

    def device_batch(seed):
        full = global_batch(seed)
        return global_batch_from_process_local({k: v[rows] for k, v in full.items()}, mesh, B)

    model = init_model(model_cfg, seed=0, mesh=mesh)
    graphdef, ts = init_train_state(model, cfg)
    ts = place_train_state(ts, mesh)
    _log("model and train state initialised")
    leaves = jax.tree.leaves(ts.params)
    out["layout/rows"] = rows  # process 0's rows (each process writes its own to rows_<process>.npy)
    out["layout/global_leaves"] = np.asarray(sum(not x.is_fully_addressable for x in leaves))
    out["layout/sharded_leaves"] = np.asarray(sum(not x.sharding.is_fully_replicated for x in leaves))
    out["layout/num_leaves"] = np.asarray(len(leaves))
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    np.save(pathlib.Path(args.out) / f"rows_{jax.process_index()}.npy", rows)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # built by a jitted function, not device_put: in a multi-process run device_put onto a global sharding
    # asserts the value is equal on every process, and init_stare_state's last_entropy is NaN (NaN != NaN)
    ss = jax.jit(lambda: init_stare_state(stare_cfg), out_shardings=rep)()
    step_fn = make_train_step(graphdef, cfg, mesh=mesh, train_state=ts)

    to_replicated = jax.jit(lambda t: t, out_shardings=rep)

    def host(tree):
        """Global arrays (sharded or replicated) -> full NumPy copies on every process (an all-gather onto
        every device, then this process's first copy); the same shapes in 1- and 2-process runs."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), to_replicated(tree))

    def record_params(prefix, params):
        flat, _ = jax.tree_util.tree_flatten_with_path(host(params))
        for path, x in flat:
            out[prefix + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(x)

    def record_step(i, metrics, stare_state):
        m = host({k: v for k, v in metrics.items() if k != "debug/grads"})
        for k, v in m.items():
            out[f"s{i}/{k}"] = np.asarray(v)
        for f in dataclasses.fields(stare_state):
            out[f"s{i}/state/{f.name}"] = np.asarray(host(getattr(stare_state, f.name)))
        _log(
            f"step {i}: loss {float(m['loss']):.6g} entropy {float(m['entropy']):.4f} "
            f"gate_on {float(m['gate_on'])} frac_reweighted {float(m.get('stare/frac_reweighted', -1)):.3f}"
        )

    if args.phase == "train":
        record_params("init/params/", ts.params)
        for i in range(args.steps):
            ts, ss, met = step_fn(ts, device_batch(100 + i), ss)
            record_step(i, met, ss)
            record_params(f"s{i}/params/", ts.params)
        if args.ckpt:
            ck = Checkpointer(args.ckpt, keep=2, every_steps=0, async_save=True)
            ck.save(args.steps, {"train_state": ts, "stare_state": ss}, {"step": args.steps}, force=True)
            ck.close()
            _log(f"saved checkpoint step {args.steps} in {args.ckpt}")
    else:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            {"train_state": ts, "stare_state": ss},
        )
        ck = Checkpointer(args.ckpt, keep=2, every_steps=0, async_save=True, must_exist=True)
        r = ck.restore(abstract_state=abstract)
        ck.close()
        ts, ss = r.state["train_state"], r.state["stare_state"]
        for a, b in zip(jax.tree.leaves(ts), jax.tree.leaves(abstract["train_state"])):
            if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
                raise SystemExit(f"restored leaf sharding {a.sharding} != requested {b.sharding}")
        _log(f"restored checkpoint step {r.step} (train_state.step={int(host(ts.step))})")
        out["restored/step"] = np.asarray(r.step)
        out["restored/train_step"] = np.asarray(host(ts.step))
        record_params("restored/params/", ts.params)
        for f in dataclasses.fields(ss):
            out[f"restored/stare/{f.name}"] = np.asarray(host(getattr(ss, f.name)))
        i = int(r.extra["step"])
        ts, ss, met = step_fn(ts, device_batch(100 + i), ss)
        record_step(i, met, ss)
        record_params(f"s{i}/params/", ts.params)

    if jax.process_index() == 0:
        path = pathlib.Path(args.out) / "result.npz"
        np.savez(path, **out)
        _log(f"wrote {path} ({len(out)} arrays)")
    if args.num_processes > 1:
        multihost_utils.sync_global_devices("stare_jax_multihost_worker_done")
        jax.distributed.shutdown()
    _log("done")


if __name__ == "__main__":
    main()
