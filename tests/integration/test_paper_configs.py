"""The paper's run configs (configs/paper/): 5 models x 3 arms load, differ only under rl.stare, carry the paper's
hyper-parameters (docs/stare.md, "The paper's run settings") and fit the model's context; their named TPU
slice (the `launch.accelerator:` comment) is one launch/tpu_vm.sh accepts and the mesh fits it. A fourth arm per
model, grpo_kl (the paper's "GRPO" baseline), differs from grpo_ds exactly in verl's GRPO recipe: KL loss to the
starting policy, symmetric clip, no dynamic sampling; its reference policy is in `stare-jax plan`'s estimate."""

from __future__ import annotations

import math
import pathlib
import re
import subprocess

import pytest
import yaml

from stare_jax.cli import main
from stare_jax.config.loader import is_sft_config_file, load_config, to_dict
from stare_jax.models import PRESETS
from stare_jax.planning.estimate import estimate, phase_peaks

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs" / "paper"
MODELS = ["qwen2.5-math-7b", "qwen2.5-14b-instruct", "qwen2.5-32b", "r1-distill-qwen-1.5b", "qwen3-8b-base"]
ARMS = ["grpo_ds", "stare_o1", "stare_c2"]
KL_ARM = "grpo_kl"  # the paper's "GRPO": verl's GRPO recipe (KL loss), beside GRPO-ds and STARE
# LoRA arms (model -> its slice): STARE-O1 as rank-32 adapters on every linear layer, on a smaller slice
LORA = {"qwen2.5-math-7b": "v5p-8", "qwen2.5-32b": "v5p-64"}
# Fallback context table (the public config.json values); presets in stare_jax.models win when they exist.
MAX_POSITIONS = {
    "qwen2.5-math-7b": 4096,
    "qwen2.5-14b-instruct": 32768,
    "qwen2.5-32b": 32768,
    "r1-distill-qwen-1.5b": 131072,
    "qwen3-8b-base": 32768,
}
# prompt + response per model (the semantics file: 4k for Qwen2.5-Math-7B, 8k for 14B/32B, 16k long CoT).
TOTAL_TOKENS = {
    "qwen2.5-math-7b": 4096,
    "qwen2.5-14b-instruct": 8192,
    "qwen2.5-32b": 8192,
    "r1-distill-qwen-1.5b": 16384,
    "qwen3-8b-base": 16384,
}
BENCHMARKS = {"aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"}


def _path(model: str, arm: str) -> pathlib.Path:
    return PAPER / f"{model}_{arm}.yaml"


@pytest.fixture(scope="module")
def cfgs():
    return {(m, a): load_config(_path(m, a)) for m in MODELS for a in ARMS}


TOOL = "qwen2.5-7b-tool"  # the tool-use scenario: Qwen2.5-7B-Base after cold-start SFT, code interpreter, 8k


def test_exactly_the_run_files():
    """5 models x (3 arms + grpo_kl), and the tool-use scenario's 3 arms and its cold-start SFT config."""
    names = sorted(p.name for p in PAPER.glob("*.yaml") if not p.name.startswith("_"))
    assert names == sorted(
        [f"{m}_{a}.yaml" for m in MODELS for a in ARMS + [KL_ARM]]
        + [f"{TOOL}_{a}.yaml" for a in ARMS]
        + [f"{TOOL}_sft.yaml"]
        + [f"{m}_lora_stare_o1.yaml" for m in LORA]
    )
    assert [n for n in names if is_sft_config_file(n)] == [f"{TOOL}_sft.yaml"]


