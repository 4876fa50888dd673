"""The rollout engine: continuous batching over a paged KV cache, with prefix sharing, chunked prefill and
multi-turn continuation. A drop-in for `Sampler` (same `generate_arrays` / `generate` signatures and outputs).

Design (host scheduler + three jitted programs):
- Slots. `max_slots` decode slots; a queue of (prompt, sample g) requests, prompt-major. Each round the host
  (1) admits queued requests into free slots, (2) runs one prefill program over every row that still has prompt
  (or appended) tokens to write -- at most `prefill_chunk` tokens per row per round, so a long prompt never
  stalls decoding for more than one chunk, (3) attaches rows whose shared prompt prefix is complete, (4) runs
  one decode program of up to `decode_chunk` (K) steps over the ready slots, then reads back the K tokens per
  slot and frees the slots (and pages) of rows that finished (EOS or their max_new_tokens). A finished row's
  slot is refilled in the next round. The decode program exits early when every slot is done.
- Pages. Per layer k/v [K, num_pages, page_size, Dh] (kv heads first: models.paged_attention.pool_shape; on a
  CPU the keys [K, num_pages, Dh, page_size]: paged_attention.keys_transposed) allocated once (page 0 = trash
  page for padding writes); host-side free list + reference counts (paged_kv.PagePool) and a per-row page
  table. Pages are allocated as a row grows (one chunk ahead) and returned when it ends, so memory scales with
  live tokens. Prefill attention gathers a row's first M pages, M a power-of-two bucket over the live rows
  (models/paged_attention.py); decode attention is
  `sampling.engine.attention`: the same gather path, or (auto on a TPU with head_dim % 128 == 0 and a bfloat16
  pool) jax's TPU Pallas paged-attention kernel, which reads the live pages in place (under jax.shard_map on a
  mesh: each device runs it on its data shard's pool and its kv heads).
- Prefix sharing. The G samples of a prompt share its prefix pages: the prompt minus its last token is
  prefilled ONCE into a prefix entry; each sample then shares the entry's full pages (reference counted) and
  gets a private copy of the partial last page (copy-on-write at attach time), so its first new token (and the
  last prompt token, fed by the first decode step) go to a slot-private page. No page is ever written by two
  rows. The entry is dropped once all G samples are attached.
- Randomness. Sample g of prompt p draws its token at response index i from
  uniform(fold_in(fold_in(fold_in(key(seed), p), g), i)) -- exactly the static Sampler's keys -- so the tokens
  do not depend on slot, max_slots, K, page layout or which other rows run (tests check all of these).
- Pages exhausted. Rows parked between turns (keep=True: a multi-turn row waiting on its tool call) give their
  pages first, the most recently parked first (`stats["evictions"]`); their next turn prefills the whole
  conversation again. Then a row that cannot grow preempts the most recently admitted decoding row (LIFO): its
  pages are freed and it goes back to the queue front; on re-admission it is recomputed (its whole conversation
  prefilled again; same draws, same tokens). A request that cannot fit an empty pool is a ValueError naming
  sampling.engine.num_pages and the value needed.
- Multi-turn. `start` keeps rows alive after their turn (`Conversation`); `extend` appends given tokens (a
  tool's output, loss mask 0, log-prob NaN) and continues sampling: only the new tokens are prefilled into the
  row's pages, the conversation is never re-prefilled. Both block until every turn ended, or with wait=False
  only queue the rows into the running batch (`_Batch`: the shards' scheduler state, kept between calls while
  rows are queued or decoding); `advance` then runs one round and returns the rows whose turn ended in it, and
  `extend(..., wait=False)` of some of them queues their next turn while the other rows keep decoding (the
  event-driven tool rollout: tools/rollout.py). A row whose turn ended gives its slot back at once (a row
  waiting on a tool call never holds a slot or masks a decode row) and keeps its pages (its continuation
  prefills only the appended tokens, unless a short pool evicted them). The rows of a batch share its sampling
  arguments; a blocking call on an engine with a running batch is refused; `close` of a running row cancels the
  batch (an error path).
- Weights. `update_params` reshards the trainer's parameters on device into the sampler layout (as Sampler);
  the page pool is allocated on the first call and reused (donated through every program) until `release`
  frees it with the weight copy before the train step; nothing recompiles across RL steps once the page-table
  width buckets of a workload have been seen.
- Mesh: parameters in the sampler layout, the pool's kv heads over the tensor axis. A mesh that splits the batch
  over D = batch_shards(mesh) data shards (its data / fsdp axes) gives each shard its own ceil(max_slots / D)
  slots and its own pool of ceil(num_pages / D) pages: the pool per layer is [D, K, N/D, P, Dh] (the leading axis
  over the batch axes, kv heads over tensor), page tables hold shard-local page ids, and D host sub-schedulers
  (_Shard: free list, queue, slots, prefix entries) each admit, grow, preempt and retire their own rows. Prompts
  go to shards whole (all G samples on one shard, so prefix pages are shared in one pool), balanced by token
  work. The programs run the one-shard body under jax.vmap(spmd_axis_name=the batch axes) over the shard axis:
  each device gathers and writes only its own pages (tests check the compiled programs have no all-gather of the
  pool). Every round every shard advances one program (a shard without work runs masked rows; rows are bucketed
  by the busiest shard); a decode chunk ends early once any shard can refill slots. Draws depend on (seed,
  prompt, g, step) only, so the tokens do not depend on the shard. One shard (D = 1) is the program without the
  shard axis.
- Multi-process (multi-host) runs: the host scheduler is replicated SPMD. Every process runs the same scheduler
  on the same host data (the prompts, the appended tool tokens) and so takes the same decisions (admission,
  pages, preemption, bucket shapes); the only cross-process data are device results. Every host input of a
  program (tokens, positions, page tables, budgets, copy lists, sampling scalars) is built by every process from
  its identical host value with distributed.global_from_host (each process places its own devices' pieces:
  `_put`, `_put_rows`); the pool is a global array made in its sharding by a jitted program; the tokens,
  log-probs, counts and EOS flags of a decode chunk come back to every process in one distributed.fetch_global
  per chunk. Draws depend on (seed, prompt, g, step) only, so the tokens equal the single-process engine's
  (tests/test_multihost_engine.py: 2 processes x 4 devices == 1 x 8). `generate_arrays` returns arrays
  replicated over the mesh (global arrays that fetch_global reads on every process).
- Not yet: a Pallas prefill kernel (prefill gathers on every platform; over a context longer than two
  PREFILL_KEY_BLOCKs it attends one key block at a time, so its fp32 scores stay one block wide).
- Ahead of time: `Engine.trace_programs` traces the decode and prefill programs at their largest shapes on an
  abstract engine (models.abstract_model), for stare_jax.training.aot to compile for a TPU slice on a CPU host.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stare_jax import distributed
from stare_jax.models import paged_attention as pa
from stare_jax.models import sharding as model_sharding
from stare_jax.sampling import paged_kv, selection
from stare_jax.sampling import sharding as sampling_sharding
from stare_jax.config.engine import EngineConfig
from stare_jax.sampling.sampler import (SampleArrays, SampleOutput, Sampler, _check_prompts, _check_sampling_args,
                                        _eos_array, model_config)


EXIT_FRACTION = 4  # a decode chunk ends early once 1/EXIT_FRACTION of the slots can be refilled
MIN_ROWS = 4  # smallest prefill / decode batch (fewer compiled shapes)
MIN_WIDTH = 1  # smallest page-table width (pages) of a program (buckets: powers of two)

# ----------------------------------------------------------------------------------------------- config

# ----------------------------------------------------------------------------------------------- programs

def _row_keys(key, prompt_index_S, sample_S):
    """fold_in(fold_in(key, p), g) per row: the static Sampler's sequence keys."""
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(
        prompt_index_S.astype(jnp.uint32), sample_S.astype(jnp.uint32))


