"""LoRA adapters (stare_jax.models.lora): zero-B identity, parity with transformers + peft on Llama / Qwen2 / Qwen3
(all seven targets), merged export, sharding on an 8-device mesh, scan_layers and KV-cache decode, config errors,
bf16 base with fp32 adapters, and the adapter-only gradient the train step takes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from stare_jax.models import LORA_TARGETS, ModelConfig, from_pretrained, hf_io, lora, save_pretrained
from stare_jax.models.sharding import DEFAULT_RULES, activation_rules, logical_to_spec, make_mesh
from stare_jax.models.transformer import LoRAParam, Transformer
from support.models import FAMILIES, hf_logits, make_hf_model, padded_batch
from support.params import representative

RANK, ALPHA = 4, 8.0
LORA = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=LORA_TARGETS)
LENGTHS, T = [5, 12, 1, 9], 12


@jax.jit
def _fwd(model, ids, mask, pos=None):
    return model(ids, mask, pos)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{family: folder} of tiny transformers checkpoints (our own: peft wraps models in place)."""
    out = {}
    for fam in FAMILIES:
        folder = tmp_path_factory.mktemp(f"lora_hf_{fam}")
        make_hf_model(fam).save_pretrained(folder)
        out[fam] = folder
    return out


def _randomize(model, seed=0, scale=0.1):
    """Random non-zero A and B (so the adapters change every projection's output)."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, LoRAParam)
    new = [
        (p, v.replace(jnp.asarray(rng.normal(0, scale, v.get_value().shape), jnp.float32)))
        for p, v in nnx.to_flat_state(state)
    ]
    nnx.update(model, nnx.from_flat_state(new))
    return model


def _peft_logits(fam, adapter_dir, ids, mask, pos, merge=False):
    import peft

    model = peft.PeftModel.from_pretrained(make_hf_model(fam), str(adapter_dir)).eval()
    if merge:
        model = model.merge_and_unload()
    return hf_logits(model, ids, mask, pos), model


# ----------------------------------------------------------------------------- (a) identity at init, param tree
@pytest.mark.parametrize("family", representative(FAMILIES))
def test_zero_b_gives_the_base_logits_exactly(ckpts, family):
    base = from_pretrained(ckpts[family])
    model = from_pretrained(ckpts[family], **LORA)
    assert not nnx.to_flat_state(nnx.state(base, LoRAParam))  # LoRA off: no adapters, the same tree as before
    base_paths = [p for p, _ in nnx.to_flat_state(nnx.state(base))]
    assert [p for p, _ in nnx.to_flat_state(nnx.state(model, lora.FROZEN))] == base_paths
    cfg = model.config
    assert lora.lora_param_count(model) == cfg.num_lora_params() > 0
    for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        a = np.asarray(v.get_value())
        assert a.dtype == np.float32
        if p[-1] == "lora_b":
            assert not a.any()
        else:  # PEFT default: kaiming_uniform(a=sqrt(5)) over fan_in -> U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1 / np.sqrt(np.prod(a.shape[:-1]))
            assert 0.8 * bound < np.abs(a).max() <= bound
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=1)
    np.testing.assert_array_equal(np.asarray(_fwd(model, ids, mask)), np.asarray(_fwd(base, ids, mask)))
    # same seed -> same adapters; another seed -> other ones
    again = from_pretrained(ckpts[family], **LORA)
    other = from_pretrained(ckpts[family], lora_seed=1, **LORA)
    qa = ("layers", 0, "self_attn", "q_proj", "lora_a")
    flat = [dict(nnx.to_flat_state(nnx.state(m, LoRAParam)))[qa].get_value() for m in (model, again, other)]
    np.testing.assert_array_equal(flat[0], flat[1])
    assert np.abs(np.asarray(flat[0]) - np.asarray(flat[2])).max() > 0


def test_random_init_keeps_base_weights_and_loop_scan_agree():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    base = Transformer(cfg, rngs=nnx.Rngs(3))
    with_lora = Transformer(cfg.replace(lora_rank=2, lora_targets=("q_proj", "down_proj")), rngs=nnx.Rngs(3))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(base), nnx.state(with_lora, lora.FROZEN))
    scanned = Transformer(
        cfg.replace(lora_rank=2, lora_targets=("q_proj", "down_proj"), scan_layers=True), rngs=nnx.Rngs(3)
    )
    a, b = lora.peft_adapter_state_dict(with_lora), lora.peft_adapter_state_dict(scanned)
    assert sorted(a) == sorted(b) and len(a) == 2 * 2 * 2
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    seeded = Transformer(cfg.replace(lora_rank=2, lora_targets=("q_proj",)), rngs=nnx.Rngs(3, lora=5))
    k = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert np.abs(lora.peft_adapter_state_dict(seeded)[k] - a[k]).max() > 0  # the "lora" stream is used


# ----------------------------------------------------------------------------- (b) parity with transformers + peft
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_peft(ckpts, family, tmp_path):
    import peft

    model = _randomize(from_pretrained(ckpts[family], **LORA), seed=2)
    out_dir = lora.write_peft_adapter(model, tmp_path / "adapter", str(ckpts[family]))
    conf = json.loads((out_dir / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM" and conf["r"] == RANK
    assert conf["lora_alpha"] == ALPHA and sorted(conf["target_modules"]) == sorted(LORA_TARGETS)
    assert conf["base_model_name_or_path"] == str(ckpts[family])
    ids, mask, pos = padded_batch(LENGTHS, T, left=True, seed=3)
    ref, peft_model = _peft_logits(family, out_dir, ids, mask, pos)
    # our names and layouts are PEFT's own (get_peft_model_state_dict of the loaded model)
    theirs = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(peft_model).items()}
    ours = lora.peft_adapter_state_dict(model)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 7 * model.config.num_layers
    assert ours["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (RANK, 64)
    assert ours["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, RANK)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])
    out = np.asarray(_fwd(model, ids, mask))
    real = mask.astype(bool)
    base = hf_logits(make_hf_model(family), ids, mask, pos)
    assert np.abs(ref[real] - base[real]).max() > 0.1  # the adapters matter
    np.testing.assert_allclose(out[real], ref[real], atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- (c) merged weights
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_merged_export_and_merge_lora(ckpts, family, tmp_path):
    model = _randomize(from_pretrained(ckpts[family], **LORA), seed=4)
    ids, mask, pos = padded_batch(LENGTHS, T, left=False, seed=5)
    real = mask.astype(bool)
    want = np.asarray(_fwd(model, ids, mask))
    # plain export: the base weights only, byte-identical to the checkpoint's, and the same config.json
    save_pretrained(model, tmp_path / "base")
    save_pretrained(from_pretrained(ckpts[family]), tmp_path / "plain")
    base_t = hf_io._SafetensorsFile(tmp_path / "base" / "model.safetensors")
    plain_t = hf_io._SafetensorsFile(tmp_path / "plain" / "model.safetensors")
    orig_t = hf_io._SafetensorsFile(ckpts[family] / "model.safetensors")
    assert sorted(base_t.names()) == sorted(plain_t.names()) and not [n for n in base_t.names() if "lora" in n]
    for n in base_t.names():
        np.testing.assert_array_equal(np.asarray(base_t.array(n)), np.asarray(orig_t.array(n)))
    assert (tmp_path / "base" / "config.json").read_text() == (tmp_path / "plain" / "config.json").read_text()
    # merged export: our loader and transformers both give the adapter forward's logits
    save_pretrained(model, tmp_path / "merged", merged=True)
    merged = from_pretrained(tmp_path / "merged")
    assert merged.config.lora_rank == 0
    np.testing.assert_allclose(np.asarray(_fwd(merged, ids, mask))[real], want[real], atol=1e-5)
    import transformers

    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    np.testing.assert_allclose(hf_logits(hf_merged, ids, mask, pos)[real], want[real], atol=2e-5)
    # PEFT's merge_and_unload gives the same weights
    lora.write_peft_adapter(model, tmp_path / "adapter")
    _, peft_merged = _peft_logits(family, tmp_path / "adapter", ids, mask, pos, merge=True)
    sd = {k: v.detach().numpy() for k, v in peft_merged.state_dict().items()}
    for name, arr in hf_io.hf_state_dict(model, merged=True).items():
        np.testing.assert_allclose(arr, sd[name], atol=1e-6, rtol=1e-5)
    # merge_lora: an in-memory copy without adapters
    copy = lora.merge_lora(model)
    assert copy.config.lora_rank == 0 and not nnx.to_flat_state(nnx.state(copy, LoRAParam))
    np.testing.assert_allclose(np.asarray(_fwd(copy, ids, mask))[real], want[real], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(copy.embed_tokens[...]), np.asarray(model.embed_tokens[...]))
    with pytest.raises(ValueError, match="no HF tensor name"):
        hf_io.hf_name_and_kind(("layers", 0, "self_attn", "q_proj", "lora_a"))


# ----------------------------------------------------------------------------- (d) sharding
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


@needs8
def test_adapters_shard_like_their_base_layer(ckpts):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    folder = ckpts["qwen2"]
    model = from_pretrained(folder, mesh=mesh, **LORA)
    want = {  # (A spec, B spec): A on the kernel's input axes, B on its output axes, rank replicated
        ("self_attn", "q_proj"): (P("fsdp", None), P(None, "tensor", None)),
        ("self_attn", "k_proj"): (P("fsdp", None), P(None, "tensor", None)),
        ("self_attn", "o_proj"): (P("tensor", None, None), P(None, "fsdp")),
        ("mlp", "gate_proj"): (P("fsdp", None), P(None, "tensor")),
        ("mlp", "down_proj"): (P("tensor", None), P(None, "fsdp")),
    }
    block = model.layers[1]
    for (grp, name), (a_spec, b_spec) in want.items():
        lin = getattr(getattr(block, grp), name)
        a, b, k = lin.lora_a[...], lin.lora_b[...], lin.kernel[...]
        assert a.sharding.spec == a_spec and b.sharding.spec == b_spec, (name, a.sharding.spec, b.sharding.spec)
        assert a.sharding.spec[:-1] == k.sharding.spec[: lin.n_in]  # input axes follow the kernel
        assert b.sharding.spec[1:] == k.sharding.spec[lin.n_in :]  # output axes follow the kernel
        names = lin.lora_a.get_metadata()["out_sharding"]
        assert a.sharding.spec == logical_to_spec(names, DEFAULT_RULES, a.shape, mesh)
    # the same adapters as the unsharded load, and the same logits
    host = from_pretrained(folder, **LORA)
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        nnx.state(model, LoRAParam),
        nnx.state(host, LoRAParam),
    )
    _randomize(model, seed=6)
    _randomize(host, seed=6)
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=7)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh), activation_rules(DEFAULT_RULES):
        out = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m))(state, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(_fwd(host, ids, mask))[real], atol=1e-5)
    # a custom rules table without "lora_rank" replicates the rank axis
    custom = {k: v for k, v in DEFAULT_RULES.items() if k != "lora_rank"}
    assert logical_to_spec(("embed", "lora_rank"), custom, (64, RANK), mesh) == P("fsdp", None)


# ----------------------------------------------------------------------------- (e) scan_layers and decode
def _stack_into(scanned, looped):
    """Copy the python-loop model's adapters into the scan model's stacked ones."""
    loop_flat = {tuple(str(x) for x in p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(looped, LoRAParam))}
    new = []
    for p, v in nnx.to_flat_state(nnx.state(scanned, LoRAParam)):
        rest = tuple(str(x) for x in p[1:])
        stacked = jnp.stack([loop_flat[("layers", str(i)) + rest] for i in range(scanned.config.num_layers)])
        new.append((p, v.replace(stacked)))
    nnx.update(scanned, nnx.from_flat_state(new))


def _check_decode(model, ref_model, n_new=3):
    """Prefill a left-padded bucket, decode token by token: the logits equal ref_model's full forward."""
    prompt_lens, p_len = [3, 6, 1], 6
    b = len(prompt_lens)
    ids, mask, _ = padded_batch(prompt_lens, p_len, left=True, seed=8)
    new_ids = np.random.default_rng(9).integers(3, 256, size=(b, n_new)).astype(np.int32)
    full_ids = np.concatenate([ids, new_ids], 1)
    full_mask = np.concatenate([mask, np.ones((b, n_new), np.int32)], 1)
    full_pos = np.maximum(np.cumsum(full_mask, 1) - 1, 0)
    ref = np.asarray(_fwd(ref_model, full_ids, full_mask, full_pos))
    s = p_len + n_new + 2
    cache = model.init_cache(b, s, dtype=jnp.float32)
    kv_mask = np.zeros((b, s), np.int32)
    kv_mask[:, :p_len] = mask
    step = jax.jit(lambda m, i, p, c, ci, km: m.decode_step(i, p, c, ci, km))
    logits, cache = step(model, ids, full_pos[:, :p_len], cache, 0, kv_mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], ref[:, :p_len][real], atol=1e-5)
    for t in range(n_new):
        idx = p_len + t
        kv_mask[:, idx] = 1
        logits, cache = step(model, new_ids[:, t : t + 1], full_pos[:, idx : idx + 1], cache, idx, kv_mask)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], ref[:, idx], atol=1e-5)


