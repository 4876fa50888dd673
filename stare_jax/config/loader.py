"""Typed run configuration: dataclass sections, YAML files, dotted command-line overrides, strict validation.

One `Config` describes a whole run (model, mesh, data, sampling, RL/STARE, optimizer, checkpointing, logging).
YAML files may name a `base:` file (relative to themselves) whose values they override. Every key is checked:
an unknown key (with the closest valid key suggested), a wrong type or an out-of-range value raises
`ConfigError` naming the dotted key, the file or override it came from, and what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from stare_jax.config.advantage import AdvantageConfig
from stare_jax.config.engine import EngineConfig
from stare_jax.config.kl import KLConfig
from stare_jax.config.lora import LoRAConfig
from stare_jax.config.offload import OffloadConfig
from stare_jax.config.optimizer import OptimizerConfig
from stare_jax.config.options import ConfigError, check_range, coerce, option
from stare_jax.config.packing import PackingConfig
from stare_jax.config.policy_loss import TOKEN_LEVEL, PolicyLossConfig, TokenFilterConfig
from stare_jax.config.rollout_correction import RolloutCorrectionConfig
from stare_jax.config.stare import StareConfig
from stare_jax.models.config import AttentionImpl, ModelConfig, RematPolicy
from stare_jax.tools.config import ToolConfig

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelRunConfig:
    """Which model to train and how to compute with it."""

    path: str | None = option(
        None, doc="HF checkpoint folder (config.json + *.safetensors); None with `preset` for random init"
    )
    preset: str | None = option(None, doc="named architecture (e.g. qwen2.5-7b) or 'tiny'; used when path is None")
    dtype: DType = option("float32", doc="compute dtype")
    param_dtype: DType = option("float32", doc="parameter (master) dtype")
    attention_impl: AttentionImpl = option("xla", doc="attention kernel")
    remat_policy: RematPolicy = option("none", doc="per-layer rematerialisation")
    scan_layers: bool = option(
        False,
        doc="stacked layers run as one lax.scan (one compiled layer, sequential "
        "remat); checkpoints are then stored stacked",
    )
    tokenizer_path: str | None = option(None, doc="tokenizer folder or SentencePiece .model; defaults to path")
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters on a frozen base (stare_jax/config/lora.py)

    def architecture_overrides(self) -> dict:
        """The stare_jax.models.ModelConfig fields this section sets on top of the checkpoint's config.json: every
        field of this section that the architecture config also has, by name (numerics, kernels, remat, scan),
        and the LoRA adapters' (lora_rank, lora_alpha, lora_targets) from `lora`."""
        arch = {f.name for f in dataclasses.fields(ModelConfig)}
        same_named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in arch}
        return {**same_named, **self.lora.architecture_fields()}


@dataclass
class MeshConfig:
    """Device mesh with named axes; -1 means 'all remaining devices' (at most one axis)."""

    data: int = option(1, lo=-1, nonzero=True)
    fsdp: int = option(-1, lo=-1, nonzero=True)
    tensor: int = option(1, lo=-1, nonzero=True)


@dataclass
class DataConfig:
    """Prompt data for training and held-out evaluation."""

    train_path: str | None = option(None, doc="jsonl/parquet of {problem, answer} rows")
    eval_paths: dict = option({}, doc="benchmark name -> jsonl path")
    prompt_field: str = option("problem")
    answer_field: str = option("answer")
    task: Literal["math", "digit_set", "digit_sum", "tool_mul"] = option(
        "math", doc="verifier: math answers (sandboxed) or one of the toy tasks"
    )
    prompt_template: Literal["paper", "chat", "raw"] = option("paper", doc="paper instruction, chat template, or raw")
    max_prompt_len: int = option(1024, lo=1)
    shuffle: bool = option(True)
    seed: int = option(0, lo=0)


