"""Sampler vs transformers: greedy decoding token for token, and returned log-probs vs a full forward.

Tiny random Qwen2 / Llama checkpoints are written with transformers (torch fp32) and loaded with
stare_jax.models.from_pretrained, on one device and on 8 fake CPU devices (data 8, data 2 x fsdp 4).
A divergence from the reference is accepted only where the reference's top-2 logit margin at that step is
below 1e-4 (a numerical tie); such events are counted and printed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stare_jax.models import from_pretrained  # noqa: E402
from stare_jax.models.sharding import make_mesh  # noqa: E402
from stare_jax.sampling import Sampler, SamplingParams  # noqa: E402
from support.params import representative  # noqa: E402

NEW_TOKENS = 32
TIE_MARGIN = 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2], list(range(30, 60)), [200, 100, 50, 25, 12]]
PAD = 0
TIE_EVENTS: list[tuple[str, int, int, float]] = []
ROWS_COMPARED = [0]


def _hf_config(arch: str):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    return transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=5000.0, **common)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    """(arch, path, torch model) of a tiny random HF checkpoint."""
    arch = request.param
    torch.manual_seed(0 if arch == "qwen2" else 1)
    cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    hf = cls(_hf_config(arch)).eval().to(torch.float32)
    path = tmp_path_factory.mktemp(f"tiny_{arch}")
    hf.save_pretrained(path)
    return arch, path, hf


def _hf_greedy(hf, prompts, eos_id=None):
    """transformers generate(do_sample=False) with left padding: (token lists, per-step logits [B,N,V])."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        mask[i, T - len(p) :] = 1
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=PAD,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, T:].numpy()
    logits = torch.stack(out.logits, dim=1).numpy()
    tokens = []
    for row in new:
        row = row.tolist()
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        tokens.append(row)
    return tokens, logits


def _compare(tag, ours, ref, ref_logits):
    """Token-for-token equality; a divergence is allowed only at a reference top-2 margin < TIE_MARGIN.
    Returns, per row, the length of the prefix that agrees with the reference."""
    agree = []
    ROWS_COMPARED[0] += len(ours)
    for b, (a, r) in enumerate(zip(ours, ref)):
        n = min(len(a), len(r))
        diff = [i for i in range(n) if a[i] != r[i]]
        agree.append(diff[0] if diff else n)
        if not diff:
            assert len(a) == len(r), f"{tag} row {b}: lengths {len(a)} vs reference {len(r)}"
            continue
        i = diff[0]
        top2 = np.sort(ref_logits[b, i])[-2:]
        margin = float(top2[1] - top2[0])
        assert margin < TIE_MARGIN, (
            f"{tag} row {b} step {i}: token {a[i]} != reference {r[i]} with a "
            f"reference top-2 margin {margin:.3g} >= {TIE_MARGIN}"
        )
        TIE_EVENTS.append((tag, b, i, margin))
    return agree


MESHES = {"single": None, "data8": {"data": 8}, "data2_fsdp4": {"data": 2, "fsdp": 4}}


# (architecture, mesh) pairs: the default suite runs Qwen2 on one device and Llama on the data 2 x fsdp 4 mesh; the
# other four pairs run with --runslow (CPU budget of the default suite).
GREEDY_PAIRS = [
    ("qwen2", "single"),
    ("llama", "data2_fsdp4"),
    ("qwen2", "data8"),
    ("qwen2", "data2_fsdp4"),
    ("llama", "single"),
    ("llama", "data8"),
]


