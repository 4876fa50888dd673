"""The rollout sampler: one jitted program = prefill of a left-padded prompt batch + a `lax.while_loop` decode
over a preallocated KV cache, stopping as soon as every sequence has finished.

Layout and choices (why):
- Prompts are LEFT-padded to a bucket length T (power of two, minimum `min_prompt_bucket`): the last prompt
  token of every row then sits in slot T-1, so the first new token of every row goes to slot T, the next to
  T+1, ... -- one shared `cache_index` per step, a single dynamic_update_slice, no per-row scatter. Positions
  are cumsum(mask)-1, so a padded prompt gets the same positions (and RoPE) as the unpadded one.
- The cache holds T + N slots, N = the max_new_tokens bucket (`new_token_bucket`: a quarter of its power-of-two
  octave, minimum `min_new_bucket`, so 3072 new tokens get exactly 3072 slots, not 4096).
  max_new_tokens and the draw options (SamplingParams: greedy on/off, temperature, top_k, top_p, the seed and the
  EOS ids) are traced values, so
  there is one program per (prompt bucket, new-token bucket, prompt-count bucket, num_samples, cache dtype,
  mesh). The number of prompts is bucketed too (power of two, multiple of the data shards).
- Prefill: slots [0, T-1) in one decode_step call whose logits are never used (XLA then drops the
  [P, T-1, V] unembedding), then slot T-1 alone for the first next-token logits.
- G samples per prompt: the P prompts are prefilled once, then the cache (and the last logits) is repeated G
  times along batch (row p*G+g = sample g of prompt p, prompt-major).
- The cache is created, filled and consumed inside the one jitted program, so it never crosses a jit boundary
  (XLA updates the loop-carried cache, token and log-prob buffers of the while loop in place; there is no
  buffer to donate across calls -- a separate prefill/decode pair of jits would have to donate the cache).
- Randomness: key(seed) -> fold_in(prompt index) -> fold_in(sample g) -> fold_in(step), one uniform per
  sequence and step (inverse-CDF sampling, see selection.py). A sequence's draws therefore depend only on
  (seed, its prompt index, g, step), not on batch size, padding or the other prompts in the call.
- Returned per sequence: tokens (without the prompt; EOS included if produced), the temperature-1 full
  vocabulary log-prob of each token, the length and whether it finished on an EOS (else on length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stare_jax import distributed
from stare_jax.models import sharding as model_sharding
from stare_jax.models.transformer import abstract_model
from stare_jax.sampling import selection, sharding as sampling_sharding
from stare_jax.sampling.params import SamplingParams, check_counts


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Results of `generate`, num_samples per prompt, prompt-major (index p * num_samples + g).

    tokens: generated ids without the prompt, EOS included when produced.
    logprobs: log p(token | prefix) under the model's temperature-1 full-vocabulary distribution.
    finish_reasons: "eos" (stopped on an EOS id) or "length" (reached max_new_tokens).
    lengths: len(tokens).
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    lengths: list[int]


class SampleArrays(NamedTuple):
    """Device-array results of `Sampler.generate_arrays` (B = P * num_samples rows, prompt-major).

    tokens_BxN: int32, `pad_id` after each sequence's end. logprobs_BxN: float32, 0 after the end.
    lengths_B: int32 number of generated tokens (EOS included). finished_B: bool, True = ended on an EOS.
    """

    tokens_BxN: jax.Array
    logprobs_BxN: jax.Array
    lengths_B: jax.Array
    finished_B: jax.Array


@dataclasses.dataclass(frozen=True)
class _LoopSpec:
    """Static (compile-time) part of one sampling program."""

    num_samples: int
    new_bucket: int
    cache_dtype: str
    pad_id: int
    batch_sharding: NamedSharding | None
    phases: tuple[int, ...] = ()  # cumulative new-token ends of the decode phases (last = new_bucket)


class _Carry(NamedTuple):
    i: jax.Array  # number of tokens generated so far (the next token's index)
    last_B: jax.Array  # last generated token (fed to the model next)
    pos_B: jax.Array  # position of last_B
    done_B: jax.Array
    eos_B: jax.Array  # finished on an EOS
    lengths_B: jax.Array
    tokens_BxN: jax.Array
    logprobs_BxN: jax.Array
    kv_mask_BxS: jax.Array
    cache: Any


def next_bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum) (minimum itself is rounded up to a power of two)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def quarter_octave_bucket(n: int) -> int:
    """n rounded up to a multiple of 2^(k-2) for 2^k <= n < 2^(k+1): 1..8 stay, then 10, 12, 14, 16, 20, ..."""
    n = max(int(n), 1)
    return _round_up(n, 1 << max(n.bit_length() - 3, 0))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def new_token_bucket(max_new_tokens: int, minimum: int) -> int:
    """Cache slots for the generated tokens: max_new_tokens rounded up to a quarter octave (at most 4 programs
    per power of two, under 25% unused slots), at least `minimum`."""
    return quarter_octave_bucket(max(int(max_new_tokens), int(minimum), 1))


def model_config(model) -> Any:
    """The model's ModelConfig (attribute `config` or `cfg`)."""
    for name in ("config", "cfg"):
        cfg = getattr(model, name, None)
        if cfg is not None:
            return cfg
    raise ValueError(f"model {type(model).__name__} has no `config`/`cfg` attribute (ModelConfig)")