def test_scan_layers_and_decode_with_adapters(ckpts):
    folder = ckpts["qwen3"]
    looped = _randomize(from_pretrained(folder, **LORA), seed=10)
    scanned = from_pretrained(folder, scan_layers=True, **LORA)
    assert scanned.layers.self_attn.o_proj.lora_a[...].shape == (2, 4, 16, RANK)
    assert scanned.layers.mlp.up_proj.lora_b[...].shape == (2, RANK, 128)
    assert scanned.layers.self_attn.q_proj.lora_a.get_metadata()["out_sharding"] == ("layers", "embed", "lora_rank")
    fresh = lora.peft_adapter_state_dict(from_pretrained(folder, **LORA))
    for k, v in lora.peft_adapter_state_dict(scanned).items():  # same seed: the same adapters as the loop model
        np.testing.assert_array_equal(v, fresh[k])
    _stack_into(scanned, looped)
    for k, v in lora.peft_adapter_state_dict(scanned).items():
        np.testing.assert_array_equal(v, lora.peft_adapter_state_dict(looped)[k])
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=11)
    real = mask.astype(bool)
    want = np.asarray(_fwd(looped, ids, mask))
    np.testing.assert_allclose(np.asarray(_fwd(scanned, ids, mask))[real], want[real], atol=1e-5)
    remat = from_pretrained(folder, scan_layers=True, remat_policy="dots_saveable", **LORA)
    _stack_into(remat, looped)
    np.testing.assert_allclose(np.asarray(_fwd(remat, ids, mask))[real], want[real], atol=1e-5)
    _check_decode(looped, looped)
    _check_decode(scanned, looped)
    merged = lora.merge_lora(scanned)  # stacked merge
    np.testing.assert_allclose(np.asarray(_fwd(merged, ids, mask))[real], want[real], atol=1e-5)


