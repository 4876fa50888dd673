"""Terms beside the policy loss (entropy bonus, KL estimators / loss / reward penalty, the 80/20 token filter) and
the advantage shapers (W-REINF, EntroAdv, Dr.GRPO) vs NumPy re-derivations and verl's / TRL's formulas in torch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stare_jax.rl.advantages import entropy_advantage, grpo_advantages, w_reinforce_advantages
from stare_jax.rl.loss_terms import (
    KL_ESTIMATORS,
    entropy_bonus,
    high_entropy_mask,
    kl_loss,
    kl_penalty,
    kl_reward_penalty,
)
from stare_jax.rl.losses import AGG_MODES, compute_policy_loss, policy_loss
from support.rl import np_agg

B, T = 8, 16


def _batch(seed, b=B, t=T):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(1.0, 1.0, size=(b, t))
    ref = lp + rng.choice([-25.0, -3.0, -0.5, 0.0, 0.2, 1.0, 25.0], size=(b, t))  # hits every clamp
    ent = rng.gamma(1.0, 0.5, size=(b, t))
    lengths = rng.integers(2, t + 1, size=b)
    lengths[2] = 0
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    ent = np.where(mask > 0, ent, 99.0)  # padding garbage: must never be selected or counted
    return [x.astype(np.float32) for x in (lp, ref, ent, mask)]


def _t_agg(mat, m, mode):  # verl agg_loss without global_batch_info
    if mode == "token-mean":
        return (mat * m).sum() / m.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        cnt = m.sum(-1)
        seq = (mat * m).sum(-1) / ((cnt + 1e-8) if mode == "seq-mean-token-mean" else 1.0)
        has = (cnt > 0).float()
        return (seq * has).sum() / has.sum()
    return (mat * m).sum(-1).sum() / m.shape[-1]


def _t_kl(lp, ref, kind):  # verl kl_penalty_forward
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref).square()
    kl = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def _np_kl(lp, ref, kind):
    d = lp.astype(np.float64) - ref
    return {"kl": d, "k1": d, "abs": np.abs(d), "mse": d * d / 2, "k2": d * d / 2}.get(
        kind, np.clip(np.exp(np.clip(-d, -20, 20)) - np.clip(-d, -20, 20) - 1, -10, 10)
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_entropy_bonus_matches_numpy_and_verl(mode):
    _, _, ent, mask = _batch(0)
    term, h = entropy_bonus(ent, mask, 0.003, loss_agg_mode=mode)
    np.testing.assert_allclose(float(h), np_agg(ent.astype(np.float64), mask, mode), rtol=1e-5)
    x = torch.tensor(ent, requires_grad=True)
    want = -0.003 * _t_agg(x, torch.tensor(mask), mode)
    want.backward()
    np.testing.assert_allclose(float(term), float(want.detach()), rtol=1e-5)
    g = jax.grad(lambda e: entropy_bonus(e, mask, 0.003, loss_agg_mode=mode)[0])(ent)
    np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_kl_penalty_matches_numpy_and_verl(kind):
    lp, ref, _, _ = _batch(1)
    got = kl_penalty(lp, ref, kind)
    np.testing.assert_allclose(np.asarray(got), _np_kl(lp, ref, kind), rtol=1e-5, atol=1e-6)
    x = torch.tensor(lp, requires_grad=True)
    _t_kl(x, torch.tensor(ref), kind).sum().backward()
    g = jax.grad(lambda a: jnp.sum(kl_penalty(a, ref, kind)))(lp)
    np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_loss_matches_verl(kind, mode):
    lp, ref, _, mask = _batch(2)
    term, kl_agg = kl_loss(lp, ref, mask, 0.001, kind=kind, loss_agg_mode=mode)
    x = torch.tensor(lp, requires_grad=True)
    tk = _t_agg(_t_kl(x, torch.tensor(ref), kind), torch.tensor(mask), mode)
    (0.001 * tk).backward()
    np.testing.assert_allclose(float(kl_agg), float(tk.detach()), rtol=1e-5)
    np.testing.assert_allclose(float(term), 0.001 * float(tk.detach()), rtol=1e-5)
    g = jax.grad(lambda a: kl_loss(a, ref, mask, 0.001, kind=kind, loss_agg_mode=mode)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=1e-4, atol=1e-9)


def test_kl_reward_penalty_matches_numpy():
    lp, ref, _, mask = _batch(3)
    scores = np.zeros_like(lp)
    scores[np.arange(B), np.maximum(mask.sum(1).astype(int) - 1, 0)] = 1.0
    rewards, cur = kl_reward_penalty(scores, lp, ref, mask, 0.05, kind="kl")
    kld = _np_kl(lp, ref, "kl") * mask
    np.testing.assert_allclose(np.asarray(rewards), scores - 0.05 * kld, rtol=1e-5, atol=1e-6)
    per_seq = kld.sum(1) / np.maximum(mask.sum(1), 1)
    np.testing.assert_allclose(float(cur), per_seq.mean(), rtol=1e-5)


def _trl_high_entropy_mask(ent, mask, rho):
    """TRL's top_entropy_quantile: quantile of the non-pad entropies at 1 - rho, keep entropy >= it."""
    e, m = torch.tensor(ent, dtype=torch.float64), torch.tensor(mask) > 0
    thr = torch.quantile(e[m], 1 - rho)
    return ((e >= thr) & m).numpy()