def sampling_graph(model, compute_dtype=None) -> tuple[Any, nnx.GraphDef, Any]:
    """(config, graphdef, state) to sample `model` with: its own graph, or with `compute_dtype` (e.g. bfloat16 under
    a float32 trainer: sampling.dtype) the same architecture's graph built with that compute dtype (activations and
    matmuls in it; reshard_for_sampling casts the weights). The state is the model's, untouched."""
    cfg = model_config(model)
    graphdef, state = nnx.split(model)
    if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.dtype(getattr(cfg, "dtype", "float32")):
        return cfg, graphdef, state
    cfg = dataclasses.replace(cfg, dtype=jnp.dtype(compute_dtype).name)
    return cfg, nnx.graphdef(abstract_model(cfg)), state


def _constrain(tree, sharding: NamedSharding | None, batch: int):
    """Shard every array whose leading dimension is the batch over the data axes."""
    if sharding is None:
        return tree
    return jax.tree.map(
        lambda x: (
            jax.lax.with_sharding_constraint(x, sharding)
            if hasattr(x, "ndim") and x.ndim >= 1 and x.shape[0] == batch
            else x
        ),
        tree,
    )


def _sequence_keys(key: jax.Array, prompt_index_P: jax.Array, num_samples: int) -> jax.Array:
    """One key per row p*G+g: fold_in(fold_in(key, prompt_index[p]), g)."""
    prompt_index_B = jnp.repeat(prompt_index_P, num_samples)
    g_B = jnp.tile(jnp.arange(num_samples, dtype=jnp.uint32), prompt_index_P.shape[0])
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(prompt_index_B, g_B)