@pytest.mark.parametrize("checkpoint,mesh_name", representative(GREEDY_PAIRS, keep=2), indirect=["checkpoint"])
def test_greedy_matches_transformers(checkpoint, mesh_name):
    arch, path, hf = checkpoint
    mesh = None if MESHES[mesh_name] is None else make_mesh(MESHES[mesh_name])
    model = from_pretrained(path, mesh=mesh)
    ref, ref_logits = _hf_greedy(hf, PROMPTS)
    out = Sampler(model, mesh=mesh).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0, eos_ids=[])
    )
    assert out.lengths == [NEW_TOKENS] * len(PROMPTS)
    assert out.finish_reasons == ["length"] * len(PROMPTS)
    agree = _compare(f"{arch}/{mesh_name}", out.tokens, ref, ref_logits)
    # The returned log-probs are those of the reference's temperature-1 distribution at each step.
    for b, (toks, n) in enumerate(zip(out.tokens, agree)):
        ref_lp = torch.log_softmax(torch.from_numpy(ref_logits[b]), -1).numpy()
        np.testing.assert_allclose(out.logprobs[b][:n], ref_lp[np.arange(n), toks[:n]], atol=2e-4, rtol=0)


def test_greedy_eos_matches_transformers(checkpoint):
    """With an EOS id that greedy decoding actually produces: same stopping point and padding as HF."""
    arch, path, hf = checkpoint
    model = from_pretrained(path)
    free, _ = _hf_greedy(hf, PROMPTS)
    eos = free[0][9]  # the 10th greedy token of prompt 0 becomes the EOS
    ref, ref_logits = _hf_greedy(hf, PROMPTS, eos_id=eos)
    out = Sampler(model).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0, eos_ids=[eos])
    )
    _compare(f"{arch}/eos", out.tokens, ref, ref_logits)
    first = free[0].index(eos)
    assert out.tokens[0] == free[0][: first + 1] and out.finish_reasons[0] == "eos"
    assert out.lengths[0] == first + 1
    for toks, reason in zip(out.tokens, out.finish_reasons):
        assert reason == ("eos" if toks[-1] == eos else "length")
        assert eos not in toks[:-1]


@pytest.mark.parametrize(
    "checkpoint,mesh_name",
    representative([("llama", "data2_fsdp4"), ("qwen2", "data2_fsdp4")]),
    indirect=["checkpoint"],
)
def test_sampled_logprobs_equal_teacher_forced(checkpoint, mesh_name):
    """Log-probs returned while sampling == log_softmax of a full forward over prompt + sample (fp32, 1e-5)."""
    arch, path, _ = checkpoint
    mesh = None if MESHES[mesh_name] is None else make_mesh(MESHES[mesh_name])
    model = from_pretrained(path, mesh=mesh)
    out = Sampler(model, mesh=mesh).generate(
        PROMPTS, max_new_tokens=24, num_samples=2, sampling=SamplingParams(temperature=1.0, seed=3, eos_ids=[])
    )
    single = from_pretrained(path)
    rows = [PROMPTS[r // 2] + toks for r, toks in enumerate(out.tokens)]
    L = max(map(len, rows))
    ids = np.zeros((len(rows), L), np.int32)
    mask = np.zeros((len(rows), L), np.int32)
    for r, row in enumerate(rows):  # right-padded batch: one full forward for all rows
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
    logp_BxLxV = np.asarray(jax.nn.log_softmax(single(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), -1))
    for r, (toks, lps) in enumerate(zip(out.tokens, out.logprobs)):
        n0 = len(PROMPTS[r // 2])
        ref = logp_BxLxV[r, n0 - 1 : n0 - 1 + len(toks)][np.arange(len(toks)), toks]
        np.testing.assert_allclose(np.asarray(lps), ref, atol=1e-5, rtol=0, err_msg=f"{arch} row {r}")


def test_near_tie_divergences_are_rare():
    """Runs after the parity tests of this file: divergences excused by a near-tie (reference top-2 margin <
    TIE_MARGIN) stay exceptions - at most 1 in 10 compared rows - and each was a genuine near-tie."""
    if not ROWS_COMPARED[0]:
        pytest.skip("no parity test ran before this one")
    print(f"\nnear-tie divergences (margin < {TIE_MARGIN}): {len(TIE_EVENTS)} of {ROWS_COMPARED[0]} rows", TIE_EVENTS)
    assert len(TIE_EVENTS) <= max(1, ROWS_COMPARED[0] // 10), TIE_EVENTS
    assert all(0 <= margin < TIE_MARGIN for *_, margin in TIE_EVENTS)
