"""The rollout engine's device side: its three jitted programs and `Device`, which owns what they run on.

Why a module of its own: everything here is about arrays on the accelerator (the weights in the sampler layout,
the paged KV pool, the mesh layouts of each program input); nothing here knows about conversations, slots or
queues. The host scheduler (scheduler.py) decides what to run and hands `Device` plain numpy arrays; `Device`
places them (replicated, or split over the data shards), runs one program, keeps the pool the program returns
(the pool is donated through every program) and gives back host values.

The programs (each compiled once per shape bucket; `compiled_programs` counts them for recompilation checks):
- `_decode_chunk`: up to K decode steps of every live slot; a `lax.while_loop` that ends early once enough rows
  finished for the host to refill slots. Sample g of prompt p draws response index i from
  uniform(fold_in(fold_in(fold_in(key(seed), p), g), i)): exactly the static Sampler's keys.
- `_prefill`: writes the k/v of one chunk of prompt (or appended) tokens per row into its pages.
- `_copy_pages`: copy-on-write of a shared prompt prefix's partial last page.
Over D > 1 data shards each program is its one-shard body under jax.vmap(spmd_axis_name=the batch axes) over a
leading shard axis, so each device gathers and writes only its own shard's pages (no pool all-gather).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stare_jax import distributed
from stare_jax.config.engine import EngineConfig
from stare_jax.models import paged_attention as pa, sharding as model_sharding
from stare_jax.sampling import selection, sharding as sampling_sharding
from stare_jax.sampling.params import SamplingParams

# ----------------------------------------------------------------------------------------------- the programs


def _row_keys(key, prompt_index_S, sample_S):
    """fold_in(fold_in(key, p), g) per row: the static Sampler's sequence keys."""
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(
        prompt_index_S.astype(jnp.uint32), sample_S.astype(jnp.uint32)
    )


def _over_shards(f, batch_axes: tuple):
    """f itself for one data shard (no leading shard axis); with batch_axes, f vmapped over the leading shard
    axis [D, ...] of every argument, that axis split over the mesh's batch axes: each shard's rows gather and
    write only its own page pool, on its own devices (no pool all-gather)."""
    return jax.vmap(f, spmd_axis_name=batch_axes) if batch_axes else f


def _decode_chunk(
    graphdef,
    state,
    pages,
    page_table_SxM,
    tok_S,
    pos_S,
    step_S,
    budget_S,
    live_S,
    prompt_index_S,
    sample_S,
    exit_after,
    key,
    greedy,
    temperature,
    top_k,
    top_p,
    eos_E,
    *,
    steps: int,
    page_size: int,
    pad_id: int,
    batch_axes: tuple = (),
    attention: str = "gather",
    keys_transposed: bool = False,
):
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
        hidden, pages = pa.paged_forward(
            model,
            tok[:, None],
            pos[:, None],
            ~done[:, None],
            pages,
            page_table_SxM,
            page_size,
            attention=attention,
            batch_axes=batch_axes,
            keys_transposed=keys_transposed,
        )
        logits_SxV = model.logits_from_hidden(hidden)[:, -1].astype(jnp.float32)
        u_S = jax.vmap(lambda k, s: jax.random.uniform(jax.random.fold_in(k, s)))(keys_S, step)
        t, lp = selection.select_tokens(
            logits_SxV, u_S, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p
        )
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

    init = (
        jnp.int32(0),
        pages,
        tok_S,
        pos_S,
        step_S,
        ~live_S | (step_S >= budget_S),
        jnp.zeros(tok_S.shape, bool),
        jnp.full(tok_S.shape + (steps,), pad_id, jnp.int32),
        jnp.zeros(tok_S.shape + (steps,), jnp.float32),
        jnp.zeros(tok_S.shape, jnp.int32),
    )

    def cond(c):
        finished = jnp.sum(c[5] & live_S, axis=-1)
        return (c[0] < steps) & jnp.any(~c[5]) & jnp.all(finished < exit_after)

    c = jax.lax.while_loop(cond, body, init)
    return c[1], c[7], c[8], c[9], c[6]


