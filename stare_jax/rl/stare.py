"""STARE token weights: surprisal-quantile selection of entropy-critical tokens, gates and the W/M controller.

Exact semantics: ../shared/reference/STARE-semantics.md. Summary of what this module does:
- Candidates: T+ = {mask, A > 0}, T- = {mask, A < 0} (strict); tokens whose log-prob is not finite are never
  candidates (they are left at omega = 1, so a NaN log-prob never turns into a NaN weight).
- Selection within T+ and T- separately by surprisal s = -stop_gradient(logprob):
  rule "quantile" (default, the paper): high set s >= quantile(s_cand, 1 - P), low set s <= quantile(s_cand, P),
  with numpy's default "linear" quantile; ties at the threshold can select more than P (see realised fractions).
  rule "exact_top_k" (the authors' code): k = max(1, ceil(P * n)) tokens, ties broken by position (lowest flat
  index first), so exactly k are chosen. P is used as the nearest fraction with denominator <= 10^4 so that the
  quantile index and k are computed in exact integer arithmetic at any token count (no float rounding at 16M).
  An empty candidate set selects nothing.
- scope "batch" (default): one selection over the whole (possibly sharded) [B, T] array; scope "micro_batch": each
  consecutive group of `micro_batch_size` sequences is ranked on its own (independent of the mesh).
- Variants O1..O4, C1..C4 put W or M on the selected sets; the gate (batch | sample | token | none) decides which
  selected tokens actually get them. All other tokens: omega = 1.
- Controller (`StareState`, `update_controller`): batch gate H_bar < H_tgt and the adaptive W/M schedule.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

VARIANTS = ("O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4")
GATES = ("batch", "sample", "token", "none")
RULES = ("quantile", "exact_top_k")
SCOPES = ("batch", "micro_batch")
ADAPTIVE_TIMINGS = ("same_step", "next_step")
SET_NAMES = ("pos_high", "pos_low", "neg_high", "neg_low")

# variant -> (sets that get W, sets that get M)
VARIANT_SETS = {
    "O1": (("pos_high",), ()),
    "O2": ((), ("pos_low",)),
    "O3": (("neg_low",), ()),
    "O4": ((), ("neg_high",)),
    "C1": (("pos_high", "neg_low"), ()),
    "C2": (("pos_high",), ("neg_high",)),
    "C3": (("neg_low",), ("pos_low",)),
    "C4": ((), ("pos_low", "neg_high")),
}

_P_MAX_DENOMINATOR = 10_000


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _is_concrete_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_stare_options(*, variant: str = "O1", top_p: float = 0.1, w: Any = 1.1, m: Any = 0.9,
                           gate: str = "batch", rule: str = "quantile", scope: str = "batch",
                           micro_batch_size: int | None = None, target_entropy: float = 0.3,
                           adaptive_timing: str = "same_step", alpha: float = 0.01, w_max: float = 1.5,
                           m_min: float = 0.5) -> None:
    """Config-time checks; raises ValueError naming the option, its value and the accepted values/range.

    w and m are only checked when they are plain Python numbers (inside jit they may be traced controller values).
    """
    def choice(name, value, accepted):
        if value not in accepted:
            raise ValueError(f"STARE option {name}={value!r} is not supported; accepted values: {list(accepted)}")

    choice("variant", variant, VARIANTS)
    choice("gate", gate, GATES)
    choice("rule", rule, RULES)
    choice("scope", scope, SCOPES)
    choice("adaptive_timing", adaptive_timing, ADAPTIVE_TIMINGS)
    if not _is_concrete_number(top_p) or not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"STARE option top_p={top_p!r} must be a number in (0, 1] (fraction of candidate tokens)")
    if _is_concrete_number(w) and not (math.isfinite(w) and w >= 1.0):
        raise ValueError(f"STARE option w={w!r} must be >= 1 (amplification weight)")
    if _is_concrete_number(m) and not (0.0 < m <= 1.0):
        raise ValueError(f"STARE option m={m!r} must be in (0, 1] (attenuation weight)")
    if not (_is_concrete_number(target_entropy) and math.isfinite(target_entropy) and target_entropy >= 0):
        raise ValueError(f"STARE option target_entropy={target_entropy!r} must be a finite number >= 0")
    if not (_is_concrete_number(alpha) and alpha >= 0):
        raise ValueError(f"STARE option alpha={alpha!r} must be >= 0")
    if not (_is_concrete_number(w_max) and w_max >= 1.0):
        raise ValueError(f"STARE option w_max={w_max!r} must be >= 1")
    if not (_is_concrete_number(m_min) and 0.0 < m_min <= 1.0):
        raise ValueError(f"STARE option m_min={m_min!r} must be in (0, 1]")
    if scope == "micro_batch":
        if not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
            raise ValueError(f"STARE option scope='micro_batch' needs micro_batch_size >= 1 (sequences per "
                             f"selection group), got micro_batch_size={micro_batch_size!r}")


# ----------------------------------------------------------------------------------------------------------------
# Selection


def _p_fraction(top_p: float) -> tuple[int, int]:
    frac = Fraction(float(top_p)).limit_denominator(_P_MAX_DENOMINATOR)
    return frac.numerator, frac.denominator


def _mul_div_floor(a: int, n, den: int):
    """floor(a * n / den) and (a * n) mod den in int32 without overflow (a <= den <= 10^4, n < 2^31)."""
    q, r = n // den, n % den
    prod = a * r  # < den^2 <= 1e8
    return a * q + prod // den, prod % den


def _lerp(a, b, t):
    """numpy's _lerp (used by np.quantile 'linear'): symmetric form for t >= 0.5."""
    diff = b - a
    return jnp.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)


