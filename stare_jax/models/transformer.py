"""Decoder-only transformer (Llama / Qwen2 / Qwen2.5 / Qwen3) in Flax NNX.

One module family covers the three HF architectures: GQA attention with RoPE (optionally Llama-3 scaled),
optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), SwiGLU MLP, RMSNorm, tied or untied
embeddings. Parameters are stored in `param_dtype` (fp32 master weights) and cast to `dtype` for compute;
softmax and norms run in fp32. Weight layouts put heads on their own axis (q: [D,H,Dh]) so the sharding rules
can split heads; HF import/export (hf_io.py) handles the reshapes. Layers run as a python loop over Blocks, or
(ModelConfig.scan_layers) as one lax.scan over stacked parameters. With ModelConfig.lora_rank > 0 the projections
named in lora_targets also hold float32 LoRA adapters (nnx.LoRAParam lora_a / lora_b, see stare_jax/models/lora.py),
applied by Linear.__call__, the one projection helper every call site (full forward, decode, paged decode) uses.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stare_jax.models import attention as attn_lib
from stare_jax.models.config import ModelConfig
from stare_jax.models.sharding import constrain, state_shardings

_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LoRAParam = nnx.LoRAParam  # flax's `class LoRAParam(nnx.Param)`: the adapters' variable type
BASE_PARAMS = nnx.All(nnx.Param, nnx.Not(LoRAParam))  # nnx filter: the base (HF) weights, every Param but adapters
_LETTERS = "abcdefgh"
_LORA_KEY_SALT = 0x4C6F5241  # "LoRA"


def _dtype(name):
    return _DT[name] if isinstance(name, str) else name


def _param(rngs, init, shape, names, cfg: ModelConfig):
    dt = _dtype(cfg.param_dtype)
    if init == "ones":
        value = jnp.ones(shape, dt)
    elif init == "zeros":
        value = jnp.zeros(shape, dt)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * cfg.initializer_range).astype(dt)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[Dh/2] float32 inverse frequencies, computed like transformers' ROPE_INIT_FUNCTIONS (float32)."""
    dh = cfg.head_dim
    inv = (
        1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / np.float32(dh)))
    ).astype(np.float32)
    rt = cfg.rope_type
    if rt == "linear":
        assert cfg.rope_scaling is not None  # rope_type is "default" without it
        inv = (inv / np.float32(cfg.rope_scaling["factor"])).astype(np.float32)
    elif rt == "llama3":
        s = cfg.rope_scaling
        assert s is not None  # rope_type is "default" without it
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * np.pi / inv
        inv_l = np.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    return inv


def rope_cos_sin(positions_BxT, inv_freq, dtype):
    """cos/sin [B,T,Dh] in `dtype` (angles computed in fp32), HF "rotate_half" layout."""
    ang_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    ang = jnp.concatenate([ang_BxTxF, ang_BxTxF], axis=-1)
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def apply_rope(x_BxTxHxD, cos_BxTxD, sin_BxTxD):
    half = x_BxTxHxD.shape[-1] // 2
    x1, x2 = x_BxTxHxD[..., :half], x_BxTxHxD[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxTxHxD * cos_BxTxD[:, :, None, :] + rot * sin_BxTxD[:, :, None, :]


# ----------------------------------------------------------------------------- layers
class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig, rngs: nnx.Rngs):
        self.weight = _param(rngs, "ones", (dim,), ("norm",), cfg)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x):
        dt = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dt) * xf.astype(dt)


