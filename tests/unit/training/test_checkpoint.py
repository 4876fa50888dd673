"""Checkpointer on orbax: whole-state round trip, keep-K, async + wait, resharding restore on the 8 fake CPU
devices, corrupted / mismatched / missing checkpoints, and the SIGTERM flag."""

import dataclasses
import os
import pathlib
import signal
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from stare_jax.training import checkpoint as C


class ControllerState(typing.NamedTuple):
    """Stand-in for the STARE controller state (W, M, gate) as arrays."""

    w: jax.Array
    m: jax.Array
    gate_on: jax.Array


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.fixture(scope="module")
def state():
    """A run-state pytree like the trainer's: sharded params, adam state after one update, controller, keys, step."""
    mesh = _mesh((8,), ("d",))
    rows = NamedSharding(mesh, P("d"))
    params = {
        "embed": jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7, rows),
        "layers": {
            "w": jax.device_put(jnp.linspace(-1, 1, 8 * 4, dtype=jnp.float32).reshape(8, 4), rows),
            "b": jnp.full((4,), 0.25, jnp.bfloat16),
        },
    }
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    _, opt_state = jax.jit(opt.update)(grads, opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "controller": ControllerState(w=jnp.float32(1.1), m=jnp.float32(0.9), gate_on=jnp.bool_(True)),
        "rng_data": jax.random.key_data(jax.random.key(42)),  # raw uint32 key data
        "rng": jax.random.key(7),  # typed key
        "step": jnp.int32(12),
    }


def _assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert y.dtype == x.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_whole_state_with_extra_json(tmp_path, state):
    extra = {"data_iterator": {"next_index": 37, "epoch": 1}, "config": {"name": "arm-a", "lr": 1e-6}}
    with C.Checkpointer(tmp_path / "ckpt", keep=2, every_steps=4, async_save=False) as ck:
        assert ck.latest_step() is None
        assert not ck.save(3, state, extra)  # not a save step
        assert ck.save(4, state, extra)
        assert not ck.save(4, state, extra, force=True)  # already there: no-op
        assert ck.latest_step() == 4
        out = ck.restore(abstract_state=jax.eval_shape(lambda: state))
    assert out.step == 4 and out.extra == extra and out.skipped_corrupt_steps == ()
    _assert_same(state, out.state)
    assert isinstance(out.state["controller"], ControllerState)
    assert type(out.state["opt_state"][0]) is type(state["opt_state"][0])
    # with concrete arrays as the target (their shardings are used)
    with C.Checkpointer(tmp_path / "ckpt", must_exist=True) as ck:
        again = ck.restore(4, abstract_state=state)
    _assert_same(state, again.state)
    assert again.state["params"]["embed"].sharding == state["params"]["embed"].sharding