# ----------------------------------------------------------------------------- (f) config validation
def test_config_errors_name_the_field_and_allowed_values():
    kw = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"lora_rank must be a positive int when lora_targets is set"):
        ModelConfig(**kw, lora_rank=0, lora_targets=("q_proj",))
    with pytest.raises(ValueError, match=r"lora_rank must be an int >= 0"):
        ModelConfig(**kw, lora_rank=-2, lora_targets=("q_proj",))
    with pytest.raises(ValueError, match=r"lora_rank must be an int"):
        ModelConfig(**kw, lora_rank=2.0, lora_targets=("q_proj",))
    with pytest.raises(
        ValueError,
        match=r"lora_targets has unknown module name\(s\) \['qkv'\]; allowed: "
        r"\['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
        r"'down_proj'\]",
    ):
        ModelConfig(**kw, lora_rank=4, lora_targets=("q_proj", "qkv"))
    with pytest.raises(ValueError, match=r"lora_targets must name at least one of \['q_proj'"):
        ModelConfig(**kw, lora_rank=4)
    with pytest.raises(ValueError, match=r"lora_targets must be a list of module names among \['q_proj'"):
        ModelConfig(**kw, lora_rank=4, lora_targets="q_proj")
    with pytest.raises(ValueError, match="names a module twice"):
        ModelConfig(**kw, lora_rank=4, lora_targets=("q_proj", "q_proj"))
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="lora_alpha must be a positive finite number"):
            ModelConfig(**kw, lora_rank=4, lora_alpha=bad, lora_targets=("q_proj",))
    cfg = ModelConfig(**kw, lora_rank=4, lora_alpha=8, lora_targets=["v_proj", "q_proj"])  # a YAML list is fine
    assert cfg.lora_targets == ("v_proj", "q_proj") and cfg.lora_scale == 2.0 and hash(cfg)
    # not config.json fields: export ignores them, import leaves LoRA off unless overridden
    plain = ModelConfig(**kw)
    assert cfg.to_hf_config() == plain.to_hf_config()
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == plain
    assert (
        ModelConfig.from_hf_config(cfg.to_hf_config(), lora_rank=4, lora_alpha=8, lora_targets=("v_proj", "q_proj"))
        == cfg
    )
    assert ModelConfig(**kw).lora_scale == 0.0


