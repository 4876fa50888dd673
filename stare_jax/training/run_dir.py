"""Where a run's files go: a local folder, or an object-store URL (gs://bucket/path, s3://...) for multi-host
runs whose workers must all see the checkpoints.

Checkpoints are written by orbax straight to RUN_DIR/checkpoints (orbax handles object stores). The small
text outputs written by process 0 (config.yaml, metrics.jsonl, timing.jsonl, summary.json, tensorboard/) are
appended to as the run goes, which object stores cannot do, so for a remote run dir they are written to a
local mirror folder and copied up with etils.epath after every step (a resumed run first copies the remote
metrics back down, so nothing logged before the interruption is lost). gs:// needs `gcsfs` (installed by
the launch scripts' setup; see requirements-cloud.txt).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil

from etils import epath

MIRRORED_FILES = ("config.yaml", "metrics.jsonl", "timing.jsonl", "summary.json")
MIRRORED_DIRS = ("tensorboard",)


def is_remote(path) -> bool:
    return "://" in str(path)


def local_copy(url: str, cache_root: pathlib.Path | None = None, log=print) -> pathlib.Path:
    """A local copy of a remote file or folder (e.g. a Hugging Face checkpoint on gs://, which the safetensors
    loader reads from local disk), under cache_root (default ~/.cache/stare_jax/remote). Copied once per host:
    into a temporary folder renamed into place when complete, so an interrupted copy is never used."""
    src = epath.Path(str(url).rstrip("/"))
    if not src.exists():
        raise FileNotFoundError(f"{url} does not exist")
    root = cache_root or default_mirror_root().parent / "remote"
    dst = root / (src.name + "-" + hashlib.sha1(str(src).encode()).hexdigest()[:10])
    if dst.exists():
        return dst / src.name if src.is_file() else dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    files = [src] if src.is_file() else sorted(_files_under(src), key=str)
    log(f"copying {url} ({len(files)} files) to {dst}")
    for f in files:
        _copy(f, tmp / (f.name if f == src else f.relative_to(src).as_posix()))
    os.replace(tmp, dst)
    return dst / src.name if src.is_file() else dst


def _copy(src, dst) -> None:
    """Copy one file between any two epath/pathlib locations (local or object store), streamed in 64 MiB chunks."""
    dst = epath.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with epath.Path(src).open("rb") as r, dst.open("wb") as w:
        shutil.copyfileobj(r, w, 64 << 20)


def _files_under(folder: epath.Path):
    """Every file below folder (epath's rglob refuses object stores, where a recursive glob is one RPC per entry)."""
    for child in folder.iterdir():
        if child.is_dir():
            yield from _files_under(child)
        else:
            yield child


def default_mirror_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("STARE_JAX_MIRROR_DIR", pathlib.Path.home() / ".cache" / "stare_jax" / "runs"))


@dataclasses.dataclass
class RunDir:
    """local: where the text outputs are written; remote: the object-store run dir they are copied to (None for a
    local run); checkpoints: the orbax checkpoint folder (under the remote run dir when there is one)."""

    local: pathlib.Path
    remote: epath.Path | None = None

    @classmethod
    def for_run(cls, run_dir, mirror_root: pathlib.Path | None = None) -> "RunDir":
        if not is_remote(run_dir):
            return cls(pathlib.Path(run_dir))
        text = str(run_dir).rstrip("/")
        name = text.split("://", 1)[1].replace("/", "_")[-80:] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
        return cls((mirror_root or default_mirror_root()) / name, epath.Path(text))

    @property
    def root(self) -> epath.Path:
        return self.remote if self.remote is not None else epath.Path(self.local)

    @property
    def checkpoints(self) -> str:
        return str(self.root / "checkpoints")

    def has_checkpoint(self) -> bool:
        """A completed checkpoint step (a numeric folder) exists."""
        d = self.root / "checkpoints"
        return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def reset_mirror(self) -> None:
        """A new run in a remote run dir: drop what an earlier run with the same URL left in the local mirror."""
        if self.remote is None:
            return
        for name in MIRRORED_FILES:
            (self.local / name).unlink(missing_ok=True)
        for d in MIRRORED_DIRS:
            shutil.rmtree(self.local / d, ignore_errors=True)

    def pull(self, names=("metrics.jsonl", "timing.jsonl")) -> None:
        """Copy the remote's files down into the local mirror (before resuming; missing ones are skipped)."""
        if self.remote is None:
            return
        for name in names:
            if (self.remote / name).exists():
                _copy(self.remote / name, self.local / name)

    def push(self, with_dirs: bool = False) -> None:
        """Copy the local text outputs up to the remote run dir (tensorboard/ too when with_dirs)."""
        if self.remote is None:
            return
        files = [self.local / name for name in MIRRORED_FILES]
        if with_dirs:
            files += [f for d in MIRRORED_DIRS for f in sorted((self.local / d).rglob("*"))]
        for src in files:
            if src.is_file():
                _copy(src, self.remote / src.relative_to(self.local).as_posix())
