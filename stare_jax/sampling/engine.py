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
- Pages. Per layer k/v [num_pages, page_size, K, Dh] allocated once (page 0 = trash page for padding writes);
  host-side free list + reference counts (paged_kv.PagePool) and a per-row page table. Pages are allocated as
  a row grows (one chunk ahead) and returned when it ends, so memory scales with live tokens. Attention gathers
  a row's first M pages, M a power-of-two bucket over the live rows (models/paged_attention.py).
- Prefix sharing. The G samples of a prompt share its prefix pages: the prompt minus its last token is
  prefilled ONCE into a prefix entry; each sample then shares the entry's full pages (reference counted) and
  gets a private copy of the partial last page (copy-on-write at attach time), so its first new token (and the
  last prompt token, fed by the first decode step) go to a slot-private page. No page is ever written by two
  rows. The entry is dropped once all G samples are attached.
- Randomness. Sample g of prompt p draws its token at response index i from
  uniform(fold_in(fold_in(fold_in(key(seed), p), g), i)) -- exactly the static Sampler's keys -- so the tokens
  do not depend on slot, max_slots, K, page layout or which other rows run (tests check all of these).
- Pages exhausted. A row that cannot grow preempts the most recently admitted decoding row (LIFO): its pages
  are freed and it goes back to the queue front; on re-admission it is recomputed (its whole conversation
  prefilled again; same draws, same tokens). A request that cannot fit an empty pool is a ValueError naming
  sampling.engine.num_pages and the value needed.
