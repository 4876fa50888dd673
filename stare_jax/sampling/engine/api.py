"""The rollout engine's user-facing surface: the `Engine` class and the module-level helpers around it.

Why a module of its own: this is what callers (the training loop's collection, the evaluation runner, the tool
rollouts, the ahead-of-time compile) use, and it stays thin: each call validates its input, turns prompts into
`Conversation`s, hands them to the host scheduler (scheduler.py) and reads back the result. The device programs
live in programs.py. Sampling options arrive as one `SamplingParams` and go down unchanged.

- `Engine.generate_arrays` / `Engine.generate`: the Sampler-compatible array and list APIs (a drop-in).
- `Engine.start` / `extend` / `advance` / `close`: multi-turn conversations (append-and-continue), blocking or
  event-driven (wait=False, then `advance` round by round).
- `generate`, `make_generator` (engine or static sampler per sampling.engine.enabled), `engine_unsupported`,
  `kv_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from stare_jax import distributed
from stare_jax.config.engine import EngineConfig
from stare_jax.sampling import paged_kv
from stare_jax.sampling.engine.programs import Device
from stare_jax.sampling.engine.scheduler import Conversation, Scheduler, assign_shards
from stare_jax.sampling.params import SamplingParams, check_counts
from stare_jax.sampling.sampler import (
    SampleArrays,
    SampleOutput,
    Sampler,
    _check_prompts,
    sampling_graph,
)


class Engine:
    """Continuous-batching rollout engine over a paged KV cache (see stare_jax.sampling.engine).

    Same constructor arguments as Sampler (mesh, cache_dtype, pad_id, compute_dtype) plus `config` (EngineConfig).
    With a mesh, parameters are kept in the sampler layout (replicated over the data axes, "tensor" kept) and the page
    pool's kv heads are split over the tensor axis. A mesh that splits the batch over D data shards (its data /
    fsdp axes) gives each shard its own ceil(max_slots / D) slots and its own pool of ceil(num_pages / D) pages
    (arrays with a leading shard axis split over those axes), each scheduled by its own host sub-scheduler;
    prompts are assigned to shards whole (all G samples on one shard). `stats` counts, per call, prefix
    prefills, recomputes (preemptions), decode chunks/steps and the peak number of pages in use.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        config: EngineConfig | None = None,
        mesh: Mesh | None = None,
        cache_dtype=jnp.float32,
        pad_id: int | None = None,
        compute_dtype=None,
    ):
        self.config, graphdef, state = sampling_graph(model, compute_dtype)
        self.engine_config = config if config is not None else EngineConfig()
        if self.engine_config.max_slots == "auto":
            raise ValueError(
                "sampling.engine.max_slots=auto reached the engine unresolved: resolve it with "
                "stare_jax.planning.estimate.resolve_max_slots (the run does) or give a number"
            )
        self.mesh = mesh
        self.cache_dtype = jnp.dtype(cache_dtype).name
        cfg_pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else 0))
        self.device = Device(
            self.config,
            graphdef,
            state,
            engine_config=self.engine_config,
            mesh=mesh,
            cache_dtype=self.cache_dtype,
            pad_id=self.pad_id,
        )
        self.scheduler = Scheduler(self.device, self.engine_config)

    # ------------------------------------------------------------------ state, read-only views
    @property
    def state(self) -> Any:
        """The weights in the sampler layout (None after `release`)."""
        return self.device.state

    @property
    def pages(self) -> Any:
        """The device page pool: per layer k/v arrays ([D, ...] over D > 1 data shards); None before the first
        call and after `release`."""
        return self.device.pages

    @property
    def pools(self) -> list[paged_kv.PagePool] | None:
        """The host page pools, one per data shard (None before the first call and after `release`)."""
        return self.scheduler.pools

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

    @property
    def stats(self) -> dict:
        """Counters of the current / last batch (Scheduler.stats)."""
        return self.scheduler.stats

    @property
    def platform(self) -> str:
        return self.device.platform

    @property
    def data_shards(self) -> int:
        return self.device.data_shards

    @property
    def attention(self) -> str:
        """The decode attention backend ("gather" or "pallas": sampling.engine.attention resolved)."""
        return self.device.attention

    @property
    def keys_transposed(self) -> bool:
        return self.device.keys_transposed

    @property
    def abstract(self) -> bool:
        """True when the engine holds jax.ShapeDtypeStructs (built from models.abstract_model): its programs can
        be traced and lowered (`trace_programs`), not run."""
        return self.device.abstract

    def slots_per_shard(self) -> int:
        """Decode slots of each data shard (max_slots split over the shards, rounded up)."""
        return self.scheduler.slots_per_shard()

    def program_context(self):
        """The mesh and its activation rules around the jitted programs (Device.program_context)."""
        return self.device.program_context()

    # ------------------------------------------------------------------ Sampler-compatible surface
    def update_params(self, params) -> None:
        """New parameters (nnx.Module or its nnx.State), resharded on device into the sampler layout."""
        self.device.update_params(params)

    def release(self) -> None:
        """Drop the weight copy and, when no conversation holds pages, the KV page pools (before the train step:
        sampling and training never hold their largest buffers at once). `update_params` brings the weights back;
        the next call makes the pools again (the same shapes: nothing recompiles)."""
        self.device.state = None
        self.scheduler.release_pools()

    def batch_bucket(self, num_prompts: int) -> int:
        """The engine needs no batch padding (requests are queued): the number of prompts itself."""
        return max(int(num_prompts), 1)

    def generate_arrays(
        self,
        prompt_ids_PxT,
        prompt_mask_PxT,
        *,
        max_new_tokens: int,
        num_samples: int = 1,
        sampling: SamplingParams = SamplingParams(),
        prompt_index_P=None,
        active_P=None,
    ) -> SampleArrays:
        """Sampler.generate_arrays: LEFT-padded prompts [P, T] -> SampleArrays with P * num_samples rows
        (prompt-major) and max_new_tokens columns; inactive prompts give length-0 rows."""
        check_counts(max_new_tokens, num_samples)
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
            raise ValueError(
                f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's "  # may
                f"context {max_pos}"
            )  # run past the context (the caller warns), not the budget alone
        for p in range(P):
            if active[p] and not prompts[p]:
                raise ValueError(f"prompt {p} has no tokens (its mask is all 0)")
        convs = self._run_fresh(
            [(p, prompts[p], int(index[p])) for p in range(P) if active[p]],
            max_new_tokens,
            num_samples,
            keep=False,
            sampling=sampling,
        )
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
        put = self.device.put
        return SampleArrays(put(tokens), put(logprobs), put(lengths), put(finished))

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        num_samples: int = 1,
        sampling: SamplingParams = SamplingParams(),
    ) -> SampleOutput:
        """Sampler.generate: token-id lists -> SampleOutput (prompt-major, index p * num_samples + g)."""
        convs = self.start(
            prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples, sampling=sampling, keep=False
        )
        return SampleOutput(
            tokens=[c.turn_tokens for c in convs],
            logprobs=[c.turn_logprobs for c in convs],
            finish_reasons=["eos" if c.finished_eos else "length" for c in convs],
            lengths=[len(c.turn_tokens) for c in convs],
        )

    def trace_programs(self, longest_tokens: int) -> dict[str, Any]:
        """The jax `Traced` decode and prefill programs (lower them under program_context()) at their largest
        shapes for requests of up to `longest_tokens` tokens (prompt + response): every slot of every data shard
        live, the page table as wide as the longest request's pages, a full prefill chunk per row, the pool as
        the run allocates it (Scheduler.pages_per_shard), in the layouts the scheduler passes. For an
        ahead-of-time compile (e.g. a TPU slice on a CPU host: stare_jax.training.aot); needs an abstract
        engine."""
        if not self.abstract:
            raise ValueError("Engine.trace_programs needs an abstract engine (built from models.abstract_model)")
        ec, sch = self.engine_config, self.scheduler
        return self.device.trace(
            sch.pages_per_shard(longest_tokens),
            sch.slots_per_shard(),
            sch.width(paged_kv.pages_for(longest_tokens, ec.page_size)),
            ec.prefill_width(longest_tokens),
        )

    # ------------------------------------------------------------------ multi-turn API
    def start(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        num_samples: int = 1,
        sampling: SamplingParams = SamplingParams(),
        keep: bool = True,
        prompt_index=None,
        wait: bool = True,
    ) -> list[Conversation]:
        """Sample the first turn of num_samples conversations per prompt (prompt-major). keep=True keeps each
        conversation's pages alive for `extend` (free them with `close`). wait=False only queues them: `advance`
        runs the scheduler round by round (an event-driven multi-turn rollout)."""
        check_counts(max_new_tokens, num_samples)
        prompts = _check_prompts(prompt_ids, self.config, max_new_tokens)
        index = range(len(prompts)) if prompt_index is None else [int(i) for i in prompt_index]
        return self._run_fresh(
            list(zip(range(len(prompts)), prompts, index)),
            max_new_tokens,
            num_samples,
            keep=keep,
            sampling=sampling,
            wait=wait,
        )

    def extend(
        self,
        convs: Sequence[Conversation],
        appended: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        keep: bool = True,
        wait: bool = True,
    ) -> list[Conversation]:
        """Append the given tokens (e.g. a tool's output; not sampled: mask 0, log-prob NaN) to each live
        conversation and sample its next turn. Only the new tokens (and the previous turn's last token) are
        prefilled into the conversation's pages. Use the same SamplingParams (seed) as `start` for reproducible
        draws. max_new_tokens: one limit for every conversation's turn, or one per conversation (e.g. what is left
        of each response's token budget in a multi-turn rollout). wait=False queues them into the running batch
        (or a new one) while its other rows go on decoding: the conversations whose turn ended (handed out by
        `advance`) rejoin decoding at the next round; same SamplingParams and keep as the running batch."""
        limits = (
            [max_new_tokens] * len(convs) if isinstance(max_new_tokens, (int, np.integer)) else list(max_new_tokens)
        )
        if len(limits) != len(convs):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(convs)} conversations")
        for n in limits or [1]:
            check_counts(n, 1)
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
            c.new_turn(int(limit), appended=extra)
        self.scheduler.run(list(convs), keep=keep, sampling=sampling, wait=wait)
        return list(convs)

    @property
    def running(self) -> bool:
        """Conversations are queued or decoding (queued with wait=False: `advance` runs them)."""
        return self.scheduler.batch is not None

    def advance(self) -> list[Conversation]:
        """One scheduler round of the running batch (admit, prefill a chunk, attach, decode up to decode_chunk
        steps, retire). Returns the conversations whose turn ended in it (EOS, a stop id or the turn's limit), in
        slot order: their slots are free for other rows and, with keep=True, their pages kept, so a multi-turn
        rollout can run their tool call while the other rows keep decoding and `extend(..., wait=False)` them
        when it returns. [] when nothing is running."""
        return self.scheduler.advance()

    def close(self, convs: Sequence[Conversation]) -> None:
        """Free the pages of finished conversations. Closing one that is still running (an error path) cancels the
        running batch first (every row of it stops)."""
        self.scheduler.close(convs)

    def _run_fresh(
        self, prompts, max_new_tokens: int, G: int, *, keep: bool, sampling: SamplingParams, wait: bool = True
    ) -> list[Conversation]:
        """Queue num_samples conversations of every (output position, prompt, prompt index) and run them (wait) or
        leave them queued; each prompt's samples on one data shard (assign_shards by prompt + response tokens)."""
        shard_P = assign_shards([len(prompt) + max_new_tokens for _, prompt, _ in prompts], self.data_shards)
        convs = []
        for (p, prompt, pidx), d in zip(prompts, shard_P):
            for g in range(G):
                c = Conversation(
                    index=p * G + g,
                    prompt_index=pidx,
                    sample=g,
                    prompt_len=len(prompt),
                    seq=list(prompt),
                    shareable=len(prompt) > 1,
                    prompt_pos=p,
                    shard=d,
                )
                c.new_turn(max_new_tokens)
                convs.append(c)
        self.scheduler.run(convs, keep=keep, sampling=sampling, wait=wait)
        return convs


