"""The progress lines of `stare-jax eval` (stare_jax.eval.runner.EvalProgress): per benchmark, at most every
`every_s` seconds and always when it is done, with the samples done, the generation rate and the elapsed time;
evaluate_sets calls it once per benchmark of each scored prompt chunk."""

from stare_jax.eval.runner import EvalProgress


def test_progress_lines_are_rate_limited_per_benchmark_and_say_when_done():
    now = [100.0]
    lines: list[str] = []
    progress = EvalProgress(lines.append, prefix="stare-jax eval:", every_s=10.0, clock=lambda: now[0])
    now[0] = 104.0
    progress("math500", 8, 32, 400)  # the first batch of a benchmark: said
    now[0] = 108.0
    progress("math500", 16, 32, 400)  # 4 s later: not yet
    progress("aime24", 4, 8, 200)  # another benchmark keeps its own clock
    now[0] = 115.0
    progress("math500", 24, 32, 400)  # 11 s after its last line
    now[0] = 116.0
    progress("aime24", 8, 8, 200)  # done: said at once
    assert lines == [
        "stare-jax eval: math500: 8/32 samples, 100 tokens/s, 4s",
        "stare-jax eval: aime24: 4/8 samples, 125 tokens/s, 8s",
        "stare-jax eval: math500: 24/32 samples, 93 tokens/s, 15s",
        "stare-jax eval: aime24: 8/8 samples, 100 tokens/s, 16s",
    ]