# ----------------------------------------------------------------------------- (g) bf16 base, fp32 adapters
def test_bf16_base_fp32_adapters_and_adapter_only_grads(ckpts):
    folder = ckpts["llama"]
    m16 = from_pretrained(folder, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, **LORA)
    m32 = from_pretrained(folder, **LORA)
    assert m16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    for _, v in nnx.to_flat_state(nnx.state(m16, LoRAParam)):
        assert v.get_value().dtype == jnp.float32
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        nnx.state(m16, LoRAParam),
        nnx.state(m32, LoRAParam),
    )
    _randomize(m16, seed=12)
    _randomize(m32, seed=12)
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=13)
    real = mask.astype(bool)
    l16, l32 = np.asarray(_fwd(m16, ids, mask)), np.asarray(_fwd(m32, ids, mask))
    assert l16.dtype == np.float32 and np.isfinite(l16).all()
    assert np.abs(l16[real] - l32[real]).max() < 0.1 * np.abs(l32[real]).max()
    # The train step's split: gradients for the adapters only (fp32), the base frozen.
    graphdef, adapters, base = nnx.split(m16, LoRAParam, nnx.Param)
    assert not nnx.to_flat_state(nnx.state(m16, nnx.All(nnx.Param, nnx.Not(nnx.Any(LoRAParam, lora.FROZEN)))))
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)

    def loss_fn(adapters, base):
        logits = nnx.merge(graphdef, adapters, base)(ids_j, mask_j)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        nll = -jnp.take_along_axis(logp, ids_j[:, 1:, None], -1)[..., 0]
        return (nll * mask_j[:, 1:]).sum() / mask_j[:, 1:].sum()

    grads = jax.jit(jax.grad(loss_fn))(adapters, base)
    flat = nnx.to_flat_state(grads)
    assert len(flat) == 2 * 7 * 2 and all(p[-1] in ("lora_a", "lora_b") for p, _ in flat)
    assert all(v.get_value().dtype == jnp.float32 and np.abs(np.asarray(v.get_value())).max() > 0 for _, v in flat)
    # the split lora.split_lora gives (graphdef, adapters, base, rest)
    _, a2, b2, rest = lora.split_lora(m16)
    assert len(nnx.to_flat_state(a2)) == len(flat) and not nnx.to_flat_state(rest)
    assert len(nnx.to_flat_state(b2)) == len(nnx.to_flat_state(base))


