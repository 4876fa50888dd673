"""The RL train step: ONE pure function (train_state, batch, stare_state) -> (train_state, stare_state, metrics),
compiled with jax.jit, in/out shardings on a Mesh (Auto axes), train state donated.

Batch layout (a dict of arrays, leading axis B = responses):
- input_ids_BxT      int   [B, L]  prompt + response tokens (any padding, left or right).
- attention_mask_BxT int   [B, L]  1 = real token, 0 = padding.
- response_mask_BxT  int   [B, L]  ALIGNED WITH input_ids: 1 where input_ids[b, t] is a response token whose
                                   log-prob counts in the loss (0 on prompt and padding).
- advantages_B       float [B]     trajectory advantage (grpo_advantages, flattened in batch order).
- rollout_logprobs_BxT float [B, L] (only with rl.rollout_correction.rollout_log_probs) ALIGNED WITH input_ids: the
                                   sampler's log-prob of input_ids[b, t] where it sampled it (0 elsewhere).
- rewards_B          float [B]     (only with rl.kl.use_as "reward") each response's shaped reward; the step adds the
                                   KL penalty per token and recomputes the GRPO advantage over contiguous groups of
                                   group_size responses (advantages_B is then not used).
Shift: the model's hidden state at position t predicts input_ids[t + 1], so every per-token array the step
computes (log-probs, entropy, omega) has shape [B, L - 1] with index t meaning "the token input_ids[:, t + 1]",
and its loss mask is response_mask[:, 1:] * attention_mask[:, 1:].
With cfg.packing (rl.packing) the batch is the packed layout instead (stare_jax.rl.packing.PACKED_KEYS: rows of
whole sequences told apart by segment ids); the model runs on the rows and every per-token array above is its
per-sequence view [B, Lr - 1], so steps 2-6 below are the same code on the same tokens. The layout is the one
object that differs (PaddedLayout here, packing.PackedLayout): its no-grad pass and its micro-batches. rl.kl's
reference forward runs in that same no-grad pass (on the packed rows: segment ids, per-segment positions), so its
log-probs are read back per sequence like the policy's and the KL term / KL-in-reward sums are the padded ones.
cfg.micro_batch_tokens sizes micro-batches by tokens per device (packed rows, or sequences of the batch's length
bucket); cfg.offload.optimizer keeps the AdamW moments in host memory between updates.

Data flow (docs/stare.md, "The closed-loop gate"):
 1. no-grad forward over the whole batch (micro-batched with lax.map): old log-probs and per-token entropy;
 2. batch entropy H_bar -> update_controller (gate, W, M);
 3. selection sets / omega from that pass (scope batch);
 4. for each of ppo_epochs x num_mini_batches updates (mini-batches contiguous, in batch order): lax.scan over
    num_micro_batches micro-batches, forward + backward with the mini-batch's global normaliser (so gradient
    accumulation is exactly the full-mini-batch gradient), then one optax update. With scope micro_batch, omega is
    recomputed inside each micro-batch from the current policy's log-probs (and, for sample/token gates, its
    entropies); the batch gate still comes from the controller.
 5. The loss is cfg.policy_loss (stare_jax.rl.losses.compute_policy_loss; "vanilla" + STARE's omega is the GRPO-ds /
    STARE path, computed exactly as before when no other loss, entropy bonus or token filter is set), plus
    -entropy_coeff * agg(entropy); the 80/20 filter multiplies omega by the global top-rho entropy mask of pass 1.
    Outside that path, as verl's dp_actor, a single update per batch (on-policy) uses old = stop_gradient(lp).
    clip_cov's key: fold_in(fold_in(key(seed), step), update * num_micro_batches + micro-batch).
 KL to a frozen reference (cfg.kl, verl's use_kl_loss / use_kl_in_reward): the step takes the reference parameters
    as a fourth argument (sharded like the policy's, never updated, not part of the train state or its checkpoint);
    pass 1 runs the reference forward beside the policy's (no grad) for its per-token log-probs. use_as "loss": loss
    += coef * agg(kl(lp, ref_lp)) with cfg.loss_agg (gradient through lp); use_as "reward": before step 2, the
    advantage becomes grpo(rewards_B - coef * sum_t kl(old_lp, ref_lp)). metrics["kl"]: the token-mean of the
    estimator on pass 1's log-probs.
 Rollout correction (cfg.rollout_correction, stare_jax.rl.rollout_correction; verl's decoupled mode), right after
    step 1 with the batch's sampler log-probs: the mismatch diagnostics (rollout_corr/*: all response tokens, STARE's
    high-surprisal set pos_high | neg_high and the rest); rejection (rollout_rs) removes tokens from the loss mask
    before everything that reads it (KL, controller entropy, selection, loss and its normaliser); IS weights
    (rollout_is, from the unrejected mask) multiply the per-token loss inside the policy loss, where omega does
    (after clipping); omega keeps weighting the same clipped term, so the two multiply. With
    rl.stare.surprisal_source "rollout" the selection ranks the sampler's log-probs instead of the trainer's.
 EntroAdv (cfg.advantage.entropy_adv): after step 3, the loss sees the token-level advantage A + min(alpha sg(H),
    |A| / kappa) with H from pass 1 (not combined with STARE).
 6. A non-finite loss or gradient norm skips that update (params and optimizer state unchanged) and is counted in
    metrics["skipped_updates"].

Code map: build_step_fn fixes a StepStatics (the config, its step_loss.LossPlan, the model graph, the optimizer) and
returns a step that runs _train_step: steps 1-3 (_no_grad_pass, _kl_terms, _select_tokens), then a lax.scan of
_one_update (step 4: accumulate_gradients over step_loss.micro_batch_loss (step 5), then guarded_update (step 6)).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from stare_jax.config.advantage import AdvantageConfig
from stare_jax.config.kl import KLConfig
from stare_jax.config.offload import OffloadConfig
from stare_jax.config.optimizer import OptimizerConfig
from stare_jax.config.packing import PackingConfig
from stare_jax.config.policy_loss import PolicyLossConfig, TokenFilterConfig
from stare_jax.config.rollout_correction import RolloutCorrectionConfig
from stare_jax.models.sharding import BATCH_AXES, DEFAULT_RULES, batch_sharding, program_context
from stare_jax.models.transformer import LoRAParam
from stare_jax.rl.advantages import entropy_advantage, grpo_advantages
from stare_jax.rl.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs_and_entropy
from stare_jax.rl.loss_terms import high_entropy_mask, kl_penalty, kl_reward_penalty
from stare_jax.rl.losses import AGG_MODES, clip_cov_key
from stare_jax.rl.packing import (
    PACKED_KEYS,
    PACKED_ROLLOUT_LOGPROBS_KEY,
    PADDED_ROLLOUT_LOGPROBS_KEY,
    PackedLayout,
    padded_micro_batches,
    split_micro,
)
from stare_jax.rl.rollout_correction import is_weights, offpolicy_metrics, rejection_mask
from stare_jax.rl.stare import StareConfig, StareState, stare_omega, update_controller
from stare_jax.rl.step_loss import (
    LossNormalizers,
    LossPlan,
    SequenceArrays,
    loss_normalizers,
    loss_plan,
    micro_batch_loss,
    update_metric_names,
)
from stare_jax.rl.theory import batch_entropy_terms

BATCH_KEYS = ("input_ids_BxT", "attention_mask_BxT", "response_mask_BxT", "advantages_B")
REWARDS_KEY = "rewards_B"  # read by the step only with rl.kl.use_as "reward" (batch_keys)
ROLLOUT_LOGPROBS_KEY = PADDED_ROLLOUT_LOGPROBS_KEY  # read only with rollout_correction.rollout_log_probs (batch_keys)
HIGH_SURPRISAL_SETS = ("pos_high", "neg_high")  # STARE's high-surprisal tokens: the mismatch diagnostics' subset


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
    """Everything the compiled step depends on (static)."""

    optimizer: OptimizerConfig = OptimizerConfig()
    stare: StareConfig = StareConfig()
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 10.0
    loss_agg: str = "token-mean"
    loss_agg_constant: float | None = None  # seq-mean-token-sum-norm divisor; None -> L - 1
    num_micro_batches: int = 1
    num_mini_batches: int = 1
    ppo_epochs: int = 1
    logprob_chunk_size: int = DEFAULT_CHUNK_SIZE
    debug_outputs: bool = False  # metrics["debug/..."]: omega, old log-probs, entropy, last update's grads
    policy_loss: PolicyLossConfig = PolicyLossConfig()  # the loss (compute_policy_loss name + options)
    entropy_coeff: float = 0.0  # entropy bonus: loss -= entropy_coeff * agg(entropy) (verl)
    token_filter: TokenFilterConfig = TokenFilterConfig()  # the 80/20 rule
    seed: int = 0  # clip_cov's random choice: key fold_in(fold_in(key(seed), step), update * micro-batches + micro)
    kl: KLConfig = KLConfig()  # frozen reference policy + KL penalty (the step then takes ref_params)
    advantage: AdvantageConfig = AdvantageConfig()  # EntroAdv's token-level term (the estimator is host-side)
    group_size: int = 1  # responses per prompt (contiguous in the batch): the KL-in-reward GRPO advantage's groups
    norm_adv_by_std: bool = True  # the KL-in-reward GRPO advantage
    # batch layout (stare_jax.rl.packing): packed rows instead of one padded row per sequence, and micro-batches
    # sized by tokens per device (0: num_micro_batches); with packing, rows per micro-batch = tokens // row length
    packing: PackingConfig = PackingConfig()
    micro_batch_tokens: int = 0
    offload: OffloadConfig = OffloadConfig()  # optimizer state in host memory between updates
    # the sampler's log-probs in the batch, mismatch diagnostics, IS weights / rejection; a bare step takes none
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig(rollout_log_probs=False)

    def __post_init__(self):
        if self.loss_agg not in AGG_MODES:
            raise ValueError(f"loss_agg={self.loss_agg!r} unknown; accepted values: {list(AGG_MODES)}")
        for name in ("num_micro_batches", "num_mini_batches", "ppo_epochs", "logprob_chunk_size", "group_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0 = num_micro_batches)")
        if self.packing.enabled:
            # packed micro-batches hold as many sequences as fit their tokens: a selection ranked per micro-batch
            # group of sequences would rank other groups than the padded layout's
            grouped = [
                k
                for k, on in (
                    ("rl.stare.scope = 'micro_batch'", self.stare.enabled and self.stare.scope == "micro_batch"),
                    (
                        "rl.policy_loss.scope = 'micro_batch'",
                        self.policy_loss.name in ("clip_cov", "kl_cov") and self.policy_loss.scope == "micro_batch",
                    ),
                )
                if on
            ]
            if grouped:
                raise ValueError(
                    f"rl.packing.enabled cannot be combined with {grouped[0]}: packed micro-batches "
                    f"are sized by tokens, not by sequences (use scope 'batch')"
                )
            if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_agg_constant is None:
                raise ValueError(
                    "rl.packing.enabled with loss_agg seq-mean-token-sum-norm needs loss_agg_constant "
                    "(the padded layout's default, L - 1, is not a packed row's length)"
                )
        if self.advantage.entropy_adv and self.stare.enabled:
            raise ValueError("advantage.entropy_adv is not combined with STARE (stare.enabled)")
        if self.stare.surprisal_source == "rollout" and not (
            self.rollout_correction.rollout_log_probs and self.stare.scope == "batch"
        ):
            raise ValueError(
                "rl.stare.surprisal_source = 'rollout' needs rl.rollout_correction.rollout_log_probs and "
                "rl.stare.scope = 'batch'"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """params: the trained state of split_model(model) (every nnx.Param, or the LoRA adapters); rest: the other
    model state (empty, or the frozen base weights of a LoRA run);
    opt_state: optax state; step: int32 count of train-step calls."""

    params: Any
    rest: Any
    opt_state: Any
    step: Any  # int32 scalar array (a ShapeDtypeStruct in an abstract state)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """optax chain of cfg: global-norm clipping (when grad_clip > 0), then AdamW on cfg.schedule (counted in
    optimizer updates)."""
    if cfg.schedule == "cosine":
        if not cfg.total_steps:
            raise ValueError("optimizer schedule='cosine' needs optimizer.total_steps (the run fills it in)")
        lr = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps)
    elif cfg.warmup_steps or cfg.schedule == "linear":
        lr = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    else:
        lr = optax.constant_schedule(cfg.lr)
    chain = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(cfg.grad_clip))
    chain.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*chain)


def trainable(model: nnx.Module):
    """The nnx filter of what the step trains: the LoRA adapters when the model has them (ModelConfig.lora_rank >
    0: the base weights are then frozen - no gradient, no optimizer state - and ride in TrainState.rest), else
    every nnx.Param."""
    return LoRAParam if getattr(getattr(model, "config", None), "lora_rank", 0) else nnx.Param


def split_model(model: nnx.Module):
    """(graphdef, params, rest): params = what the step trains (`trainable`), rest = everything else."""
    return nnx.split(model, trainable(model), ...)


def _mesh_of(tree):
    """The Mesh of the first NamedSharding leaf of `tree` (arrays or ShapeDtypeStructs), else None."""
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding):
            return sh.mesh
    return None


HOST = "pinned_host"  # the memory kind of offloaded state (rl.offload)


def opt_state_shardings(tx: optax.GradientTransformation, params, memory_kind: str | None = None):
    """Sharding of each optimizer-state leaf: a leaf that mirrors a parameter (Adam's mu and nu) takes that
    parameter's sharding, every other leaf (step counts) is replicated; all in `memory_kind` (None: device
    memory). None when params are not on a mesh.

    Without this, jax.jit(tx.init) returns the moments replicated on every device: 2 fp32 copies of the whole
    model per chip (57.6 GiB per chip for the 7B run on v5p-64 instead of 2.7)."""
    mesh = _mesh_of(params)
    if mesh is None:
        return None
    rep = NamedSharding(mesh, P(), memory_kind=memory_kind)
    param_sh = jax.tree.map(
        lambda x: (
            NamedSharding(mesh, x.sharding.spec, memory_kind=memory_kind)
            if isinstance(getattr(x, "sharding", None), NamedSharding)
            else rep
        ),
        params,
    )
    return optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_sh, transform_non_params=lambda _: rep
    )


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def init_train_state(model: nnx.Module, cfg: TrainStepConfig):
    """(graphdef, TrainState) from a (possibly mesh-sharded) model; optimizer state sharded like the params.

    `model` may be abstract (nnx.eval_shape, leaves jax.ShapeDtypeStruct with shardings): the TrainState is then
    abstract too, with the same shardings a real one gets - what the ahead-of-time compile (stare_jax.training.aot)
    lowers
    the step with, without allocating anything."""
    graphdef, params, rest = split_model(model)
    tx = make_optimizer(cfg.optimizer)
    shardings = opt_state_shardings(tx, params, HOST if cfg.offload.optimizer else None)
    step: Any
    if _is_abstract(params):
        abstract = jax.eval_shape(tx.init, params)
        opt_state = (
            abstract
            if shardings is None
            else jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        )
        mesh = _mesh_of(params)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()) if mesh is not None else None)
    else:
        opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
        if cfg.offload.optimizer and shardings is None:  # one device: its host memory
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        step = jnp.zeros((), jnp.int32)
    return graphdef, TrainState(params=params, rest=rest, opt_state=opt_state, step=step)


# ---------------------------------------------------------------------------------------------------------------
# Pure pieces (usable on their own, e.g. by tests and the trainer's logging)


def shift_batch(batch):
    """(input_ids, attention_mask, targets [B, L-1], loss_mask [B, L-1], advantages) from the batch dict."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"train batch is missing keys {missing}; expected {list(BATCH_KEYS)}")
    ids = jnp.asarray(batch["input_ids_BxT"], jnp.int32)
    attn = jnp.asarray(batch["attention_mask_BxT"], jnp.int32)
    resp = jnp.asarray(batch["response_mask_BxT"])
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids_BxT must be [B, L] with L >= 2, got {ids.shape}")
    for k in ("attention_mask_BxT", "response_mask_BxT"):
        if jnp.shape(batch[k]) != ids.shape:
            raise ValueError(f"{k} must have shape {ids.shape}, got {jnp.shape(batch[k])}")
    if jnp.shape(batch["advantages_B"]) != ids.shape[:1]:
        raise ValueError(f"advantages_B must have shape {ids.shape[:1]}, got {jnp.shape(batch['advantages_B'])}")
    loss_mask = ((resp[:, 1:] > 0) & (attn[:, 1:] > 0)).astype(jnp.float32)
    return ids, attn, ids[:, 1:], loss_mask, jnp.asarray(batch["advantages_B"], jnp.float32)