def test_keep_k_and_interval(tmp_path):
    x = {"a": jnp.arange(4.0)}
    with C.Checkpointer(tmp_path, keep=2, every_steps=2, async_save=False) as ck:
        saved = [s for s in range(1, 9) if ck.save(s, {"a": x["a"] + s}, {"s": s})]
        assert saved == [2, 4, 6, 8]
        assert ck.all_steps() == [6, 8]
        assert ck.save(9, x, force=True) and ck.all_steps() == [8, 9]
        np.testing.assert_array_equal(ck.restore(8, abstract_state=x).state["a"], np.arange(4.0) + 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["8", "9"]


def test_async_save_keeps_old_step_until_new_one_is_complete(tmp_path):
    big = {"w": jnp.arange(256 * 1024, dtype=jnp.float32)}
    with C.Checkpointer(tmp_path, keep=1, every_steps=1, async_save=True) as ck:
        assert ck.save(1, big, {"i": 1})
        ck.wait()
        assert ck.save(2, {"w": big["w"] * 2}, {"i": 2})
        assert (tmp_path / "1").is_dir()  # still there while step 2 may be in flight
        assert not ck.save(2, big, {"i": 3}, force=True)  # e.g. a preemption save right after a periodic one
        assert ck.latest_step() == 2
        ck.wait()
        assert ck.all_steps() == [2]
        out = ck.restore(abstract_state=big)
    assert out.step == 2 and out.extra == {"i": 2}
    np.testing.assert_array_equal(out.state["w"], np.arange(256 * 1024, dtype=np.float32) * 2)


def test_restore_onto_a_different_mesh_and_a_single_device(tmp_path):
    mesh8 = _mesh((8,), ("d",))
    src = {
        "w": jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8), NamedSharding(mesh8, P("d", None))),
        "v": jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh8, P("d"))),
    }
    with C.Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, src, force=True)
        mesh24 = _mesh((2, 4), ("a", "b"))
        targets = {
            "w": NamedSharding(mesh24, P("b", "a")),  # rows over 4, columns over 2: a different partitioning
            "v": NamedSharding(mesh24, P("a")),
        }
        abstract = C.with_shardings(jax.eval_shape(lambda: src), targets)
        out = ck.restore(abstract_state=abstract).state
        for k in src:
            assert out[k].sharding == targets[k]
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(src[k]))
        assert out["w"].addressable_shards[0].data.shape == (4, 4)
        one = SingleDeviceSharding(jax.devices()[3])
        single = C.with_shardings(jax.eval_shape(lambda: src), one)
        out1 = ck.restore(abstract_state=single).state
        for k in src:
            assert out1[k].sharding == one
            np.testing.assert_array_equal(np.asarray(out1[k]), np.asarray(src[k]))


def _corrupt_data_files(step_dir: pathlib.Path) -> int:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    for p in files:
        p.unlink()
    return len(files)


# orbax's failed read can leave a tensorstore callback that fires after its asyncio loop closed
# ("RuntimeError: Event loop is closed", reported by pytest as unraisable): harmless, not ours.
_IGNORE_ORBAX_LOOP_CLOSED = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_IGNORE_ORBAX_LOOP_CLOSED
def test_corrupted_latest_step_error_and_fallback(tmp_path):
    x = {"a": jnp.arange(64.0), "b": {"c": jnp.ones((3, 3), jnp.int32)}}
    with C.Checkpointer(tmp_path, keep=3, every_steps=1, async_save=False) as ck:
        ck.save(1, x, {"it": 1})
        ck.save(2, jax.tree.map(lambda a: a * 2, x), {"it": 2})
    assert _corrupt_data_files(tmp_path / "2") > 0
    ck = C.Checkpointer(tmp_path, keep=3, every_steps=1, async_save=False, must_exist=True)
    with pytest.raises(C.CheckpointCorruptError, match="step 2") as ei:
        ck.restore(abstract_state=x)
    assert ei.value.step == 2 and (tmp_path / "2").is_dir()  # nothing moved without fallback
    out = ck.restore(abstract_state=x, fallback_to_intact=True)
    assert out.step == 1 and out.skipped_corrupt_steps == (2,) and out.extra == {"it": 1}
    _assert_same(x, out.state)
    assert (tmp_path / "corrupt_step_2").is_dir() and ck.all_steps() == [1]
    # training continues from step 1 and saves step 2 again
    assert ck.save(2, x, {"it": 2}) and ck.latest_step() == 2
    ck.close()


@_IGNORE_ORBAX_LOOP_CLOSED
def test_missing_metadata_is_corruption_and_all_corrupt_is_an_error(tmp_path):
    x = {"a": jnp.arange(4.0)}
    with C.Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(5, x, force=True)
    (tmp_path / "5" / "state" / "_METADATA").unlink()
    with C.Checkpointer(tmp_path, async_save=False) as ck:
        with pytest.raises(C.CheckpointCorruptError, match="step 5"):
            ck.restore(abstract_state=x)
        with pytest.raises(C.CheckpointCorruptError, match="every checkpoint"):
            ck.restore(abstract_state=x, fallback_to_intact=True)
    assert (tmp_path / "corrupt_step_5").is_dir()


