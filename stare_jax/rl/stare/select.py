"""STARE selection sets: the top / bottom P of surprisal within T+ and T- (docs/stare.md, "Entropy-critical
tokens: top-P% surprisal").

- Candidates: T+ = {mask, A > 0}, T- = {mask, A < 0} (strict); tokens whose log-prob is not finite are never
  candidates (they keep omega = 1, so a NaN log-prob never turns into a NaN weight).
- Surprisal s = -stop_gradient(logprob). Rule "quantile" (default, the paper): high set s >= quantile(s_cand, 1 - P),
  low set s <= quantile(s_cand, P), numpy's "linear" quantile; ties at the threshold can select more than P (see the
  realised fractions). Rule "exact_top_k" (the authors' code): k = max(1, ceil(P n)), ties broken by position (lowest
  flat index first), so exactly k are chosen. An empty candidate set selects nothing.
- Scope "batch": one selection over the whole (possibly sharded) [B, T] array; "micro_batch": each consecutive group
  of cfg.micro_batch_size sequences is ranked on its own (independent of the mesh).
- cfg.select_impl, for the quantile rule: "bisect" finds the two order statistics around the quantile index by
  bisection on the 32-bit float keys (32 rounds of a masked count: elementwise work and a reduction, no sort, so it
  shards like any reduction); P is used as the nearest fraction with denominator <= 10^4 so the index is exact
  integer arithmetic at any token count. "jnp_quantile" calls jnp.nanquantile over the candidates (NaN elsewhere)
  on the sharded array: one sort, and jnp's index arithmetic in float32 (exact while q (n - 1) is, i.e. for n up to
  a few million candidates; beyond that the neighbouring order statistic can be picked, which changes at most the
  tokens tied at the threshold). exact_top_k always uses the bisection (jnp.quantile has no position tie-break).
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
from jax import lax

from stare_jax.config.stare import SET_NAMES, StareConfig

_P_MAX_DENOMINATOR = 10_000
_UMAX = 0xFFFFFFFF


def p_fraction(top_p: float) -> tuple[int, int]:
    """P as (numerator, denominator), the nearest fraction with denominator <= 10^4."""
    frac = Fraction(float(top_p)).limit_denominator(_P_MAX_DENOMINATOR)
    return frac.numerator, frac.denominator


def mul_div_floor(a: int, n, den: int):
    """floor(a * n / den) and (a * n) mod den in int32 without overflow (a <= den <= 10^4, n < 2^31)."""
    q, r = n // den, n % den
    prod = a * r  # < den^2 <= 1e8
    return a * q + prod // den, prod % den


def lerp(a, b, t):
    """numpy's _lerp (used by np.quantile 'linear'): symmetric form for t >= 0.5, exact when a == b."""
    diff = b - a
    return jnp.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)


