"""The train batch's layout: sequence packing (rl.packing) and token-budget micro-batches (rl.micro_batch_tokens).

Padded layout (collect.train_batch_from_rollouts; rl.step.BATCH_KEYS): one row per sequence, [B, L], every row
as long as the longest possible sequence. RL responses are long-tailed, so most of a [B, 16k] batch is padding.

Packed layout (`pack_batch`, keys PACKED_KEYS): each sequence (prompt + response, its real tokens only) is placed
whole into rows of `row_tokens` tokens by first-fit-decreasing, per mini-batch:
    input_ids_RxT     int32 [NR, Lr]  the rows' tokens (0 on padding)
    segment_ids_RxT   int32 [NR, Lr]  0 = padding, k = the row's k-th sequence (1, 2, ... along the row): attention
                                      never crosses a segment (models.attention.causal_padding_mask, splash's
                                      segment ids) and RoPE positions restart at each (models.default_positions)
    response_mask_RxT int32 [NR, Lr]  1 on response tokens
    advantages_B      float [B]       per sequence, in the padded batch's order
    rewards_B         float [B]       (only when the padded batch has it: rl.kl.use_as "reward") the same, per sequence
    rollout_logprobs_RxT float [NR, Lr] (only when the padded batch has rollout_logprobs_BxT) the sampler's
                                      log-probs, placed like the tokens
    seq_row_B         int32 [B]       the row of sequence b
    seq_col_B         int32 [B]       the column of its first token
    seq_len_B         int32 [B]       its number of tokens (prompt + response; 0: a sequence without tokens)
Rows: mini-batch j's sequences (rows [j mini, (j+1) mini) of the padded batch, as the padded step takes them) fill
rows [j M R, (j+1) M R): M micro-batches of R rows (R = rows per device per micro-batch x batch shards, see
`rows_per_micro`), M = ceil(mini / R) - the worst case, every sequence in a row of its own - so the shapes
depend on the config only, never on the lengths: one compiled program for every batch. Micro-batches left empty
are skipped at run time (lax.cond), so the work follows the tokens, not the worst case.

Sequence view (`sequence_view`): per-token quantities are computed on the packed rows ([NR, Lr - 1], column u =
the token at u + 1 predicted by the hidden state at u) and read back per sequence as [B, Lr - 1], left-aligned.
The losses, STARE's selection, the 80/20 filter and the logged metrics run on this view exactly as on the padded
layout's [B, L - 1] arrays: the same tokens, in the same rows and the same order (only the columns shift, which
no reduction and no tie-break by flat index sees), so sequence-level quantities (seq-mean aggregation, GSPO's
sequence ratio, geo_mean) map back to their sequences by construction. During an update each packed micro-batch's
log-probs are scattered into the view of its mini-batch with the loss mask restricted to the sequences it holds;
the global normalisers are those of the padded layout.

Token-budget micro-batches without packing (`trim_padded_batch`): the padded batch is cut to its own length bucket
(powers of two, at least MIN_BUCKET), and the step takes rl.micro_batch_tokens // L sequences per device per
micro-batch: one program per length bucket.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

PACKED_KEYS = (
    "input_ids_RxT",
    "segment_ids_RxT",
    "response_mask_RxT",
    "advantages_B",
    "seq_row_B",
    "seq_col_B",
    "seq_len_B",
)
PACKED_ROLLOUT_LOGPROBS_KEY = "rollout_logprobs_RxT"  # packed rollout_logprobs_BxT (rl.rollout_correction)
PADDED_ROLLOUT_LOGPROBS_KEY = "rollout_logprobs_BxT"
SEQUENCE_KEYS = ("advantages_B", "rewards_B")  # per-sequence values pack_batch carries as they are (when present)
MIN_BUCKET = 16  # shortest padded length bucket of trim_padded_batch


# ---------------------------------------------------------------------------------------------------------------
# Host side (NumPy): bin packing and the packed batch


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: items longest first (ties in index order), each
    into the first bin with room, else a new bin. Uses at most 11/9 OPT + 6/9 bins; items of length 0 are left
    out. ValueError for an item longer than capacity."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"item of length {int(lengths.max())} exceeds the bin capacity {capacity}")
    room = np.zeros(len(lengths), np.int64)
    bins: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        if n == 0:
            continue
        fits = np.flatnonzero(room[: len(bins)] >= n)
        k = int(fits[0]) if fits.size else len(bins)
        if k == len(bins):
            bins.append([])
            room[k] = capacity
        bins[k].append(int(i))
        room[k] -= n
    return bins


def fill_rate(lengths, capacity: int) -> float:
    """Fraction of the rows' tokens that are real when `lengths` are packed first-fit-decreasing into rows of
    `capacity` (1.0 for no items)."""
    lengths = np.asarray(lengths, np.int64)
    bins = first_fit_decreasing(lengths, capacity)
    return float(lengths.sum() / (len(bins) * capacity)) if bins else 1.0


def rows_per_micro(micro_batch_tokens: int, row_tokens: int, shards: int) -> int:
    """Packed rows per micro-batch over all batch shards: micro_batch_tokens // row_tokens per device (at least
    one row; 0 = one row), times the shards."""
    return max(1, int(micro_batch_tokens) // int(row_tokens)) * int(shards)


def micro_batches_per_mini(mini: int, rows: int) -> int:
    """M: micro-batches per mini-batch in the packed layout (the worst case, one sequence per row)."""
    return -(-int(mini) // int(rows))


def sequence_spans(attention_mask_BxT) -> tuple[np.ndarray, np.ndarray]:
    """(first column, number) of each padded row's real tokens; ValueError when a row's real tokens are not
    contiguous (the train batch is [left padding | prompt | response | right padding])."""
    m = np.asarray(attention_mask_BxT) > 0
    n = m.sum(axis=1)
    first = np.where(n > 0, m.argmax(axis=1), 0)
    last = np.where(n > 0, m.shape[1] - 1 - m[:, ::-1].argmax(axis=1), -1)
    gaps = np.flatnonzero((n > 0) & (last - first + 1 != n))
    if gaps.size:
        raise ValueError(
            f"train batch row {int(gaps[0])}: its real tokens (attention_mask_BxT == 1) are not "
            f"contiguous, so it cannot be packed (expected [padding | prompt | response | padding])"
        )
    return first.astype(np.int64), n.astype(np.int64)


def pack_batch(batch: dict, *, row_tokens: int, rows_per_micro: int, num_mini_batches: int = 1) -> dict:
    """The packed layout (module docstring) of a padded host batch (rl.step.BATCH_KEYS). Sequences stay in
    their mini-batch; within it they are packed first-fit-decreasing into rows of row_tokens tokens, the rows
    filled in order (micro-batch 0 first). ValueError naming rl.packing.row_tokens for a sequence longer than a
    row (sequences are never split)."""
    ids = np.asarray(batch["input_ids_BxT"])
    attn = np.asarray(batch["attention_mask_BxT"])
    resp = np.asarray(batch["response_mask_BxT"])
    B = ids.shape[0]
    if B % num_mini_batches:
        raise ValueError(f"batch size {B} is not divisible by num_mini_batches={num_mini_batches}")
    start, n = sequence_spans(attn)
    if B and n.max() > row_tokens:
        b = int(np.argmax(n))
        raise ValueError(
            f"sequence {b} of the train batch has {int(n[b])} tokens (prompt + response), more than "
            f"rl.packing.row_tokens={row_tokens}: a sequence is never split across rows; set "
            f"rl.packing.row_tokens >= {int(n.max())} (0 = the padded length)"
        )
    mini = B // num_mini_batches
    M = micro_batches_per_mini(mini, rows_per_micro)
    NR = num_mini_batches * M * rows_per_micro
    out_ids = np.zeros((NR, row_tokens), np.int32)
    out_seg = np.zeros((NR, row_tokens), np.int32)
    out_resp = np.zeros((NR, row_tokens), np.int32)
    rollout = batch.get(PADDED_ROLLOUT_LOGPROBS_KEY)
    out_rollout = None if rollout is None else np.zeros((NR, row_tokens), np.float32)
    row_B = np.zeros(B, np.int32)
    col_B = np.zeros(B, np.int32)
    for j in range(num_mini_batches):
        seqs = np.arange(j * mini, (j + 1) * mini)
        for r, bin_ in enumerate(first_fit_decreasing(n[seqs], row_tokens)):
            row = j * M * rows_per_micro + r
            col = 0
            for k, i in enumerate(bin_):
                b = int(seqs[i])
                src = slice(start[b], start[b] + n[b])
                dst = slice(col, col + n[b])
                out_ids[row, dst], out_resp[row, dst] = ids[b, src], resp[b, src]
                if out_rollout is not None:
                    out_rollout[row, dst] = np.asarray(rollout)[b, src]
                out_seg[row, dst] = k + 1
                row_B[b], col_B[b] = row, col
                col += n[b]
    per_seq = {k: np.asarray(batch[k], np.float32) for k in SEQUENCE_KEYS if k in batch}
    if out_rollout is not None:
        per_seq[PACKED_ROLLOUT_LOGPROBS_KEY] = out_rollout
    return {
        "input_ids_RxT": out_ids,
        "segment_ids_RxT": out_seg,
        "response_mask_RxT": out_resp,
        **per_seq,
        "seq_row_B": row_B,
        "seq_col_B": col_B,
        "seq_len_B": n.astype(np.int32),
    }


def packed_stats(packed: dict, rows_per_micro: int) -> dict:
    """Fill of a packed batch: real tokens / tokens of the rows in use, rows and micro-batches in use vs the
    layout's, real tokens / all tokens of the arrays."""
    seg = np.asarray(packed["segment_ids_RxT"])
    used_rows = (seg > 0).any(axis=1)
    used_micro = used_rows.reshape(-1, rows_per_micro).any(axis=1)
    tokens = int((seg > 0).sum())
    return {
        "tokens": tokens,
        "rows": int(seg.shape[0]),
        "rows_used": int(used_rows.sum()),
        "micro_batches": int(used_micro.size),
        "micro_batches_used": int(used_micro.sum()),
        "fill_rate": tokens / max(int(used_rows.sum()) * seg.shape[1], 1),
        "fill_rate_computed": tokens / max(int(used_micro.sum()) * rows_per_micro * seg.shape[1], 1),
    }


