"""Ahead-of-time compiles for real TPU slices on this CPU host (libtpu + jax.experimental.topologies): the run's
own train step, weight reshard and sampler, compiled from abstract inputs; the compiler's figures; bad input."""

import math
import sys

import jax
import pytest

from stare_jax import cli
from stare_jax.config.loader import load_config
from stare_jax.planning.estimate import GiB
from stare_jax.training import aot

pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is a test dependency: pip install -r requirements-test.txt")

TINY = [
    "rl.micro_batch_size=16",
    "model.dtype=bfloat16",
    "model.attention_impl=splash",
    "sampling.max_new_tokens=24",
    "data.max_prompt_len=100",
]


@pytest.mark.parametrize(
    "accelerator, topology",
    [
        ("v5p-8", "v5p:2x2x1"),
        ("v5p-16", "v5p:2x2x2"),
        ("v5p-64", "v5p:2x4x4"),
        ("v5p-128", "v5p:4x4x4"),
        ("v5p-256", "v5p:4x4x8"),
        ("v4-16", "v4:2x2x2"),
        ("v6e-8", "v6e:2x4"),
        ("v6e-16", "v6e:4x4"),
        ("v6e-256", "v6e:16x16"),
        ("v5litepod-4", "v5e:2x2"),
    ],
)
def test_topology_for_accelerator(accelerator, topology):
    assert aot.topology_for(accelerator) == topology
    chips = math.prod(int(d) for d in topology.split(":")[1].split("x"))
    # libtpu knows the slice; its compile-only v4 topologies list each chip's two TensorCores as devices
    cores_per_device = 2 if topology.startswith("v4") else 1
    assert len(aot.get_topology(topology).devices) == chips * cores_per_device


@pytest.fixture(scope="module", params=["v5p:2x2x1", "v6e:2x2"])
def tiny_report(request):
    cfg = load_config("configs/tiny_cpu_stare.yaml", TINY)
    return aot.compile_run(cfg, topology=request.param, log=lambda _: None)


def test_tiny_config_compiles_with_splash_through_mosaic(tiny_report):
    r = tiny_report
    assert r["devices"] == 4 and r["hbm_bytes_per_device"] > 8 * GiB  # libtpu's own HBM figure
    for name in ("train_step", "weight_reshard", "sampler"):
        p = r["compiled"][name]
        assert p["peak_bytes"] > 0 and p["compile_s"] > 0
    # splash ran as a Mosaic kernel (not the Pallas interpreter) in the step and in the sampler's prefill
    assert r["compiled"]["train_step"]["mosaic_kernels"] > 0
    assert r["compiled"]["sampler"]["mosaic_kernels"] > 0
    assert r["fits"] is True


def test_tiny_config_state_is_sharded(tiny_report):
    s = tiny_report["state_bytes_per_device"]
    # AdamW moments sharded exactly like the fp32 params (+ two replicated int32 step counts)
    assert s["optimizer"] - 2 * s["params"] == 8
    assert s["sampler_weights"] * 2 >= s["params"]  # bf16 copy, replicated over the 4 data shards
    assert tiny_report["phases"]["sampling"]["resident_bytes"] == s["params"] + s["optimizer"]
    assert s["reference_params"] == 0  # no rl.kl: no reference policy
    assert s["frozen_params"] == 0  # full weights: every parameter is trained


def test_lora_run_keeps_its_frozen_base_resident_while_sampling(tiny_report):
    """A LoRA run trains the adapters (TrainState.params) and keeps the frozen base (TrainState.rest) on the chips
    through the sampling phase: the phase counts both, the moments are the adapters' alone, and the train step
    takes the base as an argument."""
    if tiny_report["topology"] != "v5p:2x2x1":
        pytest.skip("one topology is enough")
    r = aot.compile_run(load_config("configs/tiny_cpu_stare_lora.yaml", TINY), topology="v5p:2x2x1", log=lambda _: None)
    s = r["state_bytes_per_device"]
    assert s["params"] > 0 and s["frozen_params"] > 0
    assert s["optimizer"] - 2 * s["params"] == 8  # AdamW moments of the adapters alone (+ two int32 counts)
    assert r["phases"]["sampling"]["resident_bytes"] == s["params"] + s["frozen_params"] + s["optimizer"]
    assert r["compiled"]["train_step"]["argument_bytes"] >= s["frozen_params"] + s["params"] + s["optimizer"]
    assert r["fits"] is True