def policy_forward(graphdef, params, rest, ids, attn, targets, loss_mask, *, chunk_size, theory=False):
    """Per-token log-probs and entropies [b, L-1] of `targets` under the model (chunked, no [B,T,V] logits)."""
    model = nnx.merge(graphdef, params, rest)
    hidden = model.hidden_states(ids, attention_mask=attn)
    return token_logprobs_and_entropy(
        hidden[:, :-1], model.unembed_matrix(), targets, loss_mask, chunk_size=chunk_size, theory=theory
    )


_split_micro = split_micro


@dataclasses.dataclass
class PaddedLayout:
    """The padded batch (one row per sequence) inside the step, with the interface of packing.PackedLayout."""

    ids: jax.Array
    attn: jax.Array
    tgt: jax.Array
    lm: jax.Array
    adv: jax.Array
    n_mini: int
    micro: int  # micro-batches per mini-batch
    mesh: Any
    batch_axes: tuple

    @property
    def num_sequences(self) -> int:
        return self.ids.shape[0]

    def loss_mask(self):
        return self.lm

    def no_grad_pass(self, forward: Callable):
        """forward(ids, attn, tgt, lm) over the whole batch, micro-batched (B / (n_mini * micro) at a time)."""
        xs = tuple(
            _split_micro(a, self.n_mini * self.micro, self.mesh, self.batch_axes)
            for a in (self.ids, self.attn, self.tgt, self.lm)
        )
        outs = jax.lax.map(lambda x: forward(*x), xs)
        return jax.tree.map(lambda o: o.reshape((self.num_sequences,) + o.shape[2:]), outs)

    def micro_batches(self, j, mb_seq: tuple):
        """(xs, None, micro_fn): mini-batch j's rows and its per-sequence arrays mb_seq, split into micro-batches;
        micro_fn(forward, x) -> (log-probs, entropy, the micro-batch's per-sequence arrays)."""
        mini = self.num_sequences // self.n_mini
        rows = tuple(jax.lax.dynamic_slice_in_dim(a, j * mini, mini, axis=0) for a in (self.ids, self.attn, self.tgt))
        xs = tuple(
            None if a is None else _split_micro(a, self.micro, self.mesh, self.batch_axes) for a in rows + tuple(mb_seq)
        )

        def micro_fn(forward, x):
            lp, ent = forward(x[0], x[1], x[2], x[3])
            return lp, ent, x[3:]

        return xs, None, micro_fn


