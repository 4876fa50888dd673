"""One-accelerator device suite: train-step MFU, sampler tokens/s and the STARE-O1 / GRPO-ds step-time ratio,
printed as one JSON object, in at most --budget-s + 30 s (default 450 + 30 = 8 minutes).

    .venv/bin/python benchmarks/device_suite.py [--json PATH] [--budget-s 450]   # on a GPU or TPU chip
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/device_suite.py --tiny       # CPU smoke run (what CI runs)

Sections (each times the project's own programs, never a copy of them):
1. train_step: the real jitted RL train step (rl.step.init_train_state / make_train_step, train state
   donated, single device so mesh=None exactly as `stare-jax train` runs on one device) on a Qwen2.5-0.5B-shaped
   model with random weights (fp32 master weights, bf16 compute, remat_policy="full" and attention_impl splash on
   TPU / cudnn on GPU as the paper configs use them), STARE-O1 with the gate forced on (target entropy 1e3),
   on a synthetic full-length batch (default 16 x 1024 tokens, last 3/4 of each row response).
   MFU = model FLOPs per step / (median step time x peak bf16 dense FLOP/s of the device kind), with
       model FLOPs = tokens x (8 N + 8 n_layers n_heads head_dim L)
   i.e. 6 N + 3 x attention per token for the forward + backward update and 2 N + 1 x attention for the no-grad
   old-log-prob pass, attention = 2 n_layers n_heads head_dim L per token (QK^T and AV, causal: half of the
   L x L scores), N = ModelConfig.num_params() less the input embedding table when it is untied (a gather, not a
   matmul), tokens = batch x L. The remat recompute (one more forward) is not model FLOPs; it is reported as
   `hfu` (hardware FLOPs utilisation) beside it. The same accounting as `stare-jax plan`
   (stare_jax/planning/estimate.py).
2. sampler: stare_jax.sampling.Sampler on the same model shape (weights cast to bf16 by the sampler, bf16 KV
   cache as the run configs default), 64 prompts x 1 sample (random 128-token prompts), 512 new tokens with
   eos_ids=[] so every row generates all of them; tokens/s = prompts x samples x new tokens / wall time of
   generate_arrays (block_until_ready).
3. stare_ratio: median STARE-O1 step time / median GRPO-ds step time (StareConfig(enabled=False)) on the ~50M
   setting of benchmarks/stare_overhead.py --preset issue (hidden 512, 8 layers, vocab 32768 untied: 67M params,
   33.5M of them outside the embeddings) x 64 sequences x 512 tokens, 4 micro-batches, same dtypes and remat as
   above, the STARE gate checked on; timed interleaved (A B A B ...) so load changes hit both arms alike.

Every timing is a median of N runs after a compile call (its wall time reported as first_call_s; compile_s =
first_call_s - median) and a warm-up call; min/median/max and the raw times are in the JSON. A section that would
start with less than its minimum time left is skipped ("skipped: budget"), timing loops stop at the budget (at
least one timed run), and a watchdog prints what is done and exits at budget + 30 s whatever is running.
--tiny shrinks every size (2-layer d=64 model, 4 x 64-token batches, 4 prompts x 16 new tokens, 2 timed steps; the
ratio reuses the train_step section's model and sizes, so with a persistent compilation cache its STARE-O1 program
is a cache hit) for a CPU run well under a minute.
The exit status is 1 if a section failed (its error is in the JSON), else 0.
"""

from __future__ import annotations

_T_START = __import__("time").perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HARD_GRACE_S = 30.0  # the watchdog ends the process this long after the budget

# bf16 dense peak FLOP/s per chip, matched against jax.devices()[0].device_kind (first match wins).
PEAK_FLOPS = (
    (r"B200", 2250e12, "NVIDIA B200 / GB200"),
    (r"H100.*PCIe", 756e12, "NVIDIA H100 PCIe"),
    (r"H100|H200", 989e12, "NVIDIA H100 / H200 SXM"),
    (r"A100", 312e12, "NVIDIA A100"),
    (r"^TPU v5 ?lite|^TPU v5e", 197e12, "TPU v5e"),
    (r"^TPU v6 ?lite|^TPU v6e", 918e12, "TPU v6e"),
    (r"^TPU v5p?$", 459e12, "TPU v5p"),
    (r"^TPU v4$", 275e12, "TPU v4"),
)

