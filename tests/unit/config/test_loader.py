"""Config loading: YAML + base chains + dotted overrides, and errors that name the key, the source and what is
accepted."""

import pathlib

import pytest
import yaml

from stare_jax.config.loader import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
    save_config,
    to_dict,
)
from stare_jax.training.setup import train_step_config

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_match_paper_settings():
    cfg = load_config()
    assert cfg.rl.stare.target_entropy == 0.3 and cfg.rl.stare.top_p == 0.1
    assert (cfg.rl.stare.w, cfg.rl.stare.m) == (1.1, 0.9)
    assert (cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.clip_c) == (0.2, 0.28, 10.0)
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.grad_clip == 1.0
    assert (cfg.rl.train_batch_size, cfg.rl.group_size, cfg.rl.gen_batch_size) == (64, 8, 192)
    assert cfg.rl.loss_agg == "token-mean" and cfg.rl.stare.gate == "batch"


def test_yaml_base_chain_and_overrides(tmp_path):
    _write(tmp_path, "base.yaml", {"seed": 3, "rl": {"group_size": 4, "stare": {"w": 1.3}}})
    child = _write(tmp_path, "child.yaml", {"base": "base.yaml", "rl": {"stare": {"enabled": True}}})
    cfg = load_config(child, ["rl.stare.w=1.2", "optimizer.lr=3e-6", "model.path=null"])
    assert cfg.seed == 3 and cfg.rl.group_size == 4
    assert cfg.rl.stare.enabled is True and cfg.rl.stare.w == 1.2
    assert cfg.optimizer.lr == pytest.approx(3e-6) and cfg.model.path is None


def test_unknown_key_suggests_closest_and_names_file(tmp_path):
    p = _write(tmp_path, "bad.yaml", {"rl": {"stare": {"targt_entropy": 0.2}}})
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "rl.stare.targt_entropy" in msg and "did you mean 'rl.stare.target_entropy'" in msg