@pytest.mark.parametrize("model", sorted(LORA))
def test_lora_arm_is_the_stare_arm_as_adapters_on_a_smaller_slice(cfgs, model):
    """The LoRA arm differs from STARE-O1 only in model.lora (rank 32, alpha 64, all seven projections), its learning
    rate and its slice; it fits that slice with the 10% headroom, not the next smaller one (the smallest it fits), and
    needs less memory per chip there than the full-weight arm."""
    lora_cfg = load_config(PAPER / f"{model}_lora_stare_o1.yaml")
    full, lo = to_dict(cfgs[(model, "stare_o1")]), to_dict(lora_cfg)
    assert lo["model"].pop("lora") == {
        "enabled": True,
        "rank": 32,
        "alpha": 64.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "init_from": None,
    }
    full["model"].pop("lora")
    assert lo["launch"].pop("accelerator") == LORA[model] and lo["optimizer"].pop("lr") == 1e-5
    full["launch"].pop("accelerator"), full["optimizer"].pop("lr")
    assert lo == full
    est = estimate(lora_cfg)
    assert est["fits"] and est["peak_bytes_per_device"] <= 0.9 * est["hbm_bytes_per_device"]
    smaller = {"v5p-64": "v5p-32"}.get(LORA[model])  # v5p-8 is the smallest v5p slice
    assert smaller is None or not estimate(lora_cfg, smaller)["fits"]
    assert est["peak_bytes_per_device"] < estimate(cfgs[(model, "stare_o1")], LORA[model])["peak_bytes_per_device"]


@pytest.mark.parametrize("model", MODELS)
def test_grpo_kl_arm_is_grpo_ds_with_verls_grpo_recipe(cfgs, model):
    kl_cfg = load_config(_path(model, KL_ARM))
    ds, kl = to_dict(cfgs[(model, "grpo_ds")]), to_dict(kl_cfg)
    assert kl["rl"].pop("kl") == {"coef": 0.001, "estimator": "low_var_kl", "use_as": "loss", "reference": "initial"}
    assert ds["rl"].pop("kl")["reference"] is None
    changed = {k: (ds["rl"][k], v) for k, v in kl["rl"].items() if ds["rl"][k] != v}
    assert changed == {"gen_batch_size": (192, 64), "dynamic_sampling": (True, False), "clip_high": (0.28, 0.2)}
    ds.pop("rl"), kl.pop("rl")
    assert ds == kl  # model, data, sampling, optimizer, mesh, launch: the same as the other arms
    assert kl_cfg.rl.gen_batch_size == kl_cfg.rl.train_batch_size  # no dynamic sampling: no extra prompts drawn


