"""`stare-jax plan`: accelerator parsing, mesh resolution, eval_shape parameter counts, and the activation model
checked against XLA's compiled memory analysis on small configs."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from stare_jax.config.loader import MeshConfig, load_config
from stare_jax.models import ModelConfig, Transformer, get_preset
from stare_jax.planning.estimate import (
    estimate,
    format_plan,
    param_count,
    parse_accelerator,
    resolve_mesh,
    training_activation_bytes,
)


@pytest.mark.parametrize(
    "name, devices, hosts, hbm_gb",
    [
        ("v5p-64", 32, 8, 102.8),
        ("v4-8", 4, 1, 32.75),
        ("v5litepod-16", 16, 4, 16.9),
        ("v6e-256", 256, 64, 33.55),
        ("8xH100", 8, 1, 80),
        ("2x8xH100", 16, 2, 80),
        ("4xH200", 4, 1, 141),
    ],
)
def test_parse_accelerator(name, devices, hosts, hbm_gb):
    acc = parse_accelerator(name)
    assert (acc.num_devices, acc.num_hosts) == (devices, hosts)
    assert acc.hbm_bytes / 1e9 == pytest.approx(hbm_gb, rel=0.01)


@pytest.mark.parametrize("bad", ["v7-8", "tpu", "v5p-3", "0x8xH100", "8xV100"])
def test_unknown_accelerator_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=rf"accelerator.*{bad}"):
        parse_accelerator(bad)


def test_resolve_mesh():
    assert resolve_mesh(MeshConfig(data=2, fsdp=-1, tensor=2), 32) == {"data": 2, "fsdp": 8, "tensor": 2}
    with pytest.raises(ValueError, match="does not divide the 32 devices"):
        resolve_mesh(MeshConfig(data=3, fsdp=-1, tensor=1), 32)
    with pytest.raises(ValueError, match="has 8 devices but the accelerator has 32"):
        resolve_mesh(MeshConfig(data=2, fsdp=2, tensor=2), 32)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        resolve_mesh(MeshConfig(data=-1, fsdp=-1, tensor=1), 32)


@pytest.mark.parametrize("preset, expected", [("qwen2.5-7b", 7.6e9), ("qwen2.5-32b", 32.8e9)])
def test_eval_shape_param_counts(preset, expected):
    n = param_count(get_preset(preset))
    assert n == pytest.approx(expected, rel=0.01)
    assert n == get_preset(preset).num_params()


def _xla_temp_bytes(cfg, batch, seq):
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.zeros((batch, seq), jnp.int32)

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state).hidden_states(ids).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("layers, seq", [(2, 256), (4, 512)])
def test_activation_model_agrees_with_xla(layers, seq):
    """Without remat the analytic activation bytes are within 20% of XLA's compiled temp bytes. (The CPU
    backend's scheduler is not memory-aware, so remat savings are not visible there; they are not checked.)"""
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=256,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=704,
        attention_impl="xla",
    )
    ratio = training_activation_bytes(cfg, 4, seq) / _xla_temp_bytes(cfg, 4, seq)
    assert 0.8 <= ratio <= 1.2, ratio


def test_plan_of_a_paper_like_config():
    cfg = load_config(
        None,
        [
            "model.preset=qwen2.5-math-7b",
            "data.max_prompt_len=1024",
            "sampling.max_new_tokens=3072",
            "model.dtype=bfloat16",
            "model.remat_policy=full",
            "model.attention_impl=splash",
            "launch.accelerator=v5p-64",
            "rl.micro_batch_size=2",
        ],
    )
    plan = estimate(cfg, num_params=get_preset("qwen2.5-math-7b").num_params())
    assert plan["estimate"] and plan["devices"] == 32 and plan["mesh"] == {"data": 1, "fsdp": 32, "tensor": 1}
    assert plan["fits"] and 0 < plan["peak_bytes_per_device"] < plan["hbm_bytes_per_device"]
    assert plan["total_flops_per_step"] > 1e16
    assert "ESTIMATE" in format_plan(plan) and "fits" in format_plan(plan)
    too_long = load_config(
        None,
        [
            "model.preset=qwen2.5-math-7b",
            "data.max_prompt_len=2048",
            "sampling.max_new_tokens=3072",
            "launch.accelerator=v5p-64",
        ],
    )
    with pytest.raises(ValueError, match=r"5120 tokens exceeds the model's context \(4096\)"):
        estimate(too_long, num_params=1)
    with pytest.raises(ValueError, match="no accelerator"):
        estimate(load_config(None, ["model.preset=qwen2.5-7b"]), num_params=1)


