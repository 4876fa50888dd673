"""stare_jax.rl"""