# Qwen2.5-0.5B's config.json shape (used when stare_jax.models has no "qwen2.5-0.5b" preset).
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151643,
)
TINY_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    qkv_bias=True,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
# benchmarks/stare_overhead.py --preset issue (the ~50M-param setting; 67M with the untied embeddings)
RATIO_MODEL = dict(
    vocab_size=32768,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=8,
    intermediate_size=2048,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)

SIZES = {
    # section: (full, tiny)
    "train_step": (
        dict(batch=16, seq_len=1024, micro_batches=1, timed=5),
        dict(batch=4, seq_len=64, micro_batches=1, timed=2),
    ),
    "sampler": (
        dict(prompts=64, samples=1, prompt_len=128, new_tokens=512, timed=3),
        dict(prompts=4, samples=1, prompt_len=16, new_tokens=16, timed=2),
    ),
    "stare_ratio": (
        dict(batch=64, seq_len=512, micro_batches=4, pairs=5),
        dict(batch=4, seq_len=64, micro_batches=1, pairs=2),
    ),
}
MIN_START_S = {"train_step": 90.0, "sampler": 60.0, "stare_ratio": 60.0}  # full mode; tiny: 5 s each


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def stats(values, unit="_s"):
    import statistics

    return {
        f"min{unit}": min(values),
        f"median{unit}": statistics.median(values),
        f"max{unit}": max(values),
        "n": len(values),
        f"values{unit}": [round(v, 6) for v in values],
    }


def peak_flops(device_kind: str):
    for pattern, flops, name in PEAK_FLOPS:
        if re.search(pattern, device_kind, flags=re.IGNORECASE):
            return flops, name
    return None, None


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Suite:
    def __init__(self, args):
        self.args = args
        self.t0 = _T_START
        self.deadline = self.t0 + args.budget_s
        self.lock = threading.Lock()
        self.done = False
        self.rc = 0
        self.result = {
            "suite": "stare_jax benchmarks/device_suite.py",
            "mode": "tiny" if args.tiny else "full",
            "budget_s": args.budget_s,
            "hard_limit_s": args.budget_s + HARD_GRACE_S,
            "loadavg_before": loadavg(),
            "train_step_mfu": None,
            "sampler_tokens_per_s": None,
            "stare_vs_grpo_step_ratio": None,
            "sections": {},
        }
        self.current = None

    # ------------------------------------------------------------------ budget
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def timed(self, fn, n):
        """n timed calls of fn (which blocks), stopping early when the budget is spent (at least one)."""
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            if self.left() <= 0:
                break
        return times

    # ------------------------------------------------------------------ output
    def finish(self, interrupted: str | None = None) -> int:
        if not interrupted and getattr(self, "timer", None) is not None:
            self.timer.cancel()
        with self.lock:
            if self.done:
                return self.rc
            self.done = True
            r = self.result
            if interrupted:
                for name in SIZES:
                    sec = r["sections"].setdefault(name, {})
                    if "status" not in sec or sec["status"] == "running":
                        sec["status"] = (
                            "skipped: budget (hard limit reached while running)"
                            if name == interrupted
                            else "skipped: budget"
                        )
            r["loadavg_after"] = loadavg()
            r["wall_s"] = round(time.perf_counter() - self.t0, 3)
            for attempt in range(5):  # the watchdog may serialise while the main thread adds a key
                try:
                    text = json.dumps(r, indent=2, default=_json_default)
                    break
                except RuntimeError:
                    time.sleep(0.05)
            else:
                text = json.dumps(
                    {
                        k: r.get(k)
                        for k in (
                            "suite",
                            "mode",
                            "wall_s",
                            "train_step_mfu",
                            "sampler_tokens_per_s",
                            "stare_vs_grpo_step_ratio",
                        )
                    }
                )
            print(text, flush=True)
            if self.args.json:
                with open(self.args.json, "w") as f:
                    f.write(text + "\n")
            failed = [k for k, v in r["sections"].items() if str(v.get("status", "")).startswith("error")]
            self.rc = 1 if failed else 0
            return self.rc

    def watchdog(self):
        wait = self.deadline + HARD_GRACE_S - time.perf_counter()

        def fire():
            log(
                f"[device_suite] hard limit ({self.args.budget_s + HARD_GRACE_S:.0f} s) reached in section "
                f"{self.current!r}: printing what is done and exiting"
            )
            rc = self.finish(interrupted=self.current)
            os._exit(rc)

        self.timer = threading.Timer(max(wait, 0.0), fire)
        self.timer.daemon = True
        self.timer.start()

    # ------------------------------------------------------------------ sections
    def run_section(self, name, fn):
        min_start = 5.0 if self.args.tiny else MIN_START_S[name]
        if self.args.skip and name in self.args.skip:
            self.result["sections"][name] = {"status": "skipped: --skip"}
            return
        if self.left() < min_start:
            self.result["sections"][name] = {
                "status": "skipped: budget",
                "note": f"{self.left():.0f} s left < {min_start:.0f} s needed to start",
            }
            log(f"[device_suite] {name}: skipped (budget)")
            return
        self.current = name
        sec = self.result["sections"][name] = {"status": "running"}
        t = time.perf_counter()
        try:
            fn(sec)
            sec["status"] = "ok" if sec.get("status") == "running" else sec["status"]
        except Exception as e:  # noqa: BLE001 - recorded in the JSON, the other sections still run
            sec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
            sec["traceback"] = traceback.format_exc()[-3000:]
            log(f"[device_suite] {name}: {sec['status']}")
        sec["section_wall_s"] = round(time.perf_counter() - t, 3)
        self.current = None