def test_plan_of_the_embedded_toy_config():
    """The toy config (no model.path/preset) is planned from the toy's own model config (e.g. a TPU smoke run)."""
    import pathlib

    from stare_jax.config.loader import load_config
    from stare_jax.planning.estimate import estimate, param_count
    from stare_jax.toy.spec import ToyAssetConfig, model_config

    cfg = load_config(
        pathlib.Path(__file__).resolve().parents[3] / "configs" / "tiny_cpu_stare.yaml", ["rl.micro_batch_size=16"]
    )
    plan = estimate(cfg, "v5p-8")
    assert plan["fits"] and plan["devices"] == 4 and plan["total_flops_per_step"] > 0
    assert param_count(model_config(ToyAssetConfig())) > 100_000


def test_plan_models_the_engine_page_pool():
    """Where the run generates with the rollout engine (a long response budget, any slice) the sampling phase holds
    the page pool (sized by slots, not by the generation batch), kv heads split over the tensor axis; on a
    data-parallel mesh each data shard's pool (its slots' share); with the engine off, the static cache."""
    from stare_jax.config.engine import EngineConfig
    from stare_jax.models import get_preset

    base = [
        "model.preset=qwen2.5-math-7b",
        "data.max_prompt_len=1024",
        "sampling.max_new_tokens=3072",
        "model.dtype=bfloat16",
        "launch.accelerator=v5p-8",
        "rl.micro_batch_size=1",
        "rl.gen_batch_size=64",
    ]
    n = get_preset("qwen2.5-math-7b").num_params()
    tp = estimate(load_config(None, base + ["mesh.fsdp=1", "mesh.tensor=4"]), num_params=n)
    mc = get_preset("qwen2.5-math-7b")
    ec = EngineConfig()
    assert tp["generator"] == "engine" and "generator: engine" in format_plan(tp)
    pool = 2 * mc.num_layers * ec.pool_pages(4096) * ec.page_size * (mc.num_kv_heads / 4) * mc.head_dim * 2
    assert tp["memory_bytes"]["sample/kv_page_pool"] == pool
    static = estimate(
        load_config(None, base + ["mesh.fsdp=1", "mesh.tensor=4", "sampling.engine.enabled=false"]), num_params=n
    )
    assert static["generator"] == "static" and "sample/kv_page_pool" not in static["memory_bytes"]
    assert static["memory_bytes"]["sample/kv_cache"] > 4 * pool  # 512 rows x 4096 slots vs 65 slots' pages
    fsdp = estimate(load_config(None, base), num_params=n)  # fsdp=-1: 4 data shards of 16 slots, each its pool
    assert fsdp["generator"] == "engine" and not fsdp["warnings"]
    shard_pool = 2 * mc.num_layers * EngineConfig(max_slots=16).pool_pages(4096) * ec.page_size * mc.num_kv_heads
    assert fsdp["memory_bytes"]["sample/kv_page_pool"] == shard_pool * mc.head_dim * 2
    multi = estimate(load_config(None, base), "v5p-64", num_params=n)  # 8 hosts: the replicated scheduler
    assert multi["hosts"] == 8 and multi["generator"] == "engine" and not multi["warnings"]
    # the prefill program's fp32 attention logits + probabilities: a prefill chunk per slot over the 4096-token
    # requests, the query heads split over the tensor axis (the compiled prefill's temps, see BUILD.md's tool rows);
    # past 8 key blocks the term stops growing (attention_kv_major_blocked: one block of scores at a time; the
    # 8 are a calibration, see plan.estimate)
    from stare_jax.models.paged_attention import PREFILL_KEY_BLOCK

    scores = 2 * ec.max_slots * ec.prefill_chunk * 4096 * (mc.num_heads / 4) * 4
    assert tp["memory_bytes"]["sample/prefill_attention_scores"] == scores
    assert 4096 <= 8 * PREFILL_KEY_BLOCK  # (the cap itself is exercised by the long-CoT configs: BUILD.md)