def _group_quantile(sorted_x, offset, n, q_num: int, q_den: int):
    """numpy-'linear' quantile at q = q_num/q_den of sorted_x[offset:offset+n]; NaN when n == 0."""
    n_m1 = jnp.maximum(n - 1, 0)
    lo, rem = _mul_div_floor(q_num, n_m1, q_den)
    hi = jnp.minimum(lo + 1, n_m1)
    t = rem.astype(jnp.float32) / q_den
    size = sorted_x.shape[0]
    a = sorted_x[jnp.clip(offset + lo, 0, size - 1)]
    b = sorted_x[jnp.clip(offset + hi, 0, size - 1)]
    return jnp.where(n > 0, _lerp(a, b, t), jnp.nan)


def _select_flat_sort(s_N, cand_pos_N, cand_neg_N, *, top_p: float, rule: str, need: tuple[str, ...]):
    """Sort-based selection over one flat token array (reference implementation, same result as
    _select_flat_bisect). Returns {name: bool_N} for the names in `need`."""
    num, den = _p_fraction(top_p)
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
    pos_in_sorted = lax.iota(jnp.int32, size)
    ks = {}
    for sign in ("pos", "neg"):
        fl, rem = _mul_div_floor(num, counts[sign], den)
        ks[sign] = jnp.maximum(1, fl + (rem > 0).astype(jnp.int32))
    for side in ("high", "low"):
        names = [nm for nm in need if nm.endswith(side)]
        if not names:
            continue
        key_N = -s_N if side == "high" else s_N
        g_sorted, _, perm = lax.sort((group_N, key_N, iota_N), num_keys=3)
        for name in names:
            sign = name.split("_")[0]
            gid = 0 if sign == "pos" else 1
            rank = pos_in_sorted - offsets[sign]
            chosen_sorted = (g_sorted == gid) & (rank < ks[sign])
            out[name] = jnp.zeros((size,), bool).at[perm].set(chosen_sorted)
    return out


_UMAX = 0xFFFFFFFF


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