def _over_shards(f, batch_axes: tuple):
    """f itself for one data shard (no leading shard axis); with batch_axes, f vmapped over the leading shard
    axis [D, ...] of every argument, that axis split over the mesh's batch axes: each shard's rows gather and
    write only its own page pool, on its own devices (no pool all-gather)."""
    return jax.vmap(f, spmd_axis_name=batch_axes) if batch_axes else f


def _decode_chunk(graphdef, state, pages, page_table_SxM, tok_S, pos_S, step_S, budget_S, live_S, prompt_index_S,
                  sample_S, exit_after, key, greedy, temperature, top_k, top_p, eos_E, *, steps: int, page_size: int,
                  pad_id: int, batch_axes: tuple = (), attention: str = "gather", keys_transposed: bool = False):
    """Up to `steps` decode steps of every live slot: feed tok_S at pos_S, draw the token of response index
    step_S, stop a row on EOS or at step budget_S. The chunk ends early once `exit_after` rows have finished (the
    host has that many queued requests to put in their slots) or every row is done. With batch_axes (a mesh split
    over data shards) every row argument has a leading shard axis [D, S], pages [D, N, ...] and exit_after [D]:
    the chunk ends once any shard can refill its slots. attention: the decode attention backend ("gather" or
    "pallas": models.paged_attention); keys_transposed: the key pools' layout (paged_attention.keys_transposed).
    Returns (pages, tokens_SxK, logprobs_SxK, count_S, eos_S)."""
    model = nnx.merge(graphdef, state)
    keys_S = _over_shards(lambda p, g: _row_keys(key, p, g), batch_axes)(prompt_index_S, sample_S)

    def step_rows(pages, page_table_SxM, tok, pos, step, done, keys_S):
        hidden, pages = pa.paged_forward(model, tok[:, None], pos[:, None], ~done[:, None], pages, page_table_SxM,
                                         page_size, attention=attention, batch_axes=batch_axes,
                                         keys_transposed=keys_transposed)
        logits_SxV = model.logits_from_hidden(hidden)[:, -1].astype(jnp.float32)
        u_S = jax.vmap(lambda k, s: jax.random.uniform(jax.random.fold_in(k, s)))(keys_S, step)
        t, lp = selection.select_tokens(logits_SxV, u_S, greedy=greedy, temperature=temperature, top_k=top_k,
                                        top_p=top_p)
        return pages, t, lp

    step_rows = _over_shards(step_rows, batch_axes)

    def body(c):
        i, pages, tok, pos, step, done, eos, toks, lps, n = c
        pages, t, lp = step_rows(pages, page_table_SxM, tok, pos, step, done, keys_S)
        t = jnp.where(done, pad_id, t)
        lp = jnp.where(done, 0.0, lp)
        toks = jax.lax.dynamic_update_slice_in_dim(toks, t[..., None], i, axis=-1)
        lps = jax.lax.dynamic_update_slice_in_dim(lps, lp[..., None], i, axis=-1)
        hit = jnp.any(t[..., None] == eos_E, axis=-1) & ~done
        live = (~done).astype(jnp.int32)
        step, pos, n = step + live, pos + live, n + live
        tok = jnp.where(done, tok, t)
        return (i + 1, pages, tok, pos, step, done | hit | (step >= budget_S), eos | hit, toks, lps, n)

    init = (jnp.int32(0), pages, tok_S, pos_S, step_S, ~live_S | (step_S >= budget_S), jnp.zeros(tok_S.shape, bool),
            jnp.full(tok_S.shape + (steps,), pad_id, jnp.int32), jnp.zeros(tok_S.shape + (steps,), jnp.float32),
            jnp.zeros(tok_S.shape, jnp.int32))
    def cond(c):
        finished = jnp.sum(c[5] & live_S, axis=-1)
        return (c[0] < steps) & jnp.any(~c[5]) & jnp.all(finished < exit_after)

    c = jax.lax.while_loop(cond, body, init)
    return c[1], c[7], c[8], c[9], c[6]


def _prefill(graphdef, state, pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM, *, page_size: int,
             batch_axes: tuple = (), keys_transposed: bool = False):
    """Write the k/v of one chunk of tokens per row into its pages (the logits are not needed; attention over the
    gathered pages, whatever the decode backend); with batch_axes every argument but the weights has a leading
    data-shard axis. keys_transposed: the key pools' layout (paged_attention.keys_transposed)."""
    model = nnx.merge(graphdef, state)

    def write(pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM):
        return pa.paged_forward(model, ids_RxC, pos_RxC, valid_RxC, pages, page_table_RxM, page_size,
                                keys_transposed=keys_transposed)[1]

    return _over_shards(write, batch_axes)(pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM)


def _copy_pages(pages, src_C, dst_C, *, batch_axes: tuple = ()):
    """pages[dst] = pages[src] in every layer (copy-on-write of a shared prompt's partial last page); with
    batch_axes, within each data shard's pool."""
    def copy(pages, src_C, dst_C):
        return [{name: pa.copy_pages(x, src_C, dst_C) for name, x in layer.items()} for layer in pages]

    return _over_shards(copy, batch_axes)(pages, src_C, dst_C)


_decode_jit = jax.jit(_decode_chunk, static_argnames=("graphdef", "steps", "page_size", "pad_id", "batch_axes",
                                                     "attention", "keys_transposed"), donate_argnames=("pages",))
_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "page_size", "batch_axes", "keys_transposed"),
                       donate_argnames=("pages",))
_copy_jit = jax.jit(_copy_pages, static_argnames=("batch_axes",), donate_argnames=("pages",))


def compiled_programs() -> int:
    """Number of engine programs compiled so far in this process (for recompilation checks)."""
    return sum(f._cache_size() for f in (_decode_jit, _prefill_jit, _copy_jit))  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------- host state

@dataclasses.dataclass
class _Prefix:
    """A prompt's shared prefix (the prompt minus its last token) being / having been prefilled once."""

    key: int  # the prompt's position in the call
    tokens: list[int]
    pages: list[int]
    waiting: int  # samples of this prompt not yet attached; the entry is dropped at 0
    written: int = 0

    @property
    def complete(self) -> bool:
        return self.written >= len(self.tokens)


