"""stare_jax.rl.rollout_correction against verl's rollout_corr_helper.py (volcengine/verl, decoupled mode),
transcribed to torch below on identical inputs (weights, masks and metrics to 1e-6), and against hand-derived
values on tiny cases; plus the option parsing's errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from stare_jax.rl import rollout_correction as rc

# ------------------------------------------------------------------ verl, transcribed to torch (float64)
SB = 20.0


def t_masked_sum(v, m, axis=None):
    valid = torch.where(m.bool(), v, 0.0) * m
    return valid.sum(axis) if axis is not None else valid.sum()


def t_masked_mean(v, m, axis=None):
    return t_masked_sum(v, m, axis) / ((m.sum(axis) if axis is not None else m.sum()) + 1e-8)


def verl_is_weights(lr, m, level, thr, normalize):
    if level == "token":
        lr_metrics = lr
        w = torch.exp(torch.clamp(lr, -SB, SB))
    else:
        s = t_masked_sum(lr, m, -1).unsqueeze(-1)
        lr_metrics = s
        w = torch.exp(torch.clamp(s, -SB, SB)).expand_as(lr)
    w = w * m
    low = 1.0 / thr
    met = {"rollout_is_mean": t_masked_mean(w, m)}
    if level == "sequence":
        met["rollout_is_max"] = torch.exp(torch.clamp(lr_metrics.max(), max=SB))
        met["rollout_is_min"] = torch.exp(lr_metrics.min())
        met["rollout_is_ratio_fraction_high"] = (lr_metrics > math.log(thr)).double().mean()
        met["rollout_is_ratio_fraction_low"] = (lr_metrics < math.log(low)).double().mean()
    else:
        met["rollout_is_ratio_fraction_high"] = t_masked_mean((w > thr).double(), m)
        met["rollout_is_ratio_fraction_low"] = t_masked_mean((w < low).double(), m)
        met["rollout_is_max"] = w.masked_fill(~m.bool(), float("-inf")).max()
        met["rollout_is_min"] = w.masked_fill(~m.bool(), float("inf")).min()
    c = w.clamp(min=low, max=thr)
    mc = t_masked_mean(c, m)
    met["rollout_is_std"] = torch.sqrt(torch.clamp(t_masked_mean(c.square(), m) - mc.square(), min=0.0))
    met["rollout_is_eff_sample_size"] = 1.0 / t_masked_mean((c / (mc + 1e-8)).square(), m)
    sw = t_masked_mean(w, m, -1)
    met.update(
        rollout_is_seq_mean=sw.mean(),
        rollout_is_seq_max=sw.max(),
        rollout_is_seq_min=sw.min(),
        rollout_is_seq_max_deviation=(sw - 1.0).abs().max(),
        rollout_is_seq_fraction_high=(sw > thr).double().mean(),
        rollout_is_seq_fraction_low=(sw < low).double().mean(),
    )
    w = w.clamp(max=thr)
    if normalize:
        if level == "token":
            mean = t_masked_mean(w, m)
        else:
            seq_mask = (m.sum(-1) > 0).double()
            mean = (t_masked_mean(w, m, -1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            met["rollout_is_batch_norm_factor"] = mean
        else:
            met["rollout_is_batch_norm_factor"] = torch.tensor(1.0)
    return w, met


def verl_rejection(lr, m, options, thresholds):
    s = torch.clamp(lr, -SB, SB)
    k = {"k1": -s, "k2": 0.5 * s**2, "k3": torch.exp(s) - 1.0 - s}
    mb = m.bool()
    combined = torch.ones_like(m)
    met = {}
    for opt, spec in zip(options, thresholds):
        kind = opt[-2:]
        if kind == "k1":
            lo, hi = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
            lo, hi = math.log(float(lo)), math.log(float(hi))
        else:
            lo, hi = None, float(spec)
        if opt.startswith("token"):
            stat = k[kind]
        elif opt.startswith("seq_sum"):
            stat = t_masked_sum(k[kind], m, -1).unsqueeze(-1).expand_as(m)
        elif opt.startswith("seq_mean"):
            stat = t_masked_mean(k[kind], m, -1).unsqueeze(-1).expand_as(m)
        else:
            mx = k[kind].masked_fill(~mb, float("-inf")).max(-1).values
            stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx).unsqueeze(-1).expand_as(m)
        keep = (stat <= hi) & (stat >= lo) if lo is not None else stat <= hi
        keep_f = keep.double()
        combined = combined * keep_f
        seq_valid = (m.sum(-1) > 0).double()
        seq_keep = (~((~keep) & mb)).all(-1).double()
        met[f"rollout_rs_{opt}_masked_fraction"] = t_masked_mean(1 - keep_f, m)
        met[f"rollout_rs_{opt}_seq_masked_fraction"] = ((1.0 - seq_keep) * seq_valid).sum() / seq_valid.sum()
    met["rollout_rs_masked_fraction"] = t_masked_mean(1 - combined, m)
    met["rollout_rs_seq_masked_fraction"] = (~((combined > 0.5) & mb) & mb).any(-1).double().mean()
    return m * combined, met


def verl_offpolicy(old, roll, m):
    mo, mr = t_masked_mean(old, m, -1), t_masked_mean(roll, m, -1)
    lr = old - roll
    d = mr - mo
    return {
        "training_ppl": torch.exp(-mo).mean(),
        "training_log_ppl": (-mo).mean(),
        "kl": t_masked_mean(roll - old, m),
        "k3_kl": t_masked_mean(torch.exp(lr) - lr - 1, m),
        "rollout_ppl": torch.exp(-mr).mean(),
        "rollout_log_ppl": (-mr).mean(),
        "log_ppl_diff": d.mean(),
        "log_ppl_abs_diff": d.abs().mean(),
        "log_ppl_diff_max": d.max(),
        "log_ppl_diff_min": d.min(),
        "ppl_ratio": torch.exp(d).mean(),
        "chi2_token": t_masked_mean(torch.exp(torch.clamp(lr, -SB, SB)).square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * torch.clamp(t_masked_sum(lr, m, -1), -SB, SB)).mean() - 1.0,
    }


# ------------------------------------------------------------------ inputs
def _inputs(seed=0, B=6, T=11, scale=0.3):
    rng = np.random.default_rng(seed)
    roll = np.log(rng.uniform(0.01, 1.0, (B, T)))
    old = roll + rng.normal(0, scale, (B, T))
    lengths = rng.integers(1, T + 1, B)
    lengths[-1] = T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    old[mask == 0] = np.inf  # garbage at padding, as a trainer leaves it: must not leak
    return old, roll, mask


def _close(ours: dict, ref: dict, tol=1e-6):
    for k, v in ref.items():
        np.testing.assert_allclose(float(ours[k]), float(v), rtol=tol, atol=tol, err_msg=k)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, 1.2])
def test_is_weights_match_verl(level, normalize, threshold):
    old, roll, mask = _inputs(scale=0.3 if level == "token" else 0.05)
    lr = np.where(mask > 0, old - roll, 0.0)
    w, met = rc.is_weights(
        jnp.asarray(lr), jnp.asarray(mask), level=level, threshold=threshold, batch_normalize=normalize
    )
    w_ref, met_ref = verl_is_weights(torch.tensor(lr), torch.tensor(mask), level, threshold, normalize)
    np.testing.assert_allclose(np.asarray(w), w_ref.numpy(), rtol=1e-6, atol=1e-9)
    assert set(met) == set(met_ref)
    _close(met, met_ref)


@pytest.mark.parametrize(
    "options,thresholds",
    [
        (["token_k1"], ["0.8_1.25"]),
        (["token_k1"], ["1.5"]),
        (["token_k2"], ["0.02"]),
        (["token_k3"], ["0.01"]),
        (["seq_sum_k1"], ["0.5_2.0"]),
        (["seq_sum_k2"], ["0.1"]),
        (["seq_sum_k3"], ["0.1"]),
        (["seq_mean_k1"], ["0.9_1.1"]),
        (["seq_mean_k2"], ["0.02"]),
        (["seq_mean_k3"], ["0.02"]),
        (["seq_max_k2"], ["0.05"]),
        (["seq_max_k3"], ["0.05"]),
        (["token_k1", "seq_mean_k3"], ["0.7_1.4", "0.03"]),
    ],
)
def test_rejection_mask_matches_verl(options, thresholds):
    old, roll, mask = _inputs(seed=3)
    lr = np.where(mask > 0, old - roll, 0.0)
    spec = ",".join(thresholds)
    parsed = rc.parse_rejection(",".join(options), spec if len(thresholds) > 1 else thresholds[0])
    keep, met = rc.rejection_mask(jnp.asarray(lr), jnp.asarray(mask), parsed)
    keep_ref, met_ref = verl_rejection(torch.tensor(lr), torch.tensor(mask), options, thresholds)
    np.testing.assert_array_equal(np.asarray(keep), keep_ref.numpy())
    assert 0 < float(met["rollout_rs_masked_fraction"]) < 1  # the thresholds above bite on these inputs
    _close(met, met_ref)


def test_offpolicy_metrics_match_verl_and_subsets_split_the_tokens():
    old, roll, mask = _inputs(seed=5)
    ours = rc.offpolicy_metrics(jnp.asarray(old), jnp.asarray(roll), jnp.asarray(mask))
    _close(ours, verl_offpolicy(torch.tensor(old), torch.tensor(roll), torch.tensor(mask)))
    lr = np.where(mask > 0, old - roll, 0.0)
    assert float(ours["max_abs_log_ratio"]) == pytest.approx(np.abs(lr).max())
    selected = (np.random.default_rng(1).uniform(size=mask.shape) < 0.3).astype(np.float64)
    split = rc.offpolicy_metrics(
        jnp.asarray(old), jnp.asarray(roll), jnp.asarray(mask), subsets={"selected": selected, "rest": 1 - selected}
    )
    n_sel, n_rest = (selected * mask).sum(), ((1 - selected) * mask).sum()
    k1 = lambda sub: ((np.where(mask > 0, roll - old, 0)) * sub * mask).sum() / (sub * mask).sum()  # noqa: E731
    assert float(split["selected_kl"]) == pytest.approx(k1(selected), rel=1e-6)
    # the whole-set kl is the token-weighted mix of the two subsets'
    mix = (float(split["selected_kl"]) * n_sel + float(split["rest_kl"]) * n_rest) / (n_sel + n_rest)
    assert float(split["kl"]) == pytest.approx(mix, rel=1e-6)


def test_identical_policies_give_unit_weights_and_zero_divergence():
    _, roll, mask = _inputs(seed=7)
    lr = jnp.zeros_like(jnp.asarray(roll))
    w, _ = rc.is_weights(lr, jnp.asarray(mask), level="sequence", threshold=2.0)
    np.testing.assert_array_equal(np.asarray(w), mask)
    keep, _ = rc.rejection_mask(lr, jnp.asarray(mask), rc.parse_rejection("token_k1,seq_max_k3", "1.01,1e-9"))
    np.testing.assert_array_equal(np.asarray(keep), mask)
    met = rc.offpolicy_metrics(jnp.asarray(roll), jnp.asarray(roll), jnp.asarray(mask))
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "max_abs_log_ratio"):
        assert abs(float(met[k])) < 1e-6, k


def test_weights_carry_no_gradient_and_jit():
    old, roll, mask = _inputs(seed=9)
    lr = jnp.asarray(np.where(mask > 0, old - roll, 0.0))
    g = jax.grad(lambda x: jnp.sum(rc.is_weights(x, jnp.asarray(mask), level="token", threshold=2.0)[0]))(lr)
    assert float(jnp.abs(g).max()) == 0.0
    f = jax.jit(lambda x: rc.rejection_mask(x, jnp.asarray(mask), rc.parse_rejection("seq_sum_k3", 0.1))[0])
    np.testing.assert_array_equal(
        np.asarray(f(lr)),
        np.asarray(rc.rejection_mask(lr, jnp.asarray(mask), rc.parse_rejection("seq_sum_k3", 0.1))[0]),
    )


@pytest.mark.parametrize(
    "rs,thr,msg",
    [
        ("token_k4", 2.0, "unknown option 'token_k4'"),
        ("", 2.0, "at least one option"),
        ("token_k1", None, "rollout_rs_threshold must be set"),
        ("token_k1,token_k2", "1,2,3", "one per option"),
        ("token_k2", "0.1_0.2", "one positive number"),
        ("seq_sum_k1", "-1", "lower_upper"),
    ],
)
def test_bad_options_are_named(rs, thr, msg):
    with pytest.raises(ValueError, match=msg):
        rc.parse_rejection(rs, thr)
    with pytest.raises(ValueError, match="rollout_is"):
        rc.is_weights(jnp.zeros((1, 2)), jnp.ones((1, 2)), level="geometric", threshold=2.0)


def test_the_config_section_takes_verls_names_and_names_bad_values():
    from stare_jax.config.loader import load_config
    from stare_jax.config.options import ConfigError

    sec = "rl.rollout_correction."
    cfg = load_config(
        None,
        [
            sec + "rollout_is=sequence",
            sec + "rollout_rs=token_k1,seq_mean_k3",
            sec + "rollout_rs_threshold=0.5_2.0,0.01",
        ],
    ).rl.rollout_correction
    assert cfg.corrects and cfg.rollout_is_threshold == 2.0
    assert cfg.rejection_options == (
        rc.RejectionOption("token_k1", math.log(0.5), math.log(2.0)),
        rc.RejectionOption("seq_mean_k3", None, 0.01),
    )
    assert not load_config(None, []).rl.rollout_correction.corrects  # off by default
    for bad, msg in (
        [[sec + "rollout_rs=token_k9", sec + "rollout_rs_threshold=2"], "unknown option 'token_k9'"],
        [[sec + "rollout_is=geometric"], "accepted values: 'token', 'sequence'"],
        [[sec + "rollout_rs_threshold=2"], "rollout_rs is null"],
        [[sec + "rollout_is_threshold=0"], "rollout_is_threshold"],
        [[sec + "rollout_is=token", sec + "rollout_is_threshold=1.0"], "must be > 1"],
        [[sec + "rollout_is=token", sec + "rollout_log_probs=false"], "rollout_is is set but .*rollout_log_probs"],
        [[sec + "rollout_rs=token_k2", sec + "rollout_rs_threshold=1", sec + "rollout_log_probs=false"], "rollout_rs"],
        [["rl.stare.surprisal_source=rollout", sec + "rollout_log_probs=false"], "surprisal_source"],
        [["rl.stare.surprisal_source=rollout", "rl.stare.scope=micro_batch"], "scope = 'batch'"],
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, bad)
    # the run keeps the sampler's log-probs by default and hands the section to the step
    from stare_jax.training.setup import train_step_config

    run = load_config(None, ["rl.stare.surprisal_source=rollout"])
    step_cfg = train_step_config(run)
    assert step_cfg.rollout_correction is run.rl.rollout_correction and step_cfg.rollout_correction.rollout_log_probs
    assert step_cfg.stare.surprisal_source == "rollout"