# ----------------------------------------------------------------------------------------------- helpers


def generate(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    sampling: SamplingParams = SamplingParams(),
    mesh: Mesh | None = None,
    cache_dtype=jnp.float32,
    config: EngineConfig | None = None,
) -> SampleOutput:
    """sampling.generate through the engine."""
    return Engine(model, mesh=mesh, cache_dtype=cache_dtype, config=config).generate(
        prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples, sampling=sampling
    )


def engine_unsupported(mesh: Mesh | None) -> str | None:
    """Why the engine cannot run here (None if it can). Any mesh runs, in one process or in several (the host
    scheduler is replicated: every process runs it on the same host data; a data-split mesh gives each data shard
    its own slots and page pool); several processes need the run's mesh over their devices."""
    if distributed.is_multiprocess() and mesh is None:
        return f"the run has {jax.process_count()} processes but the engine got no mesh over their devices"
    return None


def make_generator(
    model: nnx.Module,
    *,
    config: EngineConfig,
    max_new_tokens: int,
    mesh: Mesh | None = None,
    cache_dtype=jnp.float32,
    pad_id: int | None = None,
    resolve: Callable[[EngineConfig], EngineConfig] | None = None,
    compute_dtype=None,
) -> Engine | Sampler:
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
        return Sampler(model, mesh=mesh, cache_dtype=cache_dtype, pad_id=pad_id, compute_dtype=compute_dtype)
    return Engine(
        model,
        mesh=mesh,
        cache_dtype=cache_dtype,
        pad_id=pad_id,
        compute_dtype=compute_dtype,
        config=resolve(config) if resolve is not None else config,
    )


def kv_bytes(engine: Engine) -> int:
    """Bytes of the engine's page pool (all layers, k and v)."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(engine.pages)))
