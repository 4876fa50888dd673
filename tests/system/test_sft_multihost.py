"""A REAL multi-process `stare-jax sft`: 2 local processes x 4 CPU devices (jax.distributed, gloo collectives) on a
data 2 x fsdp 2 x tensor 2 mesh give the same losses and the same saved weights as 1 process x 8 devices on that
mesh; process 0 alone writes the output folder (weights gathered to it, log, summary, tokenizer files).

Every process reads the same conversations, draws the same batches (same seed) and feeds the rows its devices hold
(stare_jax.distributed.global_batch), as the RL step does. Tolerance: cross-process all-reduces (gloo) sum in
another order than the in-process ones (a few float32 ulps per step; see tests/system/test_multihost.py)."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from stare_jax.data.tokenizer import load_tokenizer
from support.conversations import CONVERSATIONS, _tiny_model
from support.multihost import Launch

safetensors_numpy = pytest.importorskip("safetensors.numpy")

STEPS = 6
CLI = [sys.executable, "-c", "import sys; from stare_jax.cli import main; sys.exit(main(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def runs(qwen_sft_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_multihost")
    model_dir = d / "base"
    shutil.copytree(qwen_sft_dir, model_dir)
    _tiny_model(model_dir, load_tokenizer(model_dir).vocab_size)
    data = d / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    cfg = d / "sft.yaml"
    # 8 conversations a step, 1 per data shard and micro-batch: 2 micro-batches over the 4 batch shards
    cfg.write_text(
        f"model: {{path: {model_dir}}}\ntrain_path: {data}\nsteps: {STEPS}\nbatch_size: 8\n"
        f"micro_batch_size: 1\nlr: 3.0e-3\nmax_len: 1024\nchunk_size: 128\n"
        f"mesh: {{data: 2, fsdp: 2, tensor: 2}}\ntools: none\n"
    )
    ref = Launch("sft_1x8", d, 1, CLI + ["sft", "--config", str(cfg), f"out_dir={d / 'ref'}"])
    mp = Launch("sft_2x4", d, 2, CLI + ["sft", "--config", str(cfg), f"out_dir={d / 'mp'}"])
    mp.wait()
    ref.wait()
    return d


def _losses(folder):
    return np.array([json.loads(line)["loss"] for line in (folder / "sft_log.jsonl").read_text().splitlines()])


def test_two_processes_equal_one_process(runs):
    ref, mp = runs / "ref", runs / "mp"
    assert len(_losses(ref)) == STEPS
    np.testing.assert_allclose(_losses(mp), _losses(ref), rtol=1e-5, atol=1e-6)
    w_ref = safetensors_numpy.load_file(str(ref / "model.safetensors"))
    w_mp = safetensors_numpy.load_file(str(mp / "model.safetensors"))
    assert w_mp.keys() == w_ref.keys()
    for k in w_ref:
        # AdamW turns a few-ulp gradient difference of a near-zero component into a fraction of lr (3e-3); the
        # folder holds bf16 weights, so a few-ulp fp32 difference may also round to the neighbouring bf16 value
        # (one bf16 step: 2^(exponent - 7)), e.g. 0.052490 vs 0.052246
        a, b = w_mp[k].astype(np.float32), w_ref[k].astype(np.float32)
        bf16_step = np.exp2(np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - 7)
        bad = np.abs(a - b) > np.maximum(1e-4 + 1e-5 * np.abs(b), bf16_step)
        assert not bad.any(), (k, a[bad][:5], b[bad][:5])
    assert not np.allclose(w_ref["model.norm.weight"], 1.0)  # training moved the weights


def test_process_zero_writes_the_folder(runs):
    mp = runs / "mp"
    summary = json.loads((mp / "sft_summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert summary["micro_batches"] == 2
    assert {p.name for p in mp.iterdir()} == {p.name for p in (runs / "ref").iterdir()}
    assert (mp / "tokenizer.json").is_file() and (mp / "generation_config.json").is_file()
    # one log line per step (process 1 did not write a second copy); only process 0 printed the summary line
    assert len((mp / "sft_log.jsonl").read_text().splitlines()) == STEPS
    logs = [(runs / f"sft_2x4_p{i}.log").read_text(errors="replace") for i in range(2)]
    assert "sft: loss" in logs[0] and "sft: loss" not in logs[1]