# ----------------------------------------------------------------------------- (h) PEFT import (model.lora.init_from)
def _peft_saved(family, folder, targets, seed=0):
    """A PEFT LoRA folder saved by peft itself: rank RANK, alpha ALPHA, random non-zero A and B (seeded)."""
    import peft
    import torch

    model = peft.get_peft_model(
        make_hf_model(family),
        peft.LoraConfig(r=RANK, lora_alpha=int(ALPHA), target_modules=list(targets), init_lora_weights=False),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize(
    "family,targets,scan",
    [("qwen2", ("q_proj", "v_proj", "o_proj", "down_proj"), False), ("llama", LORA_TARGETS, True)],
)
def test_read_peft_adapter_gives_the_peft_models_logits(ckpts, family, targets, scan, tmp_path):
    peft_model = _peft_saved(family, tmp_path / "adapter", targets, seed=20)
    model = from_pretrained(ckpts[family], scan_layers=scan, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets)
    assert lora.read_peft_adapter(model, tmp_path / "adapter") is model
    ids, mask, pos = padded_batch(LENGTHS, T, left=True, seed=21)
    real = mask.astype(bool)
    ref = hf_logits(peft_model, ids, mask, pos)
    assert np.abs(ref[real] - hf_logits(make_hf_model(family), ids, mask, pos)[real]).max() > 0.1  # adapters matter
    diff = np.abs(np.asarray(_fwd(model, ids, mask))[real] - ref[real]).max()
    print(f"PEFT import {family} scan={scan}: max |logits - peft logits| = {diff:.2e}")
    assert diff <= 1e-4
    # and our export of the imported adapters is peft's own state dict
    import peft

    theirs = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(peft_model).items()}
    ours = lora.peft_adapter_state_dict(model)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])


