"""stare_jax: STARE (surprisal-guided token-level advantage reweighting with a closed-loop entropy gate)
for GRPO-style RL post-training of LLMs, in JAX / Flax NNX."""

from stare_jax._platform import choose_default_platforms

choose_default_platforms()  # before any submodule imports jax: no libtpu start-up errors on a CPU-only machine

__version__ = "0.1.0"
