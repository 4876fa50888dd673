"""stare_jax.sampling"""