def trim_padded_batch(batch: dict, minimum: int = MIN_BUCKET) -> dict:
    """The padded batch cut to the columns its sequences use, rounded up to a power-of-two length (>= minimum,
    <= the batch's own length): the same sequences, rows and order (positions and masks follow the real tokens),
    fewer padding columns. Used with rl.micro_batch_tokens and no packing."""
    attn = np.asarray(batch["attention_mask_BxT"])
    L = attn.shape[1]
    cols = np.flatnonzero((attn > 0).any(axis=0))
    if cols.size == 0:
        return dict(batch)
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    width = min(max(1 << max(hi - lo - 1, 0).bit_length(), int(minimum), 2), L)
    lo = min(lo, L - width)
    keep = slice(lo, lo + width)
    return {k: (np.asarray(v)[:, keep] if np.ndim(v) == 2 else v) for k, v in batch.items()}


def host_layout(batch: dict, cfg, shards: int) -> dict:
    """The train step's batch in the layout its config `cfg` (a TrainStepConfig: packing, micro_batch_tokens,
    num_mini_batches) asks for, from the padded host batch: packed (rows of packing.row_tokens tokens, 0 = the
    padded length), cut to its length bucket (token-budget micro-batches without packing) or as given.
    shards: the mesh's batch shards (1 without a mesh)."""
    if cfg.packing.enabled:
        rt = int(cfg.packing.row_tokens) or np.shape(batch["input_ids_BxT"])[1]
        return pack_batch(
            batch,
            row_tokens=rt,
            rows_per_micro=rows_per_micro(cfg.micro_batch_tokens, rt, shards),
            num_mini_batches=cfg.num_mini_batches,
        )
    if cfg.micro_batch_tokens:
        return trim_padded_batch(batch)
    return batch


