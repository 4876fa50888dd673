"""stare_jax: STARE (surprisal-guided token-level advantage reweighting with a closed-loop entropy gate)
for GRPO-style RL post-training of LLMs, in JAX / Flax NNX."""

__version__ = "0.1.0"
