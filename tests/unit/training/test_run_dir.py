"""RunDir: local run dirs are used as they are; remote ones (gs://...) get a local mirror of the text outputs that
is pushed after every step and pulled back on resume. The object store is stood in for by a second local folder
(etils.epath gives both the same API); a real gs:// bucket is not reachable from the test machines."""

from __future__ import annotations

import pathlib

import pytest
from etils import epath

from stare_jax.toy.assets import run_inputs
from stare_jax.training.run_dir import RunDir, is_remote

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_local_run_dir_is_used_as_is(tmp_path):
    rd = RunDir.for_run(tmp_path / "run")
    assert rd.remote is None and rd.local == tmp_path / "run"
    assert rd.checkpoints == str(tmp_path / "run" / "checkpoints") and not rd.has_checkpoint()
    rd.push(with_dirs=True)
    rd.pull()  # no-ops
    (tmp_path / "run" / "checkpoints" / "7").mkdir(parents=True)
    assert rd.has_checkpoint()


def test_remote_run_dir_maps_to_a_stable_local_mirror(tmp_path):
    a = RunDir.for_run("gs://bucket/runs/q7b-o1", mirror_root=tmp_path)
    b = RunDir.for_run("gs://bucket/runs/q7b-o1/", mirror_root=tmp_path)
    c = RunDir.for_run("gs://bucket/runs/q7b-c2", mirror_root=tmp_path)
    assert is_remote("gs://x") and not is_remote(tmp_path)
    assert a.local == b.local != c.local and a.local.parent == tmp_path and "q7b-o1" in a.local.name
    assert str(a.remote) == "gs://bucket/runs/q7b-o1" and a.checkpoints == "gs://bucket/runs/q7b-o1/checkpoints"


def _fake_remote(tmp_path) -> RunDir:
    return RunDir(local=tmp_path / "mirror", remote=epath.Path(tmp_path / "bucket" / "run"))


def test_push_pull_and_reset(tmp_path):
    rd = _fake_remote(tmp_path)
    rd.local.mkdir(parents=True)
    (rd.local / "metrics.jsonl").write_text('{"step": 1}\n')
    (rd.local / "config.yaml").write_text("seed: 0\n")
    (rd.local / "tensorboard").mkdir()
    (rd.local / "tensorboard" / "events.out").write_bytes(b"tb")
    (rd.local / "scratch.txt").write_text("not mirrored")
    rd.push()
    remote = tmp_path / "bucket" / "run"
    assert (remote / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (remote / "tensorboard").exists()
    assert not (remote / "scratch.txt").exists()
    rd.push(with_dirs=True)
    assert (remote / "tensorboard" / "events.out").read_bytes() == b"tb"
    assert rd.exists("metrics.jsonl") and not rd.has_checkpoint()
    rd.reset_mirror()
    assert not (rd.local / "metrics.jsonl").exists() and not (rd.local / "tensorboard").exists()
    rd.pull()
    assert (rd.local / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.slow  # two in-process training runs (fresh, then resumed); the sync tests above run by default
def test_training_in_a_remote_run_dir_resumes_with_its_history(tmp_path, monkeypatch):
    """run_training against the stand-in object store: fresh run (2 steps), then --resume to 3 steps from an
    EMPTY local mirror (another machine): the remote ends with the whole history and the checkpoints."""
    import stare_jax.training.loop as train
    from stare_jax.config.loader import load_config
    from stare_jax.training.metrics import read_metrics
    from support.toy_runs import TINY

    remote_root = epath.Path(tmp_path / "bucket" / "run")
    mirrors = iter([tmp_path / "mirror_a", tmp_path / "mirror_b", tmp_path / "mirror_c"])
    monkeypatch.setattr(train.RunDir, "for_run", classmethod(lambda cls, run_dir: cls(next(mirrors), remote_root)))
    overrides = [f"toy.cache_dir={tmp_path / 'toy'}", *TINY, "logging.eval_every_steps=0", "rl.micro_batch_size=2"]
    cfg = load_config(str(REPO / "configs" / "tiny_cpu_stare.yaml"), overrides + ["total_steps=2"])
    train.run_training(cfg, "gs://bucket/run", inputs_for=run_inputs, log=lambda *_: None)
    remote = tmp_path / "bucket" / "run"
    assert [r["step"] for r in read_metrics(remote)] == [1, 2] and (remote / "config.yaml").is_file()
    assert (remote / "checkpoints" / "2").is_dir() and (remote / "summary.json").is_file()
    with pytest.raises(train.TrainingError, match="already holds a run"):
        train.run_training(cfg, "gs://bucket/run", inputs_for=run_inputs, log=lambda *_: None)
    cfg3 = load_config(str(REPO / "configs" / "tiny_cpu_stare.yaml"), overrides + ["total_steps=3"])
    summary = train.run_training(cfg3, "gs://bucket/run", resume=True, inputs_for=run_inputs, log=lambda *_: None)
    assert summary["steps_run"] == 1
    assert [r["step"] for r in read_metrics(remote)] == [1, 2, 3]
    assert (remote / "checkpoints" / "3").is_dir()


def test_local_copy_of_a_folder_and_a_file(tmp_path):
    from stare_jax.training.run_dir import local_copy

    src = tmp_path / "bucket" / "Qwen-tiny"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"x" * 1000)
    (src / "sub" / "extra.txt").write_text("e")
    logs = []
    got = local_copy(str(src), cache_root=tmp_path / "cache", log=logs.append)
    assert (got / "config.json").read_text() == "{}" and (got / "model.safetensors").stat().st_size == 1000
    assert (got / "sub" / "extra.txt").read_text() == "e" and len(logs) == 1
    assert local_copy(str(src) + "/", cache_root=tmp_path / "cache", log=logs.append) == got and len(logs) == 1
    assert not list((tmp_path / "cache").glob("*.tmp*"))
    one = local_copy(str(src / "config.json"), cache_root=tmp_path / "cache", log=logs.append)
    assert one.name == "config.json" and one.read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_copy(str(tmp_path / "bucket" / "nope"), cache_root=tmp_path / "cache")