@pytest.mark.parametrize("model", MODELS)
def test_grpo_kl_plan_counts_the_reference_and_fits(model):
    """The estimate with the reference minus the same config without it is exactly the reference's bytes (the
    policy's parameters, sharded like them) in both phases, and the arm still fits its slice and GPU alternative."""
    with_ref = estimate(load_config(_path(model, KL_ARM)))
    without = estimate(load_config(_path(model, KL_ARM), ["rl.kl.coef=0", "rl.kl.reference=null"]))
    ref = with_ref["memory_bytes"]["train/reference_params"]
    assert ref == with_ref["model"]["params"] * 4 / (with_ref["devices"] // with_ref["mesh"]["data"])  # fp32 master
    assert "train/reference_params" not in without["memory_bytes"]
    a, b = phase_peaks(with_ref), phase_peaks(without)
    for phase in ("sampling", "training"):
        assert a[phase] - b[phase] == pytest.approx(ref, rel=1e-9)
    assert with_ref["peak_bytes_per_device"] - without["peak_bytes_per_device"] == pytest.approx(ref, rel=1e-9)
    assert with_ref["fits"]
    cfg = load_config(_path(model, KL_ARM), _gpu_overrides(model))
    assert estimate(cfg, cfg.launch.gpu_alternative)["fits"]


@pytest.mark.parametrize("model", MODELS)
def test_arms_differ_only_under_rl_stare(cfgs, model):
    dicts = {a: to_dict(cfgs[(model, a)]) for a in ARMS}
    stares = {a: d["rl"].pop("stare") for a, d in dicts.items()}
    assert dicts["grpo_ds"] == dicts["stare_o1"] == dicts["stare_c2"]
    assert stares["grpo_ds"]["enabled"] is False
    assert (stares["stare_o1"]["enabled"], stares["stare_o1"]["variant"]) == (True, "O1")
    assert (stares["stare_c2"]["enabled"], stares["stare_c2"]["variant"]) == (True, "C2")
    for s in stares.values():  # the arms share W/M/P/H_tgt/gate; only enabled/variant differ
        for key in ("enabled", "variant"):
            s.pop(key)
    assert stares["grpo_ds"] == stares["stare_o1"] == stares["stare_c2"]
    # and each arm file itself touches nothing but rl.stare
    for arm in ARMS:
        raw = yaml.safe_load(_path(model, arm).read_text())
        assert raw["base"] == f"_base_{model}.yaml"
        assert set(raw) == {"base", "rl"} and set(raw["rl"]) == {"stare"}


@pytest.mark.parametrize("model", MODELS)
def test_paper_hyper_parameters(cfgs, model):
    for arm in ARMS:
        c = cfgs[(model, arm)]
        o, rl, st, s = c.optimizer, c.rl, c.rl.stare, c.sampling
        assert (o.lr, o.b1, o.b2, o.weight_decay, o.grad_clip, o.schedule, o.warmup_steps) == (
            1e-6,
            0.9,
            0.999,
            0.01,
            1.0,
            "constant",
            0,
        )
        assert (rl.train_batch_size, rl.group_size, rl.gen_batch_size) == (64, 8, 192)
        assert rl.dynamic_sampling and rl.max_num_gen_batches == 10
        assert (rl.clip_low, rl.clip_high, rl.loss_agg) == (0.2, 0.28, "token-mean")
        assert (rl.mini_batches, rl.ppo_epochs) == (1, 1)  # one gradient step per batch (on-policy)
        assert (s.temperature, s.top_p, s.eval_temperature, s.eval_top_p) == (1.0, 1.0, 0.7, 0.95)
        big = model in ("qwen2.5-14b-instruct", "qwen2.5-32b")
        assert (st.w, st.m) == ((1.05, 0.95) if big else (1.1, 0.9))
        assert (st.target_entropy, st.top_p, st.gate) == (0.3, 0.1, "batch")
        assert c.model.path and c.model.path.startswith("/path/to/")  # placeholder the user must set
        assert c.data.train_path and c.data.train_path.startswith("/path/to/")
        assert set(c.data.eval_paths) == BENCHMARKS
        assert c.data.max_prompt_len + s.max_new_tokens == TOTAL_TOKENS[model]
        assert c.data.max_prompt_len == 1024
        # micro-batches tile the 64 x 8 training batch
        assert rl.micro_batch_size >= 1


@pytest.mark.parametrize("model", MODELS)
def test_prompt_plus_response_fit_the_context(cfgs, model):
    """Against the preset's max_position_embeddings and the checkpoint's own (the table; e.g. Qwen3-8B-Base has
    32768 where the qwen3-8b preset says 40960)."""
    c = cfgs[(model, "grpo_ds")]
    assert c.model.preset in PRESETS, f"{model}: model.preset {c.model.preset!r} is not a stare_jax preset"
    total = c.data.max_prompt_len + c.sampling.max_new_tokens
    assert total <= PRESETS[c.model.preset].max_position_embeddings
    assert total <= MAX_POSITIONS[model]


@pytest.mark.parametrize("model", MODELS)
def test_mesh_fits_the_named_tpu_slice(cfgs, model):
    accel = cfgs[(model, "stare_c2")].launch.accelerator
    assert accel, f"_base_{model}.yaml sets no launch.accelerator"
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "tpu_vm.sh"), "info", "--accelerator-type", accel],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    chips = int(re.search(r"chips (\d+)", out.stdout).group(1))
    c = cfgs[(model, "stare_c2")]
    arch = PRESETS[c.model.preset]
    mesh = c.mesh
    fixed = math.prod(v for v in (mesh.data, mesh.fsdp, mesh.tensor) if v != -1)
    assert chips % fixed == 0
    fsdp = chips // fixed if mesh.fsdp == -1 else mesh.fsdp
    assert mesh.data * fsdp * mesh.tensor == chips
    assert arch.num_kv_heads % mesh.tensor == 0 and arch.num_heads % mesh.tensor == 0
    # micro-batches of micro_batch_size sequences per data shard tile the 64 x 8 training batch
    assert (c.rl.train_batch_size * c.rl.group_size) % (c.rl.micro_batch_size * mesh.data * fsdp) == 0


GPU_OVERRIDES = ["sampling.max_prompts_per_call=32"]  # what the configs' GPU-alternative comments pass (--set)
# the engine's slots on the GPU alternative where the TPU slice's 512 (64 prompts x 8) do not fit 80 GB: the
# comments pass these too; the slices' 16 / 8 data shards hold max_slots / D slots each
GPU_SLOTS = {"qwen3-8b-base": 192, "qwen2.5-14b-instruct": 128, "qwen2.5-32b": 384}


