"""stare_jax.models"""
