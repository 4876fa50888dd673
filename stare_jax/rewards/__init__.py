"""stare_jax.rewards"""