def _generate_core(
    graphdef,
    state,
    prompt_ids_PxT,
    prompt_mask_PxT,
    prompt_index_P,
    active_P,
    key,
    max_new_tokens,
    greedy,
    temperature,
    top_k,
    top_p,
    eos_E,
    *,
    spec: _LoopSpec,
) -> SampleArrays:
    """The jitted sampling program (see module docstring)."""
    model = nnx.merge(graphdef, state)
    P, T = prompt_ids_PxT.shape
    G, N = spec.num_samples, spec.new_bucket
    B = P * G
    mask_PxT = prompt_mask_PxT.astype(jnp.int32)

    # Prefill the P distinct prompts once: slots [0, T-1) in one call whose logits are unused (so XLA drops
    # the [P, T-1, V] unembedding entirely), then the last prompt slot T-1 as a one-token step for the logits.
    ids_PxT = prompt_ids_PxT.astype(jnp.int32)
    positions_PxT = jnp.maximum(jnp.cumsum(mask_PxT, axis=-1) - 1, 0)
    phases = spec.phases or (N,)
    S = T + phases[0]  # the cache grows phase by phase (see body), starting with the first phase's slots
    cache = _constrain(model.init_cache(P, S, dtype=jnp.dtype(spec.cache_dtype)), spec.batch_sharding, P)
    kv_mask_PxS = jnp.concatenate([mask_PxT, jnp.zeros((P, phases[0]), jnp.int32)], axis=-1)
    if T > 1:
        _, cache = model.decode_step(ids_PxT[:, :-1], positions_PxT[:, :-1], cache, 0, kv_mask_PxS)
    logits_Px1xV, cache = model.decode_step(ids_PxT[:, -1:], positions_PxT[:, -1:], cache, T - 1, kv_mask_PxS)
    last_logits_PxV = logits_Px1xV[:, -1].astype(jnp.float32)

    # Repeat along batch for the G samples per prompt (prompt-major rows).
    def rep(x):
        return jnp.repeat(x, G, axis=0) if G > 1 and hasattr(x, "ndim") and x.ndim >= 1 and x.shape[0] == P else x

    cache = _constrain(jax.tree.map(rep, cache), spec.batch_sharding, B)
    logits_BxV = _constrain(rep(last_logits_PxV), spec.batch_sharding, B)
    kv_mask_BxS = _constrain(rep(kv_mask_PxS), spec.batch_sharding, B)
    prompt_len_B = rep(jnp.sum(mask_PxT, axis=-1))
    keys_B = _sequence_keys(key, prompt_index_P.astype(jnp.uint32), G)

    def emit(c: _Carry, logits_BxV) -> _Carry:
        """Choose token c.i for every unfinished row and record it."""
        uniform_B = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, c.i)))(keys_B)
        tok_B, lp_B = selection.select_tokens(
            logits_BxV, uniform_B, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p
        )
        tok_B = jnp.where(c.done_B, spec.pad_id, tok_B)
        lp_B = jnp.where(c.done_B, 0.0, lp_B)
        hit_eos_B = jnp.any(tok_B[:, None] == eos_E[None, :], axis=-1) & ~c.done_B
        return c._replace(
            i=c.i + 1,
            last_B=tok_B,
            pos_B=c.pos_B + 1,
            done_B=c.done_B | hit_eos_B | (c.i + 1 >= max_new_tokens),
            eos_B=c.eos_B | hit_eos_B,
            lengths_B=c.lengths_B + (~c.done_B).astype(jnp.int32),
            tokens_BxN=jax.lax.dynamic_update_slice(c.tokens_BxN, tok_B[:, None], (0, c.i)),
            logprobs_BxN=jax.lax.dynamic_update_slice(c.logprobs_BxN, lp_B[:, None], (0, c.i)),
        )

    carry = _Carry(
        i=jnp.int32(0),
        last_B=jnp.zeros((B,), jnp.int32),
        pos_B=prompt_len_B - 1,
        done_B=~rep(active_P),
        eos_B=jnp.zeros((B,), bool),
        lengths_B=jnp.zeros((B,), jnp.int32),
        tokens_BxN=jnp.full((B, N), spec.pad_id, jnp.int32),
        logprobs_BxN=jnp.zeros((B, N), jnp.float32),
        kv_mask_BxS=kv_mask_BxS,
        cache=cache,
    )
    carry = emit(carry, logits_BxV)

    def grow(c: _Carry, slots: int) -> _Carry:
        """Pad the cache and kv mask to `slots` slots (one copy per phase)."""
        extra = slots - c.kv_mask_BxS.shape[1]
        pad = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        cache = _constrain(jax.tree.map(pad, c.cache), spec.batch_sharding, B)
        return c._replace(cache=cache, kv_mask_BxS=_constrain(pad(c.kv_mask_BxS), spec.batch_sharding, B))

    def body(c: _Carry) -> _Carry:
        slot = T + c.i - 1  # cache slot of the token being fed (token index c.i - 1)
        kv_mask_BxS = jax.lax.dynamic_update_slice(c.kv_mask_BxS, jnp.ones((B, 1), jnp.int32), (0, slot))
        logits_Bx1xV, cache = model.decode_step(c.last_B[:, None], c.pos_B[:, None], c.cache, slot, kv_mask_BxS)
        c = c._replace(kv_mask_BxS=kv_mask_BxS, cache=_constrain(cache, spec.batch_sharding, B))
        return emit(c, logits_Bx1xV[:, -1].astype(jnp.float32))

    # Decode in phases: phase k runs tokens up to phases[k] against a cache of T + phases[k] slots, so the
    # attention of early steps does not read the (still empty) slots of later ones. Unfinished phases are
    # skipped as soon as every row is done.
    def running(end: int):
        return lambda c: (c.i < jnp.minimum(max_new_tokens, end)) & jnp.any(~c.done_B)

    for k, end in enumerate(phases):
        if k > 0:
            carry = grow(carry, T + end)
        carry = jax.lax.while_loop(running(end), body, carry)
    return SampleArrays(carry.tokens_BxN, carry.logprobs_BxN, carry.lengths_B, carry.eos_B)