def _select_flat_bisect(s_N, cand_pos_N, cand_neg_N, *, top_p: float, rule: str, need: tuple[str, ...]):
    """Selection over one flat token array via order statistics found by bisection (see _order_stat_keys).
    Same sets as the sort-based reference; cost O(32 K N) elementwise work, K <= 4 targets."""
    num, den = _p_fraction(top_p)
    group_N = jnp.where(cand_pos_N, 0, jnp.where(cand_neg_N, 1, 2)).astype(jnp.int32)
    key_N = _sortable_key(s_N)
    counts = {"pos": jnp.sum(group_N == 0, dtype=jnp.int32), "neg": jnp.sum(group_N == 1, dtype=jnp.int32)}
    cands = {"pos": cand_pos_N, "neg": cand_neg_N}
    gids = {"pos": 0, "neg": 1}
    names = list(need)
    if not names:
        return {}
    out = {}
    if rule == "quantile":
        ranks, fracs = [], []
        for name in names:
            sign, side = name.split("_")
            n_m1 = jnp.maximum(counts[sign] - 1, 0)
            lo, rem = _mul_div_floor(den - num if side == "high" else num, n_m1, den)
            ranks.append(lo)
            fracs.append(rem.astype(jnp.float32) / den)
        rank_K = jnp.stack(ranks)
        gid_K = jnp.array([gids[nm.split("_")[0]] for nm in names], jnp.int32)
        klo_K = _order_stat_keys(key_N, group_N, gid_K, rank_K)
        in_grp_KxN = group_N[None, :] == gid_K[:, None]
        n_le_K = jnp.sum(in_grp_KxN & (key_N[None, :] <= klo_K[:, None]), axis=1, dtype=jnp.int32)
        above_K = jnp.min(jnp.where(in_grp_KxN & (key_N[None, :] > klo_K[:, None]), key_N[None, :],
                                    jnp.uint32(_UMAX)), axis=1)
        n_K = jnp.stack([counts[nm.split("_")[0]] for nm in names])
        has_next_K = rank_K + 1 <= n_K - 1
        khi_K = jnp.where(has_next_K & (n_le_K < rank_K + 2), above_K, klo_K)
        x_lo, x_hi = _from_key(klo_K), _from_key(khi_K)
        for i, name in enumerate(names):
            sign, side = name.split("_")
            q = jnp.where(counts[sign] > 0, _lerp(x_lo[i], x_hi[i], fracs[i]), jnp.nan)
            out[name] = cands[sign] & ((s_N >= q) if side == "high" else (s_N <= q))
        return out
    # exact_top_k: the k-th largest (high) / smallest (low) value v; take every s strictly beyond v, then the
    # first (k - that count) tokens equal to v in flat order (ties by lowest index).
    ks = {}
    for sign in ("pos", "neg"):
        fl, rem = _mul_div_floor(num, counts[sign], den)
        ks[sign] = jnp.maximum(1, fl + (rem > 0).astype(jnp.int32))
    ranks = []
    for name in names:
        sign, side = name.split("_")
        k = jnp.minimum(ks[sign], counts[sign])
        ranks.append(jnp.maximum(counts[sign] - k, 0) if side == "high" else jnp.maximum(k - 1, 0))
    gid_K = jnp.array([gids[nm.split("_")[0]] for nm in names], jnp.int32)
    kv_K = _order_stat_keys(key_N, group_N, gid_K, jnp.stack(ranks))
    for i, name in enumerate(names):
        sign, side = name.split("_")
        c = cands[sign]
        beyond = c & ((key_N > kv_K[i]) if side == "high" else (key_N < kv_K[i]))
        tie = c & (key_N == kv_K[i])
        need_ties = ks[sign] - jnp.sum(beyond, dtype=jnp.int32)
        last = _kth_true_index(tie, need_ties)
        out[name] = (beyond | (tie & (lax.iota(jnp.int32, tie.shape[0]) <= last))) & (counts[sign] > 0)
    return out


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


SELECT_IMPL = "bisect"  # "bisect" (default: no sort, shards cleanly) or "sort" (reference)


def _select_flat(s_N, cand_pos_N, cand_neg_N, *, top_p: float, rule: str, need: tuple[str, ...]):
    fn = _select_flat_bisect if SELECT_IMPL == "bisect" else _select_flat_sort
    return fn(s_N, cand_pos_N, cand_neg_N, top_p=top_p, rule=rule, need=need)


def _candidates(logprobs_BxT, advantages_B, mask_BxT):
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
    cand_pos = valid & (adv_B[:, None] > 0)
    cand_neg = valid & (adv_B[:, None] < 0)
    return s, cand_pos, cand_neg


