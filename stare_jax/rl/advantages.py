"""GRPO outcome advantages and DAPO dynamic sampling (what "GRPO-ds" uses).

- `grpo_advantages`: verl's `compute_grpo_outcome_advantage` on a [P prompts, G responses] reward grid.
- `dynamic_sampling_keep_mask`: pure keep-mask of groups whose accuracy varies (DAPO).
- `DynamicSamplingAccumulator`: host-side accumulator that concatenates kept groups from successive generation
  batches until there are >= train_batch_size prompts, then truncates to exactly train_batch_size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def grpo_advantages(rewards_PxG, *, norm_by_std: bool = True, eps: float = 1e-6):
    """Per-response GRPO advantage A = (r - mean_group) / (std_group + eps) on a [P, G] reward grid.

    std is the unbiased (ddof=1) std as in verl; a group of size 1 gets mean 0 and std 1 (verl's convention).
    With norm_by_std=False: A = r - mean_group.
    """
    rewards_PxG = jnp.asarray(rewards_PxG, dtype=jnp.float32)
    if rewards_PxG.ndim != 2:
        raise ValueError(f"rewards_PxG must be 2-D [prompts, group], got shape {rewards_PxG.shape}")
    group = rewards_PxG.shape[1]
    if group == 1:
        mean_P1 = jnp.zeros_like(rewards_PxG)
        std_P1 = jnp.ones_like(rewards_PxG)
    else:
        mean_P1 = jnp.mean(rewards_PxG, axis=1, keepdims=True)
        std_P1 = jnp.std(rewards_PxG, axis=1, keepdims=True, ddof=1)
    centred_PxG = rewards_PxG - mean_P1
    if not norm_by_std:
        return centred_PxG
    return centred_PxG / (std_P1 + eps)


def dynamic_sampling_keep_mask(accuracy_PxG):
    """Keep-mask [P] of groups whose accuracy has population std (ddof=0) > 0, or whose group size is 1."""
    accuracy_PxG = jnp.asarray(accuracy_PxG, dtype=jnp.float32)
    if accuracy_PxG.ndim != 2:
        raise ValueError(f"accuracy_PxG must be 2-D [prompts, group], got shape {accuracy_PxG.shape}")
    if accuracy_PxG.shape[1] == 1:
        return jnp.ones((accuracy_PxG.shape[0],), dtype=bool)
    return jnp.std(accuracy_PxG, axis=1) > 0


class DynamicSamplingError(RuntimeError):
    """Raised when max_num_gen_batches generation batches did not yield train_batch_size kept prompts."""


class DynamicSamplingAccumulator:
    """Concatenates the kept prompt groups of successive generation batches (host side, NumPy).

    Each `add(batch, keep_P)` takes a pytree of arrays whose leading axis is the prompt axis P (e.g. [P, G] rewards,
    [P, G, T] tokens) and a boolean keep-mask [P]. After each add, `ready` tells whether >= train_batch_size prompts
    were kept; `result()` returns exactly the first train_batch_size kept prompts (in arrival order).
    Adding the max_num_gen_batches-th batch without reaching train_batch_size raises DynamicSamplingError
    (max_num_gen_batches <= 0 means no limit, as in verl).
    """

    def __init__(self, train_batch_size: int, max_num_gen_batches: int = 10):
        if int(train_batch_size) < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
        self.train_batch_size = int(train_batch_size)
        self.max_num_gen_batches = int(max_num_gen_batches)
        self.reset()

    @property
    def num_kept(self) -> int:
        return self._num_kept

    @property
    def ready(self) -> bool:
        return self._num_kept >= self.train_batch_size

    def add(self, batch, keep_P) -> bool:
        """Append the kept groups of one generation batch; returns `ready`."""
        keep_P = np.asarray(keep_P, dtype=bool)
        leaves = jax.tree_util.tree_leaves(batch)
        if keep_P.ndim != 1:
            raise ValueError(f"keep mask must be 1-D [prompts], got shape {keep_P.shape}")
        for leaf in leaves:
            if np.shape(leaf)[:1] != keep_P.shape:
                raise ValueError(
                    f"every batch leaf needs leading prompt axis {keep_P.shape[0]}, got shape {np.shape(leaf)}"
                )
        self.num_gen_batches += 1
        self.num_prompts_seen += keep_P.shape[0]
        idx = np.nonzero(keep_P)[0]
        if idx.size:
            self._parts.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[idx], batch))
            self._num_kept += int(idx.size)
        if not self.ready and self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches:
            raise DynamicSamplingError(
                f"dynamic sampling: after max_num_gen_batches={self.max_num_gen_batches} generation batches "
                f"({self.num_prompts_seen} prompts) only {self._num_kept} prompts were kept (groups with "
                f"varying accuracy), fewer than train_batch_size={self.train_batch_size}; raise "
                f"max_num_gen_batches, use a larger generation batch, or check the reward function / data difficulty"
            )
        return self.ready

    def result(self):
        """The first train_batch_size kept prompts, concatenated along the prompt axis."""
        if not self.ready:
            raise ValueError(f"only {self._num_kept} of train_batch_size={self.train_batch_size} prompts kept so far")
        cat = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, axis=0), *self._parts)
        return jax.tree_util.tree_map(lambda x: x[: self.train_batch_size], cat)

    def reset(self) -> None:
        """Forget the kept groups and the generation-batch count (the sizes stay)."""
        self.num_gen_batches = 0
        self.num_prompts_seen = 0
        self._parts: list[Any] = []
        self._num_kept = 0


def w_reinforce_advantages(correct_B, lam: float = 0.1):
    """W-REINF (Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"):
    REINFORCE with +1 / -1 rewards and the positive samples down-weighted by lambda: A = lam for a correct
    response, -1 for a wrong one (no baseline, no std). Pair with the "gpg" loss (-A log pi), or "vanilla"
    on-policy (the same gradient)."""
    if not lam >= 0.0:
        raise ValueError(f"W-REINF lambda={lam} must be >= 0")
    correct_B = jnp.asarray(correct_B)
    if correct_B.ndim != 1:
        raise ValueError(f"correct_B must be 1-D [responses], got shape {correct_B.shape}")
    return jnp.where(correct_B > 0, jnp.float32(lam), jnp.float32(-1.0))


def outcome_advantages(
    rewards_PxG, correct_PxG, *, estimator: str = "grpo", norm_by_std: bool = True, w_reinforce_lambda: float = 0.1
):
    """Per-response advantages [P, G] of rl.advantage.estimator: "grpo" (grpo_advantages of the shaped rewards) or
    "w_reinforce" (w_reinforce_advantages of the correctness)."""
    if estimator == "grpo":
        return grpo_advantages(rewards_PxG, norm_by_std=norm_by_std)
    if estimator == "w_reinforce":
        correct = jnp.asarray(correct_PxG)
        return w_reinforce_advantages(correct.reshape(-1), w_reinforce_lambda).reshape(correct.shape)
    raise ValueError(f"advantage estimator {estimator!r} unknown; accepted: 'grpo', 'w_reinforce'")


def entropy_advantage(advantages_BxT, entropy_BxT, mask_BxT, *, alpha: float = 0.4, kappa: float = 2.0):
    """EntroAdv (Cheng et al. 2025, "Reasoning with Exploration: An Entropy Perspective"): token-level
    A + min(alpha * sg(H), |A| / kappa); the clip keeps the entropy term from flipping the sign of a negative
    advantage, and the detached entropy adds no gradient of its own. advantages [B] are broadcast over T; 0 off
    the mask."""
    if not (alpha >= 0.0 and kappa > 0.0):
        raise ValueError(f"EntroAdv needs alpha >= 0 and kappa > 0, got alpha={alpha}, kappa={kappa}")
    ent = jax.lax.stop_gradient(jnp.asarray(entropy_BxT, jnp.float32))
    adv = jnp.asarray(advantages_BxT, jnp.float32)
    if adv.shape == ent.shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], ent.shape)
    if adv.shape != ent.shape or jnp.shape(mask_BxT) != ent.shape:
        raise ValueError(
            f"advantages, entropy and mask must share shape {ent.shape}, got {adv.shape}, {jnp.shape(mask_BxT)}"
        )
    valid = jnp.asarray(mask_BxT) > 0
    bonus = jnp.minimum(alpha * jnp.where(valid, ent, 0.0), jnp.abs(adv) / kappa)
    return jnp.where(valid, adv + bonus, 0.0)
