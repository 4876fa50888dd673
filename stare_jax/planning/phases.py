"""The per-phase terms of `stare-jax plan`'s estimate (stare_jax.planning.estimate): the shape of one RL step
(sequence length, micro-batches, packing), the train step's and the sampler's bytes per device, the step's FLOPs,
and the per-phase peaks and the fit rule that stare_jax.training.aot shares. Closed-form counts, calibrated against
compiled programs where the comments say so."""

from __future__ import annotations

import dataclasses

import numpy as np

from stare_jax.models.paged_attention import PREFILL_KEY_BLOCK
from stare_jax.rl.packing import first_fit_decreasing
from stare_jax.sampling import quarter_octave_bucket

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

HEADROOM = 0.10  # a config fits when every phase's peak is <= 90% of HBM (the estimate here, compiled: aot)


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """The assumed length distribution of a step's sequences (the estimate cannot know the policy's): responses
    lognormal with `response_median` (None: max_new_tokens / 8) and `response_sigma`, clipped to [1, max_new_tokens],
    each after a prompt of `prompt_tokens` (None: data.max_prompt_len / 4)."""

    response_median: float | None = None
    response_sigma: float = 1.0
    prompt_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one RL step computes on a device: `seq_len` tokens per sequence (prompt + response), `train_seqs`
    sequences per step, micro-batches of `mb_seqs` rows of `mb_len` tokens per device; `packing` is
    `expected_packing`'s layout (None without rl.packing)."""

    seq_len: int
    train_seqs: int
    mb_seqs: int
    mb_len: int
    packing: dict | None


def training_activation_bytes(model_cfg, seqs: float, seq_len: int, *, tensor: int = 1) -> float:
    """Bytes of activations live during forward+backward of `seqs` sequences on one device (one micro-batch).

    remat 'full': each layer keeps only its input; one layer's working set is rebuilt at a time.
    'none': every layer keeps its intermediates. 'dots*': matmul outputs are kept, elementwise ones rebuilt.
    Attention scores [H, T, T] in fp32 appear only for the 'xla' attention implementation."""
    b = _BYTES[model_cfg.dtype]
    d, i, L = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_layers
    h, kv, dh = model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim
    tok = seqs * seq_len
    # per layer: 2 norms + 2 residual adds + o-proj out (6d); q,k,v, rotated q,k and attention out (3h+3kv)dh;
    # gate, up, silu(gate), product (4i)
    per_layer_all = tok * (6 * d + (3 * h + 3 * kv) * dh / tensor + 4 * i / tensor) * b
    per_layer_dots = tok * (d + (2 * h + 2 * kv) * dh / tensor + 2 * i / tensor) * b
    # scores, exp and probabilities in fp32 for the reference attention
    scores = seqs * (h / tensor) * seq_len * seq_len * 4 * 3 if model_cfg.attention_impl == "xla" else 0.0
    policy = model_cfg.remat_policy
    if policy == "full":  # saved layer inputs + one layer's working set, recomputed and differentiated (the TPU
        # peaks of the paper configs, 2026-12-06: counting that set twice over-counted their train steps by 10-48%)
        return L * tok * d * b + per_layer_all + scores
    if policy.startswith("dots"):
        return L * per_layer_dots + per_layer_all + scores
    return L * (per_layer_all + scores)


