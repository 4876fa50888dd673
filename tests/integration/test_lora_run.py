"""A LoRA run end to end as users run it (`stare-jax train` with model.lora.enabled on the embedded toy, in a
subprocess): it trains, the checkpointed adapters resume to the same metrics, `stare-jax export` writes a PEFT
folder (plus the toy's base as an HF folder) that transformers + peft load to our policy's logits, and --merged
writes an HF folder with the same logits; a run started with model.lora.init_from=<that PEFT folder> starts from its
adapters (and a folder of another rank is a one-line error)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from stare_jax.training.metrics import read_metrics
from support.cli import cli_env
from support.toy_runs import TINY

REPO = pathlib.Path(__file__).resolve().parents[2]
LORA = [
    "model.lora.enabled=true",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "optimizer.lr=1e-2",
    "rl.kl.reference=initial",
    "rl.kl.coef=0.01",
    # the tiny toy rarely earns a reward in 3 steps (then every advantage is 0): the entropy bonus moves the adapters
    # whatever the samples, so the checks below do not hang on the sampled numerics (-O0 vs -O2 drew all-zero rewards)
    "rl.entropy_coeff=0.01",
]


def _run(*args, timeout=900, rc=0):
    env = cli_env(compile_cache=True)
    p = subprocess.run(
        [sys.executable, "-m", "stare_jax.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == rc, p.stdout[-2000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    run = root / "run"
    _run(
        "train",
        "--config",
        str(REPO / "configs/tiny_cpu_stare.yaml"),
        "--run-dir",
        str(run),
        f"toy.cache_dir={root / 'toy'}",
        *TINY,
        *LORA,
        "total_steps=3",
    )
    return root, run


@pytest.mark.slow  # two more CLI runs (2 steps, resumed to 3); the default suite keeps the fixture's run (export)
def test_lora_run_trains_and_resumes_identically(lora_run):
    root, run = lora_run
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert abs(recs[0]["kl"]) < 1e-6 < recs[-1]["kl"]  # the reference is the frozen base; the adapters move off it
    again = root / "again"
    _run(
        "train",
        "--config",
        str(REPO / "configs/tiny_cpu_stare.yaml"),
        "--run-dir",
        str(again),
        f"toy.cache_dir={root / 'toy'}",
        *TINY,
        *LORA,
        "total_steps=2",
    )
    _run(
        "train",
        "--config",
        str(REPO / "configs/tiny_cpu_stare.yaml"),
        "--run-dir",
        str(again),
        "--resume",
        f"toy.cache_dir={root / 'toy'}",
        *TINY,
        *LORA,
        "total_steps=3",
        "--allow-config-change",
    )
    for a, b in zip(recs, read_metrics(again)):
        for k in ("loss", "entropy", "kl", "reward_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (a["step"], k)
    # a checkpoint holds the adapters and their moments, not the frozen base (model.path's weights)
    base_bytes = max(f.stat().st_size for f in (root / "toy").rglob("model.safetensors"))
    step_dir = max((again / "checkpoints").iterdir(), key=lambda d: d.stat().st_mtime)
    ckpt_bytes = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    assert ckpt_bytes < base_bytes, (ckpt_bytes, base_bytes)  # with the base: 4.8 MB vs 3.1 MB


def test_export_peft_folder_and_merged_match_our_policy(lora_run):
    import torch
    import transformers
    from peft import PeftModel

    from stare_jax.toy.assets import run_inputs
    from stare_jax.training.policy import load_policy

    root, run = lora_run
    peft_dir, merged_dir = root / "peft", root / "merged"
    _run("export", str(run), str(peft_dir))
    _run("export", str(run), str(merged_dir), "--merged")
    assert (peft_dir / "adapter_config.json").is_file() and (peft_dir / "adapter_model.safetensors").is_file()
    assert (peft_dir / "base" / "config.json").is_file()
    policy = load_policy(run, inputs_for=run_inputs, log=lambda *_: None)
    ids = np.array([[3, 7, 11, 5, 9, 2, 14]], np.int32)
    ours = np.asarray(policy.model(ids, attention_mask=np.ones_like(ids)), np.float64)
    base = transformers.AutoModelForCausalLM.from_pretrained(peft_dir / "base", dtype=torch.float32)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, peft_dir).eval()(torch.tensor(ids, dtype=torch.long)).logits
        merged = (
            transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
            .eval()(torch.tensor(ids, dtype=torch.long))
            .logits
        )
    np.testing.assert_allclose(adapted.double().numpy(), ours, atol=2e-4)
    np.testing.assert_allclose(merged.double().numpy(), ours, atol=2e-4)
    assert (
        np.abs(
            adapted.double().numpy()
            - np.asarray(
                transformers.AutoModelForCausalLM.from_pretrained(peft_dir / "base", dtype=torch.float32)(
                    torch.tensor(ids, dtype=torch.long)
                )
                .logits.detach()
                .double()
            )
        ).max()
        > 1e-4
    )  # the adapters matter


@pytest.mark.slow  # an export and another CLI run, from the exported adapters
def test_init_from_a_peft_folder_starts_the_run_from_its_adapters(lora_run):
    from stare_jax.models import hf_io, lora
    from stare_jax.toy.assets import run_inputs
    from stare_jax.training.policy import load_policy

    root, run = lora_run
    adapter = root / "init_adapter"
    _run("export", str(run), str(adapter))
    st = hf_io._SafetensorsFile(adapter / lora.ADAPTER_WEIGHTS)
    want = {k: np.array(st.array(k)) for k in st.names()}
    assert np.abs(want["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]).max() > 0
    common = ["--config", str(REPO / "configs/tiny_cpu_stare.yaml"), f"toy.cache_dir={root / 'toy'}", *TINY, *LORA]
    new = root / "from_adapter"
    # a learning rate too small to move float32 adapters: after a step they are still the folder's
    p = _run(
        "train",
        "--run-dir",
        str(new),
        *common,
        f"model.lora.init_from={adapter}",
        "optimizer.lr=1e-30",
        "total_steps=1",
    )
    assert f"model.lora.init_from: the adapters start from {adapter}" in p.stdout + p.stderr
    assert abs(read_metrics(new)[0]["kl"]) < 1e-6  # the reference 'initial' is the base + these adapters
    got = lora.peft_adapter_state_dict(load_policy(new, inputs_for=run_inputs, log=lambda *_: None).model)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-12)
    # a folder of another rank than model.lora.rank: one line, exit status 2
    p = _run(
        "train", "--run-dir", str(root / "bad"), *common, f"model.lora.init_from={adapter}", "model.lora.rank=2", rc=2
    )
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "has r = 4 but model.lora.rank = 2: set model.lora.rank=4" in p.stderr, p.stderr
