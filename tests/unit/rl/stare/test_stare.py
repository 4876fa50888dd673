"""STARE selection, token weights, gates and controller vs independent NumPy re-derivations."""

import math
from fractions import Fraction

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from stare_jax.rl.stare import (
    StareConfig,
    StareState,
    init_stare_state,
    selection_sets,
    stare_omega,
    token_weights,
    update_controller,
    validate_stare_options,
)
from support.params import representative

SETS = ("pos_high", "pos_low", "neg_high", "neg_low")
# The variant table of docs/stare.md, written out independently: variant -> {set: "W" | "M"}
TABLE = {
    "O1": {"pos_high": "W"},
    "O2": {"pos_low": "M"},
    "O3": {"neg_low": "W"},
    "O4": {"neg_high": "M"},
    "C1": {"pos_high": "W", "neg_low": "W"},
    "C2": {"pos_high": "W", "neg_high": "M"},
    "C3": {"pos_low": "M", "neg_low": "W"},
    "C4": {"pos_low": "M", "neg_high": "M"},
}


def _batch(seed, B=8, T=37, ties=False):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(0.6, 1.5, size=(B, T)).astype(np.float32)
    if ties:
        lp = np.round(lp, 1).astype(np.float32)
    adv = rng.choice([-1.5, -0.3, 0.0, 0.7, 1.2], size=B).astype(np.float32)
    adv[0], adv[1] = 1.0, -1.0
    lengths = rng.integers(T // 3, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    ent = rng.uniform(0.0, 0.6, size=(B, T)).astype(np.float32)
    return lp, adv, mask, ent


def _np_sets(lp, adv, mask, P_, rule):
    """Reference: flat candidate lists per sign, numpy quantile (linear) or the authors' top-k with ties by position."""
    s = -lp.astype(np.float64).ravel()
    valid = (mask.ravel() > 0) & np.isfinite(s)
    a = np.repeat(adv, lp.shape[1])
    out, thresholds = {}, {}
    for sign, cand in (("pos", valid & (a > 0)), ("neg", valid & (a < 0))):
        idx = np.nonzero(cand)[0]
        for side in ("high", "low"):
            sel = np.zeros(s.shape, bool)
            if idx.size:
                v = s[idx]
                if rule == "quantile":
                    q = np.quantile(v, 1 - P_ if side == "high" else P_)
                    sel[idx[(v >= q) if side == "high" else (v <= q)]] = True
                    thresholds[f"{sign}_{side}"] = q
                else:
                    k = max(1, math.ceil(Fraction(str(P_)) * idx.size))
                    order = np.lexsort((idx, -v if side == "high" else v))
                    sel[idx[order[:k]]] = True
            out[f"{sign}_{side}"] = sel.reshape(lp.shape)
    return out, thresholds, s.reshape(lp.shape)


def _assert_sets_equal(got, ref, thresholds, s, name):
    diff = np.asarray(got) != ref
    if name in thresholds:  # float32 vs float64 threshold: only tokens numerically at the threshold may differ
        assert np.all(np.abs(s[diff] - thresholds[name]) < 1e-5), name
    else:
        assert not diff.any(), name


@pytest.mark.parametrize("P_", [0.1, 0.25, 1.0])
@pytest.mark.parametrize("rule", ["quantile", "exact_top_k"])
def test_selection_sets_match_numpy(P_, rule):
    lp, adv, mask, _ = _batch(1, ties=(rule == "exact_top_k"))
    got = selection_sets(lp, adv, mask, StareConfig(top_p=P_, rule=rule))
    ref, thr, s = _np_sets(lp, adv, mask, P_, rule)
    for name in SETS:
        _assert_sets_equal(got[name], ref[name], thr, s, name)
        n = int(got["n_" + name.split("_")[0]])
        np.testing.assert_allclose(float(got["frac_" + name]), ref[name].sum() / max(n, 1), rtol=1e-6)
    if rule == "exact_top_k":
        n_pos = int(((mask > 0) & (adv[:, None] > 0)).sum())
        assert int(np.asarray(got["pos_high"]).sum()) == max(1, math.ceil(Fraction(str(P_)) * n_pos))


def test_quantile_ties_can_select_more_than_p():
    lp = np.full((2, 10), -1.0, np.float32)
    got = selection_sets(lp, np.array([1.0, 1.0], np.float32), np.ones((2, 10), np.float32), StareConfig(top_p=0.1))
    assert float(got["frac_pos_high"]) == 1.0  # all tied at the threshold
    got = selection_sets(
        lp, np.array([1.0, 1.0], np.float32), np.ones((2, 10), np.float32), StareConfig(top_p=0.1, rule="exact_top_k")
    )
    np.testing.assert_array_equal(np.asarray(got["pos_high"]).ravel(), np.arange(20) < 2)  # ties by position


def _np_omega(lp, adv, mask, variant, W, M, gate_BxT, P_=0.1, rule="quantile"):
    ref, thr, s = _np_sets(lp, adv, mask, P_, rule)
    om = np.ones(lp.shape)
    for name, which in TABLE[variant].items():
        om = np.where(ref[name] & gate_BxT, W if which == "W" else M, om)
    return om, thr, s


@pytest.mark.parametrize("variant", list(TABLE))
def test_each_variant(variant):
    lp, adv, mask, _ = _batch(2)
    got = np.asarray(token_weights(lp, adv, mask, variant=variant, w=1.3, m=0.7, gate="none"))
    ref, _, _ = _np_omega(lp, adv, mask, variant, 1.3, 0.7, np.ones(lp.shape, bool))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert got.dtype == np.float32
    # untouched quadrants stay exactly 1
    assert np.all(got[mask == 0] == 1.0) and np.all(got[adv == 0] == 1.0)


def test_gates():
    lp, adv, mask, ent = _batch(3)
    ones = np.ones(lp.shape)
    kw = dict(variant="C2", w=1.5, m=0.5)
    # batch gate off == all ones (== GRPO-ds); batch on == none
    np.testing.assert_array_equal(np.asarray(token_weights(lp, adv, mask, gate_on=False, **kw)), ones)
    on = np.asarray(token_weights(lp, adv, mask, gate_on=True, **kw))
    np.testing.assert_array_equal(on, np.asarray(token_weights(lp, adv, mask, gate="none", gate_on=False, **kw)))
    np.testing.assert_allclose(on, _np_omega(lp, adv, mask, "C2", 1.5, 0.5, np.ones(lp.shape, bool))[0])
    # traced gate flag / weights under jit
    f = jax.jit(lambda g, w, m: token_weights(lp, adv, mask, variant="C2", w=w, m=m, gate_on=g))
    np.testing.assert_allclose(np.asarray(f(True, 1.5, 0.5)), on)
    np.testing.assert_array_equal(np.asarray(f(False, 1.5, 0.5)), ones)
    # token gate: H[i,t] < 0.3 ; sample gate: per-response mean entropy over valid tokens < 0.3
    tok = np.asarray(token_weights(lp, adv, mask, gate="token", entropy_BxT=ent, gate_on=False, **kw))
    np.testing.assert_allclose(tok, _np_omega(lp, adv, mask, "C2", 1.5, 0.5, ent < 0.3)[0])
    means = np.array([ent[i][mask[i] > 0].mean() for i in range(len(ent))])
    smp = np.asarray(token_weights(lp, adv, mask, gate="sample", entropy_BxT=ent, target_entropy=0.3, **kw))
    np.testing.assert_allclose(
        smp, _np_omega(lp, adv, mask, "C2", 1.5, 0.5, np.broadcast_to((means < 0.3)[:, None], lp.shape))[0]
    )
    for gate in ("sample", "token"):
        with pytest.raises(ValueError, match="entropy_BxT"):
            token_weights(lp, adv, mask, gate=gate)


@pytest.mark.parametrize("rule", ["quantile", "exact_top_k"])
def test_micro_batch_scope(rule):
    lp, adv, mask, _ = _batch(4, B=8, ties=True)
    got = np.asarray(
        token_weights(
            lp, adv, mask, variant="C1", w=1.2, gate="none", rule=rule, scope="micro_batch", micro_batch_size=2
        )
    )
    for g in range(4):
        sl = slice(2 * g, 2 * g + 2)
        ref, thr, s = _np_omega(lp[sl], adv[sl], mask[sl], "C1", 1.2, 0.9, np.ones((2, lp.shape[1]), bool), rule=rule)
        ok = np.isclose(got[sl], ref)
        if rule == "quantile":
            near = np.zeros_like(ok)
            for q in thr.values():
                near |= np.abs(s - q) < 1e-5
            ok |= near
        assert ok.all()
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        token_weights(lp, adv, mask, scope="micro_batch", micro_batch_size=3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        token_weights(lp, adv, mask, scope="micro_batch")


def test_degenerate_inputs_are_defined():
    lp, adv, mask, _ = _batch(5)
    zero = np.zeros_like(mask)
    for a, mk in ((adv, zero), (np.zeros_like(adv), mask)):  # all masked / no candidates
        for rule in ("quantile", "exact_top_k"):
            om = np.asarray(token_weights(lp, a, mk, variant="C2", gate="none", rule=rule))
            np.testing.assert_array_equal(om, 1.0)
            sets = selection_sets(lp, a, mk, StareConfig(rule=rule))
            assert all(float(sets["frac_" + n]) == 0.0 for n in SETS)
    # NaN / -inf log-probs: never candidates, omega finite, the rest selected as if they were masked
    bad = lp.copy()
    bad[0, :3] = np.nan
    bad[1, 0] = -np.inf
    om = np.asarray(token_weights(bad, adv, mask, variant="C2", gate="none"))
    assert np.isfinite(om).all() and np.all(om[0, :3] == 1.0) and om[1, 0] == 1.0
    mask2 = mask.copy()
    mask2[0, :3] = 0
    mask2[1, 0] = 0
    np.testing.assert_array_equal(om, np.asarray(token_weights(lp, adv, mask2, variant="C2", gate="none")))
    # a single candidate is its own top and bottom P
    one = np.zeros_like(mask)
    one[0, 0] = 1
    om = np.asarray(token_weights(lp, adv, one, variant="O1", w=1.4, gate="none"))
    assert om[0, 0] == np.float32(1.4) and (om.ravel()[1:] == 1).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(w=0.9), "'w' = 0.9 is out of range"),
        (dict(m=0.0), "'m' = 0.0"),
        (dict(m=1.2), "'m' = 1.2"),
        (dict(variant="O5"), "variant.*O1"),
        (dict(gate="global"), "gate.*batch"),
        (dict(rule="topk"), "rule.*exact_top_k"),
        (dict(scope="device"), "scope.*micro_batch"),
        (dict(adaptive_timing="later"), "adaptive_timing"),
        (dict(target_entropy=-0.1), "target_entropy"),
        (dict(select_impl="sort"), "select_impl.*jnp_quantile"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(enabled=1), "enabled.*wrong type"),
        (dict(alpha=float("nan")), "alpha.*finite"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_stare_options(**kwargs)
    with pytest.raises(ValueError, match=match):
        StareConfig(**kwargs)


def _np_controller(entropies, w0, m0, tgt=0.3, alpha=0.01, wmax=1.5, mmin=0.5, timing="same_step", adaptive=True):
    w, m, gate, last, out = w0, m0, False, float("nan"), []
    for h in entropies:
        if not np.isfinite(h):
            out.append((gate, w, m))
            continue
        gate = h < tgt
        if adaptive:
            drive = h if timing == "same_step" else last
            sg = 0.0 if not np.isfinite(drive) else float(np.sign(tgt - drive))
            w = min(max(w + alpha * sg, 1.0), wmax)
            m = min(max(m - alpha * sg, mmin), 1.0)
        last = h
        out.append((gate, w, m))
    return out


@pytest.mark.parametrize("timing", ["same_step", "next_step"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_controller_matches_numpy_loop(timing, adaptive):
    rng = np.random.default_rng(6)
    ents = list(rng.uniform(0.1, 0.35, size=60)) + [0.3, float("nan"), 0.05] + [0.01] * 60 + [0.9] * 80
    cfg = StareConfig(w=1.1, m=0.9, adaptive=adaptive, adaptive_timing=timing)
    step = jax.jit(lambda st, h: update_controller(st, h, cfg))
    st = init_stare_state(cfg)
    ref = _np_controller(ents, 1.1, 0.9, timing=timing, adaptive=adaptive)
    for h, (g, w, m) in zip(ents, ref):
        st = step(st, np.float32(h))
        assert bool(st.gate_on) == g
        np.testing.assert_allclose([float(st.w), float(st.m)], [w, m], atol=2e-6)
    if adaptive:  # the long low-entropy run saturates W at W_max and M at M_min, the high run relaxes to 1
        assert float(st.w) == 1.0 and float(st.m) == 1.0


def test_selection_on_sharded_mesh_matches_single_device():
    lp, adv, mask, _ = _batch(7, B=8, T=40)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sh2 = NamedSharding(mesh, P(("data", "fsdp"), None))
    sh1 = NamedSharding(mesh, P(("data", "fsdp")))
    f = jax.jit(lambda a, b, c: token_weights(a, b, c, variant="C2", gate="none", rule="exact_top_k"))
    single = np.asarray(token_weights(lp, adv, mask, variant="C2", gate="none", rule="exact_top_k"))
    sharded = f(jax.device_put(lp, sh2), jax.device_put(adv, sh1), jax.device_put(mask, sh2))
    np.testing.assert_array_equal(np.asarray(sharded), single)
    g = jax.jit(lambda a, b, c: token_weights(a, b, c, variant="C2", gate="none"))
    np.testing.assert_array_equal(
        np.asarray(g(jax.device_put(lp, sh2), jax.device_put(adv, sh1), jax.device_put(mask, sh2))),
        np.asarray(token_weights(lp, adv, mask, variant="C2", gate="none")),
    )


def test_config_defaults_and_accepted_edges():
    cfg = StareConfig()
    assert not cfg.enabled and cfg.select_impl == "bisect" and cfg.micro_batch_size is None
    assert StareConfig(target_entropy=0.0).target_entropy == 0.0  # H_tgt = 0: the batch gate never opens
    assert hash(StareConfig(w=2)) == hash(StareConfig(w=2.0))  # static config of the jitted step


@pytest.mark.parametrize("rule", representative(["quantile", "exact_top_k"]))
def test_bisection_selection_equals_sort_reference(rule):
    from stare_jax.rl.stare.select import _select_flat, candidates
    from support.stare_reference import select_flat_sort

    lp, adv, mask, _ = _batch(8, B=8, T=50, ties=True)
    lp[2, :5] = 0.0  # surprisal -0.0 / +0.0 ties
    lp[3, :4] = -0.0
    lp[4, :3] = np.float32(-1e-30)  # subnormal-ish tiny values
    s, cp, cn = candidates(lp, adv, mask)
    args = (s.reshape(-1), cp.reshape(-1), cn.reshape(-1))
    for P_ in (0.1, 0.37, 1.0):
        b = select_flat_sort(*args, top_p=P_, rule=rule, need=SETS)
        for impl in ("bisect", "jnp_quantile"):
            a = _select_flat(*args, top_p=P_, rule=rule, need=SETS, impl=impl)
            for name in SETS:
                np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=f"{impl} {name} P={P_}")


def _impl_cases():
    """(name, lp, adv, mask): random, heavy ties (bf16-like log-probs), all tied, padding + NaN log-probs, empty
    T- / empty T+, no valid token, a single candidate."""
    lp, adv, mask, _ = _batch(11, B=8, T=48)
    yield "random", lp, adv, mask
    tied = np.round(lp * 4) / 4
    yield "ties", tied.astype(np.float32), adv, mask
    yield "all_tied", np.full_like(lp, -0.5), adv, mask
    bad = lp.copy()
    bad[0, :4], bad[1, 2] = np.nan, -np.inf
    pad = mask.copy()
    pad[:, -9:] = 0
    yield "padding_nan", bad, adv, pad
    yield "no_neg", lp, np.abs(adv) + 0.5, mask
    yield "no_pos", lp, -np.abs(adv) - 0.5, mask
    yield "no_valid", lp, adv, np.zeros_like(mask)
    one = np.zeros_like(mask)
    one[0, 3] = 1
    yield "one", lp, adv, one


@pytest.mark.parametrize("scope", representative(["batch", "micro_batch"]))
def test_jnp_quantile_equals_bisect(scope):
    """select_impl jnp_quantile (jnp.nanquantile, linear) selects exactly the sets of the bisection, and both are
    numpy's linear quantile rule. (exact_top_k bisects whatever select_impl: checked on the mesh below.)"""
    for P_ in (0.1, 0.25, 0.37, 1.0):
        kw = dict(top_p=P_, scope=scope, micro_batch_size=2 if scope == "micro_batch" else None)
        fs = [
            jax.jit(lambda a, b, c, cfg=StareConfig(select_impl=impl, **kw): selection_sets(a, b, c, cfg))
            for impl in ("bisect", "jnp_quantile")
        ]
        for name, lp, adv, mask in _impl_cases():
            a, b = (f(lp, adv, mask) for f in fs)
            for k in SETS:
                np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"{name} {k} P={P_}")
            if scope == "batch":
                ref, thr, s = _np_sets(lp, adv, mask, P_, "quantile")
                for k in SETS:
                    _assert_sets_equal(b[k], ref[k], thr, s, k)


def test_jnp_quantile_exact_on_ties():
    """jnp.nanquantile's linear interpolation lo (1 - w) + hi w of a tie lo == hi can round below it (here to
    6.7389994 for six surprisals tied at 6.739 and q = 0.01), which would empty the low set; numpy's lerp and the
    bisection return the tie itself, and so does select_impl jnp_quantile (clipped to the bracketing values)."""
    lp, adv, mask = np.full((2, 3), -6.739, np.float32), np.ones(2, np.float32), np.ones((2, 3), np.float32)
    for impl in ("bisect", "jnp_quantile"):
        got = selection_sets(lp, adv, mask, StareConfig(top_p=0.01, select_impl=impl), which=("pos_low", "pos_high"))
        assert np.asarray(got["pos_low"]).all() and np.asarray(got["pos_high"]).all(), impl


def test_jnp_quantile_equals_bisect_on_8_device_mesh():
    """The [B, T] arrays sharded over a (2 x 4) mesh inside jit: both implementations give the single-device sets
    (exact_top_k with select_impl jnp_quantile is the bisection too)."""
    assert jax.device_count() >= 8  # tests/conftest.py: 8 fake CPU devices
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sh2, sh1 = NamedSharding(mesh, P(("data", "fsdp"), None)), NamedSharding(mesh, P(("data", "fsdp")))
    cases = list(_impl_cases())

    def sets_fn(cfg, **jit_kw):
        return jax.jit(lambda a, b, c: {k: v for k, v in selection_sets(a, b, c, cfg).items() if k in SETS}, **jit_kw)

    for rule, scope in (("quantile", "batch"), ("quantile", "micro_batch"), ("exact_top_k", "batch")):
        kw = dict(
            variant="C1", rule=rule, scope=scope, top_p=0.2, micro_batch_size=2 if scope == "micro_batch" else None
        )
        single = sets_fn(StareConfig(**kw))
        refs = [single(lp, adv, mask) for _, lp, adv, mask in cases]
        for impl in ("bisect", "jnp_quantile"):
            f = sets_fn(StareConfig(select_impl=impl, **kw), out_shardings=sh2)
            for (name, lp, adv, mask), ref in zip(cases, refs):
                got = f(jax.device_put(lp, sh2), jax.device_put(adv, sh1), jax.device_put(mask, sh2))
                for k in SETS:
                    assert got[k].sharding.is_equivalent_to(sh2, 2)
                    np.testing.assert_array_equal(
                        np.asarray(got[k]), np.asarray(ref[k]), err_msg=f"{name} {rule} {scope} {impl} {k}"
                    )


def test_stare_omega_follows_config_and_state():
    lp, adv, mask, _ = _batch(12)
    cfg = StareConfig(enabled=True, variant="C2", gate="batch")
    st = StareState(gate_on=np.bool_(True), w=np.float32(1.3), m=np.float32(0.6), last_entropy=np.float32(0.1))
    om, info = stare_omega(lp, adv, mask, st, cfg)
    np.testing.assert_array_equal(
        np.asarray(om), np.asarray(token_weights(lp, adv, mask, variant="C2", w=1.3, m=0.6, gate_on=True))
    )
    assert set(info["sets"]) == {"pos_high", "neg_high"} and float(info["metrics"]["frac_reweighted"]) > 0
    off, info = stare_omega(lp, adv, mask, st, StareConfig(variant="C2"), extra_sets=("pos_high",))
    np.testing.assert_array_equal(np.asarray(off), 1.0)  # disabled: GRPO(-ds), the sets still reported
    assert "pos_high" in info["sets"]


def test_first_step_nan_entropy_leaves_gate_off():
    """Decision: no measured entropy => gate off (that step is exactly GRPO); the authors' controller would start on."""
    cfg = StareConfig(enabled=True, target_entropy=0.3, adaptive=True)
    st0 = init_stare_state(cfg)
    st = update_controller(st0, np.float32(np.nan), cfg)
    assert not bool(st.gate_on) and float(st.w) == np.float32(1.1) and float(st.m) == np.float32(0.9)
    assert np.isnan(float(st.last_entropy))
    lp, adv, mask, _ = _batch(13)
    om, _ = stare_omega(lp, adv, mask, st, cfg)
    np.testing.assert_array_equal(np.asarray(om), 1.0)
    st = update_controller(st, np.float32(0.2), cfg)  # the first finite entropy sets the gate
    assert bool(st.gate_on) and float(st.w) == pytest.approx(1.11)


@pytest.mark.parametrize("timing", ["same_step", "next_step"])
def test_adaptive_alpha_zero_keeps_initial_weights(timing):
    """Decision: alpha = 0 recovers the fixed weights (paper, authors): W_0 above W_max is not clipped; alpha > 0
    clips it into [1, W_max] at once."""
    kw = dict(enabled=True, w=4.0, m=0.3, w_max=1.5, m_min=0.5, adaptive=True, adaptive_timing=timing)
    fixed, moving = StareConfig(alpha=0.0, **kw), StareConfig(alpha=0.01, **kw)
    st_f, st_m = init_stare_state(fixed), init_stare_state(moving)
    for h in (0.1, 0.9, 0.1):
        st_f, st_m = update_controller(st_f, np.float32(h), fixed), update_controller(st_m, np.float32(h), moving)
        assert (float(st_f.w), float(st_f.m)) == (4.0, np.float32(0.3))
        assert 1.0 <= float(st_m.w) <= 1.5 and 0.5 <= float(st_m.m) <= 1.0