def test_plan_reports_the_largest_max_slots_that_fit():
    """With the engine, the plan names the largest sampling.engine.max_slots (whole slots per data shard, at most
    one per response of a generation batch) whose sampling phase stays within 90% of HBM: that many fit, one more
    per shard does not; everything fits -> one per response; not even the weights fit -> 0; static -> absent."""
    from stare_jax.models import get_preset
    from stare_jax.planning.estimate import max_slots_that_fit, phase_peaks

    base = [
        "model.preset=qwen2.5-math-7b",
        "data.max_prompt_len=1024",
        "sampling.max_new_tokens=3072",
        "model.dtype=bfloat16",
        "rl.micro_batch_size=1",
        "rl.gen_batch_size=64",
        "mesh.fsdp=-1",
    ]
    n = get_preset("qwen2.5-math-7b").num_params()

    def sampling(acc, slots):
        cfg = load_config(None, base + [f"sampling.engine.max_slots={slots}"])
        return phase_peaks(estimate(cfg, acc, num_params=n, fit_slots=False))["sampling"]

    plan = estimate(load_config(None, base), "2xH100", num_params=n)
    fit = plan["max_slots_that_fit"]
    assert fit == max_slots_that_fit(load_config(None, base), "2xH100", num_params=n)
    limit = 0.9 * plan["hbm_bytes_per_device"]
    assert 0 < fit["per_shard"] < 256 and fit["max_slots"] == 2 * fit["per_shard"]  # 2 data shards
    assert sampling("2xH100", fit["max_slots"]) <= limit < sampling("2xH100", fit["max_slots"] + 2)
    assert fit["one_per_response"] == 64 * 8
    assert f"max_slots with the sampling phase <= 90% of HBM: {fit['max_slots']}" in format_plan(plan)
    roomy = estimate(load_config(None, base), "8xB200", num_params=n)["max_slots_that_fit"]
    assert roomy["max_slots"] == roomy["one_per_response"] == 512
    tiny = estimate(load_config(None, base), "v5e-1", num_params=n)["max_slots_that_fit"]  # 16 GB: no room
    assert tiny["max_slots"] == 0 and "not one slot per data shard fits" in format_plan(
        estimate(load_config(None, base), "v5e-1", num_params=n)
    )
    static = estimate(load_config(None, base + ["sampling.engine.enabled=false"]), "2xH100", num_params=n)
    assert "max_slots_that_fit" not in static