class Linear(nnx.Module):
    """A weight of arbitrary shape whose first `n_in` axes are the input axes (+ optional bias on the output axes,
    + optional LoRA adapters when `lora_name` is one of cfg.lora_targets).

    Adapters (float32 nnx.LoRAParam, whatever param_dtype is): lora_a [in axes..., r] with the kernel's input axis
    names + ("lora_rank",), lora_b [r, out axes...] with ("lora_rank",) + the output names, so both shard like the
    kernel. They are created as zeros here; Transformer.__init__ (or hf_io.from_pretrained) then gives A PEFT's
    default init (init_lora_state)."""

    def __init__(
        self, shape, names, cfg, rngs, bias_shape=None, bias_names=None, *, n_in: int = 1, lora_name: str | None = None
    ):
        self.kernel = _param(rngs, "normal", shape, names, cfg)
        self.bias = _param(rngs, "zeros", bias_shape, bias_names, cfg) if bias_shape is not None else None
        self.n_in = n_in
        self.lora_a: nnx.Variable | None
        self.lora_b: nnx.Variable | None
        if lora_name is not None and cfg.lora_rank > 0 and lora_name in cfg.lora_targets:
            r, shape, names = cfg.lora_rank, tuple(shape), tuple(names)
            self.lora_a = LoRAParam(
                jnp.zeros(shape[:n_in] + (r,), jnp.float32),
                out_sharding=names[:n_in] + ("lora_rank",),
                eager_sharding=False,
            )
            self.lora_b = LoRAParam(
                jnp.zeros((r,) + shape[n_in:], jnp.float32),
                out_sharding=("lora_rank",) + names[n_in:],
                eager_sharding=False,
            )
            self.lora_scale = cfg.lora_scale
        else:
            self.lora_a = self.lora_b = None
            self.lora_scale = 0.0

    def __call__(self, x, dtype):
        """x [..., in axes] -> [..., out axes] in `dtype`: x W (+ b) (+ lora_scale * (x A) B)."""
        y = _contract(x, self.kernel[...].astype(dtype), self.n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        if self.lora_a is not None and self.lora_b is not None:
            xa = _contract(x, self.lora_a[...].astype(dtype), self.n_in)
            y = y + self.lora_scale * _contract(xa, self.lora_b[...].astype(dtype), 1)
        return y


def _contract(x, w, n_in: int):
    """Contract x's last n_in axes with w's first n_in axes (the einsum of every projection)."""
    i, o = _LETTERS[:n_in], _LETTERS[n_in : w.ndim]
    return jnp.einsum(f"...{i},{i}{o}->...{o}", x, w)


def init_lora_state(lora_state, key, cfg: ModelConfig):
    """PEFT's default adapter init (init_lora_weights=True) for an nnx.State of LoRAParams (values may be abstract:
    only shapes are read): A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform with a=sqrt(5), fan_in = the
    kernel's input size), B = 0, float32. Each layer's A draws from fold_in(key, crc32 of its per-layer path), so
    the python-loop and scan_layers models get the same adapters from the same key."""
    out = []
    for path, var in nnx.to_flat_state(lora_state):
        shape = tuple(var.get_value().shape)
        p = tuple(str(x) for x in path)
        stacked = cfg.scan_layers and p[0] == "layers"
        if p[-1] == "lora_b":
            value = jnp.zeros(shape, jnp.float32)
        else:
            layer_shape = shape[1:] if stacked else shape
            bound = 1.0 / math.sqrt(math.prod(layer_shape[:-1]))

            def draw(p):
                k = jax.random.fold_in(key, zlib.crc32(".".join(p).encode()) & 0x7FFFFFFF)
                return jax.random.uniform(k, layer_shape, jnp.float32, -bound, bound)

            value = jnp.stack([draw(("layers", str(i)) + p[1:]) for i in range(shape[0])]) if stacked else draw(p)
        out.append((path, var.replace(value)))
    return nnx.from_flat_state(out)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        assert dh is not None  # ModelConfig.__post_init__ derives it
        b = cfg.qkv_bias
        self.q_proj = Linear(
            (d, h, dh),
            ("embed", "q_heads", "head_dim"),
            cfg,
            rngs,
            (h, dh) if b else None,
            ("q_heads", "head_dim"),
            lora_name="q_proj",
        )
        self.k_proj = Linear(
            (d, k, dh),
            ("embed", "kv_heads", "head_dim"),
            cfg,
            rngs,
            (k, dh) if b else None,
            ("kv_heads", "head_dim"),
            lora_name="k_proj",
        )
        self.v_proj = Linear(
            (d, k, dh),
            ("embed", "kv_heads", "head_dim"),
            cfg,
            rngs,
            (k, dh) if b else None,
            ("kv_heads", "head_dim"),
            lora_name="v_proj",
        )
        self.o_proj = Linear((h, dh, d), ("q_heads", "head_dim", "embed"), cfg, rngs, n_in=2, lora_name="o_proj")
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(dh, cfg, rngs)
            self.k_norm: RMSNorm | None = RMSNorm(dh, cfg, rngs)
        else:
            self.q_norm = self.k_norm = None
        self.dtype = _dtype(cfg.dtype)
        self.impl = cfg.attention_impl

    def _proj(self, lin: Linear, x_BxTxD):
        return lin(x_BxTxD, self.dtype)  # [B,T,D] -> [B,T,H,Dh]

    def qkv(self, x_BxTxD, cos, sin):
        q = self._proj(self.q_proj, x_BxTxD)
        k = self._proj(self.k_proj, x_BxTxD)
        v = self._proj(self.v_proj, x_BxTxD)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
        k = apply_rope(k, cos, sin)
        return q, k, v

    def out(self, o_BxTxHxD):
        return self.o_proj(o_BxTxHxD, self.dtype)  # [B,T,H,Dh] -> [B,T,D]

    def __call__(self, x_BxTxD, cos, sin, mask_BxTxS, attention_mask_BxT):
        q, k, v = self.qkv(x_BxTxD, cos, sin)
        o = attn_lib.attend(self.impl, q, k, v, mask_BxTxS, attention_mask_BxT=attention_mask_BxT)
        return self.out(o)

    def decode(self, x_BxTxD, cos, sin, mask_BxTxV, cache: dict, cache_index, prefill_mask_BxT=None):
        """Write this call's k/v at cache_index, attend over the first V slots of the cache (V = mask width:
        the whole cache, or cache_index+T when cache_index is static). With prefill_mask_BxT (static
        cache_index 0) the call is plain self-attention over the new tokens, so "splash" can run it."""
        q, k, v = self.qkv(x_BxTxD, cos, sin)
        ck = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, cache_index, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, cache_index, 0, 0))
        n = mask_BxTxV.shape[-1]
        kv_k, kv_v = ck[:, :n].astype(self.dtype), cv[:, :n].astype(self.dtype)
        if self.impl == "splash" and prefill_mask_BxT is not None:
            o = attn_lib.attend("splash", q, kv_k, kv_v, mask_BxTxV, attention_mask_BxT=prefill_mask_BxT)
        else:
            impl = "xla" if self.impl == "splash" else self.impl
            o = attn_lib.attend(impl, q, kv_k, kv_v, mask_BxTxV)
        return self.out(o), {"k": ck, "v": cv}


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear((d, i), ("embed", "mlp"), cfg, rngs, lora_name="gate_proj")
        self.up_proj = Linear((d, i), ("embed", "mlp"), cfg, rngs, lora_name="up_proj")
        self.down_proj = Linear((i, d), ("mlp", "embed"), cfg, rngs, lora_name="down_proj")
        self.dtype = _dtype(cfg.dtype)

    def __call__(self, x_BxTxD):
        dt = self.dtype
        g = self.gate_proj(x_BxTxD, dt)
        u = self.up_proj(x_BxTxD, dt)
        hdn = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_mlp"))
        return self.down_proj(hdn, dt)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask_BxTxS, attention_mask_BxT):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask_BxTxS, attention_mask_BxT)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, ("batch", "seq", "act_embed"))

    def decode(self, x, cos, sin, mask_BxTxV, cache, cache_index, prefill_mask_BxT=None):
        a, cache = self.self_attn.decode(
            self.input_layernorm(x), cos, sin, mask_BxTxV, cache, cache_index, prefill_mask_BxT
        )
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


