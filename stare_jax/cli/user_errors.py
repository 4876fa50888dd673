"""The exception types that are about the user's input or files, not bugs (bad data rows, missing/corrupt
checkpoints, a resume with another config, an exhausted dynamic sampling budget): `stare-jax` reports them in one
line, exit status 2, without a traceback. Its own module because the types live in modules that import jax:
`stare_jax.cli.main` loads it only when a command has raised."""

from __future__ import annotations

from stare_jax.config.resume import ConfigChangeError
from stare_jax.data.prompts import DataError
from stare_jax.rl.advantages import DynamicSamplingError
from stare_jax.training.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from stare_jax.training.setup import TrainingError

USER_ERRORS: tuple[type[BaseException], ...] = (
    DataError,
    TrainingError,
    ConfigChangeError,
    CheckpointNotFoundError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    DynamicSamplingError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)