def _select(logprobs_BxT, advantages_B, mask_BxT, *, top_p, rule, scope, micro_batch_size, need):
    s, cand_pos, cand_neg = _candidates(logprobs_BxT, advantages_B, mask_BxT)
    B, T = s.shape
    if scope == "batch":
        sets = _select_flat(s.reshape(-1), cand_pos.reshape(-1), cand_neg.reshape(-1),
                            top_p=top_p, rule=rule, need=need)
        sets = {k: v.reshape(B, T) for k, v in sets.items()}
    else:
        g = int(micro_batch_size)
        if B % g:
            raise ValueError(f"scope='micro_batch': batch size {B} is not a multiple of micro_batch_size={g}")
        fn = lambda a, b, c: _select_flat(a, b, c, top_p=top_p, rule=rule, need=need)
        sets = jax.vmap(fn)(s.reshape(B // g, g * T), cand_pos.reshape(B // g, g * T),
                            cand_neg.reshape(B // g, g * T))
        sets = {k: v.reshape(B, T) for k, v in sets.items()}
    return sets, cand_pos, cand_neg


def selection_sets(logprobs_BxT, advantages_B, mask_BxT, *, top_p: float = 0.1, rule: str = "quantile",
                   scope: str = "batch", micro_batch_size: int | None = None,
                   which: tuple[str, ...] = SET_NAMES) -> dict:
    """Boolean selection sets {pos_high, pos_low, neg_high, neg_low} [B, T] (those in `which`) and metrics:
    n_pos / n_neg (candidate counts) and frac_<set> = |set| / |candidates| (0 when there are no candidates)."""
    validate_stare_options(top_p=top_p, rule=rule, scope=scope, micro_batch_size=micro_batch_size)
    for name in which:
        if name not in SET_NAMES:
            raise ValueError(f"selection set {name!r} unknown; accepted: {list(SET_NAMES)}")
    sets, cand_pos, cand_neg = _select(logprobs_BxT, advantages_B, mask_BxT, top_p=top_p, rule=rule,
                                       scope=scope, micro_batch_size=micro_batch_size, need=tuple(which))
    n = {"pos": jnp.sum(cand_pos, dtype=jnp.int32), "neg": jnp.sum(cand_neg, dtype=jnp.int32)}
    out = dict(sets)
    out["n_pos"], out["n_neg"] = n["pos"], n["neg"]
    for name, sel in sets.items():
        cnt = n[name.split("_")[0]]
        out["frac_" + name] = jnp.sum(sel, dtype=jnp.int32) / jnp.maximum(cnt, 1).astype(jnp.float32)
    return out


def gate_mask(*, gate: str, gate_on=True, entropy_BxT=None, mask_BxT=None, shape=None,
              target_entropy: float = 0.3):
    """Boolean [B, T] (or broadcastable) mask of tokens on which the STARE weights are active."""
    if gate == "batch":
        return jnp.broadcast_to(jnp.asarray(gate_on, bool), shape)
    if gate == "none":
        return jnp.ones(shape, bool)
    if gate in ("sample", "token"):
        if entropy_BxT is None:
            raise ValueError(f"gate={gate!r} needs entropy_BxT (per-token entropy of the trainer's forward pass)")
        ent = jnp.asarray(entropy_BxT, jnp.float32)
        if ent.shape != tuple(shape):
            raise ValueError(f"entropy_BxT must have shape {tuple(shape)}, got {ent.shape}")
        if gate == "token":
            return ent < target_entropy
        m = jnp.asarray(mask_BxT, jnp.float32)
        ent_mean_B = jnp.sum(jnp.where(m > 0, ent, 0.0), axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        return jnp.broadcast_to((ent_mean_B < target_entropy)[:, None], shape)
    raise ValueError(f"STARE option gate={gate!r} is not supported; accepted values: {list(GATES)}")


def _weights_and_sets(logprobs_BxT, advantages_B, mask_BxT, *, variant, top_p, w, m, gate_on, entropy_BxT, gate,
                      target_entropy, rule, scope, micro_batch_size, extra_sets=()):
    validate_stare_options(variant=variant, top_p=top_p, w=w, m=m, gate=gate, rule=rule, scope=scope,
                           micro_batch_size=micro_batch_size, target_entropy=target_entropy)
    w_sets, m_sets = VARIANT_SETS[variant]
    need = tuple(dict.fromkeys(w_sets + m_sets + tuple(extra_sets)))
    shape = jnp.shape(logprobs_BxT)
    g = gate_mask(gate=gate, gate_on=gate_on, entropy_BxT=entropy_BxT, mask_BxT=mask_BxT, shape=shape,
                  target_entropy=target_entropy)
    sets, cand_pos, cand_neg = _select(logprobs_BxT, advantages_B, mask_BxT, top_p=top_p, rule=rule, scope=scope,
                                       micro_batch_size=micro_batch_size, need=need)
    sel_w = jnp.zeros(shape, bool)
    for name in w_sets:
        sel_w = sel_w | sets[name]
    sel_m = jnp.zeros(shape, bool)
    for name in m_sets:
        sel_m = sel_m | sets[name]
    w = jnp.asarray(w, jnp.float32)
    m = jnp.asarray(m, jnp.float32)
    omega = jnp.where(sel_w & g, w, jnp.where(sel_m & g, m, 1.0)).astype(jnp.float32)
    return lax.stop_gradient(omega), sets, g, cand_pos, cand_neg


def token_weights(logprobs_BxT, advantages_B, mask_BxT, *, variant: str = "O1", top_p: float = 0.1,
                  w=1.1, m=0.9, gate_on=True, entropy_BxT=None, gate: str = "batch",
                  target_entropy: float = 0.3, rule: str = "quantile", scope: str = "batch",
                  micro_batch_size: int | None = None):
    """STARE per-token weights omega [B, T] (float32, stop-gradient): W / M on the variant's selected sets where
    the gate is on, 1 elsewhere. gate_on is read by gate="batch" only; sample/token gates need entropy_BxT."""
    return _weights_and_sets(logprobs_BxT, advantages_B, mask_BxT, variant=variant, top_p=top_p, w=w, m=m,
                             gate_on=gate_on, entropy_BxT=entropy_BxT, gate=gate, target_entropy=target_entropy,
                             rule=rule, scope=scope, micro_batch_size=micro_batch_size)[0]


def micro_batch_token_weights(logprobs_BxT, advantages_B, mask_BxT, *, micro_batch_size: int, **kwargs):
    """token_weights with scope='micro_batch': each consecutive group of micro_batch_size sequences is ranked on
    its own (the authors' per-GPU-micro-batch behaviour, defined independently of the mesh)."""
    return token_weights(logprobs_BxT, advantages_B, mask_BxT, scope="micro_batch",
                         micro_batch_size=micro_batch_size, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Configuration and closed-loop controller


@dataclasses.dataclass(frozen=True)
class StareConfig:
    """All STARE options (defaults = the paper's). enabled=False gives GRPO(-ds): omega == 1 everywhere."""
    enabled: bool = True
    variant: str = "O1"
    top_p: float = 0.1
    w: float = 1.1
    m: float = 0.9
    gate: str = "batch"
    target_entropy: float = 0.3
    rule: str = "quantile"
    scope: str = "batch"
    micro_batch_size: int | None = None
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    adaptive_timing: str = "same_step"

    def __post_init__(self):
        validate_stare_options(variant=self.variant, top_p=self.top_p, w=self.w, m=self.m, gate=self.gate,
                               rule=self.rule, scope=self.scope, micro_batch_size=self.micro_batch_size,
                               target_entropy=self.target_entropy, adaptive_timing=self.adaptive_timing,
                               alpha=self.alpha, w_max=self.w_max, m_min=self.m_min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StareState:
    """Controller state carried across steps: the gate flag and the W/M used at the latest step, and the latest
    finite batch entropy (NaN before the first step)."""
    gate_on: jax.Array
    w: jax.Array
    m: jax.Array
    last_entropy: jax.Array


def init_stare_state(cfg: StareConfig | None = None) -> StareState:
    cfg = cfg or StareConfig()
    return StareState(gate_on=jnp.asarray(False), w=jnp.asarray(cfg.w, jnp.float32),
                      m=jnp.asarray(cfg.m, jnp.float32), last_entropy=jnp.asarray(jnp.nan, jnp.float32))


def update_controller(state: StareState, batch_entropy, cfg: StareConfig | None = None) -> StareState:
    """One controller step from step k's batch mean entropy H_bar_k (trainer forward pass before the update).

    gate_on = H_bar_k < H_tgt (strict). Adaptive weights (every step, also with the gate off):
    sign = sgn(H_tgt - H); W = clip(W + alpha sign, 1, W_max); M = clip(M - alpha sign, M_min, 1), where H is H_bar_k
    (adaptive_timing same_step: step k uses the updated values) or H_bar_{k-1} (next_step: the update computed from
    step k-1 takes effect at step k). The returned state's (gate_on, w, m) are what step k uses.
    A non-finite batch_entropy returns the previous state unchanged.
    """
    cfg = cfg or StareConfig()
    h = jnp.asarray(batch_entropy, jnp.float32)
    finite = jnp.isfinite(h)
    gate_on = h < cfg.target_entropy
    if cfg.adaptive:
        if cfg.adaptive_timing == "same_step":
            h_drive = h
        else:
            h_drive = state.last_entropy
        sign = jnp.where(jnp.isfinite(h_drive), jnp.sign(cfg.target_entropy - h_drive), 0.0)
        w = jnp.clip(state.w + cfg.alpha * sign, 1.0, cfg.w_max)
        m = jnp.clip(state.m - cfg.alpha * sign, cfg.m_min, 1.0)
    else:
        w, m = state.w, state.m
    new = StareState(gate_on=gate_on, w=jnp.asarray(w, jnp.float32), m=jnp.asarray(m, jnp.float32),
                     last_entropy=h)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, state)


def stare_omega(logprobs_BxT, advantages_B, mask_BxT, state: StareState, cfg: StareConfig, entropy_BxT=None,
                extra_sets: tuple[str, ...] = (), scope: str | None = None):
    """(omega [B, T], info) for a config and controller state; omega == 1 when cfg.enabled is False.

    info: {"sets": {name: bool [B, T]} (the variant's sets plus extra_sets), "gate": bool mask, "metrics": realised
    fractions frac_<set>, n_pos, n_neg, omega_mean (over valid tokens), frac_reweighted (omega != 1)}.
    scope overrides cfg.scope (train_step passes "batch" / "micro_batch" explicitly)."""
    scope = cfg.scope if scope is None else scope
    shape = jnp.shape(logprobs_BxT)
    valid = jnp.asarray(mask_BxT) > 0
    n_valid = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    if not cfg.enabled and not extra_sets:
        omega = jnp.ones(shape, jnp.float32)
        return omega, {"sets": {}, "gate": jnp.zeros(shape, bool),
                       "metrics": {"omega_mean": jnp.float32(1.0), "frac_reweighted": jnp.float32(0.0)}}
    omega, sets, g, cand_pos, cand_neg = _weights_and_sets(
        logprobs_BxT, advantages_B, mask_BxT, variant=cfg.variant, top_p=cfg.top_p, w=state.w, m=state.m,
        gate_on=state.gate_on, entropy_BxT=entropy_BxT, gate=cfg.gate, target_entropy=cfg.target_entropy,
        rule=cfg.rule, scope=scope, micro_batch_size=cfg.micro_batch_size, extra_sets=extra_sets)
    if not cfg.enabled:
        omega = jnp.ones(shape, jnp.float32)
    n = {"pos": jnp.sum(cand_pos, dtype=jnp.int32), "neg": jnp.sum(cand_neg, dtype=jnp.int32)}
    metrics = {"n_pos": n["pos"], "n_neg": n["neg"],
               "omega_mean": jnp.sum(jnp.where(valid, omega, 0.0)) / n_valid,
               "frac_reweighted": jnp.sum(valid & (omega != 1.0)) / n_valid,
               "gate_frac": jnp.sum(valid & g) / n_valid}
    for name, sel in sets.items():
        metrics["frac_" + name] = (jnp.sum(sel, dtype=jnp.int32)
                                   / jnp.maximum(n[name.split("_")[0]], 1).astype(jnp.float32))
    return omega, {"sets": sets, "gate": g, "metrics": metrics}
