"""PEFT round trip on the real SmolLM2-135M-Instruct (issue: LoRA): our adapters (rank 32, alpha 64, all seven
projections, random non-zero A and B) exported with `write_peft_adapter` and loaded by `peft.PeftModel.from_pretrained`
over transformers' SmolLM2 (export), and a PEFT adapter saved by peft itself (random non-zero A and B) read into our
model with `read_peft_adapter` (import). Prints max |logit difference| over the real tokens of a small padded batch,
and how far the adapters move the logits (so the comparison is not of two base models).

    python benchmarks/lora_peft_roundtrip.py [--tokens 24 --rows 3]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from stare_jax.models import from_pretrained, lora
from stare_jax.models.config import LORA_TARGETS
from stare_jax.models.gguf_convert import ensure_smollm2_hf
from stare_jax.models.transformer import LoRAParam

REPO = pathlib.Path(__file__).resolve().parents[1]
RANK, ALPHA = 32, 64.0


def _logits_ours(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)), np.float64)


def _logits_hf(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    return out.double().numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rows", type=int, default=3)
    args = ap.parse_args(argv)
    import peft
    import transformers

    folder = ensure_smollm2_hf(str(REPO / ".cache" / "smollm2-135m-instruct-hf"))
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 1000, (args.rows, args.tokens)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1:, : args.tokens // 3] = 0  # left padding on all rows but the first
    real = mask.astype(bool)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    base_logits = _logits_hf(hf_base, ids, mask)
    base_diff = np.abs(_logits_ours(from_pretrained(folder), ids, mask)[real] - base_logits[real]).max()
    with tempfile.TemporaryDirectory() as tmp:
        # export: ours -> PEFT folder -> peft over transformers
        ours = from_pretrained(folder, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=LORA_TARGETS)
        flat = [
            (p, v.replace(jnp.asarray(rng.normal(0, 0.02, v.get_value().shape), jnp.float32)))
            for p, v in nnx.to_flat_state(nnx.state(ours, LoRAParam))
        ]
        nnx.update(ours, nnx.from_flat_state(flat))
        out = lora.write_peft_adapter(ours, pathlib.Path(tmp) / "export", str(folder))
        peft_model = peft.PeftModel.from_pretrained(hf_base, str(out)).eval()
        theirs = _logits_hf(peft_model, ids, mask)
        export_diff = np.abs(_logits_ours(ours, ids, mask)[real] - theirs[real]).max()
        export_moved = np.abs(theirs[real] - base_logits[real]).max()
        # import: a PEFT folder saved by peft -> ours
        hf_fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        saved = peft.get_peft_model(
            hf_fresh,
            peft.LoraConfig(r=RANK, lora_alpha=int(ALPHA), target_modules=list(LORA_TARGETS), init_lora_weights=False),
        )
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in saved.named_parameters():
                if "lora_" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        saved.save_pretrained(pathlib.Path(tmp) / "import")
        ref = _logits_hf(saved.eval(), ids, mask)
        imported = from_pretrained(folder, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=LORA_TARGETS)
        lora.read_peft_adapter(imported, pathlib.Path(tmp) / "import")
        import_diff = np.abs(_logits_ours(imported, ids, mask)[real] - ref[real]).max()
        import_moved = np.abs(ref[real] - base_logits[real]).max()
    print(f"SmolLM2-135M-Instruct, rank {RANK}, alpha {ALPHA:g}, all 7 projections, {int(real.sum())} real tokens")
    print(f"  base model, no adapters (ours vs transformers): max |logit diff| {base_diff:.2e}")
    for what, diff, moved in (
        ("export (ours -> peft)", export_diff, export_moved),
        ("import (peft -> ours)", import_diff, import_moved),
    ):
        print(f"  {what}: max |logit diff| {diff:.2e} (the adapters move the logits by up to {moved:.2f})")


if __name__ == "__main__":
    main()
