"""stare_jax.sampling: the rollout sampler (prefill + while_loop decode over a KV cache).

SamplingParams(temperature=, top_p=, top_k=, eos_ids=, seed=)            the draw options, one typed value
generate(model, prompt_ids, *, max_new_tokens, sampling=...) -> SampleOutput  list API
Sampler(model, mesh=...).generate_arrays(ids_PxT, mask_PxT, ...)         array API for the training loop
reshard_for_sampling(state, mesh)                                         trainer layout -> sampler layout
Engine(model, config=EngineConfig(...), mesh=...).generate_arrays(...)    the rollout engine (same array API):
                                                                          continuous batching over a paged KV cache
"""

from stare_jax.models.sharding import batch_sharding
from stare_jax.sampling.engine import Conversation, Engine, EngineConfig
from stare_jax.sampling.params import SamplingParams
from stare_jax.sampling.sampler import (
    SampleArrays,
    SampleOutput,
    Sampler,
    compiled_programs,
    generate,
    next_bucket,
    quarter_octave_bucket,
)
from stare_jax.sampling.selection import (
    greedy_tokens,
    inverse_cdf_sample,
    select_tokens,
    token_logprobs,
    top_k_mask,
    top_p_mask,
)
from stare_jax.sampling.sharding import reshard_for_sampling, sampler_param_sharding

__all__ = [
    "Conversation",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "SampleArrays",
    "SampleOutput",
    "Sampler",
    "compiled_programs",
    "generate",
    "next_bucket",
    "quarter_octave_bucket",
    "greedy_tokens",
    "inverse_cdf_sample",
    "select_tokens",
    "token_logprobs",
    "top_k_mask",
    "top_p_mask",
    "batch_sharding",
    "reshard_for_sampling",
    "sampler_param_sharding",
]
