"""HF import/export: config conversion, sharded-index checkpoints, bf16 files, export round trip through
transformers, and clear errors for broken folders."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from stare_jax.models import ModelConfig, from_pretrained, hf_io, save_pretrained
from stare_jax.models.config import PRESETS, get_preset
from support.models import hf_logits, padded_batch


@jax.jit
def _fwd(model, ids, mask):
    return model(ids, mask)


def _copy(folder, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def _tensors(folder):
    f = hf_io._SafetensorsFile(folder / "model.safetensors")
    return {n: np.array(f.array(n)) for n in f.names()}


def test_config_roundtrip_all_families(hf_checkpoints):
    for fam, (folder, hf_model) in hf_checkpoints.items():
        hf = json.loads((folder / "config.json").read_text())
        cfg = ModelConfig.from_hf_config(hf)
        assert cfg.architecture == hf["architectures"][0]
        assert cfg.num_kv_heads == 2 and cfg.vocab_size == 256
        assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    llama = ModelConfig.from_hf_config(json.loads((hf_checkpoints["llama"][0] / "config.json").read_text()))
    assert llama.rope_type == "llama3" and llama.rope_theta == 5e5
    # transformers 4.x style keys
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    c = ModelConfig.from_hf_config(legacy)
    assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 32.0 and c.num_kv_heads == 2


def test_unsupported_architecture_error_names_field():
    bad = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    with pytest.raises(ValueError, match=r"architectures.*MistralForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_hf_config(bad)
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_config(
            {**bad, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )


def test_presets_shapes():
    assert set(PRESETS) >= {
        "qwen2.5-7b",
        "qwen2.5-32b",
        "qwen2.5-math-7b",
        "qwen2.5-14b",
        "qwen3-8b",
        "r1-distill-qwen-1.5b",
        "llama-3.2-1b",
    }
    assert get_preset("qwen2.5-7b").num_params() == 7_615_616_512
    assert get_preset("qwen2.5-32b").num_params() == 32_763_876_352
    assert get_preset("r1-distill-qwen-1.5b").vocab_size == 151936
    assert get_preset("qwen3-8b").qk_norm and get_preset("qwen3-8b").vocab_size == 151936
    assert get_preset("llama-3.2-1b").tie_word_embeddings
    assert get_preset("qwen2.5-7b", dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("gpt-5")


def test_sharded_index_and_bf16_files(hf_checkpoints, tmp_path):
    """model-0000x-of-0000y.safetensors + index.json, stored in bf16, loads (and casts to fp32)."""
    folder, hf_model = hf_checkpoints["qwen3"]
    dst = _copy(folder, tmp_path)
    tensors = _tensors(folder)
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate([names[:half], names[half:]]):
        fn = f"model-{k + 1:05d}-of-00002.safetensors"
        hf_io._write_safetensors(dst / fn, {n: tensors[n].astype(ml_dtypes.bfloat16) for n in part})
        weight_map.update({n: fn for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = from_pretrained(dst)
    assert model.embed_tokens[...].dtype == jnp.float32
    ref = tensors["model.layers.1.mlp.down_proj.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.down_proj.kernel[...]), ref.T)
    ids, mask, pos = padded_batch([4, 7], 7, left=True)
    real = mask.astype(bool)
    diff = np.abs(np.asarray(_fwd(model, ids, mask))[real] - hf_logits(hf_model, ids, mask, pos)[real]).max()
    assert diff < 0.1  # bf16-rounded weights


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_export_roundtrip_through_transformers(hf_checkpoints, tmp_path, family):
    import torch
    import transformers

    folder, _ = hf_checkpoints[family]
    model = from_pretrained(folder)
    out = save_pretrained(model, tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask, pos = padded_batch([5, 9], 9, left=True, seed=3)
    real = mask.astype(bool)
    np.testing.assert_allclose(
        hf_logits(back, ids, mask, pos)[real], np.asarray(_fwd(model, ids, mask))[real], atol=1e-4
    )
    # and our own reader gets the identical parameters back
    again = from_pretrained(out)
    np.testing.assert_array_equal(
        np.asarray(again.layers[0].self_attn.q_proj.kernel[...]),
        np.asarray(model.layers[0].self_attn.q_proj.kernel[...]),
    )


def test_export_bf16(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["qwen2"]
    out = save_pretrained(from_pretrained(folder), tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert hf_io._SafetensorsFile(out / "model.safetensors").header["model.norm.weight"]["dtype"] == "BF16"
    assert from_pretrained(out).norm.weight[...].dtype == jnp.float32


def test_missing_tensor_error(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["qwen2"]
    dst = _copy(folder, tmp_path)
    t = _tensors(folder)
    del t["model.layers.1.self_attn.k_proj.bias"]
    hf_io._write_safetensors(dst / "model.safetensors", t)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing.*ckpt"):
        from_pretrained(dst)


def test_wrong_shape_error(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["qwen2"]
    dst = _copy(folder, tmp_path)
    t = _tensors(folder)
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100]
    hf_io._write_safetensors(dst / "model.safetensors", t)
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(100, 64\).*expected \(128, 64\)"):
        from_pretrained(dst)


def test_unexpected_tensor_error_and_ignorable(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["qwen2"]
    dst = _copy(folder, tmp_path)
    t = _tensors(folder)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # ignorable
    hf_io._write_safetensors(dst / "model.safetensors", t)
    from_pretrained(dst)
    t["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
    hf_io._write_safetensors(dst / "model.safetensors", t)
    with pytest.raises(ValueError, match=r"unexpected tensors.*o_proj\.bias"):
        from_pretrained(dst)


def test_unsupported_architecture_folder(hf_checkpoints, tmp_path):
    folder, _ = hf_checkpoints["llama"]
    dst = _copy(folder, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"`architectures`.*GPT2LMHeadModel"):
        from_pretrained(dst)
    (dst / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(dst)


def test_export_sharded_files(hf_checkpoints, tmp_path):
    """A small max_shard_bytes splits the weights over several files + index.json; both readers load it."""
    import torch
    import transformers

    folder, _ = hf_checkpoints["llama"]
    model = from_pretrained(folder)
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=100_000)
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    ids, mask, pos = padded_batch([3, 6], 6, left=True, seed=4)
    real = mask.astype(bool)
    ours = np.asarray(_fwd(model, ids, mask))[real]
    np.testing.assert_array_equal(np.asarray(_fwd(from_pretrained(out), ids, mask))[real], ours)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(back, ids, mask, pos)[real], ours, atol=1e-4)


def test_scan_layers_export_roundtrip(hf_checkpoints, tmp_path):
    """A scan_layers model (stacked params) exports the same HF tensors as the per-layer model."""
    folder, _ = hf_checkpoints["qwen3"]
    out = save_pretrained(from_pretrained(folder, scan_layers=True), tmp_path / "scan", max_shard_bytes=50_000)
    a = hf_io.hf_state_dict(from_pretrained(out))
    b = hf_io.hf_state_dict(from_pretrained(folder))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
