"""stare_jax.eval: benchmark loading, metrics (benchmarks.py) and the sampler-driven eval CLI."""
