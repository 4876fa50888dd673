"""Built-in verifiable tasks (no download needed), and their registry.

Each task module provides prompt_text, spec, parse_spec, sample_answer and score(response, answer) -> 0.0/1.0
(a pure string check). `TASKS` maps a run config's `data.task` / `toy.task` name to its module; "math" is not a
task here but the sandboxed verifier of stare_jax.rewards."""

from types import ModuleType

from stare_jax.tasks import digit_set, digit_sum, tool_mul

__all__ = ["TASKS", "digit_set", "digit_sum", "get_task", "tool_mul"]

TASKS: dict[str, ModuleType] = {"digit_set": digit_set, "digit_sum": digit_sum, "tool_mul": tool_mul}


def get_task(name: str) -> ModuleType:
    """The task module registered as `name`; a ValueError naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
