"""Next-token selection from logits: greedy, temperature, top-k, top-p, and the temperature-1 log-prob.

Everything here is a pure function of fp32 logits so it can run inside the sampler's `lax.while_loop`.
Design choices (CPU/GPU cost matters: these run once per generated token on [B, V] logits):
- Sampling is inverse-CDF with ONE uniform per sequence (not Gumbel-max, which needs V random numbers per
  sequence and step). The CDF is built in two levels (block sums, then a cumsum inside the chosen block) so the
  cost is a few O(V) elementwise passes and reductions instead of a full O(V) scan along the vocabulary.
- top-p without a full vocabulary sort (sorting [B, V] is very slow on CPU): an exact bisection on the bit
  pattern of the probability threshold. The kept set is {i : p_i >= t*}, t* the largest value with
  sum(p_j >= t*) >= top_p -- the smallest set of most likely tokens whose mass reaches top_p, as in
  transformers' TopPLogitsWarper, except that tokens tied at the threshold are all kept (transformers keeps
  the subset that its sort happens to put first).
- top-k keeps logits >= the k-th largest (ties included, like transformers); the k-th largest is found by
  the same kind of exact bisection, so k (like temperature and top_p, and greedy on/off) is a traced value
  and changing it never recompiles.
- Order of warpers as in transformers: temperature, then top-k, then top-p (on the renormalised top-k set).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
_BLOCK = 128  # vocabulary block width of the two-level inverse CDF


def _blocks(logits_BxV: jax.Array, fill) -> jax.Array:
    """[B, V] -> [B, ceil(V / _BLOCK), _BLOCK], the tail block padded with `fill`."""
    B, V = logits_BxV.shape
    n_blocks = -(-V // _BLOCK)
    return jnp.pad(logits_BxV, ((0, 0), (0, n_blocks * _BLOCK - V)), constant_values=fill).reshape(B, n_blocks, _BLOCK)


def block_max(logits_BxV: jax.Array) -> jax.Array:
    """Max of each _BLOCK-wide vocabulary block, [B, ceil(V / _BLOCK)]: one pass over the logits that gives both the
    row max (for the log-prob's logsumexp) and where the greedy token is."""
    return jnp.max(_blocks(logits_BxV, NEG_INF), axis=-1)


def _first_index(x_BxN: jax.Array, value_B: jax.Array) -> jax.Array:
    """First index of value_B in each row (N when absent, e.g. a NaN row)."""
    n = x_BxN.shape[-1]
    return jnp.min(jnp.where(x_BxN == value_B[:, None], jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def greedy_tokens(logits_BxV: jax.Array, block_max_BxN: jax.Array | None = None) -> jax.Array:
    """First index of the maximum logit per row (same tie rule as torch/jnp argmax), int32 [B]: the first block
    holding the row max, then the first index of the max inside it (two small passes after `block_max`, instead
    of two full [B, V] passes)."""
    V = logits_BxV.shape[-1]
    blocks_BxNxK = _blocks(logits_BxV, NEG_INF)
    block_max_BxN = jnp.max(blocks_BxNxK, axis=-1) if block_max_BxN is None else block_max_BxN
    n_blocks = block_max_BxN.shape[-1]
    max_B = jnp.max(block_max_BxN, axis=-1)
    block_B = jnp.minimum(_first_index(block_max_BxN, max_B), n_blocks - 1)
    w_BxK = jnp.take_along_axis(blocks_BxNxK, block_B[:, None, None], axis=1)[:, 0]
    first_B = block_B * _BLOCK + jnp.minimum(_first_index(w_BxK, max_B), _BLOCK - 1)
    return jnp.minimum(first_B, V - 1).astype(jnp.int32)  # a NaN row (no max) still yields a valid id


def token_logprobs(logits_BxV: jax.Array, tokens_B: jax.Array, max_B: jax.Array | None = None) -> jax.Array:
    """log softmax(logits)[token] at temperature 1 over the full vocabulary (what the trainer recomputes); max_B,
    the row max when already known, saves a pass."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if max_B is None:
        lse_B = jax.nn.logsumexp(logits_BxV, axis=-1)
    else:  # jax.nn.logsumexp's formula with the given max (a -inf / NaN max as there: the row's log-probs NaN)
        m_B = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_B), max_B, 0.0))
        lse_B = m_B + jnp.log(jnp.sum(jnp.exp(logits_BxV - m_B[:, None]), axis=-1))
    picked_B = jnp.take_along_axis(logits_BxV, tokens_B[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked_B - lse_B


def _sortable_u32(x_BxV: jax.Array) -> jax.Array:
    """fp32 -> uint32 with the same order (-inf < ... < -0 < +0 < ... < +inf), for exact bisection."""
    bits = jax.lax.bitcast_convert_type(x_BxV.astype(jnp.float32), jnp.int32)
    key = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(key, jnp.uint32) ^ jnp.uint32(0x80000000)


def top_k_mask(scores_BxV: jax.Array, top_k) -> jax.Array:
    """Scores below the k-th largest set to -inf; ties with the k-th are kept (like transformers).

    top_k may be traced (0 or >= V = off). The k-th largest value is found by an exact 32-step bisection on
    the order-preserving integer image of the scores, so k needs no recompilation (unlike lax.top_k).
    """
    V = scores_BxV.shape[-1]
    k = jnp.asarray(top_k, jnp.int32)
    key_BxV = _sortable_u32(scores_BxV)
    lo_B = jnp.min(key_BxV, axis=-1)  # count(key >= lo) = V >= k: feasible
    hi_B = jnp.max(key_BxV, axis=-1) + jnp.uint32(1)  # count(key >= hi) = 0 < k: infeasible

    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = lo_B + (hi_B - lo_B) // jnp.uint32(2)
        ok_B = jnp.sum(key_BxV >= mid_B[:, None], axis=-1) >= k
        return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

    kth_B, _ = jax.lax.fori_loop(0, 32, body, (lo_B, hi_B))  # largest t with count(key >= t) >= k
    keep_BxV = (key_BxV >= kth_B[:, None]) | (k <= 0) | (k >= V)
    return jnp.where(keep_BxV, scores_BxV, NEG_INF)


def _prob_threshold_bits(probs_BxV: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Largest float t (as int32 bits, probs >= 0 so bit order == value order) with sum(p >= t) >= top_p."""
    bits_BxV = jax.lax.bitcast_convert_type(probs_BxV, jnp.int32)
    lo_B = jnp.zeros(probs_BxV.shape[:1], jnp.int32)  # t = 0 keeps everything: always feasible
    hi_B = jnp.max(bits_BxV, axis=-1) + 1  # t = above the max keeps nothing: infeasible

    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = lo_B + (hi_B - lo_B) // 2
        mass_B = jnp.sum(jnp.where(bits_BxV >= mid_B[:, None], probs_BxV, 0.0), axis=-1)
        ok_B = mass_B >= top_p_B
        return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

    lo_B, _ = jax.lax.fori_loop(0, 32, body, (lo_B, hi_B))  # 32 halvings of a < 2^31 range: exact
    return lo_B


def top_p_mask(scores_BxV: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scores outside the top-p nucleus of softmax(scores) set to -inf (top_p traced scalar in (0, 1])."""
    probs_BxV = jax.nn.softmax(scores_BxV, axis=-1)
    top_p_B = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), probs_BxV.shape[:1])
    # Rounding: the probabilities may sum to slightly below 1; never ask for more mass than exists.
    top_p_B = jnp.minimum(top_p_B, jnp.sum(probs_BxV, axis=-1))
    t_bits_B = _prob_threshold_bits(probs_BxV, top_p_B)
    keep_BxV = jax.lax.bitcast_convert_type(probs_BxV, jnp.int32) >= t_bits_B[:, None]
    # The most likely token is always kept (min_tokens_to_keep=1), whatever the rounding.
    keep_BxV = keep_BxV | (scores_BxV == jnp.max(scores_BxV, axis=-1, keepdims=True))
    return jnp.where(keep_BxV, scores_BxV, NEG_INF)


def inverse_cdf_sample(scores_BxV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """Sample index i with probability softmax(scores)_i from one uniform u in [0, 1) per row.

    Two-level CDF: block masses -> cumulative block mass -> the block holding u * total -> cumsum inside that
    block. Tokens with zero probability (score -inf) occupy empty CDF intervals and can never be returned.
    """
    w_BxNxK = _blocks(jnp.exp(scores_BxV - jnp.max(scores_BxV, axis=-1, keepdims=True)), 0.0)
    n_blocks = w_BxNxK.shape[1]
    block_cum_BxN = jnp.cumsum(jnp.sum(w_BxNxK, axis=-1), axis=-1)
    total_B = block_cum_BxN[:, -1]
    target_B = jnp.minimum(uniform_B * total_B, jnp.nextafter(total_B, jnp.zeros_like(total_B)))
    # First block whose cumulative mass exceeds the target (block_cum is non-decreasing).
    block_B = jnp.minimum(jnp.sum(block_cum_BxN <= target_B[:, None], axis=-1), n_blocks - 1)
    base_B = jnp.where(block_B > 0, jnp.take_along_axis(block_cum_BxN, (block_B - 1)[:, None], axis=-1)[:, 0], 0.0)
    w_BxK = jnp.take_along_axis(w_BxNxK, block_B[:, None, None], axis=1)[:, 0]
    cum_BxK = jnp.cumsum(w_BxK, axis=-1)
    within_B = jnp.sum(cum_BxK <= (target_B - base_B)[:, None], axis=-1)
    # Rounding between the two levels may overshoot the block; fall back to its last positive-mass token.
    iota_K = jnp.arange(_BLOCK, dtype=jnp.int32)
    last_pos_B = jnp.max(jnp.where(w_BxK > 0, iota_K, -1), axis=-1)
    within_B = jnp.minimum(within_B, last_pos_B)
    return (block_B * _BLOCK + within_B).astype(jnp.int32)


def warp_scores(logits_BxV: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """Temperature, then top-k (0 = off), then top-p (1 = off), transformers' order; all may be traced.
    The filters run under lax.cond, so a disabled filter costs nothing at run time."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    # Shift by the row max first: the max becomes exactly 0, so even a tiny temperature gives 0 / -inf, never NaN.
    scores_BxV = (logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)) / jnp.asarray(temperature, jnp.float32)
    k = jnp.asarray(top_k, jnp.int32)
    p = jnp.asarray(top_p, jnp.float32)
    scores_BxV = jax.lax.cond((k > 0) & (k < scores_BxV.shape[-1]), lambda s: top_k_mask(s, k), lambda s: s, scores_BxV)
    return jax.lax.cond(p < 1.0, lambda s: top_p_mask(s, p), lambda s: s, scores_BxV)


def select_tokens(
    logits_BxV: jax.Array, uniform_B: jax.Array, *, greedy, temperature, top_k, top_p
) -> tuple[jax.Array, jax.Array]:
    """(tokens_B int32, logprobs_B f32): the chosen tokens and their temperature-1 full-vocab log-probs.

    greedy (bool, may be traced) picks the argmax and ignores temperature/top-k/top-p."""
    logits_BxV = logits_BxV.astype(jnp.float32)

    def sample(x):
        safe_t = jnp.where(greedy, 1.0, temperature)  # never divide by a zero temperature
        return inverse_cdf_sample(warp_scores(x, safe_t, top_k, top_p), uniform_B)

    block_max_BxN = block_max(logits_BxV)
    tokens_B = jax.lax.cond(jnp.asarray(greedy), greedy_tokens, lambda x, _: sample(x), logits_BxV, block_max_BxN)
    return tokens_B, token_logprobs(logits_BxV, tokens_B, jnp.max(block_max_BxN, axis=-1))
