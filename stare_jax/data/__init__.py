"""stare_jax.data"""