def test_mismatched_state_is_not_treated_as_corruption(tmp_path):
    with C.Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, {"a": jnp.zeros((4, 2)), "b": jnp.zeros(3)}, force=True)
        with pytest.raises(C.CheckpointMismatchError, match=r"a: saved \(4, 2\) vs requested \(4, 3\)"):
            ck.restore(
                abstract_state={"a": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jnp.zeros(3)},
                fallback_to_intact=True,
            )
        with pytest.raises(C.CheckpointMismatchError, match=r"\['c'\].*\['b'\]"):
            ck.restore(abstract_state={"a": jnp.zeros((4, 2)), "c": jnp.zeros(3)})
        assert ck.all_steps() == [1]


def test_missing_directory_and_empty_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(C.CheckpointNotFoundError, match=str(missing)):
        C.Checkpointer(missing, must_exist=True)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    with C.Checkpointer(tmp_path / "empty") as ck:
        with pytest.raises(C.CheckpointNotFoundError, match="holds no complete checkpoint"):
            ck.restore(abstract_state={"a": jnp.zeros(2)})
        with pytest.raises(ValueError, match=r"extra_json\['bad'\]"):
            ck.save(1, {"a": jnp.zeros(2)}, {"bad": np.arange(2)}, force=True)
        ck.save(1, {"a": jnp.zeros(2)}, force=True)
        with pytest.raises(C.CheckpointNotFoundError, match=r"no checkpoint step 3.*\[1\]"):
            ck.restore(3, abstract_state={"a": jnp.zeros(2)})


def test_sigterm_sets_the_flag_and_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    handler = C.install_preemption_handler()
    try:
        assert not handler.requested and not handler.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the Python-level handler runs at the next bytecode boundary
            if handler.requested:
                break
        assert handler.requested and handler.signum == signal.SIGTERM and handler.should_stop(1)
        assert handler.signal_name == "SIGTERM" and handler.reason() == "preemption signal (SIGTERM)"
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_ctrl_c_sets_the_flag_says_so_once_and_a_second_one_would_end_the_process():
    """SIGINT is handled like SIGTERM (flag + one announced line); after it SIGINT is back to the system default,
    so a second Ctrl-C ends the process at once (that part is run for real in test_train.py)."""
    before = signal.getsignal(signal.SIGINT)
    said = []
    handler = C.install_preemption_handler(announce=said.append)
    try:
        assert signal.getsignal(signal.SIGINT) == handler._handle
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            if handler.requested:
                break
        assert handler.requested and handler.signum == signal.SIGINT and handler.should_stop(3)
        assert handler.signal_name == "SIGINT" and handler.reason() == "interrupted (Ctrl-C)"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        assert len(said) == 1 and "Ctrl-C" in said[0] and "checkpoint" in said[0] and "again" in said[0]
        os.kill(os.getpid(), signal.SIGTERM)  # a later SIGTERM: still stopping, nothing more said
        for _ in range(1000):
            if handler.signum == signal.SIGTERM:
                break
        assert len(said) == 1
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGINT) == before


def test_an_ignored_sigint_stays_ignored_and_install_says_what_still_stops_the_run():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    said = []
    try:
        handler = C.install_preemption_handler(announce=said.append)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert said == [C.SIGINT_IGNORED] and "Ctrl-C will not stop" in said[0] and "SIGTERM" in said[0]
        assert signal.getsignal(signal.SIGTERM) == handler._handle  # SIGTERM still stops it
        handler.uninstall()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    said.clear()
    C.install_preemption_handler(announce=said.append).uninstall()  # SIGINT not ignored: nothing said
    assert said == []


# ------------------------------------------------------------------------------------------------------
# Resume continues exactly: a toy training loop wired like the real one (Checkpointer + MetricsWriter +
# preemption flag), preempted by SIGTERM, then crashed after a checkpoint, then finished; the final state
# and the metrics (timing keys aside) equal an uninterrupted run's.

_DATA_X = np.linspace(-1.0, 1.0, 40 * 8, dtype=np.float32).reshape(40, 8)
_OPT = optax.adam(3e-2)


def _init_state():
    mesh = _mesh((8,), ("d",))
    params = {"w": jax.device_put(jnp.full((8, 4), 0.1, jnp.float32), NamedSharding(mesh, P("d")))}
    return {
        "params": params,
        "opt_state": _OPT.init(params),
        "controller": ControllerState(w=jnp.float32(1.0), m=jnp.float32(1.0), gate_on=jnp.bool_(False)),
        "rng": jax.random.key(0),
        "step": jnp.int32(0),
    }