def test_another_arm_reuses_the_sampler_programs(tiny_report):
    """The GRPO-ds arm has the STARE arm's sampler_key: only its train step is compiled, the sampler and reshard
    figures are the report's; a report of another model is refused."""
    if tiny_report["topology"] != "v5p:2x2x1":
        pytest.skip("one topology is enough")
    cfg = load_config("configs/tiny_cpu_grpo_ds.yaml", TINY)
    r = aot.compile_run(cfg, topology="v5p:2x2x1", reuse_sampler=tiny_report, log=lambda _: None)
    assert r["sampler_reused"] and r["sampler_key"] == tiny_report["sampler_key"]
    assert r["compiled"]["sampler"] == tiny_report["compiled"]["sampler"]
    assert r["compiled"]["train_step"]["compile_s"] > 0 and r["fits"] is True
    other = load_config("configs/tiny_cpu_grpo_ds.yaml", [*TINY, "sampling.max_new_tokens=40"])
    with pytest.raises(aot.CompileError, match="sampler_key differs"):
        aot.compile_run(other, topology="v5p:2x2x1", reuse_sampler=tiny_report, log=lambda _: None)


def test_kl_reference_is_an_argument_of_the_train_step_sharded_like_the_params(tiny_report):
    """With rl.kl the compiled step takes the frozen reference's parameters, sharded like the params: its argument
    bytes grow by the params' per-device bytes as the compiler lays them out (TPU tiling pads the tiny model's small
    arrays: 1413632 bytes for 800256 logical on v5p:2x2x1), and the sampling phase keeps them resident."""
    if tiny_report["topology"] != "v5p:2x2x1":
        pytest.skip("one topology is enough")
    cfg = load_config("configs/tiny_cpu_stare.yaml", [*TINY, "rl.kl.coef=0.001", "rl.kl.reference=initial"])
    r = aot.compile_run(cfg, topology="v5p:2x2x1", reuse_sampler=tiny_report, log=lambda _: None)
    s = r["state_bytes_per_device"]
    assert s["reference_params"] == s["params"]
    grown = r["compiled"]["train_step"]["argument_bytes"] - tiny_report["compiled"]["train_step"]["argument_bytes"]
    assert s["params"] <= grown < 2 * s["params"]
    assert r["phases"]["sampling"]["resident_bytes"] == s["params"] + s["optimizer"] + s["reference_params"]
    assert r["fits"] is True


def test_packed_offloaded_step_compiles_with_splash_segments(tiny_report):
    """rl.packing + rl.micro_batch_tokens + rl.offload.optimizer: the packed step (splash with segment ids, the
    micro-batches skipped when empty) compiles for the slice; the moments wait in host memory, so the sampling
    phase holds the parameters alone beside the sampler."""
    if tiny_report["topology"] != "v5p:2x2x1":
        pytest.skip("one topology is enough")
    cfg = load_config(
        "configs/tiny_cpu_stare.yaml",
        [*TINY, "rl.packing.enabled=true", "rl.micro_batch_tokens=256", "rl.offload.optimizer=true"],
    )
    r = aot.compile_run(cfg, topology="v5p:2x2x1", reuse_sampler=tiny_report, log=lambda _: None)
    t = r["compiled"]["train_step"]
    assert r["packing"] and r["optimizer_offloaded"] and t["mosaic_kernels"] > 0 and r["fits"] is True
    s = r["state_bytes_per_device"]
    assert t["host_bytes"] >= s["optimizer"]  # the moments are host arguments and outputs of the step
    assert r["phases"]["sampling"]["resident_bytes"] == s["params"]