@dataclass
class SamplingConfig:
    """Rollout generation (training) and evaluation sampling."""

    max_new_tokens: int = option(3072, lo=1)
    temperature: float = option(1.0, lo=0.0)
    top_p: float = option(1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k: int = option(0, lo=0, doc="0 = off")
    kv_cache_dtype: DType = option("bfloat16")
    dtype: DType | None = option(
        None,
        doc="the sampler's compute dtype (weights cast, activations and matmuls in it); null = model.dtype. "
        "bfloat16 under a float32 trainer: the sampler/trainer mismatch rl.rollout_correction measures",
    )
    max_prompts_per_call: int = option(
        0, lo=0, doc="prompts per sampler call (bounds the KV cache); 0 = the whole generation batch in one call"
    )
    eval_temperature: float = option(0.7, lo=0.0)
    eval_top_p: float = option(0.95, lo=0.0, hi=1.0, lo_open=True)
    eval_num_samples: int = option(0, lo=0, doc="samples per eval problem; 0 = the paper's protocol per benchmark")
    engine: EngineConfig = field(default_factory=EngineConfig)  # the rollout engine (sampling.engine.enabled)


# rl.stare is StareConfig itself (stare_jax/config/stare.py): one definition, with the same field metadata, for
# the run config and the jitted step.


@dataclass
class RLConfig:
    """GRPO-ds: group sampling, dynamic sampling, advantages and the clipped surrogate."""

    train_batch_size: int = option(64, lo=1, doc="prompts per RL step")
    group_size: int = option(8, lo=1, doc="G rollouts per prompt")
    gen_batch_size: int = option(192, lo=1, doc="prompts per generation batch")
    dynamic_sampling: bool = option(True)
    max_num_gen_batches: int = option(10, lo=1)
    norm_adv_by_std: bool = option(True)
    clip_low: float = option(0.2, lo=0.0, hi=1.0)
    clip_high: float = option(0.28, lo=0.0)
    clip_c: float = option(10.0, lo=1.0, doc="dual-clip constant")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = option(
        "token-mean"
    )
    micro_batch_size: int = option(
        8, lo=1, doc="sequences per forward/backward micro-batch on each data-parallel shard"
    )
    micro_batch_tokens: int = option(
        0,
        lo=0,
        doc="token budget per device per micro-batch (verl's "
        "ppo_max_token_len_per_gpu): with rl.packing, rows per micro-batch "
        "= this // row_tokens; without, sequences per micro-batch = this // "
        "the batch's length bucket. 0 = rl.micro_batch_size",
    )
    packing: PackingConfig = field(default_factory=PackingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    mini_batches: int = option(1, lo=1, doc="optimizer steps per RL batch")
    ppo_epochs: int = option(1, lo=1)
    logprob_chunk_size: int = option(512, lo=1, doc="sequence chunk of the log-prob/entropy pass")
    reward: Literal["binary", "signed"] = option("binary", doc="1/0 (paper) or +1/-1 (DAPO)")
    overlong_buffer: int = option(0, lo=0, doc="DAPO overlong penalty buffer in tokens (0 = off)")
    overlong_penalty: float = option(1.0, lo=0.0)
    stare: StareConfig = field(default_factory=StareConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = option(0.0, lo=0.0, doc="entropy bonus (verl): loss -= entropy_coeff * agg(entropy)")
    token_filter: TokenFilterConfig = field(default_factory=TokenFilterConfig)
    kl: KLConfig = field(default_factory=KLConfig)  # frozen reference policy + KL penalty (stare_jax/config/kl.py)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)  # W-REINF, EntroAdv
    # the sampler/trainer mismatch: diagnostics always, verl's IS weights / rejection when set
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self):
        """Combinations of the sections that are rejected (ConfigError naming the keys)."""
        name = self.policy_loss.name
        adv = self.advantage
        if adv.entropy_adv and self.stare.enabled:
            raise ConfigError(
                "rl.advantage.entropy_adv: true cannot be combined with rl.stare.enabled: true: both "
                "reshape the advantage of high-entropy / high-surprisal tokens to control entropy; "
                "compare them as separate arms"
            )
        if adv.entropy_adv and name not in TOKEN_LEVEL:
            raise ConfigError(
                f"rl.advantage.entropy_adv: true needs a token-level loss; rl.policy_loss.name = "
                f"{name!r} is sequence-level (token-level: {', '.join(TOKEN_LEVEL)})"
            )
        if adv.estimator == "w_reinforce":
            if self.kl.as_reward:
                raise ConfigError(
                    "rl.kl.use_as = 'reward' cannot be combined with rl.advantage.estimator = "
                    "'w_reinforce': W-REINF's advantage comes from correctness alone (lambda / -1), "
                    "there is no reward for the KL penalty to enter; use rl.kl.use_as: loss"
                )
            if self.overlong_buffer:
                raise ConfigError(
                    f"rl.overlong_buffer = {self.overlong_buffer} cannot be combined with "
                    f"rl.advantage.estimator = 'w_reinforce' (its advantage ignores reward shaping); "
                    f"set rl.overlong_buffer: 0"
                )
        if self.stare.surprisal_source == "rollout":
            if not self.rollout_correction.rollout_log_probs:
                raise ConfigError(
                    "rl.stare.surprisal_source = 'rollout' needs the sampler's log-probs: set "
                    "rl.rollout_correction.rollout_log_probs: true"
                )
            if self.stare.scope != "batch":
                raise ConfigError(
                    "rl.stare.surprisal_source = 'rollout' needs rl.stare.scope = 'batch' (scope micro_batch "
                    "ranks the current policy's log-probs inside each micro-batch)"
                )
        if name == "stare" and not self.stare.enabled:
            raise ConfigError(
                "rl.policy_loss.name = 'stare' needs rl.stare.enabled: true (STARE is the vanilla "
                "loss weighted by omega; name 'vanilla' with rl.stare.enabled is the same)"
            )
        for key, on in (
            ("rl.stare.enabled", self.stare.enabled),
            ("rl.token_filter.enabled", self.token_filter.enabled),
        ):
            if on and name not in TOKEN_LEVEL:
                raise ConfigError(
                    f"{key}: true cannot be combined with rl.policy_loss.name = {name!r}: it weights "
                    f"the per-token loss and {name!r} is a sequence-level loss (token-level: "
                    f"{', '.join(TOKEN_LEVEL)})"
                )


# optimizer is OptimizerConfig itself (stare_jax/config/optimizer.py), like rl.stare.


@dataclass
class CheckpointConfig:
    """orbax-checkpoint settings."""

    every_steps: int = option(50, lo=0, doc="0 = only at the end")
    keep: int = option(3, lo=1)
    async_save: bool = option(True)
    on_nan: Literal["skip", "stop"] = option("skip", doc="a non-finite loss skips the update or stops the run")


@dataclass
class LoggingConfig:
    """Metrics sinks."""

    tensorboard: bool = option(True)
    wandb_project: str | None = option(None)
    progress_bar: bool = option(True)
    eval_every_steps: int = option(0, lo=0, doc="0 = no periodic eval")


@dataclass
class ToyConfig:
    """The embedded CPU default (stare_jax/toy/__init__.py): when enabled, the run builds (or reuses from cache_dir) the
    digit-sum data, a SentencePiece tokenizer and an SFT warm-started tiny model, and trains that."""

    enabled: bool = option(False)
    cache_dir: str = option(".cache/toy")
    task: Literal["digit_set", "digit_sum", "tool_mul"] = option("digit_set")
    seed: int = option(0, lo=0)
    num_train: int = option(4000, lo=1)
    num_eval: int = option(200, lo=1)
    k_min: int = option(3, lo=1)
    k_max: int = option(5, lo=1)
    set_size: int = option(3, lo=1, hi=9, doc="digit_set, tool_mul: how many digits a prompt's set has")
    hidden_size: int = option(128, lo=8)
    num_layers: int = option(4, lo=1)
    sft_steps: int = option(150, lo=0)
    sft_lr: float = option(3e-3, lo=0.0, lo_open=True)
    sft_noise: float = option(0.3, lo=0.0, hi=1.0, doc="fraction of warm-start answer digits replaced by random ones")
    sft_direct_frac: float = option(
        0.0, lo=0.0, hi=1.0, doc="tool_mul: fraction of warm-start answers guessed without calling the tool"
    )
    vocab_size: int = option(40, lo=8, doc="the toy tokenizer's vocabulary size")


@dataclass
class LaunchConfig:
    """Where the run is meant to go (used by `stare-jax plan` and the launch/ scripts)."""

    accelerator: str | None = option(None, doc="TPU type (e.g. v5p-64) or GPUs as [NODESx]GPUSxTYPE (e.g. 2x8xH100)")
    gpu_alternative: str | None = option(
        None,
        doc="a GPU cluster the run also fits (with the overrides the config's "
        "comment names, e.g. a smaller sampler call), e.g. 2x8xH100",
    )


@dataclass
class Config:
    """A whole run."""

    seed: int = option(0, lo=0)
    total_steps: int = option(100, lo=1, doc="RL steps")
    model: ModelRunConfig = field(default_factory=ModelRunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)
    tool: ToolConfig = field(default_factory=ToolConfig)  # multi-turn tool use (tool.enabled; needs the engine)

    def __post_init__(self):
        ref = self.rl.kl.reference
        if self.model.lora.enabled and ref not in (None, "initial"):
            raise ConfigError(
                f"rl.kl.reference = {ref!r} with model.lora.enabled: a LoRA run's reference is its "
                f"frozen base: set rl.kl.reference to 'initial' (or null for no KL)"
            )


# ----------------------------------------------------------------------------------------------------------------
# Building a typed config from nested dicts, with errors that name the key and where it came from.


def _build(cls, data: dict, where: dict[str, str], prefix: str = ""):
    """Construct dataclass `cls` from `data`; `where` maps dotted keys to their source for error messages."""
    default_where = where.get("", "<defaults>")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where.get(prefix.rstrip('.'), default_where)}: '{prefix.rstrip('.')}' must be a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            full = prefix + str(k)
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"{where.get(full, default_where)}: unknown key '{full}'{hint} (valid keys here: {', '.join(fields)})"
            )
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        full = prefix + name
        src = where.get(full, default_where)
        tp = hints[name]
        value = data[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, where, full + ".")
            continue
        value = coerce(value, tp, full, src)
        check_range(value, f.metadata, full, src)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own cross-field check: name where the keys it mentions came from
        named = [k for k in where if k and k.startswith(prefix) and k in str(e)]
        named = [k for k in named if not any(o.startswith(k + ".") for o in named)]
        sources = list(dict.fromkeys(where[k] for k in named)) or [where.get(prefix.rstrip("."), default_where)]
        raise ConfigError(f"{'; '.join(sources)}: {e}") from None