def _sortable_key(x_N):
    """float32 -> uint32 with the same order (-0.0 mapped to +0.0 first, so they tie as floats do)."""
    x_N = jnp.where(x_N == 0, jnp.float32(0.0), x_N.astype(jnp.float32))
    b = lax.bitcast_convert_type(x_N, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _from_key(k):
    b = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return lax.bitcast_convert_type(b, jnp.float32)


def _order_stat_keys(key_N, group_N, gid_K, rank_K):
    """Key of the rank_K-th smallest (0-indexed) element of group gid_K, for K targets at once, by bisection on the
    32-bit key space: 32 rounds of a masked count (elementwise + one reduction each; no sort, shards cleanly)."""

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        inside = (group_N[None, :] == gid_K[:, None]) & (key_N[None, :] <= mid[:, None])
        ok = jnp.sum(inside, axis=1, dtype=jnp.int32) >= rank_K + 1
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    K = gid_K.shape[0]
    lo, _ = lax.fori_loop(0, 32, body, (jnp.zeros((K,), jnp.uint32), jnp.full((K,), _UMAX, jnp.uint32)))
    return lo


def _kth_true_index(flag_N, m):
    """Flat index of the m-th (1-based) True of flag_N (-1 when m <= 0), by bisection over the index range with
    masked counts: the tie-break "lowest position first" without a sort or a cumsum over the sharded array."""
    size = flag_N.shape[0]
    iota_N = lax.iota(jnp.int32, size)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(flag_N & (iota_N <= mid), dtype=jnp.int32) >= m
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = lax.fori_loop(0, max(size, 1).bit_length() + 1, body, (jnp.int32(0), jnp.int32(size - 1)))
    return jnp.where(m > 0, lo, -1)


def _thresholds_bisect(s_N, cands, counts, names, num, den):
    """numpy-'linear' quantile of each named set's candidates from its two bracketing order statistics."""
    gids = {"pos": 0, "neg": 1}
    group_N = jnp.where(cands["pos"], 0, jnp.where(cands["neg"], 1, 2)).astype(jnp.int32)
    key_N = _sortable_key(s_N)
    ranks, fracs = [], []
    for name in names:
        sign, side = name.split("_")
        lo, rem = mul_div_floor(den - num if side == "high" else num, jnp.maximum(counts[sign] - 1, 0), den)
        ranks.append(lo)
        fracs.append(rem.astype(jnp.float32) / den)
    rank_K = jnp.stack(ranks)
    gid_K = jnp.array([gids[nm.split("_")[0]] for nm in names], jnp.int32)
    klo_K = _order_stat_keys(key_N, group_N, gid_K, rank_K)
    # the next order statistic: the same key if it repeats, else the smallest key above it
    in_grp_KxN = group_N[None, :] == gid_K[:, None]
    n_le_K = jnp.sum(in_grp_KxN & (key_N[None, :] <= klo_K[:, None]), axis=1, dtype=jnp.int32)
    above_K = jnp.min(
        jnp.where(in_grp_KxN & (key_N[None, :] > klo_K[:, None]), key_N[None, :], jnp.uint32(_UMAX)), axis=1
    )
    n_K = jnp.stack([counts[nm.split("_")[0]] for nm in names])
    khi_K = jnp.where((rank_K + 1 <= n_K - 1) & (n_le_K < rank_K + 2), above_K, klo_K)
    x_lo, x_hi = _from_key(klo_K), _from_key(khi_K)
    return [jnp.where(n_K[i] > 0, lerp(x_lo[i], x_hi[i], fracs[i]), jnp.nan) for i in range(len(names))]


def _thresholds_jnp_quantile(s_N, cands, counts, names, num, den):
    """The same thresholds by jnp.nanquantile (the design card's formulation): candidates of each sign as one row,
    NaN elsewhere, one call per method on the [signs, N] array. jnp's linear method interpolates as
    lo (1 - w) + hi w, which can land an ulp outside [lo, hi] (also when lo == hi, i.e. on ties); numpy's and torch's
    lerp cannot, so the result is clipped to the 'lower'/'higher' order statistics of the same call."""
    signs = sorted({nm.split("_")[0] for nm in names})
    x_SxN = jnp.stack([jnp.where(cands[sg], s_N, jnp.nan) for sg in signs])
    q_Q = jnp.array([(den - num) / den if nm.endswith("high") else num / den for nm in names], jnp.float32)
    lin, lo, hi = (jnp.nanquantile(x_SxN, q_Q, axis=1, method=mth) for mth in ("linear", "lower", "higher"))
    thr_QxS = jnp.clip(lin, lo, hi)  # all-NaN rows (empty sets) stay NaN: nothing compares true
    return [thr_QxS[i, signs.index(nm.split("_")[0])] for i, nm in enumerate(names)]


def _select_flat(s_N, cand_pos_N, cand_neg_N, *, top_p: float, rule: str, need: tuple[str, ...], impl: str = "bisect"):
    """{name: bool_N} for the set names in `need`, over one flat token array."""
    num, den = p_fraction(top_p)
    cands = {"pos": cand_pos_N, "neg": cand_neg_N}
    counts = {sg: jnp.sum(c, dtype=jnp.int32) for sg, c in cands.items()}
    names = list(need)
    if not names:
        return {}
    out = {}
    if rule == "quantile":
        find = _thresholds_jnp_quantile if impl == "jnp_quantile" else _thresholds_bisect
        for name, q in zip(names, find(s_N, cands, counts, names, num, den)):
            sign, side = name.split("_")
            out[name] = cands[sign] & ((s_N >= q) if side == "high" else (s_N <= q))
        return out
    # exact_top_k: the k-th largest (high) / smallest (low) value v; take every s strictly beyond v, then the
    # first (k - that count) tokens equal to v in flat order (ties by lowest index).
    group_N = jnp.where(cand_pos_N, 0, jnp.where(cand_neg_N, 1, 2)).astype(jnp.int32)
    key_N = _sortable_key(s_N)
    ks = {}
    for sign in ("pos", "neg"):
        fl, rem = mul_div_floor(num, counts[sign], den)
        ks[sign] = jnp.maximum(1, fl + (rem > 0).astype(jnp.int32))
    ranks = []
    for name in names:
        sign, side = name.split("_")
        k = jnp.minimum(ks[sign], counts[sign])
        ranks.append(jnp.maximum(counts[sign] - k, 0) if side == "high" else jnp.maximum(k - 1, 0))
    gid_K = jnp.array([0 if nm.startswith("pos") else 1 for nm in names], jnp.int32)
    kv_K = _order_stat_keys(key_N, group_N, gid_K, jnp.stack(ranks))
    for i, name in enumerate(names):
        sign, side = name.split("_")
        c = cands[sign]
        beyond = c & ((key_N > kv_K[i]) if side == "high" else (key_N < kv_K[i]))
        tie = c & (key_N == kv_K[i])
        last = _kth_true_index(tie, ks[sign] - jnp.sum(beyond, dtype=jnp.int32))
        out[name] = (beyond | (tie & (lax.iota(jnp.int32, tie.shape[0]) <= last))) & (counts[sign] > 0)
    return out


def top_k_mask(values_N, flag_N, k):
    """bool_N: the min(k, count) flagged elements with the largest values (k a traced or static int), ties at the
    k-th value broken by lowest flat index, so exactly that many are chosen. The same order-statistic bisection as
    the exact_top_k rule (masked counts over the 32-bit keys, no sort): used by the clip_cov / kl_cov selections
    of stare_jax.rl.losses. NaN values are never chosen (flag them out first)."""
    flag_N = flag_N & ~jnp.isnan(values_N)
    key_N = _sortable_key(values_N)
    count = jnp.sum(flag_N, dtype=jnp.int32)
    k = jnp.clip(jnp.asarray(k, jnp.int32), 0, count)
    group_N = jnp.where(flag_N, 0, 1).astype(jnp.int32)
    kv = _order_stat_keys(key_N, group_N, jnp.zeros((1,), jnp.int32), jnp.maximum(count - k, 0)[None])[0]
    beyond = flag_N & (key_N > kv)
    tie = flag_N & (key_N == kv)
    last = _kth_true_index(tie, k - jnp.sum(beyond, dtype=jnp.int32))
    return (beyond | (tie & (lax.iota(jnp.int32, tie.shape[0]) <= last))) & (k > 0)


def top_fraction_mask(values_BxT, flag_BxT, fraction: float, *, rule: str = "quantile"):
    """bool [B, T]: the top `fraction` of the flagged, finite values over the whole (possibly sharded) array, by
    the same rules as STARE's high sets: "quantile" keeps v >= numpy-'linear' quantile(v, 1 - fraction) (ties at
    the threshold may keep more), "exact_top_k" keeps max(1, ceil(fraction n)) (ties by lowest flat index).
    Bisection on the float keys, no sort (the 80/20 token filter of stare_jax.rl.loss_terms)."""
    v = jnp.asarray(values_BxT, jnp.float32)
    flag = (jnp.asarray(flag_BxT) > 0) & jnp.isfinite(v)
    sel = _select_flat(
        jnp.where(flag, v, 0.0).reshape(-1),
        flag.reshape(-1),
        jnp.zeros(flag.size, bool),
        top_p=fraction,
        rule=rule,
        need=("pos_high",),
    )
    return sel["pos_high"].reshape(v.shape)


def candidates(logprobs_BxT, advantages_B, mask_BxT):
    """(surprisal [B, T] (0 off the valid tokens), T+ mask, T- mask), all stop-gradient."""
    lp = lax.stop_gradient(jnp.asarray(logprobs_BxT, jnp.float32))
    adv_B = lax.stop_gradient(jnp.asarray(advantages_B, jnp.float32))
    if lp.ndim != 2:
        raise ValueError(f"logprobs_BxT must be 2-D [batch, time], got shape {lp.shape}")
    if adv_B.shape != lp.shape[:1]:
        raise ValueError(f"advantages_B must have shape {lp.shape[:1]}, got {adv_B.shape}")
    if jnp.shape(mask_BxT) != lp.shape:
        raise ValueError(f"mask_BxT must have shape {lp.shape}, got {jnp.shape(mask_BxT)}")
    valid = (jnp.asarray(mask_BxT) > 0) & jnp.isfinite(lp)
    s = jnp.where(valid, -lp, 0.0)
    return s, valid & (adv_B[:, None] > 0), valid & (adv_B[:, None] < 0)


def select(logprobs_BxT, advantages_B, mask_BxT, cfg: StareConfig, *, need: tuple[str, ...], scope: str | None = None):
    """({name: bool [B, T]} for the names in `need`, T+ mask, T- mask); scope overrides cfg.scope."""
    for name in need:
        if name not in SET_NAMES:
            raise ValueError(f"selection set {name!r} unknown; accepted: {list(SET_NAMES)}")
    scope = cfg.scope if scope is None else scope
    s, cand_pos, cand_neg = candidates(logprobs_BxT, advantages_B, mask_BxT)
    B, T = s.shape

    def fn(a, b, c):
        return _select_flat(a, b, c, top_p=cfg.top_p, rule=cfg.rule, need=tuple(need), impl=cfg.select_impl)

    if scope == "batch":
        sets = fn(s.reshape(-1), cand_pos.reshape(-1), cand_neg.reshape(-1))
    elif scope == "micro_batch":
        g = cfg.micro_batch_size
        if g is None:
            raise ValueError("STARE scope='micro_batch' needs micro_batch_size >= 1 (sequences per selection group)")
        if B % g:
            raise ValueError(f"scope='micro_batch': batch size {B} is not a multiple of micro_batch_size={g}")
        sets = jax.vmap(fn)(s.reshape(B // g, g * T), cand_pos.reshape(B // g, g * T), cand_neg.reshape(B // g, g * T))
    else:
        raise ValueError(f"STARE scope={scope!r} is not supported; accepted values: ['batch', 'micro_batch']")
    return {k: v.reshape(B, T) for k, v in sets.items()}, cand_pos, cand_neg


def selection_sets(
    logprobs_BxT,
    advantages_B,
    mask_BxT,
    cfg: StareConfig,
    *,
    which: tuple[str, ...] = SET_NAMES,
    scope: str | None = None,
) -> dict:
    """Boolean selection sets {pos_high, pos_low, neg_high, neg_low} [B, T] (those in `which`) under cfg's top_p,
    rule, scope and select_impl, and metrics: n_pos / n_neg (candidate counts) and frac_<set> = |set| / |candidates|
    (0 when there are no candidates). Independent of cfg.enabled and of the gate."""
    sets, cand_pos, cand_neg = select(logprobs_BxT, advantages_B, mask_BxT, cfg, need=tuple(which), scope=scope)
    out = dict(sets)
    out["n_pos"], out["n_neg"] = jnp.sum(cand_pos, dtype=jnp.int32), jnp.sum(cand_neg, dtype=jnp.int32)
    out.update(set_fractions(sets, out["n_pos"], out["n_neg"]))
    return out


def set_fractions(sets: dict, n_pos, n_neg) -> dict:
    """frac_<set> = |set| / |its candidates| (0 when there are none)."""
    n = {"pos": n_pos, "neg": n_neg}
    return {
        "frac_" + name: jnp.sum(sel, dtype=jnp.int32) / jnp.maximum(n[name.split("_")[0]], 1).astype(jnp.float32)
        for name, sel in sets.items()
    }