def batch_shapes(cfg, num_sequences: int, seq_len: int, shards: int) -> dict:
    """{key: (shape, dtype)} of the step's batch for `num_sequences` padded rows of `seq_len` tokens in cfg's
    layout (the longest case for the token budget without packing): what the ahead-of-time compile lowers."""
    rollout = cfg.rollout_correction.rollout_log_probs  # the sampler's log-probs ride along (float32 per token)
    if cfg.packing.enabled:
        rt = int(cfg.packing.row_tokens) or seq_len
        R = rows_per_micro(cfg.micro_batch_tokens, rt, shards)
        rows = cfg.num_mini_batches * micro_batches_per_mini(num_sequences // cfg.num_mini_batches, R) * R
        shapes: dict[str, tuple] = {
            k: ((num_sequences,), np.float32 if k == "advantages_B" else np.int32)
            if k.endswith("_B")
            else ((rows, rt), np.int32)
            for k in PACKED_KEYS
        }
        if rollout:
            shapes[PACKED_ROLLOUT_LOGPROBS_KEY] = ((rows, rt), np.float32)
        return shapes
    shapes = {
        k: ((num_sequences,), np.float32) if k == "advantages_B" else ((num_sequences, seq_len), np.int32)
        for k in ("input_ids_BxT", "attention_mask_BxT", "response_mask_BxT", "advantages_B")
    }
    if rollout:
        shapes[PADDED_ROLLOUT_LOGPROBS_KEY] = ((num_sequences, seq_len), np.float32)
    return shapes


def padded_micro_batches(mini: int, seq_len: int, micro_batch_tokens: int, shards: int) -> int:
    """Micro-batches per mini-batch of the padded layout under a token budget: k sequences per device with k the
    largest divisor of the per-device mini-batch with k x seq_len <= micro_batch_tokens (at least 1)."""
    per_dev = mini // shards
    cap = max(1, int(micro_batch_tokens) // int(seq_len))
    k = max(d for d in range(1, min(cap, per_dev) + 1) if per_dev % d == 0)
    return per_dev // k


# ---------------------------------------------------------------------------------------------------------------
# In the step (jax): the packed rows' inputs, the sequence view and the micro-batch loop's pieces


def split_micro(x, n, mesh, batch_axes):
    """[N, ...] -> [n, N/n, ...] contiguous micro-batches, each spread over the batch shards when they divide."""
    y = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    if mesh is not None:
        shards = math.prod(mesh.shape[a] for a in batch_axes)
        if y.shape[1] % shards == 0:
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, batch_axes)))
    return y