def test_export_then_import_is_exact(ckpts, tmp_path):
    src = _randomize(from_pretrained(ckpts["qwen3"], **LORA), seed=22)
    lora.write_peft_adapter(src, tmp_path / "adapter")
    want = lora.peft_adapter_state_dict(src)
    for scan in (False, True):  # into the python-loop and the stacked (scan_layers) layout
        dst = from_pretrained(ckpts["qwen3"], scan_layers=scan, lora_seed=3, **LORA)
        got = lora.peft_adapter_state_dict(lora.read_peft_adapter(dst, tmp_path / "adapter"))
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        for _, v in nnx.to_flat_state(nnx.state(dst, LoRAParam)):
            assert v.get_value().dtype == jnp.float32
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        nnx.state(src, LoRAParam),
        nnx.state(lora.read_peft_adapter(from_pretrained(ckpts["qwen3"], **LORA), tmp_path / "adapter"), LoRAParam),
    )
    if jax.device_count() >= 8:  # into a mesh-sharded model: each adapter keeps its sharding
        mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
        sharded = from_pretrained(ckpts["qwen3"], mesh=mesh, lora_seed=3, **LORA)
        specs = [v.get_value().sharding for _, v in nnx.to_flat_state(nnx.state(sharded, LoRAParam))]
        got = lora.peft_adapter_state_dict(lora.read_peft_adapter(sharded, tmp_path / "adapter"))
        assert [v.get_value().sharding for _, v in nnx.to_flat_state(nnx.state(sharded, LoRAParam))] == specs
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def _rewrite(folder, drop=(), add=None, **conf):
    """Edit a PEFT folder in place: drop tensors, add tensors, set adapter_config.json keys."""
    st = hf_io._SafetensorsFile(folder / lora.ADAPTER_WEIGHTS)
    tensors = {n: np.array(st.array(n)) for n in st.names() if n not in drop}
    tensors.update(add or {})
    del st
    hf_io._write_safetensors(folder / lora.ADAPTER_WEIGHTS, tensors)
    c = json.loads((folder / lora.ADAPTER_CONFIG).read_text())
    (folder / lora.ADAPTER_CONFIG).write_text(json.dumps({**c, **conf}))