@dataclasses.dataclass
class Conversation:
    """One sequence (sample g of prompt p) of the engine: its tokens, pages and sampling position.

    tokens: the whole conversation (prompt, then sampled and appended tokens). response_mask: 1 for sampled
    tokens, 0 for appended ones (tool output) -- the loss mask. response_logprobs: temperature-1 log-probs of
    sampled tokens, NaN for appended ones. turn_tokens / turn_logprobs: what the last call sampled.
    """

    index: int
    prompt_index: int
    sample: int
    prompt_len: int
    seq: list[int]  # tokens before this turn's sampled ones
    response_mask: list[int] = dataclasses.field(default_factory=list)
    response_logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_tokens: list[int] = dataclasses.field(default_factory=list)
    turn_logprobs: list[float] = dataclasses.field(default_factory=list)
    finished_eos: bool = False
    pages: list[int] = dataclasses.field(default_factory=list)
    written: int = 0  # tokens whose k/v are in pages (all but the last token once ready)
    budget: int = 0  # response index at which this turn stops
    turn_start: int = 0  # response index of this turn's first sampled token
    prefix: _Prefix | None = None
    tail: int | None = None  # private page reserved for the copy of the prefix's partial last page
    admitted: int = 0
    closed: bool = False
    shareable: bool = False  # a fresh first turn that may attach to its prompt's prefix entry
    prompt_pos: int = 0  # the prompt's position in the call (prefix entries are keyed by it)
    shard: int = 0  # the data shard whose slots and page pool hold it (page ids are that pool's)
    running: bool = False  # queued or in a slot of the running batch (its turn has not ended)

    @property
    def tokens(self) -> list[int]:
        return self.seq + self.turn_tokens

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def step(self) -> int:
        """Response index of the next draw (the key's step)."""
        return len(self.tokens) - self.prompt_len

    @property
    def ready(self) -> bool:
        return self.prefix is None and self.written == len(self.tokens) - 1


@dataclasses.dataclass
class _Shard:
    """One data shard's scheduler state during a call: its page pool (shard-local page ids), decode slots, request
    queue and prompt prefix entries. A one-shard engine has one; a mesh split over D data shards has D, each
    scheduled alone (its rows never touch another shard's pages)."""

    pool: paged_kv.PagePool
    slots: list[Conversation | None]
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    prefixes: dict[int, _Prefix] = dataclasses.field(default_factory=dict)
    waiting: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # unattached samples
    ended: list[Conversation] = dataclasses.field(default_factory=list)  # turns ended this round (slots freed)

    def busy(self) -> bool:
        return bool(self.queue) or any(c is not None for c in self.slots)

    def ready(self) -> list[tuple[int, Conversation]]:
        """(slot, row) of every row ready to decode."""
        return [(s, c) for s, c in enumerate(self.slots) if c is not None and c.ready]


@dataclasses.dataclass
class _Batch:
    """The running batch: every data shard's scheduler state and what its rows share (the sampling arguments, keep),
    from the first conversation queued on an idle engine until no conversation is queued or decoding."""

    shards: list[_Shard]
    sampling: tuple
    scalars: list
    keep: bool

    def busy(self) -> bool:
        return any(sh.busy() for sh in self.shards)


def assign_shards(work_P: Sequence[int], shards: int) -> list[int]:
    """The data shard of each prompt (all its samples go there, so its prefix pages are shared within one pool):
    greedily the shard with the least queued token work so far, ties to the lowest shard (round-robin for equal
    work)."""
    load = [0] * shards
    out = []
    for w in work_P:
        d = min(range(shards), key=lambda i: (load[i], i))
        load[d] += int(w)
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------------- the engine