_generate_jit = jax.jit(_generate_core, static_argnames=("graphdef", "spec"))


def compiled_programs() -> int:
    """Number of sampling programs compiled so far in this process (for recompilation checks)."""
    return _generate_jit._cache_size()  # type: ignore[attr-defined]  # jax has no public cache-size API


# ----------------------------------------------------------------------------------------------- the sampler


class Sampler:
    """Holds the model split into (graphdef, sampler-layout state) and runs the jitted sampling program.

    mesh: optional jax Mesh; the batch is sharded over its data axes ("data", "fsdp") and parameters are kept in
    the sampler layout (replicated over the data axes, "tensor" kept) in the model's compute dtype (bf16 weights
    for a bf16 model: the forward casts every weight to it anyway, so the results are identical and the copy is
    half the size). The program runs under the mesh and its activation rules (so Pallas kernels such as splash
    attention run per shard under shard_map). Call `update_params` once per RL step with the trainer's current
    parameters to reshard them on device, and `release` before the train step so the copy is not alive during it.
    A model whose parameters are jax.ShapeDtypeStructs (models.abstract_model) gives an abstract sampler whose
    programs can only be traced and lowered (`trace`), e.g. for a TPU topology on a CPU host.
    cache_dtype: KV-cache dtype (float32 or bfloat16). min_*_bucket: smallest prompt / new-token / prompt-count
    buckets. decode_phases: split the decode into up to this many while loops over a growing cache (each
    phase at least min_phase_tokens long), so early steps attend over fewer slots; worth it for long
    generations on accelerators, ~3% on CPU at 128 tokens, and each phase is compiled separately (default 1).
    pad_id: token written after a sequence's end (default: config pad_token_id, else 0).
    compute_dtype: the sampler's compute dtype (sampling.dtype; None: the model's own; sampling_graph).
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        cache_dtype=jnp.float32,
        min_prompt_bucket: int = 16,
        min_new_bucket: int = 16,
        min_batch_bucket: int = 1,
        decode_phases: int = 1,
        min_phase_tokens: int = 32,
        pad_id: int | None = None,
        compute_dtype=None,
    ):
        self.config, self.graphdef, state = sampling_graph(model, compute_dtype)
        self.mesh = mesh
        self.cache_dtype = jnp.dtype(cache_dtype).name
        self.min_prompt_bucket = min_prompt_bucket
        self.min_new_bucket = min_new_bucket
        self.decode_phases = max(1, int(decode_phases))
        self.min_phase_tokens = max(1, int(min_phase_tokens))
        self.min_batch_bucket = min_batch_bucket
        cfg_pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else 0))
        self.compute_dtype = jnp.dtype(getattr(self.config, "dtype", "float32")).name
        self.state = None
        self._batch_sharding = model_sharding.batch_sharding(mesh) if mesh is not None else None
        self.update_params(state)

    def update_params(self, params) -> None:
        """Take new parameters (an nnx.Module of the same graph, or its nnx.State), resharded on device and cast
        to the compute dtype. The previous sampler copy is dropped first so the two copies need not coexist."""
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        self.state = None
        self.state = sampling_sharding.reshard_for_sampling(state, self.mesh, dtype=self.compute_dtype)

    def release(self) -> None:
        """Drop the sampler's weight copy (e.g. before the train step); `update_params` brings it back."""
        self.state = None

    @property
    def abstract(self) -> bool:
        """True when the sampler holds jax.ShapeDtypeStructs (can lower programs, not run them)."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))

    def program_context(self):
        """The mesh and its activation rules around the jitted program (nothing without a mesh)."""
        return model_sharding.program_context(self.mesh)

    def trace(self, num_prompts: int, prompt_len: int, *, max_new_tokens: int, num_samples: int = 1):
        """The jax `Traced` sampling program (its .jaxpr; .lower() it under program_context()) for `num_prompts`
        prompts of (bucketed) length `prompt_len`: the same code path as generate_arrays (buckets, padding,
        shardings), for an ahead-of-time compile."""
        if not self.abstract:
            raise ValueError("Sampler.trace needs an abstract sampler (built from models.abstract_model)")
        ids = np.zeros((num_prompts, prompt_len), np.int32)
        return self.generate_arrays(ids, np.ones_like(ids), max_new_tokens=max_new_tokens, num_samples=num_samples)

    @property
    def data_shards(self) -> int:
        return model_sharding.batch_shards(self.mesh)

    def batch_bucket(self, num_prompts: int) -> int:
        """Padded number of prompts (>= min_batch_bucket), a multiple of the data shards: rounded up to a quarter of
        its power-of-two octave (so at most 4 programs per octave and under 25% padding, e.g. 192 stays 192
        where a power-of-two bucket would sample 256 rows)."""
        return _round_up(quarter_octave_bucket(max(num_prompts, self.min_batch_bucket)), self.data_shards)

    def phases(self, new_bucket: int) -> tuple[int, ...]:
        """Cumulative token ends of the decode phases: up to `decode_phases` equal parts of the new-token
        bucket, each at least `min_phase_tokens` long (each phase is one more while loop to compile)."""
        n = max(1, min(self.decode_phases, new_bucket // self.min_phase_tokens))
        return tuple(new_bucket * (k + 1) // n for k in range(n))

    def _spec(self, num_samples, new_bucket) -> _LoopSpec:
        return _LoopSpec(
            num_samples=int(num_samples),
            new_bucket=int(new_bucket),
            cache_dtype=self.cache_dtype,
            pad_id=self.pad_id,
            batch_sharding=self._batch_sharding,
            phases=self.phases(new_bucket),
        )

    def _put_batch(self, x):
        if self.abstract:
            return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=self._batch_sharding)
        if self._batch_sharding is None:
            return jnp.asarray(x)
        if distributed.is_multiprocess():  # every process passes the same global host batch
            return distributed.global_batch({"x": x}, self.mesh, model_sharding.batch_axes(self.mesh))["x"]
        return jax.device_put(x, self._batch_sharding)

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
        """Array API for the training loop: LEFT-padded prompt ids/mask [P, T] (device or host arrays) ->
        SampleArrays with B = P * num_samples rows (prompt-major) and N = max_new_tokens columns.

        T is left-padded up to its bucket and P up to `batch_bucket(P)` (padding rows are inactive) on device,
        so any P and T work without recompiling for every size; pass bucketed shapes to skip the copies.
        prompt_index_P (default arange(P)) seeds each prompt's randomness, e.g. a global example index, so a
        prompt's samples do not depend on its position in the batch; active_P (default all True) marks rows
        that should produce nothing (length 0). sampling: the draw options. Token ids are not range-checked here
        (no host sync): the list API validates them.
        """
        check_counts(max_new_tokens, num_samples)
        P, T = prompt_ids_PxT.shape
        if prompt_mask_PxT.shape != (P, T):
            raise ValueError(f"prompt_mask_PxT shape {prompt_mask_PxT.shape} != prompt_ids_PxT shape {(P, T)}")
        if P == 0 or T == 0:
            raise ValueError(f"empty prompt batch: prompt_ids_PxT has shape {(P, T)}")
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos is not None and max_new_tokens >= max_pos:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context {max_pos}"
            )
        if self.state is None:
            raise RuntimeError("the sampler's weights were released: call update_params(params) first")
        new_bucket = new_token_bucket(max_new_tokens, self.min_new_bucket)
        spec = self._spec(num_samples, new_bucket)
        prompt_index_P = np.arange(P, dtype=np.int32) if prompt_index_P is None else prompt_index_P
        active_P = np.ones((P,), bool) if active_P is None else active_P
        ids, mask = jnp.asarray(prompt_ids_PxT, jnp.int32), jnp.asarray(prompt_mask_PxT, jnp.int32)
        index, active = jnp.asarray(prompt_index_P, jnp.int32), jnp.asarray(active_P, bool)
        P_pad, T_pad = self.batch_bucket(P), next_bucket(T, self.min_prompt_bucket)
        if (P_pad, T_pad) != (P, T):
            ids = jnp.pad(ids, ((0, P_pad - P), (T_pad - T, 0)))
            mask = jnp.pad(mask, ((0, P_pad - P), (T_pad - T, 0))).at[P:, -1].set(1)  # pad rows: 1 real token
            index = jnp.pad(index, (0, P_pad - P))
            active = jnp.pad(active, (0, P_pad - P))
        args = (
            self.graphdef,
            self.state,
            self._put_batch(ids),
            self._put_batch(mask),
            self._put_batch(index),
            self._put_batch(active),
            jax.random.key(sampling.seed),
            jnp.int32(max_new_tokens),
            *(jnp.asarray(x) for x in sampling.program_inputs(self.config)),
        )
        if self.abstract:
            rep = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
            args = args[:6] + tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in args[6:])
            with self.program_context():
                return _generate_jit.trace(*args, spec=spec)
        with self.program_context():
            out = _generate_jit(*args, spec=spec)
        B = P * num_samples
        if new_bucket != max_new_tokens or P_pad != P:
            out = SampleArrays(
                out.tokens_BxN[:B, :max_new_tokens],
                out.logprobs_BxN[:B, :max_new_tokens],
                out.lengths_B[:B],
                out.finished_B[:B],
            )
        return out

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        num_samples: int = 1,
        sampling: SamplingParams = SamplingParams(),
    ) -> SampleOutput:
        """List API: see `generate`."""
        check_counts(max_new_tokens, num_samples)
        prompts = _check_prompts(prompt_ids, self.config, max_new_tokens)
        P = len(prompts)
        P_pad = self.batch_bucket(P)  # padded here on the host, so generate_arrays has nothing to pad
        T = next_bucket(max(len(p) for p in prompts), self.min_prompt_bucket)
        ids = np.zeros((P_pad, T), np.int32)
        mask = np.zeros((P_pad, T), np.int32)
        for r, p in enumerate(prompts):
            ids[r, T - len(p) :] = p
            mask[r, T - len(p) :] = 1
        mask[P:, -1] = 1  # padding rows: one real token, so no row attends to nothing
        out = self.generate_arrays(
            ids,
            mask,
            max_new_tokens=max_new_tokens,
            num_samples=num_samples,
            sampling=sampling,
            prompt_index_P=np.arange(P_pad, dtype=np.int32),
            active_P=np.arange(P_pad) < P,
        )
        B = P * num_samples
        tokens, logprobs, lengths, finished = (
            x[:B] for x in jax.device_get((out.tokens_BxN, out.logprobs_BxN, out.lengths_B, out.finished_B))
        )
        return SampleOutput(
            tokens=[tokens[b, : lengths[b]].tolist() for b in range(B)],
            logprobs=[logprobs[b, : lengths[b]].tolist() for b in range(B)],
            finish_reasons=["eos" if finished[b] else "length" for b in range(B)],
            lengths=[int(n) for n in lengths],
        )


def _check_prompts(prompt_ids, cfg, max_new_tokens: int) -> list[list[int]]:
    """Validated prompts as int lists; ValueError naming the offending prompt index and value."""
    if prompt_ids is None or len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt (a list of token-id lists)")
    vocab = int(cfg.vocab_size)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    prompts = []
    for i, p in enumerate(prompt_ids):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise ValueError(f"prompt {i} is not a sequence of token ids: {p!r}")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} has no tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if max_pos is not None and len(p) > max_pos:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the model's context {max_pos}")
        if max_pos is not None and len(p) + max_new_tokens > max_pos:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceeds the model's context {max_pos}"
            )
        prompts.append(p)
    return prompts


def generate(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    sampling: SamplingParams = SamplingParams(),
    mesh: Mesh | None = None,
    cache_dtype=jnp.float32,
) -> SampleOutput:
    """Sample `num_samples` continuations of every prompt (token-id lists) from `model` with the draw options
    `sampling` (SamplingParams: temperature 0 = greedy; top_k 0 / top_p 1 = off; eos_ids None = the model config's
    eos_token_id, () = never stop early). Results are prompt-major: index p * num_samples + g.
    """
    return Sampler(model, mesh=mesh, cache_dtype=cache_dtype).generate(
        prompt_ids, max_new_tokens=max_new_tokens, num_samples=num_samples, sampling=sampling
    )