def _gpu_overrides(model: str) -> list[str]:
    return GPU_OVERRIDES + ([f"sampling.engine.max_slots={GPU_SLOTS[model]}"] if model in GPU_SLOTS else [])


@pytest.mark.parametrize("model", MODELS)
def test_plan_fits_the_slice_and_the_gpu_alternative(model):
    """`stare-jax plan` (analytic estimate): every arm fits its TPU slice as configured, and its GPU alternative
    with the override its comment names (the comment's figure is the estimate's)."""
    from stare_jax.planning.estimate import GiB, estimate

    text = (PAPER / f"_base_{model}.yaml").read_text()
    for arm in ARMS:
        cfg = load_config(_path(model, arm))
        assert estimate(cfg)["fits"], (model, arm, cfg.launch.accelerator)
        gpu = estimate(load_config(_path(model, arm), _gpu_overrides(model)), cfg.launch.gpu_alternative)
        assert gpu["fits"], (model, arm, cfg.launch.gpu_alternative)
        assert all(f"--set {o}" in text for o in _gpu_overrides(model))
        assert f"{gpu['peak_bytes_per_device'] / GiB:.1f} GiB" in text


# ---------------------------------------------------------------------------------------------------------------
# The tool-use scenario (paper Figure 1 and Table 1's last row): qwen2.5-7b-tool_{grpo_ds,stare_o1,stare_c2}.yaml
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_cfgs():
    return {a: load_config(_path(TOOL, a)) for a in ARMS}


def test_tool_arms_differ_only_under_rl_stare(tool_cfgs):
    dicts = {a: to_dict(c) for a, c in tool_cfgs.items()}
    stares = {a: d["rl"].pop("stare") for a, d in dicts.items()}
    assert dicts["grpo_ds"] == dicts["stare_o1"] == dicts["stare_c2"]
    assert [(stares[a]["enabled"], stares[a]["variant"] if stares[a]["enabled"] else None) for a in ARMS] == [
        (False, None),
        (True, "O1"),
        (True, "C2"),
    ]
    for a in ARMS:
        raw = yaml.safe_load(_path(TOOL, a).read_text())
        assert raw["base"] == f"_base_{TOOL}.yaml" and set(raw) == {"base", "rl"} and set(raw["rl"]) == {"stare"}


def test_tool_paper_settings(tool_cfgs):
    """The paper's hyper-parameters (the same as every run), 8k responses, the cold-start SFT folder as the model,
    the hermes code interpreter on, and the engine (the tool rollouts need its append-and-continue)."""
    for c in tool_cfgs.values():
        o, rl, st, s = c.optimizer, c.rl, c.rl.stare, c.sampling
        assert (o.lr, o.b1, o.b2, o.weight_decay, o.grad_clip, o.schedule, o.warmup_steps) == (
            1e-6,
            0.9,
            0.999,
            0.01,
            1.0,
            "constant",
            0,
        )
        assert (rl.train_batch_size, rl.group_size, rl.gen_batch_size) == (64, 8, 192)
        assert rl.dynamic_sampling and rl.max_num_gen_batches == 10
        assert (rl.clip_low, rl.clip_high, rl.loss_agg, rl.mini_batches, rl.ppo_epochs) == (
            0.2,
            0.28,
            "token-mean",
            1,
            1,
        )
        assert (s.temperature, s.top_p, s.eval_temperature, s.eval_top_p) == (1.0, 1.0, 0.7, 0.95)
        assert (st.w, st.m, st.target_entropy, st.top_p, st.gate) == (1.1, 0.9, 0.3, 0.1, "batch")
        assert c.model.preset == "qwen2.5-7b" and c.model.path.startswith("/path/to/")
        assert "sft" in c.model.path.lower()  # the cold-start SFT output (stare-jax sft), not the base checkpoint
        assert s.max_new_tokens == 8192 and c.data.max_prompt_len == 1024
        assert c.data.max_prompt_len + s.max_new_tokens <= PRESETS["qwen2.5-7b"].max_position_embeddings
        assert c.data.prompt_template == "chat"  # the SFT model's template, listing the code tool (hermes)
        assert set(c.data.eval_paths) == BENCHMARKS
        assert c.tool.enabled and c.tool.format == "hermes" and c.tool.max_turns >= 1
        assert (c.tool.tool_bonus, c.tool.format_penalty) == (0.0, 0.0)  # the verifier's 0/1 reward only
        assert c.sampling.engine.enabled is True
        assert (c.mesh.data, c.mesh.fsdp) == (1, 1)  # tensor parallelism only on the shipped slice