def test_auto_max_slots_resolves_to_what_fits():
    """sampling.engine.max_slots=auto: the plan (and `plan --compile`, and the run on its own devices) resolves it
    to max_slots_that_fit; without an accelerator figure (a CPU host) to one slot per response; a clear error
    naming the key when nothing fits."""
    from stare_jax.models import get_preset
    from stare_jax.planning.estimate import Accelerator, max_slots_that_fit, resolve_max_slots

    base = [
        "model.preset=qwen2.5-math-7b",
        "data.max_prompt_len=1024",
        "sampling.max_new_tokens=3072",
        "model.dtype=bfloat16",
        "rl.micro_batch_size=1",
        "rl.gen_batch_size=64",
        "mesh.fsdp=-1",
    ]
    n = get_preset("qwen2.5-math-7b").num_params()
    auto = load_config(None, base + ["sampling.engine.max_slots=auto"])
    fit = max_slots_that_fit(auto, "2xH100", num_params=n)["max_slots"]
    plan = estimate(auto, "2xH100", num_params=n)
    assert plan["max_slots"] == fit and f"({fit} decode slots)" in format_plan(plan)
    fixed = estimate(load_config(None, base + [f"sampling.engine.max_slots={fit}"]), "2xH100", num_params=n)
    assert plan["memory_bytes"] == fixed["memory_bytes"]
    assert resolve_max_slots(auto, None).sampling.engine.max_slots == 64 * 8  # no HBM figure: one per response
    live = Accelerator("2xH100 (live)", "gpu", 2, 80 * 10**9, 0.0, 1)  # what live_accelerator builds on a GPU host
    assert resolve_max_slots(auto, live, num_params=n).sampling.engine.max_slots == fit
    assert "s/step" not in format_plan(estimate(auto, live, num_params=n))  # no peak FLOP/s figure: no time
    with pytest.raises(ValueError, match="max_slots=auto: not even one decode slot per data shard fits"):
        estimate(auto, "v5e-1", num_params=n)
    # with the static sampler the slot count is moot: nothing to resolve, nothing to refuse
    static = load_config(None, base + ["sampling.engine.max_slots=auto", "sampling.engine.enabled=false"])
    assert estimate(static, "v5e-1", num_params=n)["generator"] == "static"


def test_plan_models_packing_and_the_optimizer_offload():
    """rl.packing: the step's FLOPs count the packed rows first-fit-decreasing finds under the assumed lengths
    (whole micro-batches), far fewer than the padded rows; rl.offload.optimizer: the moments leave the sampling
    phase and the train step's loop, and come in for the update (params + gradients + moments), as compiled."""
    from stare_jax.planning.estimate import LengthModel, expected_packing, phase_peaks

    base = "configs/paper/qwen3-8b-base_stare_o1.yaml"
    padded = estimate(load_config(base))
    packed_cfg = load_config(base, ["rl.packing.enabled=true", "rl.micro_batch_tokens=16384"])
    packed = estimate(packed_cfg)
    pk = packed["packing"]
    assert pk["row_tokens"] == 1024 + 15360 and pk["fill_rate"] > 0.95 and pk["padded_fill_rate"] < 0.25
    assert pk["rows_per_step"] <= pk["rows_computed_per_step"] <= 512
    assert pk["rows_computed_per_step"] % 64 == 0  # whole micro-batches of one row on each of the 64 chips
    ratio = packed["flops_per_step"]["train_fwd_bwd"] / padded["flops_per_step"]["train_fwd_bwd"]
    assert ratio == pytest.approx(pk["rows_computed_per_step"] / 512, rel=1e-9)
    assert packed["memory_bytes"]["train/activations"] == padded["memory_bytes"]["train/activations"]
    # longer responses fill more rows; the length model is the caller's
    long = expected_packing(packed_cfg, LengthModel(response_median=8000, response_sigma=0.5), shards=64)
    assert long["rows_per_step"] > pk["rows_per_step"]
    off = estimate(load_config(base, ["rl.offload.optimizer=true"]))
    p_on, p_off = phase_peaks(padded), phase_peaks(off)
    opt = padded["memory_bytes"]["train/optimizer"]
    assert p_on["sampling"] - p_off["sampling"] == pytest.approx(opt)
    mem = padded["memory_bytes"]
    assert p_off["training"] == pytest.approx(
        max(p_on["training"] - opt, mem["train/params"] + mem["train/grads"] + opt)
    )
    assert p_off["training"] < p_on["training"] and off["peak_bytes_per_device"] < padded["peak_bytes_per_device"]
    assert "optimizer offloaded" in format_plan(off) and "packing (assumed lengths" in format_plan(packed)