def _json_default(x):
    try:
        return float(x)
    except Exception:  # noqa: BLE001
        return str(x)


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run (CI)")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON here")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="time budget; later sections are skipped when it runs out; hard exit at budget + 30 s",
    )
    ap.add_argument(
        "--attention-impl",
        default="auto",
        choices=("auto", "xla", "dot_product", "cudnn", "splash"),
        help="auto: splash on TPU, cudnn on GPU (the paper configs' choice), xla on CPU; a failing "
        "splash/cudnn compile is retried once with xla (noted in the JSON)",
    )
    ap.add_argument("--remat", default="full", help="remat_policy of the models (paper configs: full)")
    ap.add_argument("--batch", type=int, help="train_step batch (default 16; tiny 4)")
    ap.add_argument("--seq-len", type=int, help="train_step tokens per sequence (default 1024; tiny 64)")
    ap.add_argument("--micro-batches", type=int, help="train_step micro-batches (default 1)")
    ap.add_argument("--steps", type=int, help="timed train steps (default 5; tiny 2)")
    ap.add_argument("--sampler-prompts", type=int, help="default 64; tiny 4")
    ap.add_argument("--sampler-samples", type=int, help="samples per prompt (default 1)")
    ap.add_argument("--new-tokens", type=int, help="default 512; tiny 16")
    ap.add_argument("--ratio-pairs", type=int, help="interleaved STARE/GRPO pairs timed (default 5; tiny 2)")
    ap.add_argument("--skip", nargs="*", choices=tuple(SIZES), default=(), help="sections not to run")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error("--budget-s must be > 0")

    suite = Suite(args)
    suite.watchdog()

    import flax
    import jax
    import jaxlib

    dev = jax.devices()[0]
    kind = dev.device_kind
    peak, peak_name = peak_flops(kind)
    platform = dev.platform
    impl = args.attention_impl
    if impl == "auto":
        impl = {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")
    r = suite.result
    r.update(
        {
            "device_kind": kind,
            "platform": platform,
            "device_count": jax.device_count(),
            "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__,
            "flax_version": flax.__version__,
            "peak_bf16_flops_per_s": peak,
            "peak_flops_entry": peak_name,
            "attention_impl": impl,
            "remat_policy": args.remat,
            "import_s": round(time.perf_counter() - suite.t0, 3),
            # set (e.g. by the CI test) -> first_call_s / compile_s may be cache loads, not compiles
            "compilation_cache_dir": jax.config.jax_compilation_cache_dir or None,
        }
    )
    if jax.device_count() > 1:
        r["note_devices"] = (
            f"{jax.device_count()} devices visible; the suite runs on one ({dev}) as a single-chip benchmark"
        )

    full = not args.tiny

    def size(section, key, override):
        return override if override is not None else SIZES[section][0 if full else 1][key]

    ctx = _Ctx(args, impl, full)
    ts_sizes = dict(
        batch=size("train_step", "batch", args.batch),
        seq_len=size("train_step", "seq_len", args.seq_len),
        micro_batches=size("train_step", "micro_batches", args.micro_batches),
        timed=size("train_step", "timed", args.steps),
    )
    sp_sizes = dict(
        prompts=size("sampler", "prompts", args.sampler_prompts),
        samples=size("sampler", "samples", args.sampler_samples),
        prompt_len=SIZES["sampler"][0 if full else 1]["prompt_len"],
        new_tokens=size("sampler", "new_tokens", args.new_tokens),
        timed=SIZES["sampler"][0 if full else 1]["timed"],
    )
    ra_sizes = dict(SIZES["stare_ratio"][0 if full else 1])
    if args.ratio_pairs is not None:
        ra_sizes["pairs"] = args.ratio_pairs

    suite.run_section("train_step", lambda sec: section_train_step(suite, ctx, sec, peak, **ts_sizes))
    suite.run_section("sampler", lambda sec: section_sampler(suite, ctx, sec, **sp_sizes))
    suite.run_section("stare_ratio", lambda sec: section_stare_ratio(suite, ctx, sec, **ra_sizes))
    return suite.finish()


class _Ctx:
    """Shared helpers: model configs, model cache, synthetic batches."""

    def __init__(self, args, impl, full):
        self.args, self.impl, self.full = args, impl, full
        self._models = {}
        self.init_s = 0.0

    def big_config(self, seq_len, impl):
        from stare_jax.models import PRESETS, ModelConfig

        if self.full:
            base = PRESETS.get("qwen2.5-0.5b") or ModelConfig(**QWEN25_05B)
            name = "qwen2.5-0.5b (preset)" if "qwen2.5-0.5b" in PRESETS else "Qwen2.5-0.5B shape (inline)"
        else:
            base = ModelConfig(**TINY_MODEL)
            name = "tiny Qwen2-shaped (2 layers, d=64)"
        cfg = base.replace(
            dtype="bfloat16",
            param_dtype="float32",
            attention_impl=impl,
            remat_policy=self.args.remat,
            max_position_embeddings=max(base.max_position_embeddings, seq_len + 1),
        )
        return name, cfg

    def ratio_config(self, seq_len, impl):
        from stare_jax.models import ModelConfig

        if not self.full:  # the train_step section's model and sizes: its STARE-O1 program is reused from a
            return self.big_config(seq_len, impl)[1]  # persistent compilation cache (JAX_COMPILATION_CACHE_DIR)
        kw = dict(RATIO_MODEL, max_position_embeddings=max(RATIO_MODEL["max_position_embeddings"], seq_len + 1))
        return ModelConfig(
            **kw, dtype="bfloat16", param_dtype="float32", attention_impl=impl, remat_policy=self.args.remat
        )

    def model(self, cfg):
        from stare_jax.models import init_model

        self.init_s = 0.0  # reused
        if cfg not in self._models:
            self._models.clear()  # at most one model alive
            t = time.perf_counter()
            self._models[cfg] = init_model(cfg, seed=0)
            self.init_s = round(time.perf_counter() - t, 3)
        return self._models[cfg]

    def impls(self):
        """Attention implementations to try, in order (the preferred one, then xla as the fallback)."""
        return [self.impl] if self.impl in ("xla", "dot_product") else [self.impl, "xla"]


def _fall_back(ctx, sec, impl, err, label):
    """After attention_impl `impl` failed: re-raise if it was the last choice, else record the fallback to xla."""
    if impl == ctx.impls()[-1]:
        raise err
    sec["attention_fallback"] = (
        f"attention_impl={impl} failed ({type(err).__name__}: {str(err).splitlines()[0][:300]}); fell back to xla"
    )
    log(f"[device_suite] {label}: {sec['attention_fallback']}")
    ctx._models.clear()


def model_summary(cfg):
    d, L, h, dh, V = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    n_total = cfg.num_params()
    n_matmul = n_total - (0 if cfg.tie_word_embeddings else V * d)
    return {
        "params": n_total,
        "matmul_params": n_matmul,
        "layers": L,
        "hidden": d,
        "heads": h,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": dh,
        "intermediate": cfg.intermediate_size,
        "vocab": V,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.dtype,
        "param_dtype": cfg.param_dtype,
        "attention_impl": cfg.attention_impl,
        "remat_policy": cfg.remat_policy,
    }


def synthetic_batch(B, L, V, seed=0):
    """Full-length rows (no padding, so every position is real work), first quarter prompt, rest response;
    GRPO-like +-1 advantages in groups of 4 (all nonzero, so every response token is in the loss)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, L)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    resp = np.zeros((B, L), np.int32)
    resp[:, max(1, L // 4) :] = 1
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    return dict(input_ids_BxT=ids, attention_mask_BxT=attn, response_mask_BxT=resp, advantages_B=adv)


def _stepper(model, tcfg, batch):
    """The project's jitted step with its state committed to the device and chained (the state is donated, as
    in the run); returns (call, metrics_ref)."""
    import jax
    import jax.numpy as jnp

    from stare_jax.rl import init_stare_state
    from stare_jax.rl.step import init_train_state, make_train_step

    graphdef, state = init_train_state(model, tcfg)
    # own copy of the params: the step donates its train state, and the model's arrays stay usable
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
    state, sstate = jax.device_put((state, init_stare_state(tcfg.stare)), jax.devices()[0])
    step = make_train_step(graphdef, tcfg)
    batch = jax.device_put(batch, jax.devices()[0])
    box = {"state": state, "stare": sstate, "metrics": None}

    def call():
        box["state"], box["stare"], box["metrics"] = step(box["state"], batch, box["stare"])
        jax.block_until_ready((box["state"], box["metrics"]))

    return call, box


def section_train_step(suite, ctx, sec, peak, *, batch, seq_len, micro_batches, timed):
    import jax

    from stare_jax.rl import StareConfig
    from stare_jax.rl.step import OptimizerConfig, TrainStepConfig

    tcfg = TrainStepConfig(
        optimizer=OptimizerConfig(lr=1e-6),
        stare=StareConfig(enabled=True, variant="O1", target_entropy=1e3),
        num_micro_batches=micro_batches,
    )
    sec["sizes"] = {
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": batch * seq_len,
        "micro_batches": micro_batches,
        "timed_steps": timed,
        "warmup_steps": 1,
        "train_step": "STARE-O1, gate forced on (target_entropy 1e3), ppo_epochs 1, 1 mini-batch, "
        "token-mean, lr 1e-6 AdamW, state donated",
    }
    for impl in ctx.impls():
        name, mcfg = ctx.big_config(seq_len, impl)
        try:
            model = ctx.model(mcfg)
            sec["model_init_s"] = ctx.init_s
            t = time.perf_counter()
            call, box = _stepper(model, tcfg, synthetic_batch(batch, seq_len, mcfg.vocab_size))
            sec["state_setup_s"] = round(time.perf_counter() - t, 3)  # optimizer init, copy, device_put
            t = time.perf_counter()
            call()  # compile + first step
            first = time.perf_counter() - t
            break
        except Exception as e:  # noqa: BLE001
            _fall_back(ctx, sec, impl, e, "train_step")
    sec["model_name"] = name
    sec["model"] = model_summary(mcfg)
    log(
        f"[device_suite] train_step: {name}, {mcfg.num_params() / 1e6:.1f}M params, {batch}x{seq_len}, "
        f"first call {first:.1f} s"
    )
    call()  # warm-up
    times = suite.timed(call, timed)
    st = stats(times)
    m = jax.device_get(box["metrics"])
    sec["metrics_last_step"] = {
        k: float(m[k]) for k in ("loss", "grad_norm", "entropy", "gate_on", "skipped_updates", "response_tokens")
    }
    sec["step_time"] = st
    sec["first_call_s"] = round(first, 3)
    sec["compile_s"] = round(first - st["median_s"], 3)

    tokens = batch * seq_len
    n = sec["model"]["matmul_params"]
    attn = 2 * mcfg.num_layers * mcfg.num_heads * mcfg.head_dim * seq_len  # per token, forward, causal
    model_flops = tokens * (8 * n + 4 * attn)
    hw_flops = model_flops + (tokens * (2 * n + attn) if mcfg.remat_policy != "none" else 0)
    sec["flops"] = {
        "model_flops_per_step": model_flops,
        "train_fwd_bwd": tokens * (6 * n + 3 * attn),
        "old_logprob_pass": tokens * (2 * n + attn),
        "attention_fwd_per_token": attn,
        "remat_recompute": hw_flops - model_flops,
        "hardware_flops_per_step": hw_flops,
    }
    achieved = model_flops / st["median_s"]
    sec["model_flops_per_s"] = achieved
    sec["tokens_per_s"] = tokens / st["median_s"]
    suite.result["mfu_formula"] = (
        "MFU = tokens*(8*N + 8*n_layers*n_heads*head_dim*L) / (median_step_s * peak_bf16_flops_per_s); "
        "6N+3A fwd+bwd update + 2N+A no-grad old-log-prob pass, A = 2*n_layers*n_heads*head_dim*L per token "
        "(causal QK^T+AV), N = num_params less the untied input embedding, tokens = batch*L; remat recompute "
        "(+2N+A) excluded from MFU, included in hfu"
    )
    if peak:
        mfu = achieved / peak
        sec["mfu"] = mfu
        sec["hfu"] = hw_flops / st["median_s"] / peak
        suite.result["train_step_mfu"] = mfu
        suite.result["train_step_mfu_note"] = f"peak {peak:.3g} FLOP/s ({suite.result['peak_flops_entry']})"
    else:
        sec["mfu"] = None
        suite.result["train_step_mfu_note"] = (
            f"device kind {suite.result['device_kind']!r} is not in the peak FLOP/s table (H100/H200, A100, B200, "
            "TPU v4/v5e/v5p/v6e), so MFU is null; model_flops_per_s is in sections.train_step"
        )
    del box, call
    log(
        f"[device_suite] train_step: median {st['median_s'] * 1e3:.1f} ms, "
        f"{achieved / 1e12:.2f} TFLOP/s, MFU {sec['mfu']}"
    )


def section_sampler(suite, ctx, sec, *, prompts, samples, prompt_len, new_tokens, timed):
    import jax
    import numpy as np

    from stare_jax.sampling import Sampler, SamplingParams

    sec["sizes"] = {
        "prompts": prompts,
        "samples_per_prompt": samples,
        "rows": prompts * samples,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "timed_runs": timed,
        "warmup_runs": 1,
        "temperature": 1.0,
        "eos_ids": [],
        "kv_cache_dtype": "bfloat16",
    }
    for impl in ctx.impls():
        name, mcfg = ctx.big_config(prompt_len + new_tokens, impl)
        try:
            model = ctx.model(mcfg)
            sec["model_init_s"] = ctx.init_s
            t = time.perf_counter()
            sampler = Sampler(model, cache_dtype="bfloat16")
            sec["sampler_init_s"] = round(time.perf_counter() - t, 3)
            V = mcfg.vocab_size
            rng = np.random.default_rng(1)
            ids = jax.device_put(rng.integers(0, V, (prompts, prompt_len)).astype(np.int32))
            mask = jax.device_put(np.ones((prompts, prompt_len), np.int32))
            out_box = {}

            def call():
                out = sampler.generate_arrays(
                    ids,
                    mask,
                    max_new_tokens=new_tokens,
                    num_samples=samples,
                    sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=0),
                )
                out_box["out"] = jax.block_until_ready(out)

            t = time.perf_counter()
            call()
            first = time.perf_counter() - t
            break
        except Exception as e:  # noqa: BLE001
            _fall_back(ctx, sec, impl, e, "sampler")
    sec["model_name"] = name
    sec["model"] = model_summary(mcfg)
    sec["sampler_weights_dtype"] = str(jax.tree.leaves(sampler.state)[0].dtype)
    log(f"[device_suite] sampler: first call {first:.1f} s")
    call()  # warm-up
    times = suite.timed(call, timed)
    lengths = np.asarray(jax.device_get(out_box["out"].lengths_B))
    rows = prompts * samples
    if lengths.shape != (rows,) or not (lengths == new_tokens).all():
        raise RuntimeError(f"expected {rows} rows of {new_tokens} tokens, got lengths {lengths.tolist()[:16]}")
    st = stats(times)
    sec["generate_time"] = st
    sec["first_call_s"] = round(first, 3)
    sec["compile_s"] = round(first - st["median_s"], 3)
    sec["generated_tokens_per_call"] = rows * new_tokens
    tps = rows * new_tokens / st["median_s"]
    sec["tokens_per_s"] = tps
    sec["tokens_per_s_best"] = rows * new_tokens / st["min_s"]
    suite.result["sampler_tokens_per_s"] = tps
    suite.result["sampler_setup"] = (
        f"{prompts} prompts x {samples} sample(s), {prompt_len}-token prompts, {new_tokens} new tokens, eos_ids=[]"
    )
    sampler.release()
    log(f"[device_suite] sampler: median {st['median_s']:.3f} s -> {tps:.0f} tokens/s")


def section_stare_ratio(suite, ctx, sec, *, batch, seq_len, micro_batches, pairs):
    from stare_jax.rl import StareConfig
    from stare_jax.rl.step import OptimizerConfig, TrainStepConfig

    arms = {
        "grpo_ds": StareConfig(enabled=False),
        "stare_o1": StareConfig(enabled=True, variant="O1", target_entropy=1e3),
    }
    sec["sizes"] = {
        "batch": batch,
        "seq_len": seq_len,
        "micro_batches": micro_batches,
        "timed_pairs": pairs,
        "warmup_steps": 1,
        "order": "interleaved grpo_ds, stare_o1, grpo_ds, ...",
    }
    sec["arms"] = {
        "grpo_ds": "StareConfig(enabled=False)",
        "stare_o1": "StareConfig(enabled=True, variant='O1', target_entropy=1e3): gate on",
    }
    for impl in ctx.impls():
        mcfg = ctx.ratio_config(seq_len, impl)
        try:
            model = ctx.model(mcfg)
            sec["model_init_s"] = ctx.init_s
            batch_np = synthetic_batch(batch, seq_len, mcfg.vocab_size, seed=2)
            calls, boxes, first = {}, {}, {}
            for arm, scfg in arms.items():
                tcfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-6), stare=scfg, num_micro_batches=micro_batches)
                calls[arm], boxes[arm] = _stepper(model, tcfg, batch_np)
                t = time.perf_counter()
                calls[arm]()
                first[arm] = round(time.perf_counter() - t, 3)
            break
        except Exception as e:  # noqa: BLE001
            _fall_back(ctx, sec, impl, e, "stare_ratio")
    sec["model"] = model_summary(mcfg)
    log(f"[device_suite] stare_ratio: {mcfg.num_params() / 1e6:.1f}M params, {batch}x{seq_len}, first calls {first}")
    for arm in arms:
        calls[arm]()  # warm-up
    times = {arm: [] for arm in arms}
    for _ in range(pairs):
        for arm in arms:
            t = time.perf_counter()
            calls[arm]()
            times[arm].append(time.perf_counter() - t)
        if suite.left() <= 0:
            break
    import jax

    gate = float(jax.device_get(boxes["stare_o1"]["metrics"]["gate_on"]))
    if gate != 1.0:
        raise RuntimeError(f"the STARE-O1 arm's gate is off (gate_on={gate}): the ratio would not time STARE")
    sec["stare_o1_gate_on"] = gate
    st = {arm: stats(ts) for arm, ts in times.items()}
    sec["step_time"] = st
    sec["first_call_s"] = first
    sec["compile_s"] = {arm: round(first[arm] - st[arm]["median_s"], 3) for arm in arms}
    ratio = st["stare_o1"]["median_s"] / st["grpo_ds"]["median_s"]
    pair_ratios = [s / g for s, g in zip(times["stare_o1"], times["grpo_ds"])]
    sec["ratio_median_of_medians"] = ratio
    sec["pair_ratios"] = stats(pair_ratios, unit="")
    suite.result["stare_vs_grpo_step_ratio"] = ratio
    log(f"[device_suite] stare_ratio: STARE-O1 / GRPO-ds = {ratio:.4f}")


if __name__ == "__main__":
    sys.exit(main())