- Multi-turn. `start` keeps rows alive after their turn (`Conversation`); `extend` appends given tokens (a
  tool's output, loss mask 0, log-prob NaN) and continues sampling: only the new tokens are prefilled into the
  row's pages, the conversation is never re-prefilled.
- Weights. `update_params` reshards the trainer's parameters on device into the sampler layout (as Sampler);
  the page pool is allocated on the first call and reused (donated through every program) until `release`
  frees it with the weight copy before the train step; nothing recompiles across RL steps once the page-table
  width buckets of a workload have been seen.
- Mesh: parameters in the sampler layout, the pool's kv heads over the tensor axis, slots replicated.
- Not yet: a TPU Pallas decode kernel (jax.experimental.pallas.ops.tpu.paged_attention wants the pool as
  [K, N, P, Dh], kv heads first; this pool is [N, P, K, Dh] and decode uses the gather path everywhere), slots and
  page pools split over the data axes, and multi-process (the host scheduler drives one process). Where those are
  needed, `make_generator` (sampling.engine.enabled=auto) picks the static sampler.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

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
from stare_jax.sampling.engine_config import EngineConfig
from stare_jax.sampling.sampler import (SampleArrays, SampleOutput, Sampler, _check_prompts, _check_sampling_args,
                                        _eos_array, model_config)


EXIT_FRACTION = 4  # a decode chunk ends early once 1/EXIT_FRACTION of the slots can be refilled
MIN_ROWS = 4  # smallest prefill / decode batch (fewer compiled shapes)
MIN_PREFILL_WIDTH = 32  # tokens per row of a prefill call whose chunks are all short (else prefill_chunk)
MIN_WIDTH = 1  # smallest page-table width (pages) of a program (buckets: powers of two)

# ----------------------------------------------------------------------------------------------- config

# ----------------------------------------------------------------------------------------------- programs

def _row_keys(key, prompt_index_S, sample_S):
    """fold_in(fold_in(key, p), g) per row: the static Sampler's sequence keys."""
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(
        prompt_index_S.astype(jnp.uint32), sample_S.astype(jnp.uint32))


def _decode_chunk(graphdef, state, pages, page_table_SxM, tok_S, pos_S, step_S, budget_S, live_S, prompt_index_S,
                  sample_S, exit_after, key, greedy, temperature, top_k, top_p, eos_E, *, steps: int, page_size: int,
                  pad_id: int):
    """Up to `steps` decode steps of every live slot: feed tok_S at pos_S, draw the token of response index
    step_S, stop a row on EOS or at step budget_S. The chunk ends early once `exit_after` rows have finished (the
    host has that many queued requests to put in their slots) or every row is done.
    Returns (pages, tokens_SxK, logprobs_SxK, count_S, eos_S)."""
    model = nnx.merge(graphdef, state)
    S = tok_S.shape[0]
    keys_S = _row_keys(key, prompt_index_S, sample_S)

    def body(c):
        i, pages, tok, pos, step, done, eos, toks, lps, n = c
        hidden, pages = pa.paged_forward(model, tok[:, None], pos[:, None], ~done[:, None], pages, page_table_SxM,
                                         page_size)
        logits_SxV = model.logits_from_hidden(hidden)[:, -1].astype(jnp.float32)
        u_S = jax.vmap(lambda k, s: jax.random.uniform(jax.random.fold_in(k, s)))(keys_S, step)
        t, lp = selection.select_tokens(logits_SxV, u_S, greedy=greedy, temperature=temperature, top_k=top_k,
                                        top_p=top_p)
        t = jnp.where(done, pad_id, t)
        lp = jnp.where(done, 0.0, lp)
        toks = jax.lax.dynamic_update_slice(toks, t[:, None], (0, i))
        lps = jax.lax.dynamic_update_slice(lps, lp[:, None], (0, i))
        hit = jnp.any(t[:, None] == eos_E[None, :], axis=-1) & ~done
        live = (~done).astype(jnp.int32)
        step, pos, n = step + live, pos + live, n + live
        tok = jnp.where(done, tok, t)
        return (i + 1, pages, tok, pos, step, done | hit | (step >= budget_S), eos | hit, toks, lps, n)

    init = (jnp.int32(0), pages, tok_S, pos_S, step_S, ~live_S | (step_S >= budget_S), jnp.zeros((S,), bool),
            jnp.full((S, steps), pad_id, jnp.int32), jnp.zeros((S, steps), jnp.float32), jnp.zeros((S,), jnp.int32))
    def cond(c):
        finished = jnp.sum(c[5] & live_S)
        return (c[0] < steps) & jnp.any(~c[5]) & (finished < exit_after)

    c = jax.lax.while_loop(cond, body, init)
    return c[1], c[7], c[8], c[9], c[6]


def _prefill(graphdef, state, pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM, *, page_size: int):
    """Write the k/v of one chunk of tokens per row into its pages (the logits are not needed)."""
    model = nnx.merge(graphdef, state)
    _, pages = pa.paged_forward(model, ids_RxC, pos_RxC, valid_RxC, pages, page_table_RxM, page_size)
    return pages


def _copy_pages(pages, src_C, dst_C):
    """pages[dst] = pages[src] in every layer (copy-on-write of a shared prompt's partial last page)."""
    return [{name: x.at[dst_C].set(x[src_C]) for name, x in layer.items()} for layer in pages]


_decode_jit = jax.jit(_decode_chunk, static_argnames=("graphdef", "steps", "page_size", "pad_id"),
                      donate_argnames=("pages",))
_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "page_size"), donate_argnames=("pages",))
_copy_jit = jax.jit(_copy_pages, donate_argnames=("pages",))


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


# ----------------------------------------------------------------------------------------------- the engine