def _masked_mean(x, m):
    return jnp.sum(jnp.where(m > 0, x, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def accumulate_gradients(loss_and_grad: Callable, params, scan_xs: dict, zeros_aux):
    """(gradient, loss, aux) summed over micro-batches: a lax.scan over scan_xs' leading axis calling
    loss_and_grad(xs) -> ((loss, aux), gradient) on each (gradient accumulation: with every micro-batch's loss
    normalised by the whole batch's count, the sums are the whole batch's loss and gradient, one micro-batch's
    activations alive at a time). A micro-batch whose xs["run"] is False is skipped (zeros: an empty packed one)."""
    zeros_g = jax.tree.map(jnp.zeros_like, params)

    def acc(c, xs):
        g_sum, l_sum, a_sum = c
        if "run" in xs:
            (loss, aux), g = jax.lax.cond(
                xs["run"], lambda: loss_and_grad(xs), lambda: ((jnp.float32(0.0), zeros_aux), zeros_g)
            )
        else:
            (loss, aux), g = loss_and_grad(xs)
        return (jax.tree.map(jnp.add, g_sum, g), l_sum + loss, jax.tree.map(jnp.add, a_sum, aux)), None

    (grads, loss, aux), _ = jax.lax.scan(acc, (zeros_g, jnp.float32(0.0), zeros_aux), scan_xs)
    return grads, loss, aux


def guarded_update(tx: optax.GradientTransformation, grads, loss, params, opt_state, *, offload: bool = False):
    """(new params, new optimizer state, gradient norm, finite): one optax update, skipped (params and optimizer
    state unchanged) when the loss or the gradient norm is not finite.

    offload (rl.offload.optimizer): the optimizer state lives in host memory and comes in for the update only. The
    transfer sits inside a lax.cond on `finite`, so it cannot start before the gradients exist: a plain device_put
    of a host argument is an async copy XLA starts at the top of the program, and the moments then sat in device
    memory through the whole micro-batch loop (7B tool step on v5p-8: 37.5 GiB per chip offloaded that way, 33.2
    with the cond, 48.1 not offloaded; benchmarks/aot_layouts.py). The cond's update equals the masked one below
    to rounding (XLA fuses the two programs differently: ~1 ulp)."""
    gnorm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    if offload:

        def apply(_):
            updates, new_opt = tx.update(grads, jax.device_put(opt_state, jax.memory.Space.Device), params)
            return optax.apply_updates(params, updates), jax.device_put(new_opt, jax.memory.Space.Host)

        new_p, new_opt = jax.lax.cond(finite, apply, lambda _: (params, opt_state), None)
        return new_p, new_opt, gnorm, finite
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt = tx.update(safe_grads, opt_state, params)
    new_p = optax.apply_updates(params, updates)
    new_p = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_p, params)
    new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt_state)
    return new_p, new_opt, gnorm, finite