@pytest.mark.parametrize("rho", [0.2, 0.05, 0.5, 1.0])
def test_high_entropy_mask_matches_trl_quantile(rho):
    _, _, ent, mask = _batch(4)
    got = np.asarray(high_entropy_mask(ent, mask, rho))
    want = _trl_high_entropy_mask(ent, mask, rho)
    np.testing.assert_array_equal(got, want)
    assert not got[mask == 0].any()
    n = int(mask.sum())
    assert got.sum() >= np.ceil(rho * n) - 1


def test_high_entropy_mask_exact_top_k_and_ties():
    ent = np.array([[0.5, 0.5, 0.5, 0.5, 0.1], [0.5, 0.2, 0.3, 9.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float32)
    sel = np.asarray(high_entropy_mask(ent, mask, 0.2, rule="exact_top_k"))  # k = ceil(0.2 * 8) = 2
    assert sel.sum() == 2 and sel[0, 0] and sel[0, 1]  # ties by lowest flat index; the 9.0 is padding
    assert np.asarray(high_entropy_mask(ent, mask, 0.2)).sum() == 5  # quantile: every tie at 0.5 is kept


def test_high_entropy_mask_sharded_equals_single_device():
    _, _, ent, mask = _batch(5, b=16, t=32)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sh = NamedSharding(mesh, P("data"))
    f = jax.jit(lambda e, m: high_entropy_mask(e, m, 0.2))
    single = np.asarray(f(ent, mask))
    sharded = f(jax.device_put(ent, sh), jax.device_put(mask, sh))
    assert sharded.sharding.num_devices == 8
    np.testing.assert_array_equal(np.asarray(sharded), single)


def test_filtered_loss_has_gradient_only_on_selected_tokens():
    lp, _, ent, mask = _batch(6)
    adv = np.linspace(-1, 1, B).astype(np.float32)
    keep = high_entropy_mask(ent, mask, 0.2)
    g = jax.grad(lambda x: policy_loss(x, lp, adv, mask, omega_BxT=keep.astype(jnp.float32))[0])(lp)
    g = np.asarray(g)
    assert (g[~np.asarray(keep)] == 0).all() and (g[np.asarray(keep) & (adv[:, None] != 0)] != 0).all()
    # the normaliser stays the count of every valid token: -A / N on the kept tokens (on-policy)
    np.testing.assert_allclose(
        g[np.asarray(keep)], (-adv[:, None] / mask.sum() * np.ones_like(lp))[np.asarray(keep)], rtol=1e-5
    )


def test_w_reinforce_advantages_and_gradient():
    correct = np.array([1, 0, 1, 0], np.int32)
    adv = w_reinforce_advantages(correct, lam=0.1)
    np.testing.assert_allclose(np.asarray(adv), [0.1, -1.0, 0.1, -1.0])
    lp = -np.ones((4, 3), np.float32)
    mask = np.ones((4, 3), np.float32)
    g = jax.grad(lambda x: compute_policy_loss("gpg", lp, x, adv, mask, loss_agg_mode="token-mean")[0])(lp)
    np.testing.assert_allclose(np.asarray(g), -np.asarray(adv)[:, None] / 12 * mask, rtol=1e-6)
    with pytest.raises(ValueError, match="lambda"):
        w_reinforce_advantages(correct, lam=-1.0)


def test_entropy_advantage_matches_numpy():
    _, _, ent, mask = _batch(7)
    adv = np.array([1.0, -1.0, 0.5, -0.2, 2.0, 0.0, -3.0, 0.1], np.float32)
    got = np.asarray(entropy_advantage(adv, ent, mask, alpha=0.4, kappa=2.0))
    a = adv[:, None].astype(np.float64) * np.ones_like(ent)
    want = np.where(mask > 0, a + np.minimum(0.4 * ent, np.abs(a) / 2.0), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (got[(mask > 0) & (a < 0)] < 0).all()  # the clip never flips a negative advantage
    assert not np.asarray(jax.grad(lambda e: jnp.sum(entropy_advantage(adv, e, mask)))(ent)).any()


def test_dr_grpo_is_no_std_plus_seq_mean_token_sum_norm():
    """Dr.GRPO (Liu et al. 2025) = A_i = r_i - mean_group(r) and sum over all tokens / a fixed constant (the
    max response length): rl.norm_adv_by_std=false + rl.loss_agg=seq-mean-token-sum-norm."""
    rng = np.random.default_rng(8)
    rewards = rng.integers(0, 2, (2, 4)).astype(np.float32)
    adv = np.asarray(grpo_advantages(rewards, norm_by_std=False)).reshape(-1)
    lp = -rng.gamma(1.0, 1.0, (8, 10)).astype(np.float32)
    old = lp - np.log(rng.choice([0.9, 1.0, 1.1], (8, 10))).astype(np.float32)
    mask = (np.arange(10)[None] < rng.integers(1, 11, 8)[:, None]).astype(np.float32)
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", normalizer=30.0)
    a = (rewards - rewards.mean(1, keepdims=True)).reshape(-1)[:, None].astype(np.float64)
    r = np.exp(lp.astype(np.float64) - old)
    tok = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
    np.testing.assert_allclose(float(loss), (tok * mask).sum() / 30.0, rtol=1e-5)
