"""Helpers shared by the tests (reference implementations, tiny checkpoints, fake servers); pytest fixtures live
in tests/conftest.py. tests/ is on sys.path (pyproject.toml: pythonpath), so tests import them as `support.x`."""