# ---------------------------------------------------------------------------------------------------------------
# The step: stages over its StepStatics (the static config, its LossPlan, the model graph, the optimizer)


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """What build_step_fn fixes for every call of the step: nothing in it is traced."""

    graphdef: Any
    cfg: TrainStepConfig
    plan: LossPlan
    tx: optax.GradientTransformation
    mesh: Any
    batch_axes: tuple


class NoGradPass(NamedTuple):
    """Step 1's outputs over the whole batch, per sequence [B, T] (no gradient)."""

    old_logprobs_BxT: jax.Array
    entropy_BxT: jax.Array
    theory: dict | None  # {phi, s_star} [B, T] with stare.theory_diagnostics, else None
    ref_logprobs_BxT: jax.Array | None  # the frozen reference's log-probs with rl.kl, else None


class RolloutCorrection(NamedTuple):
    """The rollout correction stage's outputs (right after step 1)."""

    rollout_logprobs_BxT: jax.Array | None  # the sampler's log-probs (per-sequence view), None without them
    loss_mask_BxT: jax.Array  # the loss mask with rejected tokens (rollout_rs) removed
    is_weights_BxT: jax.Array | None  # truncated IS weights (rollout_is), else None
    metrics: dict  # rollout_corr/* (verl's names)


class TokenSelection(NamedTuple):
    """Step 3's per-token weights of the batch."""

    omega_BxT: jax.Array  # STARE's omega (scope batch; ones with scope micro_batch) times keep_BxT
    keep_BxT: jax.Array | None  # the 80/20 filter's float mask (rl.token_filter), else None
    stare_info: dict  # stare_omega's info: its "sets" ([B, T] bool) and "metrics"


def build_step_fn(graphdef, cfg: TrainStepConfig, *, mesh=None, batch_axes=BATCH_AXES) -> Callable:
    """The pure (un-jitted) step function (train_state, batch, stare_state) -> (train_state, stare_state, metrics)."""
    statics = StepStatics(
        graphdef=graphdef,
        cfg=cfg,
        plan=loss_plan(cfg),
        tx=make_optimizer(cfg.optimizer),
        mesh=mesh,
        batch_axes=batch_axes,
    )

    def step_fn(train_state: TrainState, batch, stare_state: StareState, ref_params=None):
        return _train_step(statics, train_state, batch, stare_state, ref_params)

    return step_fn


def _forward(statics: StepStatics, params, rest, ids, attn, tgt, lm, *, theory=False):
    """policy_forward with the step's model graph and log-prob chunk size."""
    return policy_forward(
        statics.graphdef, params, rest, ids, attn, tgt, lm, chunk_size=statics.cfg.logprob_chunk_size, theory=theory
    )