def test_read_peft_adapter_bad_folders_are_one_line_errors(ckpts, tmp_path):
    model = from_pretrained(ckpts["qwen2"], **LORA)
    before = lora.peft_adapter_state_dict(model)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    # an adapter of another base (hidden size 32, not 64): the tensor key and both shapes
    other = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    lora.write_peft_adapter(Transformer(other.replace(**LORA), rngs=nnx.Rngs(0)), tmp_path / "other")
    errors = {}
    with pytest.raises(lora.PeftAdapterError, match=r"tensor base_model\.model\.model\.layers\.0\.\S+ has shape "):
        lora.read_peft_adapter(model, tmp_path / "other")
    with pytest.raises(lora.PeftAdapterError) as e:
        lora.read_peft_adapter(model, tmp_path / "other")
    errors["other base"] = str(e.value)
    assert "has shape [" in str(e.value) and "the model's adapter needs [" in str(e.value)
    good = tmp_path / "good"
    lora.write_peft_adapter(_randomize(from_pretrained(ckpts["qwen2"], **LORA), seed=23), good)
    cases = {  # name: (edit of a copy of `good`, regex)
        "missing tensor": (dict(drop=[q_a]), r"lacks tensor base_model\.model\.model\.layers\.0\.self_attn\.q_proj"),
        "unexpected tensor": (
            dict(add={"base_model.model.lm_head.lora_A.weight": np.zeros((RANK, 64), np.float32)}),
            r"has unexpected tensor base_model\.model\.lm_head\.lora_A\.weight",
        ),
        "rank": (dict(r=8), r"has r = 8 but ModelConfig\.lora_rank = 4"),
        "alpha": (dict(lora_alpha=16), r"has lora_alpha = 16 but ModelConfig\.lora_alpha = 8"),
        "targets": (dict(target_modules=["q_proj"]), r"has target_modules = \[q_proj\] but ModelConfig\.lora_targets"),
        "pattern": (dict(target_modules=".*proj"), r"target_modules is the pattern"),
        "dora": (dict(use_dora=True), r"sets use_dora = true, which stare_jax's LoRA does not implement"),
        "not lora": (dict(peft_type="IA3"), r"peft_type 'IA3' is not a LoRA adapter"),
    }
    import shutil

    for name, (edit, pattern) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, folder)
        _rewrite(folder, **edit)
        with pytest.raises(lora.PeftAdapterError, match=pattern) as e:
            lora.read_peft_adapter(model, folder)
        errors[name] = str(e.value)
    (tmp_path / "no_weights").mkdir()
    shutil.copy(good / lora.ADAPTER_CONFIG, tmp_path / "no_weights")
    with pytest.raises(lora.PeftAdapterError, match=r"no adapter_model\.safetensors in .*no_weights") as e:
        lora.read_peft_adapter(model, tmp_path / "no_weights")
    errors["no safetensors"] = str(e.value)
    with pytest.raises(lora.PeftAdapterError, match=r"is not a PEFT adapter folder \(no such folder\)") as e:
        lora.read_peft_adapter(model, tmp_path / "nowhere")
    errors["no folder"] = str(e.value)
    for name, msg in errors.items():
        print(f"{name}: {msg}")
        assert "\n" not in msg
    # a failed import leaves the model's adapters as they were
    after = lora.peft_adapter_state_dict(model)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.read_peft_adapter(from_pretrained(ckpts["qwen2"]), good)