def check_packed_batch(batch) -> None:
    missing = [k for k in PACKED_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"packed train batch (rl.packing.enabled) is missing keys {missing}; expected "
            f"{list(PACKED_KEYS)} (stare_jax.rl.packing.pack_batch)"
        )
    shape = jnp.shape(batch["input_ids_RxT"])
    if len(shape) != 2 or shape[1] < 2:
        raise ValueError(f"input_ids_RxT must be [rows, row_tokens] with row_tokens >= 2, got {shape}")
    for k in ("segment_ids_RxT", "response_mask_RxT"):
        if jnp.shape(batch[k]) != shape:
            raise ValueError(f"{k} must have shape {shape}, got {jnp.shape(batch[k])}")
    B = jnp.shape(batch["advantages_B"])
    for k in ("seq_row_B", "seq_col_B", "seq_len_B"):
        if jnp.shape(batch[k]) != B:
            raise ValueError(f"{k} must have shape {B}, got {jnp.shape(batch[k])}")


def sequence_view(x_NxV, row_B, col_B, len_B, row_offset=0):
    """[B, V]: sequence b's per-token values, left-aligned (column u = its token u + 1), read from packed rows
    x_NxV (row_offset = the global index of x's first row); 0 where b has no token u + 1 or lies outside x."""
    N, V = x_NxV.shape
    u = jnp.arange(V)
    local = row_B - row_offset
    inside = (local >= 0) & (local < N)
    valid = inside[:, None] & (u[None, :] < (len_B - 1)[:, None])
    idx = jnp.clip(local, 0, N - 1)[:, None] * V + jnp.clip(col_B[:, None] + u[None, :], 0, V - 1)
    return jnp.where(valid, x_NxV.reshape(-1)[idx], jnp.zeros((), x_NxV.dtype))


def _zeros_like_output(fn, *args):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))