def test_tool_plan_fits_its_single_host_slice_and_gpu_alternative(tool_cfgs):
    """`stare-jax plan`: the engine plans the rollouts, on one host, and the run fits its slice (v5p-8) and its
    GPU alternative; the slice is one launch/tpu_vm.sh knows, with one worker."""
    for a, cfg in tool_cfgs.items():
        for accel in (cfg.launch.accelerator, cfg.launch.gpu_alternative):
            est = estimate(cfg, accel)
            assert est["fits"], (a, accel, est["peak_bytes_per_device"])
            assert est["generator"] == "engine" and est["hosts"] == 1 and not est["warnings"]
            assert "sample/kv_page_pool" in est["memory_bytes"]
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "tpu_vm.sh"),
            "info",
            "--accelerator-type",
            tool_cfgs["stare_o1"].launch.accelerator,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert int(re.search(r"workers (\d+)", out.stdout).group(1)) == 1
    c = tool_cfgs["stare_o1"]
    assert PRESETS[c.model.preset].num_kv_heads % c.mesh.tensor == 0
    assert int(re.search(r"chips (\d+)", out.stdout).group(1)) == c.mesh.tensor


def test_tool_plan_rejects_the_engine_off():
    """Tool rollouts run on the engine: sampling.engine.enabled=false is rejected by the plan (the run would refuse
    to start), not planned as fitting. The same slice without tools plans (the static sampler there)."""
    cfg = load_config(_path(TOOL, "stare_o1"), ["sampling.engine.enabled=false"])
    with pytest.raises(ValueError, match=r"tool.enabled needs the rollout engine"):
        estimate(cfg, "v5p-8")
    cfg = load_config(_path(TOOL, "stare_o1"), ["sampling.engine.enabled=false", "tool.enabled=false"])
    assert estimate(cfg, "v5p-8")["generator"] == "static"


def test_tool_plan_runs_the_engine_on_a_multi_host_slice():
    """The engine's host scheduler is replicated over the processes: a multi-host slice plans the engine too."""
    for extra in ([], ["sampling.engine.enabled=auto"]):
        est = estimate(load_config(_path(TOOL, "stare_o1"), ["mesh.fsdp=-1", *extra]), "v5p-64")
        assert est["hosts"] == 8 and est["generator"] == "engine" and not est["warnings"]


def test_tool_plan_runs_the_engine_on_a_data_split_single_host_mesh():
    cfg = load_config(_path(TOOL, "stare_o1"), ["mesh.tensor=4", "mesh.fsdp=2"])
    est = estimate(cfg, "1x8xH100")
    assert est["generator"] == "engine" and not est["warnings"]


def test_tool_plan_cli_plans_a_multi_host_slice(capsys):
    assert main(["plan", str(_path(TOOL, "stare_c2")), "--accelerator", "v5p-64", "mesh.fsdp=-1"]) == 0
    assert "generator: engine" in capsys.readouterr().out


def test_tool_cold_start_sft_config(tool_cfgs):
    """configs/paper/qwen2.5-7b-tool_sft.yaml: the cold-start SFT of the arms' model at the paper's size (8k tokens,
    batch 32) on the arms' slice and mesh, with their model numerics; micro-batches split the batch."""
    from stare_jax.training.sft import load_sft_config

    sft = load_sft_config(PAPER / f"{TOOL}_sft.yaml")
    arm = tool_cfgs["stare_o1"]
    assert (sft.max_len, sft.batch_size, sft.tools) == (8192, 32, "code_interpreter")
    assert sft.launch.accelerator == arm.launch.accelerator and sft.mesh == arm.mesh
    for key in ("preset", "dtype", "param_dtype", "attention_impl", "remat_policy", "scan_layers"):
        assert getattr(sft.model, key) == getattr(arm.model, key), key
    assert sft.micro_batches(arm.mesh.data * arm.mesh.fsdp) > 1