def test_init_from_in_the_run_setup_and_config(ckpts, tmp_path):
    from stare_jax.config.loader import load_config
    from stare_jax.config.options import ConfigError
    from stare_jax.training.setup import TrainingError, init_adapters

    def run_cfg(*extra):
        base = [f"model.path={ckpts['qwen2']}", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]
        return load_config(None, [*base, *extra])

    adapter = tmp_path / "adapter"
    src = _randomize(from_pretrained(ckpts["qwen2"], **LORA), seed=24)
    lora.write_peft_adapter(src, adapter, base_model_name_or_path=str(ckpts["qwen2"]))
    want = lora.peft_adapter_state_dict(src)

    def same(model, ref):
        got = lora.peft_adapter_state_dict(model)
        return all(np.array_equal(got[k], ref[k]) for k in ref)

    def fresh(cfg):
        return from_pretrained(ckpts["qwen2"], **cfg.model.architecture_overrides())

    lines: list[str] = []
    cfg = run_cfg(f"model.lora.init_from={adapter}")
    assert same(init_adapters(fresh(cfg), cfg, log=lines.append), want) and len(lines) == 1
    # resume: the checkpoint's adapters win; they are read only for the KL reference 'initial'
    m = fresh(cfg)
    init = lora.peft_adapter_state_dict(m)
    assert same(init_adapters(m, cfg, resume=True, log=lines.append), init)
    ref_cfg = run_cfg(f"model.lora.init_from={adapter}", "rl.kl.reference=initial")
    assert same(init_adapters(fresh(ref_cfg), ref_cfg, resume=True, log=lines.append), want)
    # without init_from: untouched
    plain = run_cfg()
    m = fresh(plain)
    assert same(init_adapters(m, plain), lora.peft_adapter_state_dict(m))
    # another existing local base: reported, not refused
    other = tmp_path / "elsewhere"
    other.mkdir()
    _rewrite(adapter, base_model_name_or_path=str(other))
    lines.clear()
    assert same(init_adapters(fresh(cfg), cfg, log=lines.append), want)
    assert any(f"trained on {other}, not on this run's model" in x for x in lines), lines
    # the folder's settings must be the section's: errors name the key to change, both values
    bad = {
        "model.lora.rank=2": r"has r = 4 but model\.lora\.rank = 2: set model\.lora\.rank=4",
        "model.lora.alpha=16": r"has lora_alpha = 8\.0 but model\.lora\.alpha = 16: set model\.lora\.alpha=8\.0",
        "model.lora.target_modules=[q_proj,v_proj]": r"target_modules = \[q_proj,k_proj,v_proj,o_proj,gate_proj,"
        r"up_proj,down_proj\] but model\.lora\.target_modules = \[q_proj,v_proj\]",
    }
    for override, pattern in bad.items():
        c = run_cfg(f"model.lora.init_from={adapter}", override)
        with pytest.raises(TrainingError, match=rf"^model\.lora\.init_from = '{adapter}': .*{pattern}") as e:
            init_adapters(fresh(c), c)
        print(e.value)
    # config-time checks: the key named, with enabled off or an empty / non-string value
    with pytest.raises(ConfigError, match=r"model\.lora\.init_from = '/x' needs model\.lora\.enabled=true"):
        load_config(None, ["model.lora.init_from=/x"])
    with pytest.raises(ConfigError, match=r"model\.lora\.init_from is empty"):
        load_config(None, ["model.lora.enabled=true", "model.lora.init_from="])
    with pytest.raises(ConfigError, match=r"'model\.lora\.init_from' = 3 has the wrong type"):
        load_config(None, ["model.lora.enabled=true", "model.lora.init_from=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'model\.lora\.init_form'"):
        load_config(None, ["model.lora.enabled=true", "model.lora.init_form=/x"])
    assert load_config(None, ["model.lora.init_from=/x", "model.lora.enabled=true"]).model.lora.init_from == "/x"
    assert "init_from" not in str(run_cfg(f"model.lora.init_from={adapter}").model.architecture_overrides())
