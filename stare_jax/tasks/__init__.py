"""Built-in verifiable tasks (no download needed)."""