@dataclasses.dataclass
class PackedLayout:
    """The packed batch inside the step: row inputs, per-sequence placement and the micro-batch structure."""

    ids: jax.Array  # [NR, Lr]
    seg: jax.Array  # [NR, Lr]
    tgt: jax.Array  # [NR, Lr - 1]
    lm_rows: jax.Array  # [NR, Lr - 1] float: loss mask on the rows (a response token of the same segment)
    adv: jax.Array  # [B]
    row_B: jax.Array
    col_B: jax.Array
    len_B: jax.Array
    rows: int  # R, rows per micro-batch
    micro: int  # M, micro-batches per mini-batch
    n_mini: int
    mesh: object
    batch_axes: tuple

    @classmethod
    def from_batch(cls, batch, *, n_mini: int, micro_batch_tokens: int, mesh, batch_axes) -> "PackedLayout":
        check_packed_batch(batch)
        ids = jnp.asarray(batch["input_ids_RxT"], jnp.int32)
        seg = jnp.asarray(batch["segment_ids_RxT"], jnp.int32)
        resp = jnp.asarray(batch["response_mask_RxT"])
        NR, Lr = ids.shape
        B = jnp.shape(batch["advantages_B"])[0]
        if B % n_mini:
            raise ValueError(f"batch size {B} must be divisible by num_mini_batches={n_mini}")
        shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in batch_axes)
        R = rows_per_micro(micro_batch_tokens, Lr, shards)
        M = micro_batches_per_mini(B // n_mini, R)
        if NR != n_mini * M * R:
            raise ValueError(
                f"packed batch has {NR} rows; the layout of {B} sequences in {n_mini} mini-batch(es), "
                f"{R} rows per micro-batch has {n_mini * M * R} (pack it with rows_per_micro={R})"
            )
        same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        lm_rows = ((resp[:, 1:] > 0) & same).astype(jnp.float32)
        return cls(
            ids,
            seg,
            ids[:, 1:],
            lm_rows,
            jnp.asarray(batch["advantages_B"], jnp.float32),
            jnp.asarray(batch["seq_row_B"], jnp.int32),
            jnp.asarray(batch["seq_col_B"], jnp.int32),
            jnp.asarray(batch["seq_len_B"], jnp.int32),
            R,
            M,
            n_mini,
            mesh,
            tuple(batch_axes),
        )

    @property
    def num_sequences(self) -> int:
        return self.adv.shape[0]

    def _by_sequence(self, x_BxV):
        """Sequence views split over the batch shards like the padded layout's [B, T] arrays (when they divide)."""
        if self.mesh is None or x_BxV.shape[0] % math.prod(self.mesh.shape[a] for a in self.batch_axes):
            return x_BxV
        return jax.lax.with_sharding_constraint(x_BxV, NamedSharding(self.mesh, P(self.batch_axes)))

    def view(self, x_NxV, row_offset=0):
        return self._by_sequence(sequence_view(x_NxV, self.row_B, self.col_B, self.len_B, row_offset))

    def loss_mask(self):
        return self.view(self.lm_rows)

    def _split(self, arrays, n):
        return tuple(split_micro(a, n, self.mesh, self.batch_axes) for a in arrays)

    def _nonempty(self, seg_MxRxT):
        return jnp.any(seg_MxRxT.reshape(seg_MxRxT.shape[0], -1) > 0, axis=1)

    def no_grad_pass(self, forward: Callable):
        """forward(ids, seg, tgt, lm) over every non-empty micro-batch (lax.map, empty ones skipped), its outputs
        (a tree of [R, Lr - 1] arrays) read back as [B, Lr - 1] sequence views."""
        n = self.n_mini * self.micro
        xs = self._split((self.ids, self.seg, self.tgt, self.lm_rows), n)
        zeros = _zeros_like_output(forward, *(x[0] for x in xs))

        def one(args):
            x, nonempty = args
            return jax.lax.cond(nonempty, lambda: forward(*x), lambda: zeros)

        outs = jax.lax.map(one, (xs, self._nonempty(xs[1])))
        rows = jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:]), outs)
        return jax.tree.map(self.view, rows)

    def micro_batches(self, j, mb_seq: tuple):
        """(xs, nonempty, micro_fn) of mini-batch j (traced) for the update's scan: xs the micro-batches' row inputs
        and global micro-batch index, nonempty [M] bool; micro_fn(forward, x) -> (log-probs, entropy, per-sequence
        arrays) on mini-batch j's view, the loss mask (mb_seq[0]) restricted to the micro-batch's sequences."""
        span = self.micro * self.rows
        rows = tuple(
            jax.lax.dynamic_slice_in_dim(a, j * span, span, axis=0)
            for a in (self.ids, self.seg, self.tgt, self.lm_rows)
        )
        xs = self._split(rows, self.micro) + (j * self.micro + jnp.arange(self.micro),)
        mini = self.num_sequences // self.n_mini
        place = tuple(jax.lax.dynamic_slice_in_dim(a, j * mini, mini) for a in (self.row_B, self.col_B, self.len_B))

        def micro_fn(forward, x):
            ids, seg, tgt, lm_r, k = x
            lp_r, ent_r = forward(ids, seg, tgt, lm_r)
            offset = k * self.rows
            lp, ent = (self._by_sequence(sequence_view(o, *place, offset)) for o in (lp_r, ent_r))
            inside = (place[0] >= offset) & (place[0] < offset + self.rows)
            return lp, ent, (mb_seq[0] * inside[:, None].astype(mb_seq[0].dtype),) + tuple(mb_seq[1:])

        return xs, self._nonempty(xs[1]), micro_fn