def expected_packing(
    cfg, lengths: LengthModel = LengthModel(), *, shards: int = 1, draws: int = 8, seed: int = 0
) -> dict:
    """The packed layout of one step under `lengths`: each mini-batch's sequences packed first-fit-decreasing into
    rows of rl.packing.row_tokens (0: the padded length), averaged over `draws` random batches: fill rate (real
    tokens / rows' tokens), rows per step, rows computed (whole micro-batches of rl.micro_batch_tokens //
    row_tokens rows per device x `shards`: a micro-batch that runs computes all its rows), real and padded tokens
    per step."""
    rl = cfg.rl
    max_new = cfg.sampling.max_new_tokens
    seq_len = cfg.data.max_prompt_len + max_new
    row = rl.packing.row_tokens or seq_len
    median = lengths.response_median or max_new / 8
    prompt = lengths.prompt_tokens if lengths.prompt_tokens is not None else max(1, cfg.data.max_prompt_len // 4)
    B = rl.train_batch_size * rl.group_size
    mini = B // rl.mini_batches
    per_micro = max(1, rl.micro_batch_tokens // row) * shards
    rng = np.random.default_rng(seed)
    rows = computed = real = 0
    for _ in range(draws):
        resp = np.clip(np.round(rng.lognormal(np.log(median), lengths.response_sigma, size=B)), 1, max_new)
        n = (resp + prompt).astype(int)
        used = [len(first_fit_decreasing(n[j * mini : (j + 1) * mini], row)) for j in range(rl.mini_batches)]
        rows += sum(used)
        computed += sum(-(-u // per_micro) * per_micro for u in used)
        real += int(n.sum())
    return {
        "row_tokens": row,
        "response_median": float(median),
        "response_sigma": lengths.response_sigma,
        "prompt_tokens": prompt,
        "rows_per_step": rows / draws,
        "rows_computed_per_step": computed / draws,
        "real_tokens_per_step": real / draws,
        "padded_tokens_per_step": B * seq_len,
        "fill_rate": real / (rows * row),
        "padded_fill_rate": real / draws / (B * seq_len),
    }


def step_shape(cfg, model_cfg, data_shards: int, lengths: LengthModel) -> StepShape:
    """The step's sequence length and micro-batches per device. rl.packing: micro_batch_tokens // row_tokens rows
    (at least one); rl.micro_batch_tokens without packing: micro_batch_tokens // the padded length sequences (the
    longest bucket); else rl.micro_batch_size. A ValueError when the sequence exceeds the model's context or the
    step's sequences do not split into micro-batches over the data shards."""
    seq_len = cfg.data.max_prompt_len + cfg.sampling.max_new_tokens
    if seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"prompt {cfg.data.max_prompt_len} + response {cfg.sampling.max_new_tokens} = {seq_len} tokens "
            f"exceeds the model's context ({model_cfg.max_position_embeddings})"
        )
    train_seqs = cfg.rl.train_batch_size * cfg.rl.group_size
    if train_seqs % (cfg.rl.micro_batch_size * data_shards):
        raise ValueError(
            f"{train_seqs} training sequences (rl.train_batch_size x rl.group_size) do not split into "
            f"micro-batches of rl.micro_batch_size={cfg.rl.micro_batch_size} on each of {data_shards} data shards"
        )
    mb_seqs = cfg.rl.micro_batch_size
    mb_len = seq_len  # tokens per row of a micro-batch
    packing = expected_packing(cfg, lengths, shards=data_shards) if cfg.rl.packing.enabled else None
    if packing is not None:
        mb_len = packing["row_tokens"]
        mb_seqs = max(1, cfg.rl.micro_batch_tokens // mb_len)
    elif cfg.rl.micro_batch_tokens:
        mb_seqs = max(1, cfg.rl.micro_batch_tokens // seq_len)
    return StepShape(seq_len, train_seqs, mb_seqs, mb_len, packing)


def train_memory(cfg, model_cfg, num_params: int, mesh: dict, shape: StepShape) -> dict[str, float]:
    """Bytes per device of the train step: sharded params, gradients and AdamW moments, the gathered layer
    weights, one micro-batch's activations and log-prob chunks, the vocab tables (+ the frozen reference policy
    with rl.kl; with LoRA only the adapters are trained: gradients, moments and the reference are theirs).

    Calibrated against the compiled train step (stare-jax plan --compile, its peak_memory_in_bytes; BUILD.md): the
    micro-batch scan holds the gradient accumulator and one micro-batch's gradient; the log-prob pass gathers the
    unembedding in fp32 beside a bf16 copy of a vocab table (the Qwen3-8B step's buffer report, fsdp 64).
    Layer weights in the compute dtype: with FSDP two layers' gathered weights at a time; without it (fsdp 1)
    XLA hoists the cast of every layer's (tensor-sharded) weights out of the micro-batch loop and keeps them all
    for the step (the 7B tool config's buffer report: bf16 [28, ...] stacks, 3.0 GiB per chip)."""
    P = num_params
    shard, tensor = mesh["fsdp"] * mesh["tensor"], mesh["tensor"]
    pb, cb = _BYTES[model_cfg.param_dtype], _BYTES[model_cfg.dtype]
    d, L, V = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.vocab_size
    layer_params = (P - V * d * (1 if model_cfg.tie_word_embeddings else 2)) / L
    cast_layers = L if mesh["fsdp"] == 1 and pb != cb else 2
    # LoRA (model.lora): the frozen base in param dtype plus float32 adapters; gradients, moments and a KL
    # reference ('initial') cover the adapters alone
    lora = model_cfg.num_lora_params() if model_cfg.lora_rank else 0
    trained_bytes = lora * 4 if lora else P * pb
    mem = {
        "params": ((P - lora) * pb + lora * 4) / shard,
        "grads": 2 * trained_bytes / shard,
        "optimizer": 2 * (lora or P) * 4 / shard,
        "gathered_layer_weights": cast_layers * layer_params * cb / tensor,
        "activations": training_activation_bytes(model_cfg, shape.mb_seqs, shape.mb_len, tensor=tensor),
        "logits_chunks": shape.mb_seqs * min(cfg.rl.logprob_chunk_size, shape.mb_len) * (V / tensor) * 4 * 3,
        "vocab_tables": V * d * (4 + cb) / tensor,
    }
    if cfg.rl.kl.enabled:  # the frozen reference policy: the policy's parameters and shardings, no optimizer state
        mem["reference_params"] = trained_bytes / shard
    return mem


def engine_sampling_memory(
    cfg, model_cfg, num_params: int, mesh: dict, data_shards: int, seq_len: int, engine_cfg
) -> dict[str, float]:
    """Bytes per device of the rollout engine's sampling phase.

    Each data shard's page pool (allocated once: sampling.engine.num_pages / dp, or auto-sized for its
    max_slots / dp requests) on its devices, kv heads split over the tensor axis where it divides them;
    one layer's gathered pages of the shard's slots (the prefill's, and the decode step's on the gather path:
    sampling.engine.attention=pallas decodes without gathering, the prefill gathers either way; the layout of
    the pool, [K, N, P, Dh], does not change its bytes); per prefill call one layer's fp32
    attention logits and probabilities of a prefill chunk per slot over the longest request, or over one
    key block where the context is longer than two (attention_kv_major_blocked: over the whole 9k context
    they were 15.9 GiB per chip for the 7B tool configs)."""
    tensor, dp, ec = mesh["tensor"], data_shards, engine_cfg
    cb, kvb = _BYTES[model_cfg.dtype], _BYTES[cfg.sampling.kv_cache_dtype]
    L, V, kv_heads, dh = model_cfg.num_layers, model_cfg.vocab_size, model_cfg.num_kv_heads, model_cfg.head_dim
    slots = -(-ec.max_slots // dp)
    pool_pages = (
        -(-ec.num_pages // dp) if ec.num_pages else dataclasses.replace(ec, max_slots=slots).pool_pages(seq_len)
    )
    heads_dev = kv_heads / tensor if kv_heads % tensor == 0 else kv_heads
    # the prefill's scores over a long context are one key block wide (attention_kv_major_blocked), but the
    # compiled sampling programs of the 4k-8k configs hold more than the modelled terms (Math-7B, 32B: 15% and 12%
    # under an estimate with one block), so the term keeps the one-pass size up to 8 blocks (calibration)
    prefill_keys = min(seq_len, 8 * PREFILL_KEY_BLOCK)
    return {
        "sampler_weights": num_params * cb / tensor,
        "kv_page_pool": 2 * L * pool_pages * ec.page_size * heads_dev * dh * kvb,
        "kv_gathered_pages": 2 * slots * seq_len * heads_dev * dh * cb,
        "sampler_logits": slots * (V / tensor) * 4 * 2,
        "prefill_attention_scores": 2
        * slots
        * ec.prefill_width(seq_len)
        * prefill_keys
        * model_cfg.num_heads
        / tensor
        * 4,
    }


def static_sampling_memory(
    cfg, model_cfg, num_params: int, mesh: dict, data_shards: int, seq_len: int
) -> dict[str, float]:
    """Bytes per device of the static sampler's sampling phase: one sampler call holds
    sampling.max_prompts_per_call prompts (0: the whole generation batch), padded as the sampler pads them
    (Sampler.batch_bucket), G sequences each, with a dense KV cache."""
    tensor, dp = mesh["tensor"], data_shards
    cb, kvb = _BYTES[model_cfg.dtype], _BYTES[cfg.sampling.kv_cache_dtype]
    L, V, kv_heads, dh = model_cfg.num_layers, model_cfg.vocab_size, model_cfg.num_kv_heads, model_cfg.head_dim
    call_prompts = min(cfg.rl.gen_batch_size, cfg.sampling.max_prompts_per_call or cfg.rl.gen_batch_size)
    padded = -(-quarter_octave_bucket(call_prompts) // dp) * dp
    gen_seqs_dev = padded * cfg.rl.group_size / dp
    return {
        "sampler_weights": num_params * cb / tensor,
        "kv_cache": 2 * L * gen_seqs_dev * seq_len * kv_heads * dh * kvb / min(tensor, kv_heads),
        "sampler_logits": gen_seqs_dev * (V / tensor) * 4 * 2,
    }


def step_flops(cfg, model_cfg, num_params: int, shape: StepShape) -> dict[str, float]:
    """FLOPs of one RL step: generation, the old-policy (+ reference) log-prob pass and the train step's
    forward/backward (with remat 'full' the forward once more). Packed rows attend within a row of mb_len tokens
    (the whole causal row: segments are masked, not skipped)."""
    P, L, seq_len, mb_len = num_params, model_cfg.num_layers, shape.seq_len, shape.mb_len
    train_tokens = shape.packing["rows_computed_per_step"] * mb_len if shape.packing else shape.train_seqs * seq_len
    gen_tokens = cfg.rl.gen_batch_size * cfg.rl.group_size * seq_len
    attn_per_len = 4 * L * model_cfg.num_heads * model_cfg.head_dim / 2  # causal, per token per context token
    attn, train_attn = attn_per_len * seq_len, attn_per_len * mb_len
    recompute = 2 if model_cfg.remat_policy == "full" else 0
    return {
        "generation": gen_tokens * (2 * P + attn),
        "old_logprob_pass": train_tokens * (2 * P + train_attn) * (2 if cfg.rl.kl.enabled else 1),  # + reference
        "train_fwd_bwd": cfg.rl.ppo_epochs * train_tokens * ((6 + recompute) * P + 3 * train_attn),
    }


def fits_hbm(peak_bytes: float, hbm_bytes: float) -> bool:
    """Whether a per-device peak leaves HEADROOM of the device's HBM free: the one fit rule of the plan and aot."""
    return bool(peak_bytes <= (1 - HEADROOM) * hbm_bytes)


def phase_peaks(plan: dict) -> dict[str, float]:
    """Per-phase peak bytes per device of an `estimate` result, as stare_jax.training.aot defines the phases: sampling =
    the sampler's buffers + the params and AdamW moments that stay resident; training = the train step. With
    rl.offload.optimizer the moments are in host memory while sampling and through the train step's micro-batch
    loop; they come in for the update only, which then holds the params, the gradients and the moments (counted
    in full: the compiled 7B tool step is 33.2 GiB offloaded vs 48.1 not, the 14.2 GiB of moments)."""
    mem = plan["memory_bytes"]
    opt = mem["train/optimizer"]
    ref = mem.get("train/reference_params", 0.0)
    off = plan.get("offload_optimizer", False)
    train = sum(v for k, v in mem.items() if k.startswith("train/"))
    if off:
        update = mem["train/params"] + mem["train/grads"] + opt + ref
        train = max(train - opt, update)
    return {
        "sampling": mem["train/params"]
        + (0.0 if off else opt)
        + ref
        + sum(v for k, v in mem.items() if k.startswith("sample/")),
        "training": train,
    }
