"""Transformer forward vs transformers (PyTorch fp32), hidden/unembed identity, bf16, remat, KV-cache decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax.models import ModelConfig, from_pretrained, init_model
from stare_jax.models.transformer import rope_inv_freq
from support.models import FAMILIES, hf_logits, padded_batch
from support.params import representative

LENGTHS = [5, 12, 1, 9]
T = 12


@jax.jit
def _fwd(model, ids, mask, pos=None):
    return model(ids, mask, pos)


@jax.jit
def _hidden(model, ids, mask):
    return model.hidden_states(ids, mask)


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return {fam: from_pretrained(folder) for fam, (folder, _) in hf_checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
def test_logits_match_transformers(hf_checkpoints, loaded, family, left):
    _, hf_model = hf_checkpoints[family]
    ids, mask, pos = padded_batch(LENGTHS, T, left=left, seed=1)
    ref = hf_logits(hf_model, ids, mask, pos)
    out = np.asarray(_fwd(loaded[family], ids, mask))
    real = mask.astype(bool)
    assert out.dtype == np.float32
    assert np.abs(ref[real]).max() > 0.5  # logits are not trivially small
    np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0)


def test_explicit_positions_and_padding_invariance(loaded):
    """A left-padded row gives the same real-token logits as the same row unpadded."""
    model = loaded["qwen2"]
    ids, mask, pos = padded_batch([6], 10, left=True, seed=2)
    padded = np.asarray(_fwd(model, ids, mask, pos))[0, 4:]
    alone = np.asarray(_fwd(model, ids[:, 4:], np.ones((1, 6), np.int32)))[0]
    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_rope_llama3_inv_freq_matches_transformers(hf_checkpoints, loaded):
    _, hf_model = hf_checkpoints["llama"]
    ref = hf_model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(rope_inv_freq(loaded["llama"].config), ref, rtol=1e-6)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hidden_states_times_unembed_is_logits(loaded, family):
    model = loaded[family]
    ids, mask, _ = padded_batch([4, 8], 8, left=True, seed=3)
    hidden = _hidden(model, ids, mask)
    w = model.unembed_matrix()
    assert w.shape == (model.config.vocab_size, model.config.hidden_size)
    if model.config.tie_word_embeddings:
        assert w is model.embed_tokens[...]
    np.testing.assert_allclose(
        np.asarray(hidden.astype(jnp.float32) @ w.astype(jnp.float32).T), np.asarray(_fwd(model, ids, mask)), atol=1e-5
    )


def test_bf16_compute_close(hf_checkpoints, loaded):
    folder, _ = hf_checkpoints["qwen2"]
    m16 = from_pretrained(folder, dtype=jnp.bfloat16)
    assert m16.embed_tokens[...].dtype == jnp.float32  # fp32 master weights
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=4)
    l16 = np.asarray(_fwd(m16, ids, mask))
    l32 = np.asarray(_fwd(loaded["qwen2"], ids, mask))
    real = mask.astype(bool)
    assert l16.dtype == np.float32 and np.isfinite(l16).all()
    assert np.abs(l16[real] - l32[real]).max() < 0.1 * np.abs(l32[real]).max()
    mb = from_pretrained(folder, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert mb.embed_tokens[...].dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(_fwd(mb, ids, mask))).all()


def _loss_and_grads(model, ids, mask):
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        m = nnx.merge(graphdef, state)
        logits = m(ids, mask)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

    return jax.jit(jax.value_and_grad(loss_fn))(state)


@pytest.mark.parametrize("policy", representative(["full", "dots_saveable"]))
def test_remat_same_loss_and_grads(hf_checkpoints, policy):
    folder, _ = hf_checkpoints["qwen3"]
    ids, mask, _ = padded_batch([6, 8], 8, left=True, seed=5)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    l0, g0 = _loss_and_grads(from_pretrained(folder), ids, mask)
    l1, g1 = _loss_and_grads(from_pretrained(folder, remat_policy=policy), ids, mask)
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g0, g1)


@pytest.mark.parametrize("family,static_index", [("qwen2", False), ("llama", True)])
def test_decode_with_kv_cache_matches_full_forward(loaded, family, static_index):
    """Prefill a left-padded prompt bucket, then decode token by token: logits equal the full forward.
    static_index: cache_index is a python int (attention over the first cache_index+T slots only)."""
    _check_decode(loaded[family], static_index)


def test_decode_splash_prefill(hf_checkpoints):
    """attention_impl="splash": the prefill call (static cache_index 0) runs the splash kernel (interpreted
    on CPU), later steps the einsum path; logits equal the full forward."""
    folder, _ = hf_checkpoints["qwen2"]
    _check_decode(from_pretrained(folder, attention_impl="splash"), True, n_new=2)


def _check_decode(model, static_index, n_new=5):
    prompt_lens, p_len = [3, 6, 1], 6
    b = len(prompt_lens)
    ids, mask, _ = padded_batch(prompt_lens, p_len, left=True, seed=6)
    rng = np.random.default_rng(7)
    new_ids = rng.integers(3, 256, size=(b, n_new)).astype(np.int32)
    full_ids = np.concatenate([ids, new_ids], 1)
    full_mask = np.concatenate([mask, np.ones((b, n_new), np.int32)], 1)
    full_pos = np.maximum(np.cumsum(full_mask, 1) - 1, 0)
    ref = np.asarray(_fwd(model, full_ids, full_mask, full_pos))

    s = p_len + n_new + 3  # cache longer than needed: empty slots must be ignored
    cache = model.init_cache(b, s, dtype=jnp.float32)
    kv_mask = np.zeros((b, s), np.int32)
    kv_mask[:, :p_len] = mask
    step = jax.jit(
        lambda m, i, p, c, ci, km: m.decode_step(i, p, c, ci, km), static_argnums=(4,) if static_index else ()
    )
    logits, cache = step(model, ids, full_pos[:, :p_len], cache, 0, kv_mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], ref[:, :p_len][real], atol=1e-5)
    for t in range(n_new):
        idx = p_len + t
        kv_mask[:, idx] = 1
        logits, cache = step(model, new_ids[:, t : t + 1], full_pos[:, idx : idx + 1], cache, idx, kv_mask)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], ref[:, idx], atol=1e-5)
    assert cache[0]["k"].shape == (b, s, model.config.num_kv_heads, model.config.head_dim)


@pytest.mark.parametrize("impl", ["dot_product", "cudnn"])
def test_dot_product_impl_matches_xla(hf_checkpoints, loaded, impl):
    folder, _ = hf_checkpoints["qwen2"]
    m = from_pretrained(folder, attention_impl=impl)
    ids, mask, _ = padded_batch(LENGTHS, T, left=True, seed=8)
    real = mask.astype(bool)
    np.testing.assert_allclose(
        np.asarray(_fwd(m, ids, mask))[real], np.asarray(_fwd(loaded["qwen2"], ids, mask))[real], atol=1e-5
    )


def test_init_model_and_config_validation():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        tie_word_embeddings=True,
    )
    model = init_model(cfg, seed=0)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.num_params()
    assert _fwd(model, np.ones((1, 3), np.int32), np.ones((1, 3), np.int32)).shape == (1, 3, 64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cfg.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        cfg.replace(hidden_size=0)
    with pytest.raises(ValueError, match="attention_impl"):
        cfg.replace(attention_impl="flash9")
    with pytest.raises(ValueError, match="remat_policy"):
        cfg.replace(remat_policy="some")


def test_splash_attention_interpret_matches_reference():
    """Pallas splash (TPU flash) kernel run through the Pallas interpreter on CPU: forward and vjp equal the
    einsum reference on real positions of a left-padded batch (T=100 also exercises the pad-to-128 path)."""
    from stare_jax.models import attention as A

    rng = np.random.default_rng(0)
    b, t, h, k, d = 1, 100, 2, 1, 32
    q, kk, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(b, t, h, d), (b, t, k, d), (b, t, k, d)])
    mask = np.ones((b, t), np.int32)
    mask[0, :30] = 0
    m = jnp.asarray(mask)
    cot = jnp.asarray(rng.standard_normal((b, t, h, d)) * mask[:, :, None, None], jnp.float32)
    out_s, vjp_s = jax.vjp(lambda *a: A.attention_splash(*a, m, interpret=True), q, kk, v)
    out_r, vjp_r = jax.vjp(lambda *a: A.attention_xla(*a, A.causal_padding_mask(m)), q, kk, v)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out_s)[real], np.asarray(out_r)[real], atol=1e-5)
    for gs, gr in zip(vjp_s(cot), vjp_r(cot)):
        np.testing.assert_allclose(np.asarray(gs), np.asarray(gr), atol=1e-5)


@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys-SxD", "keys-DxS"])
@pytest.mark.parametrize("t", [2, 1], ids=["prefill", "decode"])
def test_kv_major_attention_matches_reference(t, keys_transposed):
    """attention_kv_major (k/v [K, B, S, Dh], the paged pool's gathered layout; keys [K, B, Dh, S] from the CPU's
    transposed key pool) equals attention_xla on the same keys in [B, S, K, Dh] and a numpy float64 softmax, for
    GQA with a ragged mask: several query tokens and one (a decode step)."""
    from stare_jax.models import attention as A

    rng = np.random.default_rng(1)
    b, s, h, k, d = 3, 7, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k_BxSxKxD, v_BxSxKxD = (jnp.asarray(rng.standard_normal((b, s, k, d)), jnp.float32) for _ in range(2))
    pos_BxT = np.asarray([[3, 4], [0, 1], [5, 6]])[:, :t]
    mask = jnp.asarray(np.arange(s)[None, None, :] <= pos_BxT[:, :, None])
    keys = jnp.transpose(k_BxSxKxD, (2, 0, 3, 1) if keys_transposed else (2, 0, 1, 3))
    out = A.attention_kv_major(q, keys, jnp.moveaxis(v_BxSxKxD, 2, 0), mask, keys_transposed=keys_transposed)
    np.testing.assert_allclose(np.asarray(out), np.asarray(A.attention_xla(q, k_BxSxKxD, v_BxSxKxD, mask)), atol=1e-6)
    kk, vv, qq = (np.asarray(x, np.float64) for x in (k_BxSxKxD, v_BxSxKxD, q))
    for r in range(b):
        for i in range(t):
            n = pos_BxT[r, i] + 1
            for j in range(h):
                logits = kk[r, :n, j // (h // k)] @ qq[r, i, j] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                np.testing.assert_allclose(np.asarray(out[r, i, j]), p / p.sum() @ vv[r, :n, j // (h // k)], atol=1e-5)


@pytest.mark.parametrize("s, block", [(40, 8), (37, 8), (9, 16)], ids=["whole-blocks", "padded-tail", "one-block"])
def test_blocked_kv_major_attention_matches_one_pass(s, block):
    """attention_kv_major_blocked (online softmax over key blocks: the engine's long-context prefill) equals
    attention_kv_major in float32 to rounding, for GQA, ragged causal masks (rows whose visible keys end inside,
    at the edge of, and before a block), a key count that is not a multiple of the block, and a fully masked
    (padding) query row, which stays finite; with keys [K, B, Dh, S] too; in bfloat16 to bfloat16 rounding."""
    from stare_jax.models import attention as A

    rng = np.random.default_rng(2)
    b, t, h, k, d = 4, 3, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k_KxBxSxD, v_KxBxSxD = (jnp.asarray(rng.standard_normal((k, b, s, d)), jnp.float32) for _ in range(2))
    last = np.asarray([[s - 3, s - 2, s - 1], [block - 1, block, block + 1], [0, 1, 2], [4, 5, 6]])
    mask = np.arange(s)[None, None, :] <= np.minimum(last, s - 1)[:, :, None]
    mask[3, 0] = False  # a padding query: no key at all
    mask = jnp.asarray(mask)
    ref = A.attention_kv_major(q, k_KxBxSxD, v_KxBxSxD, mask)
    out = A.attention_kv_major_blocked(q, k_KxBxSxD, v_KxBxSxD, mask, block=block)
    assert np.all(np.isfinite(np.asarray(out)))
    real = np.asarray(mask).any(-1)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-6, rtol=1e-5)
    out_t = A.attention_kv_major_blocked(
        q, jnp.swapaxes(k_KxBxSxD, -1, -2), v_KxBxSxD, mask, block=block, keys_transposed=True
    )  # the CPU's transposed key pool, gathered
    np.testing.assert_allclose(np.asarray(out_t)[real], np.asarray(ref)[real], atol=2e-6, rtol=1e-5)
    bf = [x.astype(jnp.bfloat16) for x in (q, k_KxBxSxD, v_KxBxSxD)]
    out_bf = A.attention_kv_major_blocked(*bf, mask, block=block).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(out_bf)[real], np.asarray(ref)[real], atol=0.05)


def test_grads_match_torch_autograd(hf_checkpoints, loaded):
    """Mean next-token cross entropy and its gradients (tied embedding, q-norm, q kernel) equal torch's."""
    import torch

    _, hf_model = hf_checkpoints["qwen3"]
    model = loaded["qwen3"]
    ids, mask, pos = padded_batch([8, 8], 8, left=True, seed=9)
    loss, g = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(mask))
    hf_model.zero_grad(set_to_none=True)
    out = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long), labels=torch.as_tensor(ids, dtype=torch.long))
    out.loss.backward()
    np.testing.assert_allclose(float(loss), float(out.loss), rtol=1e-5)
    emb = hf_model.model.embed_tokens.weight.grad.numpy()
    np.testing.assert_allclose(np.asarray(g["embed_tokens"][...]), emb, atol=1e-5)
    qn = hf_model.model.layers[1].self_attn.q_norm.weight.grad.numpy()
    np.testing.assert_allclose(np.asarray(g["layers"][1]["self_attn"]["q_norm"]["weight"][...]), qn, atol=1e-5)
    qk = hf_model.model.layers[0].self_attn.q_proj.weight.grad.numpy()  # [H*Dh, D]
    ours = np.asarray(g["layers"][0]["self_attn"]["q_proj"]["kernel"][...])  # [D, H, Dh]
    np.testing.assert_allclose(ours.reshape(ours.shape[0], -1).T, qk, atol=1e-5)
    hf_model.zero_grad(set_to_none=True)


