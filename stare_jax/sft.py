"""Supervised fine-tuning (teacher-forced NLL on response tokens): the warm start before RL.

Uses the same pieces as the RL step: `policy_forward` (chunked log-probs, no [B,T,V] logits) and `make_optimizer`.
Examples are (prompt_ids, response_ids) pairs; the loss is the mean negative log-likelihood over response tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stare_jax.rl.train_step import OptimizerConfig, make_optimizer, policy_forward, split_model


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    chunk_size: int = 64


def pack_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, length: int | None = None):
    """Right-padded ids [N, L], attention mask [N, L] and response mask [N, L] (1 where the token is a response
    token, so the loss is on predicting it)."""
    if not examples:
        raise ValueError("pack_examples: no examples")
    lens = [len(p) + len(r) for p, r in examples]
    L = length or max(lens)
    if max(lens) > L:
        raise ValueError(f"pack_examples: an example has {max(lens)} tokens > length {L}")
    ids = np.full((len(examples), L), pad_id, np.int32)
    attn = np.zeros((len(examples), L), np.int32)
    resp = np.zeros((len(examples), L), np.int32)
    for i, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        ids[i, :n] = list(p) + list(r)
        attn[i, :n] = 1
        resp[i, len(p):n] = 1
    return ids, attn, resp


def make_sft_step(graphdef, tx, chunk_size: int) -> Callable:
    """jitted (params, rest, opt_state, ids, attn, resp) -> (params, opt_state, loss)."""

    def loss_fn(params, rest, ids, attn, resp):
        lm = ((resp[:, 1:] > 0) & (attn[:, 1:] > 0)).astype(jnp.float32)
        lp, _ = policy_forward(graphdef, params, rest, ids, attn, ids[:, 1:], lm, chunk_size=chunk_size)
        return -jnp.sum(lp * lm) / jnp.maximum(jnp.sum(lm), 1.0)

    @jax.jit
    def step(params, rest, opt_state, ids, attn, resp):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, ids, attn, resp)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(jnp.add, params, updates), opt_state, loss

    return step


def sft_train(model: nnx.Module, sample_batch: Callable[[np.random.Generator, int], tuple], cfg: SFTConfig,
              log: Callable[[int, float], None] | None = None) -> list[float]:
    """Train `model` in place for cfg.steps steps. `sample_batch(rng, batch_size)` returns (ids, attn, resp)
    arrays of one fixed shape (so the step compiles once). Returns the loss curve."""
    graphdef, params, rest = split_model(model)
    tx = make_optimizer(OptimizerConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                                        schedule="linear" if cfg.warmup_steps else "constant"))
    opt_state = tx.init(params)
    step = make_sft_step(graphdef, tx, cfg.chunk_size)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for i in range(cfg.steps):
        ids, attn, resp = sample_batch(rng, cfg.batch_size)
        params, opt_state, loss = step(params, rest, opt_state, ids, attn, resp)
        losses.append(float(loss))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"SFT loss is {losses[-1]} at step {i}")
        if log is not None:
            log(i, losses[-1])
    nnx.update(model, params)
    return losses
