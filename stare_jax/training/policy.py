"""Load a policy for evaluation or export: a Hugging Face folder, or a training run folder (its config.yaml and
the newest orbax checkpoint in RUN_DIR/checkpoints), and write any of them back out as a Hugging Face folder."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import yaml
from etils import epath
from flax import nnx

from stare_jax import models
from stare_jax.config.loader import Config, config_from_dict
from stare_jax.models.lora import write_peft_adapter
from stare_jax.training.checkpoint import Checkpointer
from stare_jax.training.run_dir import is_remote, local_copy
from stare_jax.training.setup import (
    InputsFn,
    abstract_like,
    checkpoint_tree,
    init_run_state,
    resolve_inputs,
    train_step_config,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclasses.dataclass
class Policy:
    model: models.Transformer
    tokenizer_path: pathlib.Path
    run_config: Config | None  # the training run's config when loaded from a run folder
    step: int | None  # the checkpoint step restored (None for an HF folder)


def load_policy(
    path: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str = "float32",
    mesh=None,
    inputs_for: InputsFn = resolve_inputs,
    log=print,
) -> Policy:
    """An HF folder (config.json) or a training run folder (config.yaml + checkpoints/); with a mesh the
    parameters are loaded (and restored) straight into their sharded layout on it, on every process. inputs_for
    resolves a run folder's model and tokenizer (stare_jax.toy.assets.run_inputs for a toy run: run_training's
    argument of the same name)."""
    if is_remote(path):  # an HF folder on gs://: copied to local disk once (a remote run folder is not supported)
        if not (epath.Path(str(path)) / "config.json").exists():
            raise FileNotFoundError(
                f"{path}: only Hugging Face folders (config.json) are read from object storage; "
                f"export a training run with `stare-jax export` first"
            )
        path = local_copy(str(path), log=log)
    path = pathlib.Path(path)
    if (path / "config.json").is_file():
        return Policy(models.from_pretrained(path, dtype=dtype, mesh=mesh), path, None, None)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face folder (config.json) nor a training run folder "
            f"(config.yaml + checkpoints/)"
        )
    cfg = config_from_dict(yaml.safe_load((path / "config.yaml").read_text()), source=str(path / "config.yaml"))
    cfg, inputs = inputs_for(cfg, log)
    model = models.from_pretrained(
        inputs.model_path, mesh=mesh, **{**cfg.model.architecture_overrides(), "dtype": dtype}
    )
    tcfg = train_step_config(cfg)  # only the state's tree and shapes matter here, not the run's batch layout
    _, train_state, stare_state = init_run_state(model, tcfg, mesh)
    abstract = abstract_like(checkpoint_tree(cfg, train_state, stare_state))
    ckpt = Checkpointer(
        path / "checkpoints", keep=cfg.checkpoint.keep, every_steps=0, async_save=False, must_exist=True
    )
    try:
        restored = ckpt.restore(step, abstract_state=abstract)
    finally:
        ckpt.close()
    nnx.update(model, restored.state["train_state"].params)
    log(f"loaded {path} at checkpoint step {restored.step}")
    return Policy(model, inputs.tokenizer_path, cfg, restored.step)


def _copy_tokenizer(tokenizer_path, out_dir: pathlib.Path) -> None:
    """The tokenizer files next to the weights (a SentencePiece .model file, or an HF tokenizer folder's files)."""
    tok = pathlib.Path(tokenizer_path)
    tok_dir = tok.parent if tok.is_file() else tok
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copy2(tok_dir / name, out_dir / name)
    if tok.is_file() and tok.suffix == ".model" and not (out_dir / "tokenizer.model").exists():
        shutil.copy2(tok, out_dir / "tokenizer.model")


def export_policy(
    src: str | pathlib.Path,
    out_dir: str | pathlib.Path,
    *,
    step: int | None = None,
    merged: bool = False,
    inputs_for: InputsFn = resolve_inputs,
    log=print,
):
    """Write `src` (HF folder or training run) as an HF folder that transformers and stare_jax load: weights,
    config, and the tokenizer files next to them.

    A LoRA run (model.lora.enabled) is written as a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors, peft.PeftModel.from_pretrained loads it) whose base_model_name_or_path is the run's
    model.path; a run without one (the embedded toy) gets its base written as an HF folder in OUT_DIR/base, and
    the adapter points there. merged=True writes the full HF folder with the adapters merged into the weights."""
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"export: {out_dir} exists and is not empty")
    policy = load_policy(src, step=step, inputs_for=inputs_for, log=log)
    if policy.model.config.lora_rank and not merged:
        base = policy.run_config.model.path if policy.run_config is not None else None
        if not base:
            base_dir = out_dir / "base"
            models.save_pretrained(policy.model, base_dir)
            _copy_tokenizer(policy.tokenizer_path, base_dir)
            base = str(base_dir.resolve())
        write_peft_adapter(policy.model, out_dir, base_model_name_or_path=base)
        _copy_tokenizer(policy.tokenizer_path, out_dir)
        log(f"export: LoRA adapters as a PEFT folder over the base {base}")
        return out_dir
    models.save_pretrained(policy.model, out_dir, merged=merged)
    _copy_tokenizer(policy.tokenizer_path, out_dir)
    return out_dir