def _prefill(
    graphdef,
    state,
    pages,
    ids_RxC,
    pos_RxC,
    valid_RxC,
    page_table_RxM,
    *,
    page_size: int,
    batch_axes: tuple = (),
    keys_transposed: bool = False,
):
    """Write the k/v of one chunk of tokens per row into its pages (the logits are not needed; attention over the
    gathered pages, whatever the decode backend); with batch_axes every argument but the weights has a leading
    data-shard axis. keys_transposed: the key pools' layout (paged_attention.keys_transposed)."""
    model = nnx.merge(graphdef, state)

    def write(pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM):
        return pa.paged_forward(
            model, ids_RxC, pos_RxC, valid_RxC, pages, page_table_RxM, page_size, keys_transposed=keys_transposed
        )[1]

    return _over_shards(write, batch_axes)(pages, ids_RxC, pos_RxC, valid_RxC, page_table_RxM)


def _copy_pages(pages, src_C, dst_C, *, batch_axes: tuple = ()):
    """pages[dst] = pages[src] in every layer (copy-on-write of a shared prompt's partial last page); with
    batch_axes, within each data shard's pool."""

    def copy(pages, src_C, dst_C):
        return [{name: pa.copy_pages(x, src_C, dst_C) for name, x in layer.items()} for layer in pages]

    return _over_shards(copy, batch_axes)(pages, src_C, dst_C)


_decode_jit = jax.jit(
    _decode_chunk,
    static_argnames=("graphdef", "steps", "page_size", "pad_id", "batch_axes", "attention", "keys_transposed"),
    donate_argnames=("pages",),
)
_prefill_jit = jax.jit(
    _prefill, static_argnames=("graphdef", "page_size", "batch_axes", "keys_transposed"), donate_argnames=("pages",)
)
_copy_jit = jax.jit(_copy_pages, static_argnames=("batch_axes",), donate_argnames=("pages",))


def compiled_programs() -> int:
    """Number of engine programs compiled so far in this process (for recompilation checks)."""
    return sum(f._cache_size() for f in (_decode_jit, _prefill_jit, _copy_jit))  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------- the device side