def test_bad_shapes_raise(loaded):
    model = loaded["qwen2"]
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(ValueError, match="attention_mask"):
        model.hidden_states(ids, np.ones((2, 5), np.int32))
    with pytest.raises(ValueError, match="positions"):
        model.hidden_states(ids, None, np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="input_ids"):
        model.hidden_states(np.ones((4,), np.int32))
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match="kv_mask"):
        model.decode_step(ids, ids, cache, 0, np.ones((2, 7), np.int32))
    with pytest.raises(ValueError, match="cache_index=6"):
        model.decode_step(ids, ids, cache, 6, np.ones((2, 8), np.int32))


@pytest.fixture(scope="module")
def scanned(hf_checkpoints):
    folder, _ = hf_checkpoints["qwen2"]
    return from_pretrained(folder, scan_layers=True)


def test_scan_layers_matches_transformers_and_loop(hf_checkpoints, loaded, scanned):
    """scan_layers=True: stacked [L, ...] params, one lax.scan forward; same logits, loss and grads."""
    _, hf_model = hf_checkpoints["qwen2"]
    assert scanned.layers.self_attn.q_proj.kernel[...].shape == (2, 64, 4, 16)
    ids, mask, pos = padded_batch(LENGTHS, T, left=True, seed=10)
    real = mask.astype(bool)
    out = np.asarray(_fwd(scanned, ids, mask))
    np.testing.assert_allclose(out[real], hf_logits(hf_model, ids, mask, pos)[real], atol=1e-4)
    np.testing.assert_allclose(out[real], np.asarray(_fwd(loaded["qwen2"], ids, mask))[real], atol=1e-5)
    l0, g0 = _loss_and_grads(loaded["qwen2"], jnp.asarray(ids), jnp.asarray(mask))
    remat = from_pretrained(hf_checkpoints["qwen2"][0], scan_layers=True, remat_policy="dots_saveable")
    l1, g1 = _loss_and_grads(remat, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(g1["layers"]["mlp"]["up_proj"]["kernel"][...][1]),
        np.asarray(g0["layers"][1]["mlp"]["up_proj"]["kernel"][...]),
        rtol=1e-4,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.asarray(g1["embed_tokens"][...]), np.asarray(g0["embed_tokens"][...]), rtol=1e-4, atol=1e-5
    )


def test_scan_layers_decode(scanned):
    _check_decode(scanned, False, n_new=3)