def _train_step(statics: StepStatics, train_state: TrainState, batch, stare_state: StareState, ref_params):
    """build_step_fn's step: steps 1-6 of the module docstring."""
    cfg = statics.cfg
    layout = _batch_layout(statics, batch)
    _check_step_inputs(cfg, layout.num_sequences, batch, ref_params)
    loss_mask_BxT, advantages_B = layout.loss_mask(), layout.adv
    params, rest = train_state.params, train_state.rest

    # 1. no-grad pass (old log-probs, entropy, the reference's log-probs); rl.kl's metric and reward penalty
    no_grad = _no_grad_pass(statics, layout, params, rest, ref_params)
    correction = _rollout_correction(cfg, layout, batch, no_grad.old_logprobs_BxT, loss_mask_BxT)
    loss_mask_BxT = correction.loss_mask_BxT
    advantages_B, kl_metrics = _kl_terms(cfg, no_grad, loss_mask_BxT, advantages_B, batch)
    # 2. controller from the batch entropy, 3. omega from the same pass (scope batch)
    batch_entropy = _masked_mean(no_grad.entropy_BxT, loss_mask_BxT)
    stare_state = update_controller(stare_state, batch_entropy, cfg.stare)
    selection = _select_tokens(statics, stare_state, no_grad, advantages_B, loss_mask_BxT, correction)
    metrics = _selection_metrics(stare_state, batch_entropy, selection, loss_mask_BxT)
    metrics.update(kl_metrics)
    metrics.update(_mismatch_metrics(no_grad, correction, selection, loss_mask_BxT))
    loss_advantages, advantage_metrics = _loss_advantages(cfg, advantages_B, no_grad.entropy_BxT, loss_mask_BxT)
    metrics.update(advantage_metrics)
    if selection.keep_BxT is not None:
        metrics["token_filter/frac_kept"] = jnp.sum(selection.keep_BxT * loss_mask_BxT) / jnp.maximum(
            jnp.sum(loss_mask_BxT), 1.0
        )
    if no_grad.theory is not None:
        metrics.update(_theory_metrics(no_grad, advantages_B, loss_mask_BxT, selection))

    # 4. updates: epochs x mini-batches, each a scan over micro-batches
    per_sequence = SequenceArrays(
        loss_mask_BxT=loss_mask_BxT,
        advantages=loss_advantages,
        old_logprobs_BxT=no_grad.old_logprobs_BxT,
        omega_BxT=selection.omega_BxT,
        keep_BxT=selection.keep_BxT,
        ref_logprobs_BxT=no_grad.ref_logprobs_BxT if cfg.kl.as_loss else None,
        is_weights_BxT=correction.is_weights_BxT,
    )
    step_key = clip_cov_key(cfg.seed, train_state.step)
    num_updates = cfg.ppo_epochs * cfg.num_mini_batches
    update = functools.partial(
        _one_update,
        statics=statics,
        layout=layout,
        per_sequence=per_sequence,
        rest=rest,
        stare_state=stare_state,
        step_key=step_key,
    )
    (params, opt_state), updates = jax.lax.scan(update, (params, train_state.opt_state), jnp.arange(num_updates))
    metrics.update(_update_metrics(cfg, updates, num_updates))
    if cfg.debug_outputs:
        metrics.update(
            {
                "debug/omega": selection.omega_BxT,
                "debug/old_logprobs": no_grad.old_logprobs_BxT,
                "debug/entropy": no_grad.entropy_BxT,
                "debug/loss_mask": loss_mask_BxT,
                "debug/grads": jax.tree.map(lambda g: g[-1], updates["grads"]),
            }
        )
    new_state = TrainState(params=params, rest=rest, opt_state=opt_state, step=train_state.step + 1)
    return new_state, stare_state, metrics