def test_unknown_section_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optimiser'.*did you mean 'optimizer'"):
        load_config(None, ["optimiser.lr=1"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rl.stare.w=0.5", r"'rl.stare.w' = 0.5 is out of range; accepted: \[1.0, inf\]"),
        ("rl.stare.m=0", r"'rl.stare.m' = 0.0 is out of range; accepted: \(0.0, 1.0\]"),
        ("rl.stare.top_p=1.5", r"'rl.stare.top_p' = 1.5 is out of range"),
        ("rl.stare.variant=O5", r"accepted values: 'O1', 'O2'.*'C4'"),
        ("rl.stare.gate=batc", r"did you mean 'batch'"),
        ("rl.group_size=2.5", r"'rl.group_size' = 2.5 has the wrong type; expected an integer"),
        ("rl.stare.enabled=maybe", r"expected a boolean"),
        ("optimizer.lr=abc", r"expected a number"),
        ("mesh.fsdp=0", r"'mesh.fsdp' = 0 is not accepted"),
        ("optimizer.lr=.nan", r"finite"),
    ],
)
def test_bad_values_name_key_source_and_accepted(override, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        load_config(None, [override])
    assert f"command-line override '{override}'" in str(e.value)


def test_bad_value_in_file_names_file(tmp_path):
    p = _write(tmp_path, "c.yaml", {"rl": {"loss_agg": "token_mean"}})
    with pytest.raises(ConfigError, match="token-mean") as e:
        load_config(p)
    assert str(p) in str(e.value) and "rl.loss_agg" in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("rl.stare.w")
    with pytest.raises(ConfigError, match="malformed key"):
        parse_override("rl..w=1")
    assert parse_override("optimizer.lr=1e-6") == (["optimizer", "lr"], 1e-6)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    loop = _write(tmp_path, "loop.yaml", {"base": "loop.yaml"})
    with pytest.raises(ConfigError, match="circular"):
        load_config(loop)


def test_resolved_config_round_trip(tmp_path):
    cfg = load_config(None, ["rl.stare.enabled=true", "rl.stare.variant=C2", "data.eval_paths={a: x.jsonl}"])
    out = save_config(cfg, tmp_path / "run")
    back = config_from_dict(yaml.safe_load(out.read_text()), source=str(out))
    assert to_dict(back) == to_dict(cfg) and isinstance(back, Config)
    assert back.data.eval_paths == {"a": "x.jsonl"}


def test_every_shipped_config_loads():
    """Every run config loads as a run config, every SFT config (configs/sft_*.yaml, *_sft.yaml) as an SFT config."""
    from stare_jax.config.loader import is_sft_config_file
    from stare_jax.training.sft import load_sft_config

    files = sorted(CONFIGS.rglob("*.yaml"))
    assert files, "configs/ has no YAML files"
    for f in files:
        load_sft_config(f) if is_sft_config_file(f) else load_config(f)


def test_rl_stare_is_the_step_stare_config():
    """One StareConfig: the run config's rl.stare section is the jitted step's static config (no field copy)."""
    from stare_jax.rl.stare import StareConfig
    from stare_jax.training.setup import train_step_config

    cfg = load_config(None, ["rl.stare.enabled=true", "rl.stare.target_entropy=0", "rl.stare.select_impl=jnp_quantile"])
    assert type(cfg.rl.stare) is StareConfig and cfg.rl.stare.target_entropy == 0.0
    assert train_step_config(cfg).stare is cfg.rl.stare
    # scope micro_batch ranks groups of rl.micro_batch_size unless rl.stare.micro_batch_size says otherwise
    mb = load_config(None, ["rl.stare.scope=micro_batch", "rl.micro_batch_size=4"])
    assert mb.rl.stare.micro_batch_size is None and train_step_config(mb).stare.micro_batch_size == 4
    own = load_config(None, ["rl.stare.scope=micro_batch", "rl.micro_batch_size=4", "rl.stare.micro_batch_size=2"])
    assert train_step_config(own).stare.micro_batch_size == 2


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rl.stare.target_entropy=-0.1", r"'rl.stare.target_entropy' = -0.1 is out of range; accepted: \[0.0, inf\]"),
        ("rl.stare.select_impl=sort", r"accepted values: 'bisect', 'jnp_quantile'"),
        ("rl.stare.micro_batch_size=0", r"'rl.stare.micro_batch_size' = 0 is out of range"),
        ("rl.stare.selct_impl=bisect", r"did you mean 'rl.stare.select_impl'"),
    ],
)
def test_stare_options_errors_name_key_and_source(override, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        load_config(None, [override])
    assert f"command-line override '{override}'" in str(e.value)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rl.policy_loss.name=vanila"], r"'rl.policy_loss.name' = 'vanila' is not accepted.*did you mean 'vanilla'"),
        (
            ["rl.policy_loss.clip_cov_ratio=0.1"],
            r"rl.policy_loss.clip_cov_ratio do not belong to policy loss 'vanilla'",
        ),
        (
            ["rl.policy_loss.name=gspo", "rl.policy_loss.tau_pos=2"],
            r"rl.policy_loss.tau_pos do not belong to policy "
            r"loss 'gspo'",
        ),
        (["rl.policy_loss.name=stare"], r"'stare' needs rl.stare.enabled: true"),
        (
            ["rl.policy_loss.name=geo_mean", "rl.stare.enabled=true"],
            r"rl.stare.enabled: true cannot be combined with "
            r"rl.policy_loss.name = 'geo_mean'",
        ),
        (["rl.policy_loss.name=geo_mean", "rl.token_filter.enabled=true"], r"rl.token_filter.enabled: true cannot"),
        (["rl.policy_loss.name=clip_cov", "rl.policy_loss.clip_cov_lb=6"], r"clip_cov_lb=6.0 must be < clip_cov_ub"),
        (["rl.entropy_coeff=-0.1"], r"'rl.entropy_coeff' = -0.1 is out of range"),
        (["rl.token_filter.rho=0"], r"'rl.token_filter.rho' = 0.0 is out of range"),
        (["rl.token_filter.rule=top_k"], r"accepted values: 'quantile', 'exact_top_k'"),
    ],
)
def test_policy_loss_options_errors_name_key_and_source(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        load_config(None, overrides)
    assert "command-line override 'rl." in str(e.value)


def test_policy_loss_sections_reach_the_step_config():
    from stare_jax.training.setup import train_step_config

    cfg = load_config(
        None,
        [
            "rl.policy_loss.name=kl_cov",
            "rl.policy_loss.kl_cov_ratio=0.01",
            "rl.entropy_coeff=0.001",
            "rl.token_filter.enabled=true",
            "rl.micro_batch_size=4",
            "rl.policy_loss.scope=micro_batch",
            "seed=3",
        ],
    )
    t = train_step_config(cfg)
    assert t.policy_loss.name == "kl_cov" and t.policy_loss.micro_batch_size == 4 and t.seed == 3
    assert t.policy_loss.options() == {
        "kl_cov_ratio": 0.01,
        "ppo_kl_coef": 0.1,
        "scope": "micro_batch",
        "micro_batch_size": 4,
    }
    assert t.entropy_coeff == 0.001 and t.token_filter is cfg.rl.token_filter and t.token_filter.rho == 0.2
    assert train_step_config(load_config()).policy_loss.micro_batch_size is None  # vanilla: nothing filled in


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rl.kl.coef=0.001"], r"rl.kl.coef = 0.001 needs a reference policy: set rl.kl.reference"),
        (["rl.kl.estimator=low_var"], r"'rl.kl.estimator' = 'low_var' is not accepted.*did you mean 'low_var_kl'"),
        (["rl.kl.use_as=advantage"], r"'rl.kl.use_as' = 'advantage' is not accepted"),
        (["rl.kl.coef=-1", "rl.kl.reference=initial"], r"'rl.kl.coef' = -1.0 is out of range"),
        (
            [
                "rl.advantage.estimator=w_reinforce",
                "rl.kl.coef=0.001",
                "rl.kl.reference=initial",
                "rl.kl.use_as=reward",
            ],
            r"rl.kl.use_as = 'reward' cannot be combined with rl.advantage.estimator = 'w_reinforce'",
        ),
        (["rl.advantage.estimator=w_reinforce", "rl.overlong_buffer=4"], r"rl.overlong_buffer = 4 cannot be combined"),
        (
            ["rl.advantage.w_reinforce_lambda=0.5"],
            r"rl.advantage.w_reinforce_lambda = 0.5 belongs to "
            r"rl.advantage.estimator = 'w_reinforce'",
        ),
        (
            ["rl.advantage.entropy_adv_kappa=3"],
            r"rl.advantage.entropy_adv_kappa only apply with "
            r"rl.advantage.entropy_adv: true",
        ),
        (
            ["rl.advantage.entropy_adv=true", "rl.stare.enabled=true"],
            r"rl.advantage.entropy_adv: true cannot be "
            r"combined with rl.stare.enabled: true",
        ),
        (["rl.advantage.entropy_adv=true", "rl.policy_loss.name=geo_mean"], r"entropy_adv: true needs a token-level"),
        (["rl.advantage.estimator=reinforce"], r"'rl.advantage.estimator' = 'reinforce' is not accepted"),
    ],
)
def test_kl_and_advantage_errors_name_key_and_source(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        load_config(None, overrides)
    assert "command-line override 'rl." in str(e.value)


def test_kl_and_advantage_sections_reach_the_step_config():
    cfg = load_config(
        None,
        [
            "rl.kl.coef=0.001",
            "rl.kl.reference=initial",
            "rl.advantage.entropy_adv=true",
            "rl.group_size=4",
            "rl.norm_adv_by_std=false",
        ],
    )
    t = train_step_config(cfg)
    assert t.kl is cfg.rl.kl and t.kl.as_loss and t.kl.kind == "low_var_kl"  # verl's kl_loss_type default
    assert t.advantage is cfg.rl.advantage and t.group_size == 4 and t.norm_adv_by_std is False
    monitor = load_config(None, ["rl.kl.reference=/some/hf/folder"]).rl.kl  # coef 0: only the KL is logged
    assert monitor.enabled and not monitor.as_loss and not monitor.as_reward


def test_model_section_overrides_the_architecture_by_field_name():
    """The run's model section and the architecture config share exactly these fields (derived by name)."""
    cfg = load_config(None, ["model.dtype=bfloat16", "model.scan_layers=true", "model.attention_impl=dot_product"])
    assert cfg.model.architecture_overrides() == {
        "dtype": "bfloat16",
        "param_dtype": "float32",
        "attention_impl": "dot_product",
        "remat_policy": "none",
        "scan_layers": True,
    }


def test_model_lora_section_sets_the_adapter_fields_only_when_enabled():
    off = load_config(None, ["model.lora.rank=8"]).model.architecture_overrides()
    assert not any(k.startswith("lora_") for k in off)
    on = load_config(None, ["model.lora.enabled=true", "model.lora.rank=8", "model.lora.target_modules=[q_proj]"])
    assert on.model.architecture_overrides().items() >= {"lora_rank": 8, "lora_targets": ("q_proj",)}.items()