def _block_forward(block: Block, x, cos, sin, mask_BxTxS, attention_mask_BxT):
    return block(x, cos, sin, mask_BxTxS, attention_mask_BxT)


_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return Block(cfg, r)

    return make(rngs)


def _check_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _check_ids(input_ids_BxT):
    if input_ids_BxT.ndim != 2 or not jnp.issubdtype(input_ids_BxT.dtype, jnp.integer):
        raise ValueError(
            f"input_ids must be an integer [batch, seq] array, got shape {tuple(input_ids_BxT.shape)} "
            f"dtype {input_ids_BxT.dtype}"
        )


def default_positions(attention_mask_BxT):
    """Each real token's index within its segment (RoPE positions), 0 on padding.

    attention_mask_BxT holds segment ids (0 = padding; see attention.causal_padding_mask). With a 0/1 mask this is
    cumsum(mask) - 1 clipped at 0 (a left-padded row gets the same positions as the unpadded one, padding gaps do
    not restart the count). Packed rows number their sequences in increasing order along the row; positions
    restart at each sequence's first token, so a packed sequence sees the positions it has alone."""
    real = (attention_mask_BxT > 0).astype(jnp.int32)
    count = jnp.cumsum(real, axis=-1)  # real tokens up to and including t
    seg = attention_mask_BxT.astype(jnp.int32)
    prev_max = jnp.concatenate([jnp.zeros_like(seg[:, :1]), jax.lax.cummax(seg, axis=seg.ndim - 1)[:, :-1]], axis=-1)
    start = (real > 0) & (seg > prev_max)  # first token of a new (higher-numbered) segment
    before = jax.lax.cummax(jnp.where(start, count - 1, 0), axis=seg.ndim - 1)  # real tokens before that segment
    return jnp.maximum(count - 1 - before, 0)


