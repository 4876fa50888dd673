"""Sort-based reference for STARE's selection (moved here from production): one lax.sort of the flat token array by
(candidate group, surprisal), the numpy-'linear' quantile read off the sorted array, and exact top-k by a sort with the
flat index as the last key. Same sets as stare_jax.rl.stare.select._select_flat; the tests check that."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from stare_jax.rl.stare.select import lerp, mul_div_floor, p_fraction


def _group_quantile(sorted_x, offset, n, q_num: int, q_den: int):
    """numpy-'linear' quantile at q = q_num/q_den of sorted_x[offset:offset+n]; NaN when n == 0."""
    n_m1 = jnp.maximum(n - 1, 0)
    lo, rem = mul_div_floor(q_num, n_m1, q_den)
    hi = jnp.minimum(lo + 1, n_m1)
    t = rem.astype(jnp.float32) / q_den
    size = sorted_x.shape[0]
    a = sorted_x[jnp.clip(offset + lo, 0, size - 1)]
    b = sorted_x[jnp.clip(offset + hi, 0, size - 1)]
    return jnp.where(n > 0, lerp(a, b, t), jnp.nan)


def select_flat_sort(s_N, cand_pos_N, cand_neg_N, *, top_p: float, rule: str, need: tuple[str, ...]):
    """{name: bool_N} for the names in `need`."""
    num, den = p_fraction(top_p)
    size = s_N.shape[0]
    group_N = jnp.where(cand_pos_N, 0, jnp.where(cand_neg_N, 1, 2)).astype(jnp.int32)
    s_N = jnp.where(group_N < 2, s_N, 0.0)  # non-candidates: any finite key (they sort last by group)
    n_pos = jnp.sum(group_N == 0, dtype=jnp.int32)
    n_neg = jnp.sum(group_N == 1, dtype=jnp.int32)
    offsets = {"pos": jnp.int32(0), "neg": n_pos}
    counts = {"pos": n_pos, "neg": n_neg}
    cands = {"pos": cand_pos_N, "neg": cand_neg_N}
    out = {}
    if rule == "quantile":
        _, sorted_s = lax.sort((group_N, s_N), num_keys=2)
        for name in need:
            sign, side = name.split("_")
            if side == "high":
                q = _group_quantile(sorted_s, offsets[sign], counts[sign], den - num, den)
                out[name] = cands[sign] & (s_N >= q)
            else:
                q = _group_quantile(sorted_s, offsets[sign], counts[sign], num, den)
                out[name] = cands[sign] & (s_N <= q)
        return out
    # exact_top_k: k = max(1, ceil(P n)), exactly k per set, ties by lowest flat index.
    iota_N = lax.iota(jnp.int32, size)
    ks = {}
    for sign in ("pos", "neg"):
        fl, rem = mul_div_floor(num, counts[sign], den)
        ks[sign] = jnp.maximum(1, fl + (rem > 0).astype(jnp.int32))
    for side in ("high", "low"):
        names = [nm for nm in need if nm.endswith(side)]
        if not names:
            continue
        key_N = -s_N if side == "high" else s_N
        g_sorted, _, perm = lax.sort((group_N, key_N, iota_N), num_keys=3)
        for name in names:
            sign = name.split("_")[0]
            rank = iota_N - offsets[sign]
            chosen_sorted = (g_sorted == (0 if sign == "pos" else 1)) & (rank < ks[sign])
            out[name] = jnp.zeros((size,), bool).at[perm].set(chosen_sorted)
    return out
