"""LoRAConfig: the run config's `model.lora` section - train low-rank adapters on a frozen base (PEFT's LoRA:
each targeted projection computes x W + (alpha / rank) x A B, A random and B zero at the start, so the adapted
policy starts as the base). No jax here: the run config imports it. The model side is stare_jax.models.lora.

Off by default. With it on, only the adapters are trained (the base weights get no gradient and no optimizer
state: a 7B policy's AdamW state drops from 12 bytes per parameter to the adapters'), the KL reference is the
frozen base itself when rl.kl.reference is 'initial', and `stare-jax export` writes a PEFT adapter folder.
`init_from` starts a new run from a PEFT adapter folder (e.g. an SFT adapter) instead of the fresh init; the folder's
r / lora_alpha / target_modules must be this section's (checked when the run opens: stare_jax.training.setup).
"""

from __future__ import annotations

import dataclasses

from stare_jax.config.options import ConfigError, option, validate_fields
from stare_jax.models.config import LORA_TARGETS


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the decoder's projections (HF module names, as PEFT's target_modules)."""

    enabled: bool = option(False, "train LoRA adapters on a frozen base instead of every weight")
    rank: int = option(32, "adapter rank r", lo=1)
    alpha: float = option(
        64.0, "PEFT's lora_alpha: the adapters' update is scaled by alpha / rank", lo=0.0, lo_open=True
    )
    target_modules: list = option(
        list(LORA_TARGETS),
        "HF module names to adapt: any of " + ", ".join(LORA_TARGETS) + " (default all linear layers of the decoder)",
    )
    init_from: str | None = option(
        None,
        "PEFT adapter folder (adapter_config.json + adapter_model.safetensors, e.g. an SFT adapter) the adapters "
        "start from instead of PEFT's fresh init; its r, lora_alpha and target_modules must equal this section's. "
        "A new run only: on resume the checkpoint's adapters win",
    )

    def __post_init__(self):
        validate_fields(self, "model.lora")
        if self.init_from is not None and not self.enabled:
            raise ConfigError(
                f"model.lora.init_from = {self.init_from!r} needs model.lora.enabled=true (it names the adapters "
                f"a LoRA run starts from)"
            )
        if self.init_from is not None and not str(self.init_from).strip():
            raise ConfigError("model.lora.init_from is empty: name a PEFT adapter folder, or null for the fresh init")
        targets = list(self.target_modules)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            what = (
                f"unknown module name(s) {unknown}"
                if unknown
                else "no module"
                if not targets
                else "a module named twice"
            )
            raise ConfigError(
                f"model.lora.target_modules = {list(targets)}: {what}; allowed: {', '.join(LORA_TARGETS)}"
            )

    def architecture_fields(self) -> dict:
        """The stare_jax.models.ModelConfig fields this section sets (none when off: the architecture's own
        defaults, no adapters)."""
        if not self.enabled:
            return {}
        return {"lora_rank": self.rank, "lora_alpha": float(self.alpha), "lora_targets": tuple(self.target_modules)}
