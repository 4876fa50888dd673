"""Imported once by RewardPool's forkserver (see pool._PRELOAD): score one answer so that the LaTeX grammar
and SymPy caches are loaded before workers are forked from it; a new or replacement worker then starts warm
in milliseconds instead of re-loading the parser (~1 s).  Importing this module has that one side effect."""

from stare_jax.rewards.math import score

score("\\boxed{\\sqrt{2}}", "2^{1/2}", timeout_s=None)
