"""benchmarks/engine_profile.py: the optimized-HLO parse and op classes on a real XLA CPU program, the per-module
aggregation of profiler events, and the analytic matmul FLOPs (by hand)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import engine_profile as ep  # noqa: E402

from stare_jax.models import ModelConfig  # noqa: E402

VOCAB = 1000


def _program(x_BxD, w_DxD, head_DxV, pages_NxD, slot_B, branch):
    """A decode step in miniature: a layer matmul, a k/v write (scatter), attention in a switch, the LM head and
    the sampling reductions over its logits."""
    h_BxD = jnp.tanh(x_BxD @ w_DxD)
    pages_NxD = pages_NxD.at[slot_B].set(h_BxD)
    att_BxD = jax.lax.switch(
        branch, [lambda p: jnp.tanh(h_BxD @ p[:8].T) @ p[:8], lambda p: jnp.tanh(h_BxD @ p[:16].T) @ p[:16]], pages_NxD
    )
    logits_BxV = (h_BxD + att_BxD) @ head_DxV
    return pages_NxD, jnp.argmax(logits_BxV, -1), jax.nn.logsumexp(logits_BxV, -1)


def _ops():
    args = (
        jnp.ones((4, 32)),
        jnp.ones((32, 32)),
        jnp.ones((32, VOCAB)),
        jnp.zeros((64, 32)),
        jnp.arange(4),
        jnp.int32(1),
    )
    return ep.hlo_ops(jax.jit(_program).lower(*args).compile().as_text())


def test_classes_of_a_real_cpu_program():
    ops = _ops()
    classes = ep.classify_ops(ops, VOCAB)
    seen = set(classes.values())
    assert {"lm_head", "layer_matmuls", "attention", "kv_write", "sampling"} <= seen, seen
    heads = [n for n, c in classes.items() if c == "lm_head"]
    assert all(f",{VOCAB}]" in ops[n]["shape"] for n in heads)
    # the conditional itself is a container (its branches' ops count), never a class
    assert all(classes[n] is None for n, op in ops.items() if op["opcode"] == "conditional")
    # every op reading the logits is sampling, none of the layer's own ops is
    for n, op in ops.items():
        if any(o in heads for o in op["operands"]) and classes[n] not in (None, "lm_head"):
            assert classes[n] == "sampling", (n, op["line"])


def test_aggregate_sums_thread_time_per_class_and_wall_per_execution():
    classes = {"m": {"a": "lm_head", "b": "layer_matmuls", "c": None, "d": "layer_matmuls"}}

    def ev(op, ts, dur, run):
        return {"ts": ts, "dur": dur, "args": {"hlo_module": "m", "hlo_op": op, "run_id": run}}

    events = [
        ev("c", 0, 100, "r1"),
        ev("a", 0, 40, "r1"),
        ev("b", 10, 50, "r1"),
        ev("d", 20, 50, "r1"),
        ev("a", 1000, 30, "r2"),
        ev("x", 0, 999, "r2"),
        {"ts": 0, "dur": 5, "args": {"hlo_module": "other", "hlo_op": "a", "run_id": "r3"}},
    ]
    out = ep.aggregate(events, classes)
    assert set(out) == {"m"}
    assert out["m"]["op_s"]["lm_head"] == pytest.approx((40 + 30) / 1e6)
    assert out["m"]["op_s"]["layer_matmuls"] == pytest.approx(100 / 1e6)  # two ops at once: thread time, not wall
    assert out["m"]["op_s"]["attention"] == 0.0
    # r1 spans 0..100, r2 1000..1030; ops the module does not hold are skipped
    assert out["m"]["wall_s"] == pytest.approx((100 + 30) / 1e6)


def test_variants_of_one_program_merge_by_name_and_conflicts_are_counted():
    merged, n = ep.merge_variants(
        [
            {"a": "lm_head", "b": "attention", "w": None},
            {"a": "lm_head", "b": "layer_matmuls", "c": "sampling", "w": "other"},
        ]
    )
    assert merged == {"a": "lm_head", "b": "other", "c": "sampling", "w": None} and n == 2


def test_matmul_flops_per_token_by_hand():
    cfg = ModelConfig(vocab_size=100, hidden_size=8, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=16)
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up/down 3 x 8x16 = 64+32+32+64+384 = 576 weights
    assert ep.matmul_flops_per_token(cfg) == (2 * 576 * 3, 2 * 8 * 100)