@jax.jit
def _toy_step(state, x_B):
    rng, sub = jax.random.split(state["rng"])
    noise = jax.random.normal(sub, (4,)) * 0.01

    def loss_fn(params):
        return jnp.mean((x_B @ params["w"] - noise) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = _OPT.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    c = state["controller"]
    gate = loss < 0.01
    controller = ControllerState(w=jnp.where(gate, c.w + 0.01, c.w), m=c.m, gate_on=gate)
    new = {"params": params, "opt_state": opt_state, "controller": controller, "rng": rng, "step": state["step"] + 1}
    return new, {"loss": loss, "gate_on": gate, "stare_w": controller.w}


class _Crash(Exception):
    pass


def _train(run_dir, total, *, resume=False, preempt_at=None, crash_after=None):
    from stare_jax.training import metrics as M

    ck = C.Checkpointer(run_dir / "ckpt", keep=2, every_steps=3, async_save=True, must_exist=resume)
    state, data_pos, start = _init_state(), 0, 0
    if resume:
        restored = ck.restore(abstract_state=jax.eval_shape(_init_state) | {"params": state["params"]})
        state, data_pos, start = restored.state, restored.extra["data"]["pos"], restored.step
        assert int(state["step"]) == start
    writer = M.MetricsWriter(run_dir, tensorboard=False, is_main_process=True, resume_step=start if resume else None)
    handler = C.install_preemption_handler()
    try:
        for step in range(start + 1, total + 1):
            x_B = _DATA_X[data_pos * 4 : data_pos * 4 + 4]
            data_pos += 1
            state, m = _toy_step(state, x_B)
            writer.log(step, {**m, "step_time_s": 0.001 * step * (2 if resume else 1)})
            if step == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)
            extra = {"data": {"pos": data_pos}}
            if handler.should_stop(step):
                ck.save(step, state, extra, force=True)
                return "preempted", step
            ck.save(step, state, extra, force=step == total)
            if step == crash_after:
                raise _Crash(step)
        return "done", state
    finally:
        handler.uninstall()
        ck.close()
        writer.close()


def test_preempt_crash_resume_equals_uninterrupted_run(tmp_path):
    from stare_jax.training import metrics as M

    status, straight = _train(tmp_path / "straight", 10)
    assert status == "done"
    run = tmp_path / "interrupted"
    assert _train(run, 10, preempt_at=5) == ("preempted", 5)
    with pytest.raises(_Crash):
        _train(run, 10, resume=True, crash_after=8)  # checkpoint at 6, metrics logged up to 8
    with C.Checkpointer(run / "ckpt", must_exist=True) as ck:
        assert ck.all_steps() == [5, 6]
    status, resumed = _train(run, 10, resume=True)
    assert status == "done"
    _assert_same(straight, resumed)
    assert [r["step"] for r in M.read_metrics(run)] == list(range(1, 11))
    assert M.canonical_metrics(run) == M.canonical_metrics(tmp_path / "straight")
    with C.Checkpointer(run / "ckpt", must_exist=True) as ck:
        assert ck.all_steps() == [9, 10]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TrainStateLike:
    """Shaped like stare_jax.rl.step.TrainState: nnx.State params/rest, optax chain state, step."""

    params: typing.Any
    rest: typing.Any
    opt_state: typing.Any
    step: jax.Array


def test_nnx_state_and_registered_dataclass_round_trip(tmp_path):
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)  # non-Param state lands in `rest`

    _, params, rest = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    ts = _TrainStateLike(params=params, rest=rest, opt_state=jax.jit(tx.init)(params), step=jnp.int32(3))
    with C.Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(3, {"train_state": ts}, {"step": 3}, force=True)
        out = ck.restore(abstract_state={"train_state": ts})
    assert isinstance(out.state["train_state"], _TrainStateLike)
    assert isinstance(out.state["train_state"].params, nnx.State)
    _assert_same({"train_state": ts}, out.state)