class Transformer(nnx.Module):
    """Decoder-only LM. Call: logits_BxTxV = model(input_ids_BxT, attention_mask=None, positions=None)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = _param(rngs, "normal", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        self.layers: Block | nnx.List[Block]
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)  # one Block whose params have a leading [L] axis
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg, rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(rngs, "normal", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        if cfg.lora_rank > 0:
            # The adapters' key comes from the "lora" stream's (else the params stream's) seed, not from its draw
            # counter: the base init does not depend on LoRA, and loop and scan_layers models get the same A.
            stream = rngs["lora"] if "lora" in rngs else rngs.params
            key = jax.random.fold_in(stream.key[...], _LORA_KEY_SALT)
            nnx.update(self, init_lora_state(nnx.state(self, LoRAParam), key, cfg))

    # ------------------------------------------------------------------ helpers
    def blocks(self) -> list:
        """The layers as a list of Blocks (with scan_layers: per-layer slices of the stacked parameters)."""
        if not self.config.scan_layers:
            assert isinstance(self.layers, nnx.List)
            return list(self.layers)
        graphdef, stacked = nnx.split(self.layers)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked)) for i in range(self.config.num_layers)]

    @property
    def dtype(self):
        return _dtype(self.config.dtype)

    def unembed_matrix(self) -> jax.Array:
        """[V, D] output projection in param dtype (the embedding table when tied)."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]

    def embed(self, input_ids_BxT):
        x = jnp.take(self.embed_tokens[...], input_ids_BxT, axis=0).astype(self.dtype)
        return constrain(x, ("batch", "seq", "act_embed"))

    def _cos_sin(self, positions_BxT):
        return rope_cos_sin(positions_BxT, rope_inv_freq(self.config), self.dtype)

    def logits_from_hidden(self, hidden_BxTxD):
        """fp32 logits; fp32 config: exactly hidden.astype(f32) @ unembed.astype(f32).T. With bf16 compute the
        matmul inputs are bf16 with fp32 accumulation."""
        w = self.unembed_matrix().astype(self.dtype)
        logits = jnp.einsum("btd,vd->btv", hidden_BxTxD.astype(self.dtype), w, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab"))

    # ------------------------------------------------------------------ full-sequence forward
    def hidden_states(self, input_ids_BxT, attention_mask=None, positions=None):
        """[B,T,D] in compute dtype, after the final norm. attention_mask: 1/0 per token, or segment ids (0 =
        padding, sequences packed into one row numbered 1, 2, ... in order): attention stays within a segment on
        every attention_impl and the default positions restart at each segment (default_positions)."""
        input_ids_BxT = jnp.asarray(input_ids_BxT)
        _check_ids(input_ids_BxT)
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids_BxT.shape, jnp.int32)
        attention_mask = jnp.asarray(attention_mask)
        _check_shape("attention_mask", attention_mask, input_ids_BxT.shape)
        if positions is None:
            positions = default_positions(attention_mask)
        positions = jnp.asarray(positions)
        _check_shape("positions", positions, input_ids_BxT.shape)
        cos, sin = self._cos_sin(positions)
        mask_BxTxT = attn_lib.causal_padding_mask(attention_mask)
        x = self.embed(input_ids_BxT)
        policy = self.config.remat_policy
        if self.config.scan_layers:
            graphdef, stacked = nnx.split(self.layers)

            def body(x, layer_state):
                return _block_forward(nnx.merge(graphdef, layer_state), x, cos, sin, mask_BxTxT, attention_mask)

            if policy != "none":
                body = jax.checkpoint(body, policy=_POLICIES[policy])
            x, _ = jax.lax.scan(lambda x, st: (body(x, st), None), x, stacked)
            return self.norm(x)
        fwd = _block_forward if policy == "none" else nnx.remat(_block_forward, policy=_POLICIES[policy])
        for block in self.layers:
            x = fwd(block, x, cos, sin, mask_BxTxT, attention_mask)
        return self.norm(x)

    def __call__(self, input_ids_BxT, attention_mask=None, positions=None):
        return self.logits_from_hidden(self.hidden_states(input_ids_BxT, attention_mask, positions))

    # ------------------------------------------------------------------ KV-cache decoding
    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> list:
        """Per layer {"k", "v"}: [B, max_len, Hkv, Dh] zeros (dtype defaults to the compute dtype)."""
        cfg = self.config
        dt = self.dtype if dtype is None else dtype
        shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        return [{"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)} for _ in range(cfg.num_layers)]

    def decode_step(self, input_ids_BxT, positions_BxT, cache, cache_index, kv_mask_BxS):
        """Run T new tokens against the cache. Writes their k/v to slots [cache_index, cache_index+T);
        query t (slot cache_index+t) attends to slots s <= cache_index+t with kv_mask_BxS[b, s] == 1.
        Returns (fp32 logits [B,T,V], new cache).

        When cache_index is a python int (e.g. the prefill call with 0), only the first cache_index+T slots
        can be visible, so attention is computed over those alone (T x T for a prefill, not T x S)."""
        input_ids_BxT = jnp.asarray(input_ids_BxT)
        _check_ids(input_ids_BxT)
        kv_mask_BxS = jnp.asarray(kv_mask_BxS)
        b, t = input_ids_BxT.shape
        if len(cache) != self.config.num_layers:
            raise ValueError(f"cache has {len(cache)} layers, the model has {self.config.num_layers}")
        s = cache[0]["k"].shape[1]
        _check_shape("cache[0]['k']", cache[0]["k"], (b, s, self.config.num_kv_heads, self.config.head_dim))
        _check_shape("positions", jnp.asarray(positions_BxT), (b, t))
        _check_shape("kv_mask", kv_mask_BxS, (b, s))
        if isinstance(cache_index, (int, np.integer)) and not 0 <= cache_index <= s - t:
            raise ValueError(f"cache_index={cache_index} with {t} new tokens does not fit a cache of {s} slots")
        static = isinstance(cache_index, (int, np.integer)) and not isinstance(cache_index, bool)
        n = min(int(cache_index) + t, s) if static else s
        mask_BxTxV = attn_lib.cache_mask(t, n, cache_index, kv_mask_BxS[:, :n])
        prefill_mask = kv_mask_BxS[:, :t] if static and int(cache_index) == 0 else None
        cos, sin = self._cos_sin(jnp.asarray(positions_BxT))
        x = self.embed(input_ids_BxT)
        new_cache = []
        for block, layer_cache in zip(self.blocks(), cache):
            x, layer_cache = block.decode(x, cos, sin, mask_BxTxV, layer_cache, cache_index, prefill_mask)
            new_cache.append(layer_cache)
        return self.logits_from_hidden(self.norm(x)), new_cache


def abstract_model(cfg: ModelConfig, mesh=None, rules=None) -> Transformer:
    """The model with every parameter a jax.ShapeDtypeStruct (carrying its NamedSharding on `mesh` when given):
    nothing is allocated, so any size can be traced and compiled ahead of time (e.g. for a TPU topology)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    if mesh is None:
        return abstract
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh, rules)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings)
    return nnx.merge(graphdef, state)


def init_model(cfg: ModelConfig, seed: int = 0, mesh=None, rules=None) -> Transformer:
    """Random init (normal(0, initializer_range) weights, unit norms, zero biases); sharded onto mesh if given."""
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, abs_state = nnx.split(abstract_model(cfg, mesh, rules))
    shardings = jax.tree.map(lambda a: a.sharding, abs_state)

    def make():
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(make, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