def test_plan_names_the_offload_when_it_makes_a_config_fit():
    """A config that does not fit without rl.offload.optimizer gets the peak it would have with it (the 7B tool
    config on v6e-8: 30.4 GiB of 31.2 without, 23.3 with), printed as a hint; a fitting or already offloaded one
    gets none."""
    from stare_jax.planning.estimate import phase_peaks

    base = "configs/paper/qwen2.5-7b-tool_stare_o1.yaml"
    mesh = ["mesh.tensor=4", "mesh.fsdp=2"]
    tight = estimate(load_config(base, mesh), "v6e-8")
    off = estimate(load_config(base, [*mesh, "rl.offload.optimizer=true"]), "v6e-8")
    assert not tight["fits"] and off["fits"]
    assert tight["peak_with_offload"] == pytest.approx(max(phase_peaks(off).values()))
    assert "with rl.offload.optimizer=true (AdamW moments in host memory but for the update)" in format_plan(tight)
    assert "peak_with_offload" not in off and "peak_with_offload" not in estimate(load_config(base))


def test_plan_counts_the_kl_reference_with_packing():
    """rl.kl with rl.packing (and the optimizer offload): the frozen reference's parameters (the policy's shardings)
    are resident in both phases, the offloaded update included, and its no-grad forward over the packed rows
    doubles the old-log-prob pass, as in the padded layout."""
    from stare_jax.planning.estimate import phase_peaks

    base = "configs/paper/qwen3-8b-base_stare_o1.yaml"
    kl = ["rl.kl.reference=initial", "rl.kl.coef=0.001"]
    for packed in (
        ["rl.packing.enabled=true", "rl.micro_batch_tokens=16384"],
        ["rl.packing.enabled=true", "rl.micro_batch_tokens=16384", "rl.offload.optimizer=true"],
    ):
        without, with_kl = estimate(load_config(base, packed)), estimate(load_config(base, packed + kl))
        ref = with_kl["memory_bytes"]["train/reference_params"]
        assert ref == pytest.approx(with_kl["memory_bytes"]["train/params"]) and ref > 0
        for phase, peak in phase_peaks(with_kl).items():
            assert peak == pytest.approx(phase_peaks(without)[phase] + ref), (packed, phase)
    flops = with_kl["flops_per_step"]["old_logprob_pass"]
    assert flops == pytest.approx(2 * without["flops_per_step"]["old_logprob_pass"])


def test_live_accelerator_reads_the_runtime_hbm():
    """live_accelerator: the devices' HBM as the runtime reports it (memory_stats bytes_limit), hosts from their
    process indices; None on a backend that reports none (this CPU host)."""
    from types import SimpleNamespace

    from stare_jax.planning.estimate import live_accelerator

    assert live_accelerator() is None  # the CPU reports no bytes_limit

    def gpu(i):
        return SimpleNamespace(
            memory_stats=lambda: {"bytes_limit": 79 * 10**9},
            device_kind="NVIDIA H100 80GB HBM3",
            platform="gpu",
            process_index=i // 8,
        )

    acc = live_accelerator([gpu(i) for i in range(16)])
    assert (acc.num_devices, acc.num_hosts, acc.hbm_bytes, acc.kind) == (16, 2, 79 * 10**9, "gpu")
    assert acc.name == "16xNVIDIA H100 80GB HBM3"


def test_lora_trains_only_the_adapters_in_the_plan():
    """model.lora: the frozen base stays (in its dtype) beside float32 adapters; gradients, AdamW moments and the
    'initial' KL reference are the adapters' alone."""
    base = ["model.preset=qwen2.5-7b", "launch.accelerator=v5p-8", "rl.kl.reference=initial"]
    full = estimate(load_config(None, base))["memory_bytes"]
    lora_cfg = load_config(None, base + ["model.lora.enabled=true", "model.lora.rank=32"])
    lora = estimate(lora_cfg)["memory_bytes"]
    arch = get_preset("qwen2.5-7b")
    n_lora = arch.replace(lora_rank=32, lora_targets=tuple(lora_cfg.model.lora.target_modules)).num_lora_params()
    assert lora["train/optimizer"] / full["train/optimizer"] == pytest.approx(n_lora / arch.num_params(), rel=0.02)
    assert lora["train/grads"] == pytest.approx(lora["train/optimizer"])  # fp32 accumulator + micro-batch grads
    assert lora["train/reference_params"] == pytest.approx(lora["train/optimizer"] / 2)
    assert lora["train/params"] > full["train/params"]  # the base plus the adapters