class Engine:
    """Continuous-batching rollout engine over a paged KV cache (see the module docstring).

    Same constructor arguments as Sampler (mesh, cache_dtype, pad_id) plus `config` (EngineConfig). With a
    mesh, parameters are kept in the sampler layout (replicated over the data axes, "tensor" kept) and the page
    pool's kv heads are split over the tensor axis. A mesh that splits the batch over D data shards (its data /
    fsdp axes) gives each shard its own ceil(max_slots / D) slots and its own pool of ceil(num_pages / D) pages
    (arrays with a leading shard axis split over those axes), each scheduled by its own host sub-scheduler;
    prompts are assigned to shards whole (all G samples on one shard). `stats` counts, per call, prefix
    prefills, recomputes (preemptions), decode chunks/steps and the peak number of pages in use.
    """

    def __init__(self, model: nnx.Module, *, config: EngineConfig | None = None, mesh: Mesh | None = None,
                 cache_dtype=jnp.float32, pad_id: int | None = None):
        self.config = model_config(model)
        self.engine_config = config if config is not None else EngineConfig()
        if self.engine_config.max_slots == "auto":
            raise ValueError("sampling.engine.max_slots=auto reached the engine unresolved: resolve it with "
                             "stare_jax.planning.estimate.resolve_max_slots (the run does) or give a number")
        self.mesh = mesh
        self.cache_dtype = jnp.dtype(cache_dtype).name
        cfg_pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else 0))
        self.compute_dtype = jnp.dtype(getattr(self.config, "dtype", "float32")).name
        self.graphdef, state = nnx.split(model)
        self.state = None
        self.pages: Any = None  # per layer k/v page arrays (made with the pools), [D, N, ...] over D > 1 shards
        self.pools: list[paged_kv.PagePool] | None = None  # one per data shard
        self.stats: dict = {}
        self._admitted = 0
        self._batch: _Batch | None = None  # the running batch (conversations queued or decoding)
        self._parked: list[Conversation] = []  # rows between turns that keep their pages (keep=True), in park order
        self._replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self._batch_axes: tuple[str, ...] = ()  # the mesh axes of the leading shard axis (none: one shard)
        self._split: NamedSharding | None = None  # the layout of a per-shard argument [D, ...]
        if mesh is not None and self.data_shards > 1:
            self._batch_axes = model_sharding.batch_axes(mesh)
            self._split = NamedSharding(mesh, PartitionSpec(self._batch_axes))
        self.attention = pa.resolve_attention(self.engine_config.attention, platform=self.platform,
                                              head_dim=self.config.head_dim, cache_dtype=self.cache_dtype)
        self.keys_transposed = pa.keys_transposed(self.attention, self.platform,
                                                  getattr(self.config, "attention_impl", "xla"))
        self.update_params(state)

    @property
    def pool(self) -> paged_kv.PagePool | None:
        """The page pool of a one-shard engine (None before the first call and after `release`); a mesh split
        over data shards has one per shard: `pools`."""
        if self.pools is None:
            return None
        if len(self.pools) != 1:
            raise AttributeError(f"the engine has {len(self.pools)} page pools (one per data shard): use .pools")
        return self.pools[0]

    @property
    def live_pool(self) -> paged_kv.PagePool:
        """The page pool of the call in progress (made by the call's first step; one-shard engines)."""
        if self.pool is None:
            raise RuntimeError("the engine has no page pool yet: it is made by the first generate call")
        return self.pool

    # ------------------------------------------------------------------ Sampler-compatible surface
    def update_params(self, params) -> None:
        """New parameters (nnx.Module or its nnx.State), resharded on device into the sampler layout."""
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        self.state = None
        self.state = sampling_sharding.reshard_for_sampling(state, self.mesh, dtype=self.compute_dtype)

    def release(self) -> None:
        """Drop the weight copy and, when no conversation holds pages, the KV page pools (before the train step:
        sampling and training never hold their largest buffers at once). `update_params` brings the weights back;
        the next call makes the pools again (the same shapes: nothing recompiles)."""
        self.state = None
        if self._batch is None and (self.pools is None or all(p.all_free() for p in self.pools)):
            self.pages = None
            self.pools = None

    def batch_bucket(self, num_prompts: int) -> int:
        """The engine needs no batch padding (requests are queued): the number of prompts itself."""
        return max(int(num_prompts), 1)

    @property
    def platform(self) -> str:
        """The platform the programs run on: the mesh's devices' (a TPU topology's in an ahead-of-time compile on
        a CPU host), else the default backend."""
        return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

    @property
    def data_shards(self) -> int:
        return model_sharding.batch_shards(self.mesh)

    def program_context(self):
        """The mesh and its activation rules around the jitted programs (nothing without a mesh). Over data
        shards the rows of a program are one shard's (the shard axis carries the batch axes), so the row
        dimension inside is not split again."""
        rules = {**model_sharding.DEFAULT_RULES, "batch": None} if self._batch_axes else None
        return model_sharding.program_context(self.mesh, rules)

    def generate_arrays(self, prompt_ids_PxT, prompt_mask_PxT, *, max_new_tokens: int, num_samples: int = 1,
                        temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None,
                        seed: int = 0, prompt_index_P=None, active_P=None) -> SampleArrays:
        """Sampler.generate_arrays: LEFT-padded prompts [P, T] -> SampleArrays with P * num_samples rows
        (prompt-major) and max_new_tokens columns; inactive prompts give length-0 rows."""
        _check_sampling_args(max_new_tokens, num_samples, temperature, top_p, top_k)
        ids, mask = distributed.fetch_global((prompt_ids_PxT, prompt_mask_PxT))
        P, T = ids.shape
        if mask.shape != (P, T):
            raise ValueError(f"prompt_mask_PxT shape {mask.shape} != prompt_ids_PxT shape {(P, T)}")
        if P == 0 or T == 0:
            raise ValueError(f"empty prompt batch: prompt_ids_PxT has shape {(P, T)}")
        index = np.arange(P) if prompt_index_P is None else distributed.fetch_global(prompt_index_P)
        active = np.ones((P,), bool) if active_P is None else distributed.fetch_global(active_P).astype(bool)
        prompts = [ids[p][mask[p] > 0].tolist() for p in range(P)]
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos is not None and max_new_tokens >= max_pos:  # as Sampler.generate_arrays: prompt + response
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's "  # may
                             f"context {max_pos}")  # run past the context (the caller warns), not the budget alone
        for p in range(P):
            if active[p] and not prompts[p]:
                raise ValueError(f"prompt {p} has no tokens (its mask is all 0)")
        convs = self._run_fresh([(p, prompts[p], int(index[p])) for p in range(P) if active[p]], max_new_tokens,
                                num_samples, keep=False,
                                sampling=(temperature, top_p, top_k, eos_ids, seed))
        G, N = num_samples, max_new_tokens
        tokens = np.full((P * G, N), self.pad_id, np.int32)
        logprobs = np.zeros((P * G, N), np.float32)
        lengths = np.zeros((P * G,), np.int32)
        finished = np.zeros((P * G,), bool)
        for c in convs:
            n = len(c.turn_tokens)
            tokens[c.index, :n], logprobs[c.index, :n] = c.turn_tokens, c.turn_logprobs
            lengths[c.index], finished[c.index] = n, c.finished_eos
        # replicated over the mesh: in a multi-process run global arrays that fetch_global reads on every process
        return SampleArrays(self._put(tokens), self._put(logprobs), self._put(lengths), self._put(finished))

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, num_samples: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None,
                 seed: int = 0) -> SampleOutput:
        """Sampler.generate: token-id lists -> SampleOutput (prompt-major, index p * num_samples + g)."""
        convs = self.start(prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples,
                           temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=eos_ids, seed=seed, keep=False)
        return SampleOutput(tokens=[c.turn_tokens for c in convs], logprobs=[c.turn_logprobs for c in convs],
                            finish_reasons=["eos" if c.finished_eos else "length" for c in convs],
                            lengths=[len(c.turn_tokens) for c in convs])

    @property
    def abstract(self) -> bool:
        """True when the engine holds jax.ShapeDtypeStructs (built from models.abstract_model): its programs can
        be traced and lowered (`trace_programs`), not run."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))

    def trace_programs(self, longest_tokens: int) -> dict[str, Any]:
        """The jax `Traced` decode and prefill programs (lower them under program_context()) at their largest
        shapes for requests of up to `longest_tokens` tokens (prompt + response): every slot of every data shard
        live, the page table as wide as the longest request's pages, a full prefill chunk per row, the pool as
        the run allocates it (`_pages_per_shard`), in the layouts the scheduler passes. For an ahead-of-time
        compile (e.g. a TPU slice on a CPU host: stare_jax.training.aot); needs an abstract engine."""
        if not self.abstract:
            raise ValueError("Engine.trace_programs needs an abstract engine (built from models.abstract_model)")
        cfg, ec = self.config, self.engine_config
        num = self._pages_per_shard(longest_tokens)
        lead = (self.data_shards,) if self._batch_axes else ()
        def pool(transposed: bool):
            shape = pa.pool_shape(num, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self._shard_axis(),
                                  transposed=transposed)
            return jax.ShapeDtypeStruct(shape, jnp.dtype(self.cache_dtype),
                                        sharding=self._pool_sharding(shape) if self.mesh is not None else None)

        pages = [{"k": pool(self.keys_transposed), "v": pool(False)} for _ in range(cfg.num_layers)]
        rows = self._slots_per_shard()
        width = self._width(paged_kv.pages_for(longest_tokens, ec.page_size))
        split = self._split if self._split is not None else self._replicated

        def arg(shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct((*lead, *shape), jnp.dtype(dtype), sharding=split)

        rep = self._replicated
        scalars = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)
                   for x in [jax.eval_shape(lambda: jax.random.key(0)), *self._sampling_values((1.0, 1.0, 0, None, 0))]]
        with self.program_context():
            decode = _decode_jit.trace(
                self.graphdef, self.state, pages, arg((rows, width)), *(arg((rows,)) for _ in range(4)),
                arg((rows,), bool), arg((rows,), np.uint32), arg((rows,), np.uint32), arg((), np.int32), *scalars,
                steps=ec.decode_chunk, page_size=ec.page_size, pad_id=self.pad_id, batch_axes=self._batch_axes,
                attention=self.attention, keys_transposed=self.keys_transposed)
            chunk = ec.prefill_width(longest_tokens)
            prefill = _prefill_jit.trace(
                self.graphdef, self.state, pages, arg((rows, chunk)), arg((rows, chunk)), arg((rows, chunk), bool),
                arg((rows, width)), page_size=ec.page_size, batch_axes=self._batch_axes,
                keys_transposed=self.keys_transposed)
        return {"decode": decode, "prefill": prefill}

    # ------------------------------------------------------------------ multi-turn API
    def start(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, num_samples: int = 1,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None, seed: int = 0,
              keep: bool = True, prompt_index=None, wait: bool = True) -> list[Conversation]:
        """Sample the first turn of num_samples conversations per prompt (prompt-major). keep=True keeps each
        conversation's pages alive for `extend` (free them with `close`). wait=False only queues them: `advance`
        runs the scheduler round by round (an event-driven multi-turn rollout)."""
        _check_sampling_args(max_new_tokens, num_samples, temperature, top_p, top_k)
        prompts = _check_prompts(prompt_ids, self.config, max_new_tokens)
        index = range(len(prompts)) if prompt_index is None else [int(i) for i in prompt_index]
        return self._run_fresh(list(zip(range(len(prompts)), prompts, index)), max_new_tokens, num_samples,
                               keep=keep, sampling=(temperature, top_p, top_k, eos_ids, seed), wait=wait)

    def extend(self, convs: Sequence[Conversation], appended: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int], temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               eos_ids=None, seed: int = 0, keep: bool = True, wait: bool = True) -> list[Conversation]:
        """Append the given tokens (e.g. a tool's output; not sampled: mask 0, log-prob NaN) to each live
        conversation and sample its next turn. Only the new tokens (and the previous turn's last token) are
        prefilled into the conversation's pages. Use the same seed as `start` for reproducible draws.
        max_new_tokens: one limit for every conversation's turn, or one per conversation (e.g. what is left of
        each response's token budget in a multi-turn rollout). wait=False queues them into the running batch (or
        a new one) while its other rows go on decoding: the conversations whose turn ended (handed out by
        `advance`) rejoin decoding at the next round; same sampling arguments and keep as the running batch."""
        limits = ([max_new_tokens] * len(convs) if isinstance(max_new_tokens, (int, np.integer))
                  else list(max_new_tokens))
        if len(limits) != len(convs):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(convs)} conversations")
        for n in limits or [1]:
            _check_sampling_args(n, 1, temperature, top_p, top_k)
        if len(appended) != len(convs):
            raise ValueError(f"{len(appended)} appended token lists for {len(convs)} conversations")
        for c in convs:  # before any turn is opened
            if c.closed or c.running:
                raise ValueError(f"conversation {c.index} is {'closed' if c.closed else 'still running'}")
        max_pos = getattr(self.config, "max_position_embeddings", None)
        for c, extra, limit in zip(convs, appended, limits):
            extra = [int(t) for t in extra]
            bad = [t for t in extra if not 0 <= t < int(self.config.vocab_size)]
            if bad:
                raise ValueError(f"conversation {c.index}: appended token id {bad[0]} outside the vocabulary")
            total = len(c.tokens) + len(extra) + int(limit)
            if max_pos is not None and total > max_pos:
                raise ValueError(f"conversation {c.index}: {total} tokens exceed the model's context {max_pos}")
            self._new_turn(c, int(limit), appended=extra)
        self._run(list(convs), keep=keep, sampling=(temperature, top_p, top_k, eos_ids, seed), wait=wait)
        return list(convs)

    @property
    def running(self) -> bool:
        """Conversations are queued or decoding (queued with wait=False: `advance` runs them)."""
        return self._batch is not None

    def advance(self) -> list[Conversation]:
        """One scheduler round of the running batch (module docstring: admit, prefill a chunk, attach, decode up to
        decode_chunk steps, retire). Returns the conversations whose turn ended in it (EOS, a stop id or the turn's
        limit), in slot order: their slots are free for other rows and, with keep=True, their pages kept, so a
        multi-turn rollout can run their tool call while the other rows keep decoding and `extend(...,
        wait=False)` them when it returns. [] when nothing is running."""
        b = self._batch
        if b is None:
            return []
        try:
            with self.program_context():
                self.stats["rounds"] += 1
                progress = any([self._admit(sh) for sh in b.shards])
                progress |= self._prefill_round(b.shards)
                self._attach(b.shards)
                progress |= self._decode_round(b.shards, b.scalars, b.keep)
            if not progress and not any(self._drop_idle_prefix(sh) for sh in b.shards):
                raise paged_kv.PagesExhausted(
                    f"the page pool ({[sh.pool.num_pages for sh in b.shards]} pages per shard, "
                    f"{[sh.pool.num_free for sh in b.shards]} free) cannot make progress: raise "
                    f"sampling.engine.num_pages")
        except BaseException:
            self._cancel()
            raise
        self.stats["peak_pages"] = sum(sh.pool.peak_used for sh in b.shards)
        ended = [c for sh in b.shards for c in sh.ended]
        for sh in b.shards:
            sh.ended.clear()
        for c in ended:
            c.running = False
        self._parked += [c for c in ended if not c.closed]
        if not b.busy():
            self._batch = None
        return ended

    def close(self, convs: Sequence[Conversation]) -> None:
        """Free the pages of finished conversations. Closing one that is still running (an error path) cancels the
        running batch first (every row of it stops)."""
        if any(c.running for c in convs):
            self._cancel()
        self._unpark(convs)
        for c in convs:
            if not c.closed:
                self._pools()[c.shard].release(c.pages)
                c.pages, c.closed = [], True

    # ------------------------------------------------------------------ scheduling
    @staticmethod
    def _new_turn(c: Conversation, max_new_tokens: int, appended: Sequence[int] = ()) -> None:
        """Commit the last turn's sampled tokens to the conversation, append the given ones, open a new turn."""
        c.response_mask += [1] * len(c.turn_tokens) + [0] * len(appended)
        c.response_logprobs += c.turn_logprobs + [float("nan")] * len(appended)
        c.seq = c.tokens + list(appended)
        c.turn_tokens, c.turn_logprobs, c.finished_eos = [], [], False
        c.turn_start = c.step
        c.budget = c.step + max_new_tokens

    def _run_fresh(self, prompts, max_new_tokens, G, *, keep, sampling, wait=True) -> list[Conversation]:
        """Queue num_samples conversations of every (output position, prompt, prompt index) and run them (wait) or
        leave them queued; each prompt's samples on one data shard (assign_shards by prompt + response tokens)."""
        shard_P = assign_shards([len(prompt) + max_new_tokens for _, prompt, _ in prompts], self.data_shards)
        convs = []
        for (p, prompt, pidx), d in zip(prompts, shard_P):
            for g in range(G):
                c = Conversation(index=p * G + g, prompt_index=pidx, sample=g, prompt_len=len(prompt),
                                 seq=list(prompt), shareable=len(prompt) > 1, prompt_pos=p, shard=d)
                self._new_turn(c, max_new_tokens)
                convs.append(c)
        self._run(convs, keep=keep, sampling=sampling, wait=wait)
        return convs

    def _pools(self) -> list[paged_kv.PagePool]:
        if self.pools is None:
            raise RuntimeError("the engine has no page pool yet: it is made by the first generate call")
        return self.pools

    def _slots_per_shard(self) -> int:
        """Decode slots of each data shard: max_slots split over the shards (rounded up)."""
        slots = self.engine_config.max_slots
        assert isinstance(slots, int)  # auto is refused in __init__
        return -(-slots // self.data_shards)

    def _ensure_pool(self, convs) -> None:
        """Allocate the page pools once (or grow them in auto mode): one of num_pages / D pages per data shard;
        ValueError if one request cannot fit a shard's pool."""
        ec, D = self.engine_config, self.data_shards
        longest = max(len(c.seq) + (c.budget - c.turn_start) for c in convs)
        one = paged_kv.pages_for(longest, ec.page_size) + 1  # + the prefix entry's staging page
        num = self._pages_per_shard(longest)
        if ec.num_pages == 0 and self.pools is not None:
            if self.pools[0].num_pages >= num or not all(p.all_free() for p in self.pools):
                num = self.pools[0].num_pages  # never shrink; with live conversations keep it (preemption copes)
        if num - 1 < one:
            per_shard = f" ({num} pages for each of {D} data shards)" if D > 1 else ""
            raise ValueError(f"sampling.engine.num_pages={ec.num_pages or num}{per_shard} cannot hold one request of "
                             f"{longest} tokens with sampling.engine.page_size={ec.page_size}: needs >= "
                             f"{D * (one + 1)}")
        if self.pools is None or self.pools[0].num_pages != num:
            if self.pools is not None and not all(p.all_free() for p in self.pools):
                raise RuntimeError("the page pool must grow but live conversations hold pages: close them first "
                                   "or set sampling.engine.num_pages")
            self.pages = None
            self.pages = self._init_pages(num)
            self.pools = [paged_kv.PagePool(num) for _ in range(D)]

    def _pages_per_shard(self, longest_tokens: int) -> int:
        """Pages of each data shard's pool for requests of up to `longest_tokens` tokens: num_pages / D, or in auto
        mode (num_pages 0) enough for every slot of the shard (EngineConfig.pool_pages)."""
        ec, D = self.engine_config, self.data_shards
        return (-(-ec.num_pages // D) if ec.num_pages else
                dataclasses.replace(ec, max_slots=self._slots_per_shard()).pool_pages(longest_tokens))

    def _init_pages(self, num: int):
        """The zeroed device pool of `num` pages per shard, made in its layout (a data-split pool is never whole
        on one device)."""
        cfg, ec, D = self.config, self.engine_config, self.data_shards

        def make():
            pages = pa.init_pages(cfg.num_layers, num, ec.page_size, cfg.num_kv_heads, cfg.head_dim,
                                  jnp.dtype(self.cache_dtype), keys_transposed=self.keys_transposed)
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (D,) + x.shape), pages) if self._batch_axes else pages

        if self.mesh is None:  # on one device: committed to the weights' device, as the programs' outputs are (the
            # first call after the pool is made must not compile its programs again for uncommitted inputs)
            devices = jax.tree.leaves(self.state)[0].sharding.device_set
            return (jax.device_put(make(), jax.sharding.SingleDeviceSharding(next(iter(devices))))
                    if len(devices) == 1 else make())
        shape = pa.pool_shape(num, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self._shard_axis())
        return jax.jit(make, out_shardings=self._pool_sharding(shape))()  # k's too: only the kv-head dim is split

    def _shard_axis(self) -> int | None:
        """The pool's leading data-shard axis size (None: one shard, no such axis)."""
        return self.data_shards if self._batch_axes else None

    def _pool_sharding(self, shape) -> NamedSharding:
        """The page pool's layout on a mesh: kv heads over the tensor axis (as the attention's k/v); over D data
        shards the leading shard axis over the batch axes (each device holds its shard's pool only)."""
        assert self.mesh is not None
        lead = (self._batch_axes,) if self._batch_axes else ()
        spec = model_sharding.logical_to_spec(pa.POOL_AXES, model_sharding.DEFAULT_RULES, shape[len(lead):],
                                              self.mesh)
        return NamedSharding(self.mesh, PartitionSpec(*lead, *spec))

    def _put(self, x):
        """A host value (the same on every process: the scheduler is replicated) as a program input replicated
        over the mesh (distributed.global_from_host: in a multi-process run each process places its own
        devices' copies)."""
        x = np.asarray(x)
        return distributed.global_from_host(x, self._replicated) if self._replicated is not None else jnp.asarray(x)

    def _put_rows(self, x_D):
        """A per-shard argument [D, ...] of a program: split over the batch axes (each process places its own
        shards' rows); one shard: [...] as _put."""
        x_D = np.asarray(x_D)
        return distributed.global_from_host(x_D, self._split) if self._split is not None else self._put(x_D[0])

    def _sampling_values(self, sampling) -> list[np.ndarray]:
        """The host values of the decode program's sampling inputs after the key: greedy, temperature, top_k,
        top_p, EOS ids."""
        temperature, top_p, top_k, eos_ids, _ = sampling
        return [np.asarray(temperature == 0, np.bool_), np.asarray(temperature if temperature > 0 else 1.0, np.float32),
                np.asarray(min(int(top_k), int(self.config.vocab_size)), np.int32), np.asarray(top_p, np.float32),
                _eos_array(eos_ids, self.config)]

    def _scalars(self, sampling):
        """The replicated sampling inputs of the decode program: key(seed), then `_sampling_values` (the key is
        built from its uint32 data, which every process places like any host value)."""
        key_data = np.asarray(jax.random.key_data(jax.random.key(sampling[4])))
        return [jax.random.wrap_key_data(self._put(key_data))] + [self._put(x) for x in self._sampling_values(sampling)]

    def _run(self, convs: list[Conversation], *, keep: bool, sampling, wait: bool = True) -> None:
        """Queue conversations (their turn opened) in the running batch, or in a new one (its stats start from 0),
        and with wait run scheduler rounds (`advance`) until the batch is done. wait=True needs an idle engine;
        wait=False joins a running batch of the same sampling arguments and keep."""
        if self.state is None:
            raise RuntimeError("the engine's weights were released: call update_params(params) first")
        b = self._batch
        if b is not None and (wait or (b.sampling, b.keep) != (sampling, keep)):
            raise ValueError("the engine is running conversations queued with wait=False: queue more with "
                             "wait=False and the same sampling arguments and keep, and drive them with advance()")
        if not convs:
            return
        self._ensure_pool(convs)
        if b is None:
            self.stats = dict(prefix_prefills=0, recomputes=0, evictions=0, prefill_calls=0, prefill_tokens=0,
                              decode_chunks=0, decode_steps=0, peak_pages=0, rounds=0)
            b = _Batch([_Shard(pool, [None] * self._slots_per_shard()) for pool in self._pools()], sampling,
                       self._scalars(sampling), keep)
            for sh in b.shards:
                sh.pool.peak_used = sh.pool.num_used
            self._batch = b
        for sh, pool in zip(b.shards, self._pools()):
            sh.pool = pool  # _ensure_pool may have made new (empty) pools
        self._unpark(convs)
        for c in convs:
            b.shards[c.shard].queue.append(c)
            b.shards[c.shard].waiting[c.prompt_pos] += c.shareable
            c.running = True
        while wait and self._batch is not None:
            self.advance()

    def _unpark(self, convs: Sequence[Conversation]) -> None:
        ids = {id(c) for c in convs}
        self._parked = [c for c in self._parked if id(c) not in ids]

    def _make_room(self, sh: _Shard, num: int) -> bool:
        """True when `num` pages of a shard's pool are free, after freeing if needed the pages of rows parked
        between turns, the most recently parked first (a row waiting on a tool call must not exhaust the pool for
        the rows that decode); an evicted row's next turn prefills its whole conversation again."""
        while num > sh.pool.num_free:
            parked = [c for c in self._parked if c.pages and self._pools()[c.shard] is sh.pool]
            if not parked:
                return False
            c = parked[-1]
            sh.pool.release(c.pages)
            c.pages, c.written = [], 0
            self.stats["evictions"] += 1
        return True

    def _cancel(self) -> None:
        """Drop the running batch (after an error, or the close of one of its rows): its prefix entries' pages and
        reserved tail pages go back to the pools; its rows stop running, keeping their own pages."""
        b, self._batch = self._batch, None
        for sh in b.shards if b is not None else []:
            for e in sh.prefixes.values():
                sh.pool.release(e.pages)
            for c in [*sh.queue, *sh.slots]:
                if c is not None:
                    if c.tail is not None:
                        sh.pool.release([c.tail])
                    c.prefix, c.tail, c.running, c.shareable = None, None, False, False

    def _admit(self, sh: _Shard) -> bool:
        """Move a shard's queued conversations into its free slots while their first pages can be allocated."""
        ec = self.engine_config
        progress = False
        reserve = sum(max(n, 0) for _, n in self._growth(sh.slots))  # running rows grow first (no livelock)
        for s in range(len(sh.slots)):
            if sh.slots[s] is not None:
                continue
            if not sh.queue:
                break
            c = sh.queue[0]
            if ec.share_prefix and c.shareable:
                entry = sh.prefixes.get(c.prompt_pos)
                n_tail = 1 if (c.prompt_len - 1) % ec.page_size else 0
                need = n_tail + (0 if entry else paged_kv.pages_for(c.prompt_len - 1, ec.page_size))
                if not self._make_room(sh, need + reserve):
                    break
                if entry is None:
                    entry = _Prefix(c.prompt_pos, c.seq[:-1], sh.pool.alloc(need - n_tail), sh.waiting[c.prompt_pos])
                    sh.prefixes[c.prompt_pos] = entry
                    self.stats["prefix_prefills"] += 1
                c.prefix, c.tail = entry, (sh.pool.alloc(1)[0] if n_tail else None)
            else:  # recompute / continuation / one-token prompt: its own pages for what it must prefill
                need = paged_kv.pages_for(len(c.tokens) - 1, ec.page_size) - len(c.pages)
                if not self._make_room(sh, need + reserve):
                    break
                c.pages += sh.pool.alloc(max(need, 0))
            sh.queue.popleft()
            self._admitted += 1
            c.admitted = self._admitted
            sh.slots[s] = c
            progress = True
        return progress

    def _prefill_jobs(self, sh: _Shard) -> list:
        """(owner, tokens, start, pages) of a shard's unfinished prefix entries and of its slot rows that still
        have conversation tokens to write; at most one program's rows (the rest next round)."""
        jobs: list = [(e, e.tokens, e.written, e.pages) for e in sh.prefixes.values() if not e.complete]
        jobs += [(c, c.tokens[:-1], c.written, c.pages) for c in sh.slots
                 if c is not None and c.prefix is None and c.written < len(c.tokens) - 1]
        return jobs[:len(sh.slots)]

    def _prefill_round(self, shards: list[_Shard]) -> bool:
        """One chunk of up to prefill_chunk tokens for every unfinished prefix entry and every slot row that still
        has conversation tokens to write, in one jitted call over every shard."""
        ec = self.engine_config
        jobs_D = [self._prefill_jobs(sh) for sh in shards]
        every = [j for jobs in jobs_D for j in jobs]
        if not every:
            return False
        C = ec.prefill_width(max(len(toks) - start for _, toks, start, _ in every))
        R = self._row_bucket(max(len(jobs) for jobs in jobs_D))
        width = self._width(max(len(j[3]) for j in every))
        D = len(shards)
        ids, pos, valid = (np.zeros((D, R, C), np.int32) for _ in range(3))
        table = np.zeros((D, R, width), np.int32)
        for d, jobs in enumerate(jobs_D):
            for r, (owner, toks, start, _) in enumerate(jobs):
                chunk = toks[start:start + C]
                ids[d, r, :len(chunk)] = chunk
                pos[d, r, :len(chunk)] = np.arange(start, start + len(chunk))
                valid[d, r, :len(chunk)] = 1
                owner.written = start + len(chunk)
                self.stats["prefill_tokens"] += len(chunk)
            table[d] = paged_kv.page_table([j[3] for j in jobs] + [[]] * (R - len(jobs)), width)
        self.pages = _prefill_jit(self.graphdef, self.state, self.pages, self._put_rows(ids), self._put_rows(pos),
                                  self._put_rows(valid.astype(bool)), self._put_rows(table), page_size=ec.page_size,
                                  batch_axes=self._batch_axes, keys_transposed=self.keys_transposed)
        self.stats["prefill_calls"] += 1
        return True

    def _attach(self, shards: list[_Shard]) -> None:
        """Rows whose prefix entry is complete: share its full pages, copy its partial last page into the row's
        private tail page (one copy program over every shard); drop entries whose samples are all attached."""
        ps = self.engine_config.page_size
        copies_D = []
        for sh in shards:
            src, dst = [], []
            for c in sh.slots:
                if c is None or c.prefix is None or not c.prefix.complete:
                    continue
                entry = c.prefix
                n_full = len(entry.tokens) // ps
                sh.pool.share(entry.pages[:n_full])
                c.pages = entry.pages[:n_full] + ([c.tail] if c.tail is not None else [])
                if c.tail is not None:
                    src.append(entry.pages[n_full])
                    dst.append(c.tail)
                c.written, c.prefix, c.tail, c.shareable = len(entry.tokens), None, None, False
                entry.waiting -= 1
                sh.waiting[entry.key] -= 1
                if entry.waiting == 0:
                    sh.pool.release(entry.pages)
                    del sh.prefixes[entry.key]
            copies_D.append((src, dst))
        longest = max(len(src) for src, _ in copies_D)
        if longest:
            rows = len(shards[0].slots)
            n = -(-longest // rows) * rows  # one program shape
            pad = lambda x: x + [pa.TRASH_PAGE] * (n - len(x))  # noqa: E731
            src_D = np.asarray([pad(src) for src, _ in copies_D], np.int32)
            dst_D = np.asarray([pad(dst) for _, dst in copies_D], np.int32)
            self.pages = _copy_jit(self.pages, self._put_rows(src_D), self._put_rows(dst_D),
                                   batch_axes=self._batch_axes)

    def _exit_after(self, queue, num_rows: int) -> int:
        """Finished rows that end a decode chunk early: enough to refill a quarter of the slots (or all the
        queue), so freed slots do not idle until the chunk's end; never with an empty queue."""
        if not queue:
            return num_rows + 1
        return max(1, min(len(queue), -(-num_rows // EXIT_FRACTION)))

    def _row_bucket(self, num_rows: int) -> int:
        """Rows of a prefill or decode call (per shard): a power-of-two bucket of the rows with work (at least
        MIN_ROWS, at most a shard's slots): a round that prefills one new prompt, or decodes the last rows of a
        draining queue, must not pay for max_slots rows."""
        return min(1 << (max(num_rows, MIN_ROWS) - 1).bit_length(), self._slots_per_shard())

    def _width(self, num_pages: int) -> int:
        """Page-table width of a call: a power-of-two bucket of the live pages, at least MIN_WIDTH pages (few
        programs), at most the context's pages."""
        return paged_kv.width_bucket(max(num_pages, MIN_WIDTH), self._max_pages())

    def _max_pages(self) -> int:
        max_pos = getattr(self.config, "max_position_embeddings", None) or 1 << 20
        return paged_kv.pages_for(max_pos, self.engine_config.page_size)

    def _grow(self, sh: _Shard) -> None:
        """Give every ready row of a shard the pages its next chunk writes into. On a short pool free the pages of
        parked rows (`_make_room`), then preempt the most recently admitted rows (back to the queue front,
        recomputed later) until the rest fit; with one row left, drop the prefix entries no row in a slot is
        waiting for."""
        while True:
            growth = self._growth(sh.slots)
            if not growth:
                return
            if self._make_room(sh, sum(max(n, 0) for _, n in growth)):
                for c, n in growth:
                    if n > 0:
                        c.pages += sh.pool.alloc(n)
                return
            rows = sorted((c for c in sh.slots if c is not None), key=lambda c: c.admitted)
            if len(rows) > 1:  # the oldest row always keeps going: no livelock
                self._preempt(rows[-1], sh)
                continue
            if not self._drop_idle_prefix(sh):
                raise paged_kv.PagesExhausted(
                    f"one row needs {growth[0][1]} more pages, {sh.pool.num_free} free: raise "
                    f"sampling.engine.num_pages")

    def _drop_idle_prefix(self, sh: _Shard) -> bool:
        """Free the pages of one of a shard's prefix entries that no row in a slot waits for (it is prefilled
        again when its next sample is admitted); False if there is none."""
        idle = [e for e in sh.prefixes.values() if not any(c is not None and c.prefix is e for c in sh.slots)]
        if not idle:
            return False
        sh.pool.release(idle[0].pages)
        del sh.prefixes[idle[0].key]
        return True

    def _growth(self, slots) -> list[tuple[Conversation, int]]:
        """(row, pages it still needs for its next decode chunk) for every ready row, oldest admission first."""
        ec = self.engine_config
        ready = sorted((c for c in slots if c is not None and c.ready), key=lambda c: c.admitted)
        return [(c, paged_kv.pages_for(c.written + min(ec.decode_chunk, c.budget - c.step), ec.page_size)
                 - len(c.pages)) for c in ready]

    def _preempt(self, c: Conversation, sh: _Shard) -> None:
        """Free a row's pages and requeue it at its shard's queue front. A row still waiting for its prompt's
        prefix just gives back its reserved tail page; any other row is recomputed later (same draws, same
        tokens)."""
        if c.prefix is not None:
            if c.tail is not None:
                sh.pool.release([c.tail])
            c.prefix, c.tail = None, None
        else:
            sh.pool.release(c.pages)
            c.pages, c.written, c.shareable = [], 0, False
            c.turn_tokens, c.turn_logprobs = [], []
            self.stats["recomputes"] += 1
        sh.slots[sh.slots.index(c)] = None
        sh.queue.appendleft(c)

    def _decode_round(self, shards: list[_Shard], scalars, keep) -> bool:
        """Up to decode_chunk steps of every ready slot of every shard (one program); record the tokens and
        retire the rows whose turn ended (to their shard's `ended`)."""
        ec = self.engine_config
        if not any(sh.ready() for sh in shards):
            return False
        for sh in shards:
            if sh.ready():
                self._grow(sh)
        ready_D = [sh.ready() for sh in shards]
        if not any(ready_D):
            return True  # everything ready was preempted: the pages went back, the queue goes on
        # the ready rows, compacted: a draining tail does not pay for max_slots
        S = self._row_bucket(max(len(ready) for ready in ready_D))
        live_D = [[c for _, c in ready] + [None] * (S - len(ready)) for ready in ready_D]
        width = self._width(max(len(c.pages) for live in live_D for c in live if c is not None))
        table = np.stack([paged_kv.page_table([c.pages if c else [] for c in live], width) for live in live_D])
        arr = lambda f, dt=np.int32: self._put_rows(  # noqa: E731
            np.asarray([[f(c) if c else 0 for c in live] for live in live_D], dt))
        exit_after = np.asarray([self._exit_after(sh.queue, S) for sh in shards], np.int32)
        self.pages, toks, lps, n, eos = _decode_jit(
            self.graphdef, self.state, self.pages, self._put_rows(table), arr(lambda c: c.tokens[-1]),
            arr(lambda c: c.written), arr(lambda c: c.step), arr(lambda c: c.budget),
            arr(lambda c: True, bool), arr(lambda c: c.prompt_index, np.uint32), arr(lambda c: c.sample, np.uint32),
            self._put_rows(exit_after), *scalars, steps=ec.decode_chunk, page_size=ec.page_size, pad_id=self.pad_id,
            batch_axes=self._batch_axes, attention=self.attention, keys_transposed=self.keys_transposed)
        toks, lps, n, eos = distributed.fetch_global((toks, lps, n, eos))  # one gather for every process
        if not self._batch_axes:  # one shard: its rows without the shard axis
            toks, lps, n, eos = (x[None] for x in (toks, lps, n, eos))
        self.stats["decode_chunks"] += 1
        self.stats["decode_steps"] += int(n.max(initial=0))
        for sh, ready, toks_S, lps_S, n_S, eos_S in zip(shards, ready_D, toks, lps, n, eos):
            for r, (s, c) in enumerate(ready):
                k = int(n_S[r])
                c.turn_tokens += toks_S[r, :k].tolist()
                c.turn_logprobs += lps_S[r, :k].tolist()
                c.written += k
                if eos_S[r] or c.step >= c.budget:
                    c.finished_eos = bool(eos_S[r])
                    sh.slots[s] = None
                    sh.ended.append(c)
                    if not keep:
                        sh.pool.release(c.pages)
                        c.pages, c.closed = [], True
        return True


def generate(model: nnx.Module, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, num_samples: int = 1,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None, seed: int = 0,
             mesh: Mesh | None = None, cache_dtype=jnp.float32, config: EngineConfig | None = None) -> SampleOutput:
    """sampling.generate through the engine."""
    return Engine(model, mesh=mesh, cache_dtype=cache_dtype, config=config).generate(
        prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature,
        top_p=top_p, top_k=top_k, eos_ids=eos_ids, seed=seed)


def engine_unsupported(mesh: Mesh | None) -> str | None:
    """Why the engine cannot run here (None if it can). Any mesh runs, in one process or in several (the host
    scheduler is replicated: every process runs it on the same host data; a data-split mesh gives each data shard
    its own slots and page pool); several processes need the run's mesh over their devices."""
    if distributed.is_multiprocess() and mesh is None:
        return f"the run has {jax.process_count()} processes but the engine got no mesh over their devices"
    return None


def make_generator(model: nnx.Module, *, config: EngineConfig, max_new_tokens: int, mesh: Mesh | None = None,
                   cache_dtype=jnp.float32, pad_id: int | None = None,
                   resolve: Callable[[EngineConfig], EngineConfig] | None = None) -> Engine | Sampler:
    """The generator for `config.enabled`: the engine (true), the static sampler (false), or (auto) the engine
    wherever it runs (any mesh, in one process or several: over data shards each has its own slots and page pool)
    and the responses may be long enough to pay (max_new_tokens >= auto_min_new_tokens), the static sampler
    elsewhere. Both draw the same samples. enabled=true where the engine cannot run (`engine_unsupported`) is a
    ValueError naming sampling.engine.enabled and the reason. `resolve` turns the config into the engine's own
    (e.g. max_slots=auto into a number), called only when the engine is built."""
    reason = engine_unsupported(mesh)
    if config.enabled is True and reason:
        raise ValueError(f"sampling.engine.enabled=true: {reason}; set it to auto or false")
    if config.enabled is False or reason or (config.enabled == "auto" and max_new_tokens < config.auto_min_new_tokens):
        return Sampler(model, mesh=mesh, cache_dtype=cache_dtype, pad_id=pad_id)
    return Engine(model, mesh=mesh, cache_dtype=cache_dtype, pad_id=pad_id,
                  config=resolve(config) if resolve is not None else config)


def kv_bytes(engine: Engine) -> int:
    """Bytes of the engine's page pool (all layers, k and v)."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(engine.pages)))