def test_offloaded_moments_leave_the_train_steps_device_peak(tiny_report):
    """rl.offload.optimizer: the compiled step's device peak is the non-offloaded one less (at least 90% of) the
    AdamW moments, which are host arguments and outputs of the step (host_bytes), not device ones. Fails when the
    moments are brought in by a plain device_put: XLA starts that copy at the top of the program and they sit in
    device memory through the micro-batch loop (the peak did not drop)."""
    if tiny_report["topology"] != "v5p:2x2x1":
        pytest.skip("one topology is enough")
    cfg = load_config("configs/tiny_cpu_stare.yaml", [*TINY, "rl.offload.optimizer=true"])
    r = aot.compile_run(cfg, topology="v5p:2x2x1", reuse_sampler=tiny_report, log=lambda _: None)
    on, off = tiny_report["compiled"]["train_step"], r["compiled"]["train_step"]
    opt = r["state_bytes_per_device"]["optimizer"]
    assert off["host_bytes"] >= opt and on["host_bytes"] == 0
    assert on["peak_bytes"] - off["peak_bytes"] >= 0.9 * opt, (on["peak_bytes"], off["peak_bytes"], opt)
    assert r["phases"]["training"]["peak_bytes"] == off["peak_bytes"]


def test_flops_count_loop_trips(tiny_report):
    """Per-step FLOPs include every micro-batch and decode step: more than XLA's body-once count."""
    t = tiny_report["compiled"]["train_step"]
    assert t["flops_per_step"] / tiny_report["devices"] > t["xla_flops_body_once"]
    s = tiny_report["compiled"]["sampler"]  # the prefill (counted once by both) dominates the tiny decode
    assert s["flops_per_step"] / tiny_report["devices"] > 2 * s["xla_flops_body_once"]


def test_jaxpr_flops_matches_a_hand_count():
    def f(x, w):
        def body(c, _):
            return c @ w, None

        y, _ = jax.lax.scan(body, x, None, length=3)
        return jax.lax.while_loop(lambda c: c[1] < 5, lambda c: (c[0] @ w, c[1] + 1), (y, 0))[0]

    x = jax.ShapeDtypeStruct((4, 8), "float32")
    w = jax.ShapeDtypeStruct((8, 8), "float32")
    jaxpr = jax.make_jaxpr(f)(x, w).jaxpr
    assert aot.jaxpr_flops(jaxpr, while_trips=5) == (3 + 5) * 2 * 4 * 8 * 8


def test_collectives_parsed_from_hlo():
    hlo = (
        "  %ag = bf16[64,128]{1,0} all-gather(bf16[16,128]{1,0} %p), dimensions={0}\n"
        "  %ars = (f32[8]{0}, f32[8]{0}) all-reduce-start(f32[8]{0} %x), to_apply=%add\n"
        "  %ard = f32[8]{0} all-reduce-done((f32[8]{0}, f32[8]{0}) %ars)\n"
    )
    assert aot.collectives(hlo) == {
        "all-gather": {"count": 1, "bytes": 64 * 128 * 2},
        "all-reduce": {"count": 1, "bytes": 32},
    }


def test_auto_slots_resolve_for_the_slice_compiled():
    """plan --compile with sampling.engine.max_slots=auto compiles the engine at the number the plan finds for the
    slice: launch.accelerator's HBM, or (only a topology named) libtpu's own HBM figure of that topology."""
    from stare_jax.planning.estimate import max_slots_that_fit

    cfg = load_config("configs/paper/qwen2.5-7b-tool_stare_o1.yaml", ["sampling.engine.max_slots=auto"])
    devices = aot.get_topology("v5p:2x2x1").devices
    fit = max_slots_that_fit(cfg, "v5p-8")["max_slots"]
    assert fit > 128  # the config's own 128 fits with room
    assert aot._resolve_slots(cfg, "v5p-8", "v5p:2x2x1", devices).sampling.engine.max_slots == fit
    by_topology = aot._resolve_slots(cfg, None, "v5p:2x2x1", devices).sampling.engine.max_slots
    assert by_topology == fit  # libtpu's HBM figure for v5p is the table's (95.74 GiB)