def _merge(base: dict, over: dict, where: dict[str, str], source: str, prefix: str = "") -> dict:
    out = dict(base)
    for k, v in over.items():
        full = prefix + str(k)
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "eval_paths":
            out[k] = _merge(out[k], v, where, source, full + ".")
        else:
            out[k] = v
            where[full] = source
            if isinstance(v, dict):
                for sub in _flatten(v, full + "."):
                    where[sub] = source
    return out


def _flatten(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys.append(prefix + str(k))
        if isinstance(v, dict):
            keys.extend(_flatten(v, prefix + str(k) + "."))
    return keys


def _read_yaml(path: pathlib.Path, where: dict[str, str], seen: tuple = ()) -> dict:
    """Read a YAML config, resolving a top-level `base:` chain (relative paths are relative to the file)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'base:' chain: {' -> '.join(str(p) for p in seen + (path,))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    merged: dict = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file path string, got {base!r}")
        merged = _read_yaml(path.parent / base, where, seen + (path,))
    return _merge(merged, raw, where, str(path))


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split 'rl.stare.w=1.2' into (['rl', 'stare', 'w'], 1.2); the value is parsed as YAML (so 1e-6, true, null
    work)."""
    if "=" not in text:
        raise ConfigError(f"command-line override {text!r}: expected KEY=VALUE, e.g. rl.stare.w=1.2")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"command-line override {text!r}: malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        # YAML 1.1 leaves '1e-6' as a string; accept it as a float.
        try:
            value = float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            pass
    return key.split("."), value


def load_section(cls, path: str | pathlib.Path | None = None, overrides: typing.Sequence[str] = (), prefix: str = ""):
    """Dataclass `cls` from a YAML file (its `base:` chain; the defaults when path is None) and dotted KEY=VALUE
    overrides, every key checked. `prefix` (e.g. "sft.") is how errors name the keys; an override may carry it."""
    where: dict[str, str] = {"": str(path) if path else "<defaults>"}
    data = _read_yaml(pathlib.Path(path), where) if path else {}
    where = {(prefix + k if k else k): v for k, v in where.items()}
    head = prefix.rstrip(".")
    for text in overrides:
        keys, value = parse_override(text)
        if head and keys[0] == head and len(keys) > 1:
            keys = keys[1:]
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        data = _merge(data, nested, where, f"command-line override '{text}'", prefix)
    return _build(cls, data, where, prefix)


def load_config(path: str | pathlib.Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML config (or the defaults when path is None) and apply dotted KEY=VALUE overrides."""
    return load_section(Config, path, overrides)


def is_sft_config_file(path: str | pathlib.Path) -> bool:
    """Whether a config file is an SFT config (`stare-jax sft`'s options, stare_jax.training.sft.ConversationSFTConfig)
    rather than a run config, by its name: configs/sft_*.yaml or *_sft.yaml (e.g. configs/paper/*_sft.yaml)."""
    stem = pathlib.Path(path).stem
    return stem.startswith("sft_") or stem.endswith("_sft")


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    """Build a Config from a nested dict (e.g. read back from a run's config.yaml)."""
    where = {"": source}
    return _build(Config, data, where)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, run_dir: str | pathlib.Path) -> pathlib.Path:
    """Write the fully resolved config next to a run's outputs (RUN_DIR/config.yaml) and return its path."""
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(out)
    return out