def _batch_layout(statics: StepStatics, batch):
    """The batch's layout inside the step: packed rows (rl.packing) or PaddedLayout, with its micro-batch count."""
    cfg, mesh, batch_axes = statics.cfg, statics.mesh, statics.batch_axes
    n_mini = cfg.num_mini_batches
    if cfg.packing.enabled:
        return PackedLayout.from_batch(
            batch, n_mini=n_mini, micro_batch_tokens=cfg.micro_batch_tokens, mesh=mesh, batch_axes=batch_axes
        )
    ids, attn, tgt, lm, adv = shift_batch(batch)
    B, L = ids.shape
    if B % n_mini:
        raise ValueError(f"batch size {B} must be divisible by num_mini_batches={n_mini}")
    n_micro = cfg.num_micro_batches
    if cfg.micro_batch_tokens:  # sequences per micro-batch from the (bucketed) length
        shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in batch_axes)
        n_micro = padded_micro_batches(B // n_mini, L, cfg.micro_batch_tokens, shards)
    if B % (n_mini * n_micro):
        raise ValueError(f"batch size {B} must be divisible by num_mini_batches*num_micro_batches={n_mini}*{n_micro}")
    micro_size = B // n_mini // n_micro
    if statics.plan.omega_per_micro_batch and micro_size % cfg.stare.micro_batch_size:
        raise ValueError(
            f"stare scope='micro_batch': micro-batch size {micro_size} must be a multiple of "
            f"micro_batch_size={cfg.stare.micro_batch_size}"
        )
    return PaddedLayout(ids, attn, tgt, lm, adv, n_mini, n_micro, mesh, tuple(batch_axes))


def _check_step_inputs(cfg: TrainStepConfig, num_sequences: int, batch, ref_params) -> None:
    """ValueError for a step without what rl.kl needs (the reference parameters, the rewards of whole groups) or
    without the sampler's log-probs rl.rollout_correction asks for."""
    if cfg.rollout_correction.rollout_log_probs:
        key = PACKED_ROLLOUT_LOGPROBS_KEY if cfg.packing.enabled else ROLLOUT_LOGPROBS_KEY
        if key not in batch:
            raise ValueError(
                f"rl.rollout_correction.rollout_log_probs is on: the train batch needs {key!r} (the sampler's "
                f"log-probs; stare_jax.training.collect.train_batch_from_rollouts)"
            )
    kl = cfg.kl
    if kl.enabled and ref_params is None:
        raise ValueError("rl.kl.reference is set: the step needs the reference parameters (ref_params)")
    if kl.as_reward and (REWARDS_KEY not in batch or num_sequences % cfg.group_size):
        raise ValueError(
            f"rl.kl.use_as='reward' needs batch[{REWARDS_KEY!r}] and a batch of whole groups of "
            f"group_size={cfg.group_size} responses (got {num_sequences} responses)"
        )


def _no_grad_pass(statics: StepStatics, layout, params, rest, ref_params) -> NoGradPass:
    """Step 1 over the whole batch, micro-batched by the layout: the policy's log-probs and entropy (and theory
    terms), and with rl.kl the frozen reference's log-probs in the same pass (one more forward)."""
    theory = statics.cfg.stare.theory_diagnostics
    with_ref = statics.cfg.kl.enabled

    def forward(*inputs):
        policy = _forward(statics, jax.lax.stop_gradient(params), rest, *inputs, theory=theory)
        reference = _forward(statics, jax.lax.stop_gradient(ref_params), rest, *inputs)[0] if with_ref else None
        return policy, reference

    policy, reference = layout.no_grad_pass(forward)
    ref_logprobs_BxT = jax.lax.stop_gradient(reference) if with_ref else None
    return NoGradPass(
        old_logprobs_BxT=jax.lax.stop_gradient(policy[0]),
        entropy_BxT=jax.lax.stop_gradient(policy[1]),
        theory=policy[2] if theory else None,
        ref_logprobs_BxT=ref_logprobs_BxT,
    )


def _kl_terms(cfg: TrainStepConfig, no_grad: NoGradPass, loss_mask_BxT, advantages_B, batch):
    """(advantages_B, metrics) with rl.kl: metrics["kl"], the token-mean KL of pass 1; with use_as "reward" the
    advantage is the GRPO advantage of the shaped rewards minus the summed KL penalty (verl apply_kl_penalty, then
    compute_grpo_outcome_advantage)."""
    kl = cfg.kl
    metrics: dict = {}
    if not kl.enabled:
        return advantages_B, metrics
    old_logprobs_BxT, ref_logprobs_BxT = no_grad.old_logprobs_BxT, no_grad.ref_logprobs_BxT
    metrics["kl"] = _masked_mean(kl_penalty(old_logprobs_BxT, ref_logprobs_BxT, kl.kind), loss_mask_BxT)
    if kl.as_reward:
        token_rewards_BxT, metrics["kl/reward_penalty"] = kl_reward_penalty(
            jnp.zeros_like(old_logprobs_BxT), old_logprobs_BxT, ref_logprobs_BxT, loss_mask_BxT, kl.coef, kind=kl.kind
        )
        rewards_B = jnp.asarray(batch[REWARDS_KEY], jnp.float32) + jnp.sum(token_rewards_BxT, axis=1)
        num_sequences = rewards_B.shape[0]
        advantages_B = grpo_advantages(rewards_B.reshape(-1, cfg.group_size), norm_by_std=cfg.norm_adv_by_std).reshape(
            num_sequences
        )
    return advantages_B, metrics


def _rollout_correction(cfg: TrainStepConfig, layout, batch, old_logprobs_BxT, loss_mask_BxT) -> RolloutCorrection:
    """The sampler's log-probs read in the batch's layout (per-sequence view [B, T], like pass 1's), the rejection
    mask and the IS weights of rl.rollout_correction, and their metrics; a no-op without rollout log-probs."""
    rc = cfg.rollout_correction
    if not rc.rollout_log_probs:
        return RolloutCorrection(None, loss_mask_BxT, None, {})
    if cfg.packing.enabled:
        rollout_BxT = layout.view(jnp.asarray(batch[PACKED_ROLLOUT_LOGPROBS_KEY], jnp.float32)[:, 1:])
    else:
        rollout_BxT = jnp.asarray(batch[ROLLOUT_LOGPROBS_KEY], jnp.float32)[:, 1:]
    rollout_BxT = jnp.where(loss_mask_BxT > 0, rollout_BxT, 0.0)
    log_ratio_BxT = old_logprobs_BxT - rollout_BxT  # log(pi_train / pi_rollout)
    metrics: dict = {}
    weights_BxT = None
    if rc.rollout_is is not None:
        weights_BxT, is_metrics = is_weights(
            log_ratio_BxT,
            loss_mask_BxT,
            level=rc.rollout_is,
            threshold=rc.rollout_is_threshold,
            batch_normalize=rc.rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    if rc.rejection_options:
        loss_mask_BxT, rs_metrics = rejection_mask(log_ratio_BxT, loss_mask_BxT, rc.rejection_options)
        metrics.update(rs_metrics)
    return RolloutCorrection(rollout_BxT, loss_mask_BxT, weights_BxT, metrics)


def _mismatch_metrics(no_grad: NoGradPass, correction: RolloutCorrection, selection: TokenSelection, mask_BxT):
    """rollout_corr/*: the correction's metrics and the off-policy diagnostics over the (unrejected) response
    tokens, also restricted to STARE's high-surprisal set (pos_high | neg_high of the selection) and the rest."""
    if correction.rollout_logprobs_BxT is None:
        return {}
    sets = selection.stare_info["sets"]
    high_BxT = sets[HIGH_SURPRISAL_SETS[0]] | sets[HIGH_SURPRISAL_SETS[1]]
    diagnostics = offpolicy_metrics(
        no_grad.old_logprobs_BxT,
        correction.rollout_logprobs_BxT,
        mask_BxT,
        subsets={"high_surprisal": high_BxT, "rest": ~high_BxT},
    )
    diagnostics["high_surprisal_frac"] = jnp.sum(high_BxT & (mask_BxT > 0)) / jnp.maximum(jnp.sum(mask_BxT), 1.0)
    return {"rollout_corr/" + k: v for k, v in {**correction.metrics, **diagnostics}.items()}


def _select_tokens(
    statics: StepStatics,
    stare_state: StareState,
    no_grad: NoGradPass,
    advantages_B,
    loss_mask_BxT,
    correction: RolloutCorrection,
) -> TokenSelection:
    """Step 3: STARE's omega over the whole batch (scope batch) from pass 1 (or, with rl.stare.surprisal_source
    "rollout", from the sampler's log-probs), times the 80/20 filter's mask (the global top-rho entropy tokens of
    pass 1). The high-surprisal sets are selected too when the theory or mismatch diagnostics read them."""
    token_filter = statics.cfg.token_filter
    diagnosed = no_grad.theory is not None or correction.rollout_logprobs_BxT is not None
    extra_sets = HIGH_SURPRISAL_SETS if diagnosed else ()
    surprisal_logprobs_BxT = (
        correction.rollout_logprobs_BxT if statics.cfg.stare.surprisal_source == "rollout" else no_grad.old_logprobs_BxT
    )
    omega_BxT, info = stare_omega(
        surprisal_logprobs_BxT,
        advantages_B,
        loss_mask_BxT,
        stare_state,
        statics.cfg.stare,
        entropy_BxT=no_grad.entropy_BxT,
        extra_sets=extra_sets,
        scope="batch",
    )
    if statics.plan.omega_per_micro_batch:
        omega_BxT = jnp.ones_like(omega_BxT)  # recomputed per micro-batch (step_loss.micro_batch_loss)
    keep_BxT = None
    if token_filter.enabled:
        keep_BxT = high_entropy_mask(
            no_grad.entropy_BxT, loss_mask_BxT, token_filter.rho, rule=token_filter.rule
        ).astype(jnp.float32)
        omega_BxT = omega_BxT * keep_BxT
    return TokenSelection(omega_BxT=omega_BxT, keep_BxT=keep_BxT, stare_info=info)


def _selection_metrics(stare_state: StareState, batch_entropy, selection: TokenSelection, loss_mask_BxT) -> dict:
    """The controller's state after step 2 and STARE's selection metrics."""
    metrics = {
        "entropy": batch_entropy,
        "gate_on": stare_state.gate_on.astype(jnp.float32),
        "stare_w": stare_state.w,
        "stare_m": stare_state.m,
        "response_tokens": jnp.sum(loss_mask_BxT),
    }
    metrics.update({"stare/" + k: v for k, v in selection.stare_info["metrics"].items()})
    return metrics


def _loss_advantages(cfg: TrainStepConfig, advantages_B, entropy_BxT, loss_mask_BxT):
    """(the advantages the loss sees, metrics): advantages_B, or with EntroAdv the token-level
    A + min(alpha sg(H), |A| / kappa) [B, T] with H from pass 1."""
    if not cfg.advantage.entropy_adv:
        return advantages_B, {}
    advantages_BxT = entropy_advantage(
        advantages_B,
        entropy_BxT,
        loss_mask_BxT,
        alpha=cfg.advantage.entropy_adv_alpha,
        kappa=cfg.advantage.entropy_adv_kappa,
    )
    bonus = _masked_mean(advantages_BxT - advantages_B[:, None], loss_mask_BxT)
    return advantages_BxT, {"entropy_adv/bonus_mean": bonus}


def _theory_metrics(no_grad: NoGradPass, advantages_B, loss_mask_BxT, selection: TokenSelection) -> dict:
    """stare.theory_diagnostics: the batch entropy terms (Phi, Lambda, Gamma, W*) and where s* falls."""
    theory, sets = no_grad.theory, selection.stare_info["sets"]
    assert theory is not None
    terms = batch_entropy_terms(
        theory["phi"],
        advantages_B,
        loss_mask_BxT,
        omega_BxT=selection.omega_BxT,
        pos_set_BxT=sets["pos_high"],
        neg_set_BxT=sets["neg_high"],
    )
    metrics = {"theory/" + k: v for k, v in terms.items()}
    surprisal_BxT = -no_grad.old_logprobs_BxT
    pos_high_BxT = sets["pos_high"]
    metrics["theory/frac_pos_high_above_sstar"] = jnp.sum(
        pos_high_BxT & (surprisal_BxT > theory["s_star"])
    ) / jnp.maximum(jnp.sum(pos_high_BxT), 1)
    metrics["theory/s_star_mean"] = _masked_mean(theory["s_star"], loss_mask_BxT)
    return metrics


def _one_update(
    carry,
    update_index,
    *,
    statics: StepStatics,
    layout,
    per_sequence: SequenceArrays,
    rest,
    stare_state: StareState,
    step_key,
):
    """One optimizer update (lax.scan body over epochs x mini-batches): mini-batch update_index % num_mini_batches,
    its gradient accumulated over micro-batches, then guarded_update. carry: (params, optimizer state)."""
    params, opt_state = carry
    cfg, plan = statics.cfg, statics.plan
    mini_index = update_index % cfg.num_mini_batches
    mini_size = layout.num_sequences // cfg.num_mini_batches
    mini_batch = jax.tree.map(
        lambda a: jax.lax.dynamic_slice_in_dim(a, mini_index * mini_size, mini_size, axis=0), per_sequence
    )
    normalizers = loss_normalizers(plan, mini_batch.loss_mask_BxT)
    micro_xs, nonempty, micro_fn = layout.micro_batches(mini_index, mini_batch)
    loss_fn = functools.partial(
        micro_batch_loss,
        plan=plan,
        forward=functools.partial(_forward, statics),
        rest=rest,
        micro_fn=micro_fn,
        stare_state=stare_state,
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    zero_metrics = {k: jnp.float32(0.0) for k in update_metric_names(plan)}
    scan_xs = {"x": micro_xs}
    if plan.micro_batch_key:  # the micro-batch index feeds clip_cov's key
        scan_xs["i"] = jnp.arange(layout.micro)
    if nonempty is not None:  # a packed micro-batch left empty costs nothing
        scan_xs["run"] = nonempty
    loss_and_grad = functools.partial(
        _micro_loss_and_grad,
        grad_fn=grad_fn,
        params=params,
        normalizers=normalizers,
        step_key=step_key if plan.micro_batch_key else None,
        update_index=update_index,
        num_micro=layout.micro,
    )
    grads, loss, metric_sums = accumulate_gradients(loss_and_grad, params, scan_xs, zero_metrics)
    new_params, new_opt_state, grad_norm, finite = guarded_update(
        statics.tx, grads, loss, params, opt_state, offload=cfg.offload.optimizer
    )
    out = dict(metric_sums, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.float32))
    if cfg.debug_outputs:
        out["grads"] = grads
    return (new_params, new_opt_state), out


def _micro_loss_and_grad(xs, *, grad_fn, params, normalizers: LossNormalizers, step_key, update_index, num_micro):
    """grad_fn on one micro-batch of accumulate_gradients' scan; with a step_key (clip_cov) the micro-batch's key
    fold_in(step_key, update * micro-batches + micro-batch)."""
    key = jax.random.fold_in(step_key, update_index * num_micro + xs["i"]) if step_key is not None else None
    return grad_fn(params, xs["x"], normalizers, key)


def _update_metrics(cfg: TrainStepConfig, updates: dict, num_updates: int) -> dict:
    """The metrics of the updates' scan: means over updates, token-weighted fractions, skipped updates."""
    count = jnp.maximum(jnp.sum(updates["token_count"]), 1.0)
    metrics = {
        "loss": jnp.mean(updates["loss"]),
        "grad_norm": jnp.mean(updates["grad_norm"]),
        "clipfrac": jnp.sum(updates["clipfrac_sum"]) / count,
        "clipfrac_lower": jnp.sum(updates["clipfrac_lower_sum"]) / count,
        "approx_kl": jnp.sum(updates["approx_kl_sum"]) / count,
        "omega_mean_used": jnp.sum(updates["omega_sum"]) / count,
        "skipped_updates": jnp.sum(updates["skipped"]),
        "num_updates": jnp.float32(num_updates),
    }
    if cfg.kl.as_loss:
        metrics["kl_loss"] = jnp.mean(updates["kl_agg"])  # agg(kl(lp, ref_lp)) before kl.coef (verl actor/kl_loss)
    return metrics


def train_state_shardings(train_state: TrainState, mesh):
    """Each leaf's NamedSharding on `mesh` if it has one, else replicated (scalars such as step / optax counts)."""
    rep = NamedSharding(mesh, P())

    def f(x):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.shape == mesh.shape:
            return NamedSharding(mesh, sh.spec, memory_kind=sh.memory_kind)
        return rep

    return jax.tree.map(f, train_state)


def place_train_state(train_state: TrainState, mesh):
    """device_put every leaf onto its train_state_shardings sharding (call once before the first step)."""
    return jax.device_put(train_state, train_state_shardings(train_state, mesh))


def batch_keys(cfg: TrainStepConfig) -> tuple[str, ...]:
    """The batch keys the step takes: the padded layout's or the packed one's (rl.packing), plus rewards_B when
    the KL penalty enters the reward and the sampler's log-probs with rl.rollout_correction.rollout_log_probs."""
    rollout_key = PACKED_ROLLOUT_LOGPROBS_KEY if cfg.packing.enabled else ROLLOUT_LOGPROBS_KEY
    return (
        (PACKED_KEYS if cfg.packing.enabled else BATCH_KEYS)
        + ((REWARDS_KEY,) if cfg.kl.as_reward else ())
        + ((rollout_key,) if cfg.rollout_correction.rollout_log_probs else ())
    )


def batch_shardings(mesh, batch_axes=BATCH_AXES, keys=BATCH_KEYS):
    """NamedSharding for each batch key: leading (batch or row) axis over batch_axes."""
    return {k: batch_sharding(mesh, batch_axes) for k in keys}


def make_train_step(
    graphdef,
    cfg: TrainStepConfig,
    *,
    mesh=None,
    train_state: TrainState | None = None,
    rules=None,
    batch_axes=BATCH_AXES,
    donate: bool = True,
) -> Callable:
    """jax.jit-compiled step (jit_step). With a mesh: in/out shardings = the train_state's current shardings (pass
    the initialised train_state), batch sharded over batch_axes on its leading axis, controller state and metrics
    replicated, reference parameters (cfg.kl.enabled) sharded like the params and not donated; the model's
    activation constraints use `rules` (default: stare_jax.models.sharding rules)."""
    step_fn = build_step_fn(graphdef, cfg, mesh=mesh, batch_axes=batch_axes if mesh is not None else ())
    return jit_step(
        step_fn,
        mesh=mesh,
        train_state=train_state,
        keys=batch_keys(cfg),
        with_ref=cfg.kl.enabled,
        rules=rules,
        batch_axes=batch_axes,
        donate=donate,
    )


def jit_step(
    step_fn: Callable,
    *,
    mesh=None,
    train_state: TrainState | None = None,
    keys: tuple = BATCH_KEYS,
    state_args: int = 1,
    with_ref: bool = False,
    rules=None,
    batch_axes=BATCH_AXES,
    donate: bool = True,
) -> Callable:
    """step_fn(train_state, batch, *state [, ref_params]) -> (train_state, *state, metrics), jitted with the train
    state donated: plain jax.jit without a mesh; on a mesh a ShardedStep whose train state keeps its current
    shardings (pass the initialised train_state), batch keys sharded over batch_axes, the `state_args` state
    arguments (the RL step's controller state; none for the SFT step) and the metrics replicated, the reference
    parameters (with_ref) sharded like the params and not donated."""
    donate_argnums = (0,) if donate else ()
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=donate_argnums)
    if train_state is None:
        raise ValueError("a step on a mesh needs the initialised train_state to read its shardings")
    rules = DEFAULT_RULES if rules is None else rules
    rep = NamedSharding(mesh, P())
    state_sh = train_state_shardings(train_state, mesh)
    in_sh = (
        (state_sh, batch_shardings(mesh, batch_axes, keys))
        + (rep,) * state_args
        + ((state_sh.params,) if with_ref else ())
    )
    out_sh = (state_sh,) + (rep,) * (state_args + 1)
    jitted = jax.jit(step_fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate_argnums)
    return ShardedStep(jitted, mesh, rules, tuple(batch_axes), tuple(keys), with_ref, state_args)


@dataclasses.dataclass(frozen=True)
class ShardedStep:
    """The jitted step on a mesh: called like the step, it runs under the mesh and the activation rules it was
    traced with; `trace` / `lower` give jax.stages objects for real or abstract arguments (the ahead-of-time
    compile's entry, stare_jax.training.aot)."""

    jitted: Any
    mesh: Any
    rules: Any
    batch_axes: tuple
    keys: tuple = BATCH_KEYS  # the batch keys the step reads (batch_keys)
    with_ref: bool = False  # takes the frozen reference's parameters after its state arguments
    state_args: int = 1  # arguments after the batch: the RL step's controller state; 0 for the SFT step

    @property
    def batch_shardings(self) -> dict:
        return batch_shardings(self.mesh, self.batch_axes, self.keys)

    def context(self):
        """The mesh and activation rules the step is traced under."""
        return program_context(self.mesh, self.rules)

    def __call__(self, train_state, batch, *args):
        """step(train_state, batch, *state [, ref_params]): the RL step's state is its controller state."""
        state, extra = args[: self.state_args], args[self.state_args :]
        ref_params = extra[0] if extra else None
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise ValueError(f"train batch is missing keys {missing}; expected {list(self.keys)}")
        if self.with_ref and ref_params is None:
            raise ValueError("rl.kl.reference is set: the step needs the reference parameters (ref_params)")
        batch = {k: batch[k] for k in self.keys}
        shards = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        for k, v in batch.items():
            if jnp.shape(v)[0] % shards:
                raise ValueError(
                    f"batch[{k!r}] has {jnp.shape(v)[0]} rows, not divisible by the {shards} devices "
                    f"of mesh axes {self.batch_axes}"
                )
        with self.context():
            return self.jitted(train_state, batch, *state, *((ref_params,) if self.with_ref else ()))

    def trace(self, *args) -> jax.stages.Traced:
        with self.context():
            return self.jitted.trace(*args)

    def lower(self, *args) -> jax.stages.Lowered:
        with self.context():
            return self.trace(*args).lower()


def batch_entropy(graphdef, params, rest, batch, *, chunk_size=DEFAULT_CHUNK_SIZE):
    """Mean per-token entropy over valid response tokens (the controller's H_bar) of `batch` under params."""
    ids, attn, tgt, lm, _ = shift_batch(batch)
    _, ent = policy_forward(graphdef, params, rest, ids, attn, tgt, lm, chunk_size=chunk_size)
    return _masked_mean(ent, lm)