class Device:
    """What the programs run on: the weights in the sampler layout (`state`), the page pool (`pages`: per layer
    k/v, [D, ...] over D > 1 data shards, made by `init_pages`) and the layouts of the programs' host inputs.

    Every host input (tokens, positions, page tables, budgets, copy lists, draw options) is built by every process
    from its identical host value with distributed.global_from_host: `put` (replicated) and `put_rows` (a
    per-shard argument [D, ...], split over the mesh's batch axes); the results of a decode chunk come back to
    every process in one distributed.fetch_global. With a mesh the pool's kv heads are split over the tensor axis.
    """

    def __init__(
        self,
        model_config: Any,
        graphdef: Any,
        state: Any,
        *,
        engine_config: EngineConfig,
        mesh: Mesh | None,
        cache_dtype: str,
        pad_id: int,
    ):
        self.config = model_config
        self.engine_config = engine_config
        self.graphdef = graphdef
        self.mesh = mesh
        self.cache_dtype = cache_dtype
        self.pad_id = pad_id
        self.compute_dtype = jnp.dtype(getattr(model_config, "dtype", "float32")).name
        self.state: Any = None
        self.pages: Any = None  # per layer k/v page arrays (made with the pools), [D, N, ...] over D > 1 shards
        self._replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self.batch_axes: tuple[str, ...] = ()  # the mesh axes of the leading shard axis (none: one shard)
        self._split: NamedSharding | None = None  # the layout of a per-shard argument [D, ...]
        if mesh is not None and self.data_shards > 1:
            self.batch_axes = model_sharding.batch_axes(mesh)
            self._split = NamedSharding(mesh, PartitionSpec(self.batch_axes))
        self.attention = pa.resolve_attention(
            engine_config.attention, platform=self.platform, head_dim=model_config.head_dim, cache_dtype=cache_dtype
        )
        self.keys_transposed = pa.keys_transposed(
            self.attention, self.platform, getattr(model_config, "attention_impl", "xla")
        )
        self.update_params(state)

    # ------------------------------------------------------------------ weights, mesh, layouts
    def update_params(self, params) -> None:
        """New parameters (nnx.Module or its nnx.State), resharded on device into the sampler layout (the previous
        copy is dropped first, so the two never coexist)."""
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        self.state = None
        self.state = sampling_sharding.reshard_for_sampling(state, self.mesh, dtype=self.compute_dtype)

    @property
    def platform(self) -> str:
        """The platform the programs run on: the mesh's devices' (a TPU topology's in an ahead-of-time compile on
        a CPU host), else the default backend."""
        return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

    @property
    def data_shards(self) -> int:
        return model_sharding.batch_shards(self.mesh)

    @property
    def abstract(self) -> bool:
        """True when the weights are jax.ShapeDtypeStructs (models.abstract_model): programs trace, not run."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))

    def program_context(self):
        """The mesh and its activation rules around the jitted programs (nothing without a mesh). Over data
        shards the rows of a program are one shard's (the shard axis carries the batch axes), so the row
        dimension inside is not split again."""
        rules = {**model_sharding.DEFAULT_RULES, "batch": None} if self.batch_axes else None
        return model_sharding.program_context(self.mesh, rules)

    def shard_axis(self) -> int | None:
        """The pool's leading data-shard axis size (None: one shard, no such axis)."""
        return self.data_shards if self.batch_axes else None

    def pool_sharding(self, shape) -> NamedSharding:
        """The page pool's layout on a mesh: kv heads over the tensor axis (as the attention's k/v); over D data
        shards the leading shard axis over the batch axes (each device holds its shard's pool only)."""
        assert self.mesh is not None
        lead = (self.batch_axes,) if self.batch_axes else ()
        spec = model_sharding.logical_to_spec(pa.POOL_AXES, model_sharding.DEFAULT_RULES, shape[len(lead) :], self.mesh)
        return NamedSharding(self.mesh, PartitionSpec(*lead, *spec))

    def init_pages(self, num: int) -> None:
        """`pages` := the zeroed device pool of `num` pages per shard, made in its layout (a data-split pool is
        never whole on one device); the old pool is dropped first."""
        cfg, ec, D = self.config, self.engine_config, self.data_shards
        self.pages = None

        def make():
            pages = pa.init_pages(
                cfg.num_layers,
                num,
                ec.page_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                jnp.dtype(self.cache_dtype),
                keys_transposed=self.keys_transposed,
            )
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (D,) + x.shape), pages) if self.batch_axes else pages

        if self.mesh is None:  # on one device: committed to the weights' device, as the programs' outputs are (the
            # first call after the pool is made must not compile its programs again for uncommitted inputs)
            devices = jax.tree.leaves(self.state)[0].sharding.device_set
            self.pages = (
                jax.device_put(make(), jax.sharding.SingleDeviceSharding(next(iter(devices))))
                if len(devices) == 1
                else make()
            )
            return
        shape = pa.pool_shape(num, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self.shard_axis())
        self.pages = jax.jit(make, out_shardings=self.pool_sharding(shape))()  # k's too: only kv heads are split

    def put(self, x):
        """A host value (the same on every process: the scheduler is replicated) as a program input replicated
        over the mesh (distributed.global_from_host: in a multi-process run each process places its own
        devices' copies)."""
        x = np.asarray(x)
        return distributed.global_from_host(x, self._replicated) if self._replicated is not None else jnp.asarray(x)

    def put_rows(self, x_D):
        """A per-shard argument [D, ...] of a program: split over the batch axes (each process places its own
        shards' rows); one shard: [...] as put."""
        x_D = np.asarray(x_D)
        return distributed.global_from_host(x_D, self._split) if self._split is not None else self.put(x_D[0])

    def draw_inputs(self, sampling: SamplingParams) -> list:
        """The replicated draw inputs of the decode program: key(seed), then SamplingParams.program_inputs (the
        key is built from its uint32 data, which every process places like any host value)."""
        key_data = np.asarray(jax.random.key_data(jax.random.key(sampling.seed)))
        return [jax.random.wrap_key_data(self.put(key_data))] + [
            self.put(x) for x in sampling.program_inputs(self.config)
        ]

    # ------------------------------------------------------------------ running the programs
    def decode(self, table_D, rows_D: dict[str, np.ndarray], exit_after_D, draw_inputs: list):
        """One decode chunk over every shard: table_D [D, S, M] page tables, rows_D the per-row inputs [D, S]
        (tok, pos, step, budget, live, prompt_index, sample), exit_after_D [D]. Returns host (tokens [D, S, K],
        log-probs [D, S, K], counts [D, S], eos [D, S]), fetched in one gather for every process."""
        ec = self.engine_config
        r = {name: self.put_rows(x) for name, x in rows_D.items()}
        self.pages, toks, lps, n, eos = _decode_jit(
            self.graphdef,
            self.state,
            self.pages,
            self.put_rows(table_D),
            r["tok"],
            r["pos"],
            r["step"],
            r["budget"],
            r["live"],
            r["prompt_index"],
            r["sample"],
            self.put_rows(exit_after_D),
            *draw_inputs,
            steps=ec.decode_chunk,
            page_size=ec.page_size,
            pad_id=self.pad_id,
            batch_axes=self.batch_axes,
            attention=self.attention,
            keys_transposed=self.keys_transposed,
        )
        toks, lps, n, eos = distributed.fetch_global((toks, lps, n, eos))  # one gather for every process
        if not self.batch_axes:  # one shard: its rows without the shard axis
            toks, lps, n, eos = (x[None] for x in (toks, lps, n, eos))
        return toks, lps, n, eos

    def prefill(self, ids_D, pos_D, valid_D, table_D) -> None:
        """Write one chunk of tokens per row [D, R, C] into the pages of table_D [D, R, M]."""
        self.pages = _prefill_jit(
            self.graphdef,
            self.state,
            self.pages,
            self.put_rows(ids_D),
            self.put_rows(pos_D),
            self.put_rows(valid_D),
            self.put_rows(table_D),
            page_size=self.engine_config.page_size,
            batch_axes=self.batch_axes,
            keys_transposed=self.keys_transposed,
        )

    def copy(self, src_D, dst_D) -> None:
        """pages[dst] = pages[src] within each shard's pool ([D, C] page ids, padded with the trash page)."""
        self.pages = _copy_jit(self.pages, self.put_rows(src_D), self.put_rows(dst_D), batch_axes=self.batch_axes)

    def trace(self, pages_per_shard: int, rows: int, width: int, chunk: int) -> dict[str, Any]:
        """The jax `Traced` decode and prefill programs for an abstract engine, at `rows` rows per shard, page
        tables `width` pages wide, prefill chunks of `chunk` tokens and a pool of `pages_per_shard` pages per
        shard, in the layouts `decode` and `prefill` pass (lower them under program_context())."""
        cfg, ec = self.config, self.engine_config
        lead = (self.data_shards,) if self.batch_axes else ()

        def pool(transposed: bool):
            shape = pa.pool_shape(
                pages_per_shard, ec.page_size, cfg.num_kv_heads, cfg.head_dim, self.shard_axis(), transposed=transposed
            )
            return jax.ShapeDtypeStruct(
                shape,
                jnp.dtype(self.cache_dtype),
                sharding=self.pool_sharding(shape) if self.mesh is not None else None,
            )

        pages = [{"k": pool(self.keys_transposed), "v": pool(False)} for _ in range(cfg.num_layers)]
        split = self._split if self._split is not None else self._replicated

        def arg(shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct((*lead, *shape), jnp.dtype(dtype), sharding=split)

        rep = self._replicated
        scalars = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)
            for x in [jax.eval_shape(lambda: jax.random.key(0)), *SamplingParams().program_inputs(cfg)]
        ]
        with self.program_context():
            decode = _decode_jit.trace(
                self.graphdef,
                self.state,
                pages,
                arg((rows, width)),
                *(arg((rows,)) for _ in range(4)),
                arg((rows,), bool),
                arg((rows,), np.uint32),
                arg((rows,), np.uint32),
                arg((), np.int32),
                *scalars,
                steps=ec.decode_chunk,
                page_size=ec.page_size,
                pad_id=self.pad_id,
                batch_axes=self.batch_axes,
                attention=self.attention,
                keys_transposed=self.keys_transposed,
            )
            prefill = _prefill_jit.trace(
                self.graphdef,
                self.state,
                pages,
                arg((rows, chunk)),
                arg((rows, chunk)),
                arg((rows, chunk), bool),
                arg((rows, width)),
                page_size=ec.page_size,
                batch_axes=self.batch_axes,
                keys_transposed=self.keys_transposed,
            )
        return {"decode": decode, "prefill": prefill}