def test_program_peak_is_the_compilers_enforced_peak():
    """Program.peak_bytes is libtpu's peak_memory_in_bytes (+ code): the figure the TPU compiler refuses a program
    over (benchmarks/tpu_peak_memory.py finds the boundary), not arguments + temp_size_in_bytes, which over-counts
    a scan's temps; temp_bytes is what the peak leaves beside the arguments and outputs; host buffers are not in
    it."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    devices = aot.get_topology("v5p:2x2x1").devices
    mesh = jax.sharding.Mesh(np.array(devices).reshape(4), ("tensor",))

    def loss(ws, x):  # remat'ed layers in a scan: the shape whose temp_size over-counts
        def layer(c, w):
            return c + jnp.tanh(c @ w.astype(jnp.bfloat16)) @ w.T.astype(jnp.bfloat16), None

        y, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    ws = jax.ShapeDtypeStruct(
        (6, 1024, 2048), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, None, "tensor"))
    )
    x = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    traced = jax.jit(jax.grad(loss)).trace(ws, x)
    p = aot.Program.compile("toy", traced, lambda: jax.set_mesh(mesh), 4)
    ma = traced.lower().compile().memory_analysis()
    assert p.host_bytes == 0 and p.peak_bytes == ma.peak_memory_in_bytes + ma.generated_code_size_in_bytes
    assert p.peak_bytes == p.argument_bytes + p.output_bytes - p.alias_bytes + p.temp_bytes + p.generated_code_bytes
    assert p.xla_temp_bytes == ma.temp_size_in_bytes >= p.temp_bytes > 0

    # host-memory (pinned_host) buffers are in peak_memory_in_bytes but not held against HBM (the benchmark's
    # 60 + 60 GiB step compiles): the device peak leaves them out and host_bytes reports them
    host, dev = (NamedSharding(mesh, PartitionSpec("tensor"), memory_kind=k) for k in ("pinned_host", "device"))
    h = jax.ShapeDtypeStruct((4 << 20,), jnp.float32, sharding=host)
    d = jax.ShapeDtypeStruct((8 << 20,), jnp.float32, sharding=dev)
    traced = jax.jit(lambda h, d: (h, d + 1), out_shardings=(host, dev), donate_argnums=(0, 1)).trace(h, d)
    p = aot.Program.compile("host", traced, lambda: jax.set_mesh(mesh), 4)
    ma = traced.lower().compile().memory_analysis()
    assert p.host_bytes == ma.host_argument_size_in_bytes == (4 << 20) and p.argument_bytes == (8 << 20)
    assert ma.peak_memory_in_bytes >= p.host_bytes + p.argument_bytes
    assert p.peak_bytes == ma.peak_memory_in_bytes - p.host_bytes + ma.generated_code_size_in_bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "v9:2x2"], "unknown TPU topology 'v9:2x2'"),
        (["--compile", "--accelerator", "v7-8"], "unknown accelerator type 'v7-8'"),
        (["--compile", "--accelerator", "8xH100"], "GPU type"),
        (["--topology", "v5p:2x2x1", "mesh.fsdp=3"], "has 3 devices but the accelerator has 4"),
        (["--topology", "v5p:2x2x1", "mesh.fsdp=-1", "mesh.tensor=3"], "does not divide the 4 devices"),
        (["--compile"], "no accelerator"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    code = cli.main(["plan", "configs/tiny_cpu_stare.yaml", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_libtpu_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu -> ImportError
    with pytest.raises(aot.CompileError, match=r'pip install "jax\[tpu\]=='):
        aot.get_topology("v5p:2x2x1")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["r1-distill-qwen-1.5b_stare_o1", "qwen2.5-math-7b_stare_o1"])
def test_paper_config_fits_its_slice(config):
    """Opt-in (--runslow): a paper config compiled for its real slice fits with 10% headroom, and the estimate of
    each phase is at most 5% under the compiled peak (the unsafe direction) and at most 30% over it (R1-Distill's
    sampling phase: +28% on 2026-12-06, after the blocked prefill; 4-7 minutes each on a 2-core host; ~6 and ~9 GB
    of host memory)."""
    from stare_jax.planning.estimate import estimate, phase_peaks

    cfg = load_config(f"configs/paper/{config}.yaml")
    r = aot.compile_run(cfg, log=lambda _: None)
    assert r["fits"] is True
    for phase, e in phase_peaks(estimate(cfg)).items():
        assert -0.05 <= e / r["phases"][phase]["peak_bytes"] - 1 <= 0.3, (phase, e, r["phases"][phase])


def test_engine_run_compiles_the_engine_programs():
    """A run that generates with the rollout engine (tool use: one host, multi-turn) compiles the engine's decode
    and prefill programs at their largest shapes, with the page pool the run allocates as their argument (each data
    shard's pool on its own devices), instead of the static sampler's; the sampling phase holds the larger."""
    cfg = load_config(
        "configs/tiny_cpu_tool_stare.yaml",
        ["model.dtype=bfloat16", "sampling.engine.max_slots=16", "rl.micro_batch_size=16", "launch.accelerator=v5p-8"],
    )
    r = aot.compile_run(cfg, log=lambda _: None)  # the topology of launch.accelerator: v5p:2x2x1
    assert r["generator"] == "engine" and r["topology"] == "v5p:2x2x1"
    assert "peak_bytes_per_device" in r["estimate"], r["estimate"]  # the plan's estimate beside the compiler's
    decode, prefill = r["compiled"]["sampler"], r["compiled"]["sampler_prefill"]
    m = aot.run_model_config(cfg)
    # auto pool: (4 slots per shard + 1) x (pages of 32 + 40 tokens + 1) + 1, per layer k and v, one shard per
    # device (mesh fsdp 4 = 4 data shards)
    pages = (16 // 4 + 1) * (-(-(32 + 40) // 16) + 1) + 1
    pool_b = 2 * m.num_layers * pages * 16 * m.num_kv_heads * m.head_dim * 4  # float32 cache (the tool config's)
    assert decode["argument_bytes"] >= pool_b + r["state_bytes_per_device"]["sampler_weights"]
    assert decode["alias_bytes"] >= pool_b and prefill["alias_bytes"] >= pool_b  # the pool is donated
    assert r["phases"]["sampling"]["program_peak_bytes"] == max(decode["peak_bytes"], prefill["peak_bytes"])
    assert not any(k == "all-gather" and v["bytes"] >= pool_b // 4 for k, v in decode["collectives"].items())
    assert r["fits"] is True


@pytest.mark.parametrize(
    "mesh", [dict(data=1, fsdp=1, tensor=4), dict(data=2, fsdp=1, tensor=2)], ids=["tensor4", "data2-tensor2"]
)
def test_engine_decode_compiles_the_pallas_paged_attention_kernel(mesh):
    """On a TPU slice, sampling.engine.attention=auto with head_dim 128 and a bfloat16 KV cache decodes through the
    Pallas paged-attention kernel: the engine's decode program contains the Mosaic kernel (tpu_custom_call), run
    under shard_map per device (kv heads over tensor; over data=2 each shard's pool on its devices, no all-gather
    of the pool); the prefill program gathers (no kernel), as does the whole engine with attention=gather."""
    from stare_jax import models

    model_cfg = models.ModelConfig(
        vocab_size=512,
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=512,
        max_position_embeddings=1024,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        dtype="bfloat16",
    )
    cfg = load_config(
        "configs/tiny_cpu_tool_stare.yaml",
        [
            "model.dtype=bfloat16",
            "sampling.kv_cache_dtype=bfloat16",
            "sampling.engine.max_slots=8",
            "launch.accelerator=v5p-8",
            *(f"mesh.{k}={v}" for k, v in mesh.items()),
        ],
    )
    r = aot.compile_engine(cfg, model_cfg=model_cfg, log=lambda _: None)
    assert r["attention"] == "pallas" and r["mesh"] == mesh and r["topology"] == "v5p:2x2x1"
    decode, prefill = r["compiled"]["sampler"], r["compiled"]["sampler_prefill"]
    assert decode["mosaic_kernels"] > 0 and prefill["mosaic_kernels"] == 0
    page_b = 16 * model_cfg.head_dim * 2  # one kv head page of one layer (16 tokens, bf16): no pool gather
    assert decode["collectives"].get("all-gather", {"bytes": 0})["bytes"] < page_b
    g = aot.compile_engine(cfg, model_cfg=model_cfg, attention="gather", log=lambda _: None)
    assert g["attention"] == "gather" and g["compiled"]["sampler"]["mosaic_kernels"] == 0


def test_engine_programs_keep_the_page_pool_in_place():
    """Several slots per data shard and several kv heads per chip (data=2 x tensor=2, 8 kv heads: 4 per chip): the
    decode step's page writes keep the pool in the Pallas kernel's layout (a [K, N, P, Dh] scatter with window
    (K, Dh) made XLA lay the carried pool out kv-heads-minor and copy every layer's pool to and from the kernel's
    layout: temps of a second pool), and the prefill gathers each device's own kv heads (gathering by global head
    index all-reduced the gathered pages of every layer over the tensor axis)."""
    from stare_jax import models

    model_cfg = models.ModelConfig(
        vocab_size=512,
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=512,
        max_position_embeddings=1024,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        dtype="bfloat16",
    )
    cfg = load_config(
        "configs/tiny_cpu_tool_stare.yaml",
        [
            "model.dtype=bfloat16",
            "sampling.kv_cache_dtype=bfloat16",
            "sampling.engine.max_slots=32",
            "sampling.max_new_tokens=512",
            "launch.accelerator=v5p-8",
            "mesh.data=2",
            "mesh.fsdp=1",
            "mesh.tensor=2",
        ],
    )
    r = aot.compile_engine(cfg, model_cfg=model_cfg, log=lambda _: None)
    decode, prefill = r["compiled"]["sampler"], r["compiled"]["sampler_prefill"]
    pool_b = decode["alias_bytes"]  # the donated pool per device (37 MiB; before the fix: decode temps 25 MiB)
    assert r["attention"] == "pallas" and decode["temp_bytes"] < pool_b / 4, (decode["temp_bytes"], pool_b)
    # what is left: the embedding's and the row-parallel projections' all-reduces (12 MiB; before: 49 MiB)
    assert prefill["collectives"].get("all-reduce", {"bytes": 0})["bytes"] < pool_b / 2, prefill["collectives"]


def test_sft_step_compiles_sharded_with_micro_batches(tmp_path):
    """`stare-jax plan --sft CONFIG --compile`: the SFT step of a tiny model on v5p:2x2x1 (fsdp 4, 2 micro-batches
    of one conversation per device, splash through Mosaic): the train state is sharded and donated, the batch and
    the whole fp32 state fit, and the report is the plan's table."""
    from stare_jax import models
    from stare_jax.training.sft import load_sft_config

    model_cfg = models.ModelConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=256,
        max_position_embeddings=1024,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        tie_word_embeddings=True,
    )
    models.save_pretrained(models.init_model(model_cfg), tmp_path)  # plan reads only its config.json
    cfg = load_sft_config(
        "configs/sft_tool_cold_start.yaml",
        [
            f"model.path={tmp_path}",
            "model.attention_impl=splash",
            "max_len=256",
            "chunk_size=64",
            "batch_size=8",
            "micro_batch_size=1",
            "launch.accelerator=v5p-8",
        ],
    )
    r = aot.compile_sft(cfg, log=lambda _: None)
    assert r["topology"] == "v5p:2x2x1" and r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert r["batch"] == [8, 257] and r["micro_batches"] == 2
    p, s = r["compiled"]["sft_step"], r["state_bytes_per_device"]
    assert s["optimizer"] - 2 * s["params"] == 8  # AdamW moments sharded like the fp32 params
    assert p["alias_bytes"] >= s["params"] + s["optimizer"]  # the train state is donated
    assert p["mosaic_kernels"] > 0 and "all-gather" in p["collectives"]  # splash; FSDP gathers the weights
    assert r["fits"] is True and r["peak_bytes"] == p["peak_bytes"]
    assert "sft_step" in aot.format_compiled(r)