class Engine:
    """Continuous-batching rollout engine over a paged KV cache (see the module docstring).

    Same constructor arguments as Sampler (mesh, cache_dtype, pad_id) plus `config` (EngineConfig). With a
    mesh, parameters are kept in the sampler layout (replicated over the data axes, "tensor" kept) and the
    page pool and slot arrays are replicated. `stats` counts, per call, prefix prefills, recomputes
    (preemptions), decode chunks/steps and the peak number of pages in use.
    """

    def __init__(self, model: nnx.Module, *, config: EngineConfig | None = None, mesh: Mesh | None = None,
                 cache_dtype=jnp.float32, pad_id: int | None = None):
        self.config = model_config(model)
        self.engine_config = config if config is not None else EngineConfig()
        self.mesh = mesh
        self.cache_dtype = jnp.dtype(cache_dtype).name
        cfg_pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else 0))
        self.compute_dtype = jnp.dtype(getattr(self.config, "dtype", "float32")).name
        self.graphdef, state = nnx.split(model)
        self.state = None
        self.pages: Any = None  # per layer k/v page arrays (made with the pool)
        self.pool: paged_kv.PagePool | None = None
        self._waiting: collections.Counter = collections.Counter()
        self.stats: dict = {}
        self._admitted = 0
        self._replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self.update_params(state)

    @property
    def live_pool(self) -> paged_kv.PagePool:
        """The page pool of the call in progress (made by the call's first step)."""
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
        """Drop the weight copy and, when no conversation holds pages, the KV page pool (before the train step:
        sampling and training never hold their largest buffers at once). `update_params` brings the weights back;
        the next call makes the pool again (the same shapes: nothing recompiles)."""
        self.state = None
        if self.pool is None or self.pool.all_free():
            self.pages = None
            self.pool = None

    def batch_bucket(self, num_prompts: int) -> int:
        """The engine needs no batch padding (requests are queued): the number of prompts itself."""
        return max(int(num_prompts), 1)

    @property
    def data_shards(self) -> int:
        return model_sharding.batch_shards(self.mesh)

    def program_context(self):
        """The mesh and its activation rules around the jitted programs (nothing without a mesh)."""
        return model_sharding.program_context(self.mesh)

    def generate_arrays(self, prompt_ids_PxT, prompt_mask_PxT, *, max_new_tokens: int, num_samples: int = 1,
                        temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None,
                        seed: int = 0, prompt_index_P=None, active_P=None) -> SampleArrays:
        """Sampler.generate_arrays: LEFT-padded prompts [P, T] -> SampleArrays with P * num_samples rows
        (prompt-major) and max_new_tokens columns; inactive prompts give length-0 rows."""
        _check_sampling_args(max_new_tokens, num_samples, temperature, top_p, top_k)
        ids, mask = np.asarray(jax.device_get(prompt_ids_PxT)), np.asarray(jax.device_get(prompt_mask_PxT))
        P, T = ids.shape
        if mask.shape != (P, T):
            raise ValueError(f"prompt_mask_PxT shape {mask.shape} != prompt_ids_PxT shape {(P, T)}")
        if P == 0 or T == 0:
            raise ValueError(f"empty prompt batch: prompt_ids_PxT has shape {(P, T)}")
        index = np.arange(P) if prompt_index_P is None else np.asarray(jax.device_get(prompt_index_P))
        active = np.ones((P,), bool) if active_P is None else np.asarray(jax.device_get(active_P), bool)
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
        return SampleArrays(jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(lengths), jnp.asarray(finished))

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, num_samples: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None,
                 seed: int = 0) -> SampleOutput:
        """Sampler.generate: token-id lists -> SampleOutput (prompt-major, index p * num_samples + g)."""
        convs = self.start(prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples,
                           temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=eos_ids, seed=seed, keep=False)
        return SampleOutput(tokens=[c.turn_tokens for c in convs], logprobs=[c.turn_logprobs for c in convs],
                            finish_reasons=["eos" if c.finished_eos else "length" for c in convs],
                            lengths=[len(c.turn_tokens) for c in convs])

    # ------------------------------------------------------------------ multi-turn API
    def start(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, num_samples: int = 1,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=None, seed: int = 0,
              keep: bool = True, prompt_index=None) -> list[Conversation]:
        """Sample the first turn of num_samples conversations per prompt (prompt-major). keep=True keeps each
        conversation's pages alive for `extend` (free them with `close`)."""
        _check_sampling_args(max_new_tokens, num_samples, temperature, top_p, top_k)
        prompts = _check_prompts(prompt_ids, self.config, max_new_tokens)
        index = range(len(prompts)) if prompt_index is None else [int(i) for i in prompt_index]
        return self._run_fresh(list(zip(range(len(prompts)), prompts, index)), max_new_tokens, num_samples,
                               keep=keep, sampling=(temperature, top_p, top_k, eos_ids, seed))

    def extend(self, convs: Sequence[Conversation], appended: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int], temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               eos_ids=None, seed: int = 0, keep: bool = True) -> list[Conversation]:
        """Append the given tokens (e.g. a tool's output; not sampled: mask 0, log-prob NaN) to each live
        conversation and sample its next turn. Only the new tokens (and the previous turn's last token) are
        prefilled into the conversation's pages. Use the same seed as `start` for reproducible draws.
        max_new_tokens: one limit for every conversation's turn, or one per conversation (e.g. what is left of
        each response's token budget in a multi-turn rollout)."""
        limits = ([max_new_tokens] * len(convs) if isinstance(max_new_tokens, (int, np.integer))
                  else list(max_new_tokens))
        if len(limits) != len(convs):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(convs)} conversations")
        for n in limits or [1]:
            _check_sampling_args(n, 1, temperature, top_p, top_k)
        if len(appended) != len(convs):
            raise ValueError(f"{len(appended)} appended token lists for {len(convs)} conversations")
        max_pos = getattr(self.config, "max_position_embeddings", None)
        for c, extra, limit in zip(convs, appended, limits):
            if c.closed:
                raise ValueError(f"conversation {c.index} is closed")
            extra = [int(t) for t in extra]
            bad = [t for t in extra if not 0 <= t < int(self.config.vocab_size)]
            if bad:
                raise ValueError(f"conversation {c.index}: appended token id {bad[0]} outside the vocabulary")
            total = len(c.tokens) + len(extra) + int(limit)
            if max_pos is not None and total > max_pos:
                raise ValueError(f"conversation {c.index}: {total} tokens exceed the model's context {max_pos}")
            self._new_turn(c, int(limit), appended=extra)
        self._run(list(convs), keep=keep, sampling=(temperature, top_p, top_k, eos_ids, seed))
        return list(convs)

    def close(self, convs: Sequence[Conversation]) -> None:
        """Free the pages of finished conversations."""
        for c in convs:
            if not c.closed:
                self.live_pool.release(c.pages)
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

    def _run_fresh(self, prompts, max_new_tokens, G, *, keep, sampling) -> list[Conversation]:
        """Queue num_samples conversations of every (output position, prompt, prompt index) and run them."""
        convs = []
        for p, prompt, pidx in prompts:
            for g in range(G):
                c = Conversation(index=p * G + g, prompt_index=pidx, sample=g, prompt_len=len(prompt),
                                 seq=list(prompt), shareable=len(prompt) > 1, prompt_pos=p)
                self._new_turn(c, max_new_tokens)
                convs.append(c)
        self._run(convs, keep=keep, sampling=sampling, group=G)
        return convs

    def _ensure_pool(self, convs) -> None:
        """Allocate the page pool once (or grow it in auto mode); ValueError if one request cannot fit."""
        ec = self.engine_config
        longest = max(len(c.seq) + (c.budget - c.turn_start) for c in convs)
        one = paged_kv.pages_for(longest, ec.page_size) + 1  # + the prefix entry's staging page
        num = ec.pool_pages(longest)
        if ec.num_pages == 0:
            if self.pool is not None and (self.pool.num_pages >= num or not self.pool.all_free()):
                num = self.live_pool.num_pages  # never shrink; with live conversations keep it (preemption copes)
        if num - 1 < one:
            raise ValueError(f"sampling.engine.num_pages={num} cannot hold one request of {longest} tokens with "
                             f"sampling.engine.page_size={ec.page_size}: needs >= {one + 1}")
        if self.pool is None or self.pool.num_pages != num:
            if self.pool is not None and not self.pool.all_free():
                raise RuntimeError("the page pool must grow but live conversations hold pages: close them first "
                                   "or set sampling.engine.num_pages")
            cfg = self.config
            self.pages = None
            pages = pa.init_pages(cfg.num_layers, num, ec.page_size, cfg.num_kv_heads, cfg.head_dim,
                                  jnp.dtype(self.cache_dtype))
            self.pages = jax.device_put(pages, self._pool_sharding(pages[0]["k"].shape)) if self.mesh else pages
            self.pool = paged_kv.PagePool(num)

    def _pool_sharding(self, shape) -> NamedSharding:
        """The page pool's layout on a mesh: kv heads over the tensor axis (as the attention's k/v), the rest
        replicated (the engine runs where the batch is not split over data axes)."""
        assert self.mesh is not None
        return NamedSharding(self.mesh, model_sharding.logical_to_spec(
            pa.POOL_AXES, model_sharding.DEFAULT_RULES, shape, self.mesh))

    def _put(self, x):
        x = np.asarray(x)
        return jax.device_put(x, self._replicated) if self._replicated is not None else jnp.asarray(x)

    def _scalars(self, sampling):
        temperature, top_p, top_k, eos_ids, seed = sampling
        rep = [jax.random.key(seed), jnp.bool_(temperature == 0), jnp.float32(temperature if temperature > 0 else 1.0),
               jnp.int32(min(int(top_k), int(self.config.vocab_size))), jnp.float32(top_p),
               jnp.asarray(_eos_array(eos_ids, self.config))]
        if self._replicated is not None:
            rep = [jax.device_put(x, self._replicated) for x in rep]
        return rep

    def _run(self, convs: list[Conversation], *, keep: bool, sampling, group: int = 1) -> None:
        """The scheduling loop (module docstring): admit, prefill one chunk, attach, decode K steps, retire."""
        if self.state is None:
            raise RuntimeError("the engine's weights were released: call update_params(params) first")
        if not convs:
            return
        ec = self.engine_config
        self._ensure_pool(convs)
        self.stats = dict(prefix_prefills=0, recomputes=0, prefill_calls=0, prefill_tokens=0, decode_chunks=0,
                          decode_steps=0, peak_pages=0, rounds=0)
        self.live_pool.peak_used = self.live_pool.num_used
        scalars = self._scalars(sampling)
        queue = collections.deque(convs)
        prefixes: dict[int, _Prefix] = {}
        self._waiting = collections.Counter(c.prompt_pos for c in convs if c.shareable)
        slots: list[Conversation | None] = [None] * ec.max_slots
        with self.program_context():
            while queue or any(s is not None for s in slots):
                self.stats["rounds"] += 1
                progress = self._admit(queue, slots, prefixes)
                progress |= self._prefill_round(slots, prefixes)
                self._attach(slots, prefixes)
                progress |= self._decode_round(slots, queue, scalars, keep, prefixes)
                if not progress and self._drop_idle_prefix(slots, prefixes):
                    continue
                if not progress:
                    raise paged_kv.PagesExhausted(
                        f"the page pool ({self.live_pool.num_pages} pages, {self.live_pool.num_free} free) cannot make "
                        f"progress: raise sampling.engine.num_pages")
        self.stats["peak_pages"] = self.live_pool.peak_used

    def _admit(self, queue, slots, prefixes) -> bool:
        """Move queued conversations into free slots while their first pages can be allocated."""
        ec = self.engine_config
        progress = False
        reserve = sum(max(n, 0) for _, n in self._growth(slots))  # running rows grow first (no livelock)
        for s in range(len(slots)):
            if slots[s] is not None:
                continue
            if not queue:
                break
            c = queue[0]
            if ec.share_prefix and c.shareable:
                entry = prefixes.get(c.prompt_pos)
                n_tail = 1 if (c.prompt_len - 1) % ec.page_size else 0
                need = n_tail + (0 if entry else paged_kv.pages_for(c.prompt_len - 1, ec.page_size))
                if need + reserve > self.live_pool.num_free:
                    break
                if entry is None:
                    entry = _Prefix(c.prompt_pos, c.seq[:-1], self.live_pool.alloc(need - n_tail),
                                    self._waiting[c.prompt_pos])
                    prefixes[c.prompt_pos] = entry
                    self.stats["prefix_prefills"] += 1
                c.prefix, c.tail = entry, (self.live_pool.alloc(1)[0] if n_tail else None)
            else:  # recompute / continuation / one-token prompt: its own pages for what it must prefill
                need = paged_kv.pages_for(len(c.tokens) - 1, ec.page_size) - len(c.pages)
                if need + reserve > self.live_pool.num_free:
                    break
                c.pages += self.live_pool.alloc(max(need, 0))
            queue.popleft()
            self._admitted += 1
            c.admitted = self._admitted
            slots[s] = c
            progress = True
        return progress

    def _prefill_round(self, slots, prefixes) -> bool:
        """One chunk of up to prefill_chunk tokens for every unfinished prefix entry and every slot row that still
        has conversation tokens to write, in one jitted call."""
        ec = self.engine_config
        jobs = []  # (tokens to write, start position, pages, on_done)
        for entry in prefixes.values():
            if not entry.complete:
                jobs.append((entry, entry.tokens, entry.written, entry.pages))
        for c in slots:
            if c is not None and c.prefix is None and c.written < len(c.tokens) - 1:
                jobs.append((c, c.tokens[:-1], c.written, c.pages))
        if not jobs:
            return False
        jobs = jobs[:self._rows()]  # at most one program's rows per round, the rest next round
        C = self._prefill_width(max(len(toks) - start for _, toks, start, _ in jobs))
        R = self._row_bucket(len(jobs))
        width = self._width(max(len(j[3]) for j in jobs))
        ids, pos, valid = (np.zeros((R, C), np.int32) for _ in range(3))
        rows = []
        for r, (owner, toks, start, pages) in enumerate(jobs):
            chunk = toks[start:start + C]
            ids[r, :len(chunk)] = chunk
            pos[r, :len(chunk)] = np.arange(start, start + len(chunk))
            valid[r, :len(chunk)] = 1
            owner.written = start + len(chunk)
            self.stats["prefill_tokens"] += len(chunk)
            rows.append(pages)
        table = paged_kv.page_table(rows + [[]] * (R - len(rows)), width)
        self.pages = _prefill_jit(self.graphdef, self.state, self.pages, self._put(ids), self._put(pos),
                                  self._put(valid.astype(bool)), self._put(table), page_size=ec.page_size)
        self.stats["prefill_calls"] += 1
        return True

    def _attach(self, slots, prefixes) -> None:
        """Rows whose prefix entry is complete: share its full pages, copy its partial last page into the row's
        private tail page; drop entries whose samples are all attached."""
        ps = self.engine_config.page_size
        src, dst = [], []
        for c in slots:
            if c is None or c.prefix is None or not c.prefix.complete:
                continue
            entry = c.prefix
            n_full = len(entry.tokens) // ps
            self.live_pool.share(entry.pages[:n_full])
            c.pages = entry.pages[:n_full] + ([c.tail] if c.tail is not None else [])
            if c.tail is not None:
                src.append(entry.pages[n_full])
                dst.append(c.tail)
            c.written, c.prefix, c.tail, c.shareable = len(entry.tokens), None, None, False
            entry.waiting -= 1
            self._waiting[entry.key] -= 1
            if entry.waiting == 0:
                self.live_pool.release(entry.pages)
                del prefixes[entry.key]
        if src:
            n = -(-len(src) // self._rows()) * self._rows()  # one program shape
            src += [pa.TRASH_PAGE] * (n - len(src))
            dst += [pa.TRASH_PAGE] * (n - len(dst))
            self.pages = _copy_jit(self.pages, self._put(np.asarray(src, np.int32)),
                                   self._put(np.asarray(dst, np.int32)))

    def _exit_after(self, queue, num_rows: int) -> int:
        """Finished rows that end a decode chunk early: enough to refill a quarter of the slots (or all the
        queue), so freed slots do not idle until the chunk's end; never with an empty queue."""
        if not queue:
            return num_rows + 1
        return max(1, min(len(queue), -(-num_rows // EXIT_FRACTION)))

    def _row_bucket(self, num_rows: int) -> int:
        """Rows of a prefill or decode call: a power-of-two bucket of the rows with work (at least MIN_ROWS, at
        most the slot rows), a multiple of the data shards: a round that prefills one new prompt, or decodes the
        last rows of a draining queue, must not pay for max_slots rows."""
        r = min(1 << (max(num_rows, MIN_ROWS) - 1).bit_length(), self._rows())
        return -(-r // self.data_shards) * self.data_shards

    def _prefill_width(self, longest: int) -> int:
        """Tokens per row of a prefill call: MIN_PREFILL_WIDTH when every chunk left to write fits it, else
        prefill_chunk. Two widths only (each multiplies the prefill programs), but short prompts (and multi-turn
        appends) do not pay for prefill_chunk columns."""
        return min(self.engine_config.prefill_chunk, MIN_PREFILL_WIDTH if longest <= MIN_PREFILL_WIDTH else 1 << 30)

    def _rows(self) -> int:
        """Batch rows of every program: max_slots rounded up to a multiple of the data shards."""
        return -(-self.engine_config.max_slots // self.data_shards) * self.data_shards

    def _width(self, num_pages: int) -> int:
        """Page-table width of a call: a power-of-two bucket of the live pages, at least MIN_WIDTH pages (few
        programs), at most the context's pages."""
        return paged_kv.width_bucket(max(num_pages, MIN_WIDTH), self._max_pages())

    def _max_pages(self) -> int:
        max_pos = getattr(self.config, "max_position_embeddings", None) or 1 << 20
        return paged_kv.pages_for(max_pos, self.engine_config.page_size)

    def _grow(self, slots, queue, prefixes) -> None:
        """Give every ready row the pages its next chunk writes into. On a short pool preempt the most recently
        admitted rows (back to the queue front, recomputed later) until the rest fit; with one row left, drop the
        prefix entries no row in a slot is waiting for."""
        while True:
            growth = self._growth(slots)
            if not growth:
                return
            if sum(max(n, 0) for _, n in growth) <= self.live_pool.num_free:
                for c, n in growth:
                    if n > 0:
                        c.pages += self.live_pool.alloc(n)
                return
            rows = sorted((c for c in slots if c is not None), key=lambda c: c.admitted)
            if len(rows) > 1:  # the oldest row always keeps going: no livelock
                self._preempt(rows[-1], slots, queue)
                continue
            if not self._drop_idle_prefix(slots, prefixes):
                raise paged_kv.PagesExhausted(
                    f"one row needs {growth[0][1]} more pages, {self.live_pool.num_free} free: raise "
                    f"sampling.engine.num_pages")

    def _drop_idle_prefix(self, slots, prefixes) -> bool:
        """Free the pages of one prefix entry that no row in a slot waits for (it is prefilled again when its
        next sample is admitted); False if there is none."""
        idle = [e for e in prefixes.values() if not any(c is not None and c.prefix is e for c in slots)]
        if not idle:
            return False
        self.live_pool.release(idle[0].pages)
        del prefixes[idle[0].key]
        return True

    def _growth(self, slots) -> list[tuple[Conversation, int]]:
        """(row, pages it still needs for its next decode chunk) for every ready row, oldest admission first."""
        ec = self.engine_config
        ready = sorted((c for c in slots if c is not None and c.ready), key=lambda c: c.admitted)
        return [(c, paged_kv.pages_for(c.written + min(ec.decode_chunk, c.budget - c.step), ec.page_size)
                 - len(c.pages)) for c in ready]

    def _preempt(self, c: Conversation, slots, queue) -> None:
        """Free a row's pages and requeue it at the front. A row still waiting for its prompt's prefix just
        gives back its reserved tail page; any other row is recomputed later (same draws, same tokens)."""
        if c.prefix is not None:
            if c.tail is not None:
                self.live_pool.release([c.tail])
            c.prefix, c.tail = None, None
        else:
            self.live_pool.release(c.pages)
            c.pages, c.written, c.shareable = [], 0, False
            c.turn_tokens, c.turn_logprobs = [], []
            self.stats["recomputes"] += 1
        slots[slots.index(c)] = None
        queue.appendleft(c)

    def _decode_round(self, slots, queue, scalars, keep, prefixes) -> bool:
        """Up to decode_chunk steps of every ready slot; record the tokens and retire finished rows."""
        ec = self.engine_config
        if not any(c is not None and c.ready for c in slots):
            return False
        self._grow(slots, queue, prefixes)
        if not any(c is not None and c.ready for c in slots):
            return True  # everything ready was preempted: the pages went back, the queue goes on
        ready = [(s, c) for s, c in enumerate(slots) if c is not None and c.ready]
        S = self._row_bucket(len(ready))  # the ready rows, compacted: a draining tail does not pay for max_slots
        live = [c for _, c in ready] + [None] * (S - len(ready))
        width = self._width(max(len(c.pages) for c in live if c is not None))
        table = paged_kv.page_table([c.pages if c else [] for c in live], width)
        arr = lambda f, dt=np.int32: self._put(np.asarray([f(c) if c else 0 for c in live], dt))  # noqa: E731
        self.pages, toks, lps, n, eos = _decode_jit(
            self.graphdef, self.state, self.pages, self._put(table), arr(lambda c: c.tokens[-1]),
            arr(lambda c: c.written), arr(lambda c: c.step), arr(lambda c: c.budget),
            arr(lambda c: True, bool), arr(lambda c: c.prompt_index, np.uint32), arr(lambda c: c.sample, np.uint32),
            self._put(np.int32(self._exit_after(queue, S))), *scalars, steps=ec.decode_chunk,
            page_size=ec.page_size, pad_id=self.pad_id)
        toks, lps, n, eos = jax.device_get((toks, lps, n, eos))
        self.stats["decode_chunks"] += 1
        self.stats["decode_steps"] += int(n.max(initial=0))
        for r, (s, c) in enumerate(ready):
            k = int(n[r])
            c.turn_tokens += toks[r, :k].tolist()
            c.turn_logprobs += lps[r, :k].tolist()
            c.written += k
            if eos[r] or c.step >= c.budget:
                c.finished_eos = bool(eos[r])
                slots[s] = None
                if not keep:
                    self.live_pool.release(c.pages)
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
    """Why the engine cannot run here (None if it can): its host scheduler drives one process, and its slots and
    page pool are not split over the data axes (a data-parallel mesh would decode every slot on every replica)."""
    if distributed.is_multiprocess():
        return f"the run has {jax.process_count()} processes (the engine's scheduler runs in one)"
    shards = model_sharding.batch_shards(mesh)
    if mesh is not None and shards > 1:
        return (f"the mesh splits the batch over {shards} data shards {model_sharding.batch_axes(mesh)} (the "
                f"engine's slots are not split over data axes yet)")
    return None


def make_generator(model: nnx.Module, *, config: EngineConfig, max_new_tokens: int, mesh: Mesh | None = None,
                   cache_dtype=jnp.float32, pad_id: int | None = None) -> Engine | Sampler:
    """The generator for `config.enabled`: the engine (true), the static sampler (false), or (auto) the engine
    wherever it runs and the responses may be long enough to pay (max_new_tokens >= auto_min_new_tokens), the
    static sampler elsewhere. Both draw the same samples. enabled=true where the engine cannot run is a
    ValueError naming sampling.engine.enabled and the reason."""
    reason = engine_unsupported(mesh)
    if config.enabled is True and reason:
        raise ValueError(f"sampling.engine.enabled=true: {reason}; set it to auto or false")
    if config.enabled is False or reason or (config.enabled == "auto" and max_new_tokens < config.auto_min_new_tokens):
        return Sampler(model, mesh=mesh, cache_dtype=cache_dtype, pad_id=pad_id)
    return Engine(model, mesh=mesh, cache_dtype=cache_dtype, pad_id=pad_id, config=config)


def kv_bytes(engine: Engine) -> int:
    """Bytes of the engine's page pool (all layers, k and v)."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(engine.pages)))
