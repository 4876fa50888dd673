"""One process of the multi-process rollout-engine test (tests/system/test_multihost_engine.py launches it; not a pytest
file).

    python tests/system/_multihost_engine_worker.py --out DIR
        [--num-processes N --process-id I --coordinator-address 127.0.0.1:PORT]

As tests/system/_multihost_worker.py: JAX_PLATFORMS=cpu and 8 / N CPU devices per process, so every run sees 8 global
devices. Every process runs the same replicated engine scheduler on the same host data; each writes
DIR/result_<process>.json (so the test checks that the processes agree with each other and with 1 x 8):

generate: a tiny random Qwen2 on a data 2 x tensor 4 mesh (the engine's pool split over 2 data shards, kv heads
          over tensor), Engine.generate greedy (EOS ids picked from a free run: long-tailed lengths) and
          temperature 1 (8 EOS ids: geometric lengths), tokens / log-probs / finish reasons; the same through
          Engine.generate_arrays (the RL loop's call, read back with distributed.fetch_global).
tools:    stare_jax.tools.rollout.tool_rollouts with the local sandbox backend: the bigram model and byte-level
          tokenizer of tests/unit/tools/test_rollout.py on a data 2 x fsdp 2 x tensor 2 mesh (a good call, invalid JSON,
          an unknown tool, no call); rows' tokens, masks, statuses, ends, and the pool's call count per process
          (process 0 alone runs the code).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the shared helpers (support.x)

T0 = time.time()


def _log(msg):
    print(
        f"[engine worker {os.environ.get('STARE_MH_PID', '?')} +{time.time() - T0:.1f}s] {msg}",
        file=sys.stderr,
        flush=True,
    )


def _on_mesh(model, mesh):
    """The same model with its parameters as global arrays in the mesh layout (each process places its own
    devices' pieces of the identical host values)."""
    import jax
    import numpy as np
    from flax import nnx

    from stare_jax import distributed
    from stare_jax.models import init_model

    host = jax.tree.map(np.asarray, nnx.state(model))
    placed = init_model(model.config, seed=0, mesh=mesh)
    nnx.update(
        placed, jax.tree.map(lambda h, ref: distributed.global_from_host(h, ref.sharding), host, nnx.state(placed))
    )
    return placed


def _generate(out: dict) -> None:
    import jax
    import numpy as np

    from stare_jax import distributed
    from stare_jax.models.sharding import make_mesh
    from stare_jax.sampling import SamplingParams
    from stare_jax.sampling.engine import Engine, EngineConfig
    from support.engine import EOS, PROMPTS, _tiny

    mesh = make_mesh({"data": 2, "tensor": 4})
    config = EngineConfig(max_slots=8, page_size=8, decode_chunk=4, prefill_chunk=8, num_pages=32)
    engine = Engine(_on_mesh(_tiny("qwen2"), mesh), mesh=mesh, config=config)
    assert engine.data_shards == 2
    kw = dict(max_new_tokens=16, num_samples=3)
    free = engine.generate(PROMPTS, sampling=SamplingParams(temperature=0.0, eos_ids=[]), **kw)
    greedy_eos = sorted({free.tokens[3 * p][k] for p, k in ((0, 3), (2, 9), (4, 13))})
    for name, temperature, eos in (("greedy", 0.0, greedy_eos), ("t1", 1.0, EOS)):
        o = engine.generate(PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw)
        out[name] = {
            "tokens": o.tokens,
            "lengths": o.lengths,
            "finish": o.finish_reasons,
            "logprobs": [[float(x) for x in lp] for lp in o.logprobs],
            "prefix_prefills": engine.stats["prefix_prefills"],
        }
        _log(f"{name}: lengths {o.lengths}")
    T = max(len(p) for p in PROMPTS)
    ids = np.zeros((len(PROMPTS), T), np.int32)
    mask = np.zeros_like(ids)
    for r, p in enumerate(PROMPTS):  # left-padded, as rollouts.left_pad
        ids[r, T - len(p) :], mask[r, T - len(p) :] = p, 1
    arr = engine.generate_arrays(ids, mask, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=5), **kw)
    assert not arr.tokens_BxN.is_fully_addressable or jax.process_count() == 1
    toks, lengths, finished = distributed.fetch_global((arr.tokens_BxN, arr.lengths_B, arr.finished_B))
    out["arrays"] = {"tokens": toks.tolist(), "lengths": lengths.tolist(), "finished": finished.tolist()}


def _tools(out: dict) -> None:
    from stare_jax.models.sharding import make_mesh
    from stare_jax.sampling import SamplingParams
    from stare_jax.sampling.engine import Engine, EngineConfig
    from stare_jax.tools import SandboxPool, ToolConfig
    from stare_jax.tools.rollout import tool_rollouts
    from support.tools import CALL, TEMPLATE, _bigram_model, _make_tokenizer

    tokenizer = _make_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="mh_tool_tok")), TEMPLATE)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = _bigram_model(tokenizer, {"}": "</tool_call>", ")": "</code>"}, default="<|im_end|>")
    engine = Engine(
        _on_mesh(model, mesh),
        mesh=mesh,
        pad_id=tokenizer.pad_id,
        config=EngineConfig(max_slots=8, page_size=8, decode_chunk=8, prefill_chunk=64),
    )
    prompts = [
        CALL.format(name="code_interpreter", code="print(6 * 7)"),
        CALL.format(name="code_interpreter", code="print(1)")[:-1],  # invalid JSON
        CALL.format(name="web_search", code="print(1)"),
        CALL.format(name="code_interpreter", code="print(sum(range(10)))"),
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n",
    ]  # no call
    cfg = ToolConfig(enabled=True, timeout_s=5.0)
    with SandboxPool(4, timeout_s=5.0, memory_mb=512) as pool:
        rows = tool_rollouts(
            engine,
            [tokenizer.encode(p, add_bos=False) for p in prompts],
            group_size=2,
            tool_cfg=cfg,
            tokenizer=tokenizer,
            pool=pool,
            max_new_tokens=96,
            sampling=SamplingParams(seed=1),
        )
        calls = pool.stats()["n_calls"]
    out["tools"] = {
        "rows": [
            {
                "tokens": r.tokens,
                "mask": r.model_mask,
                "statuses": [s.value for s in r.statuses],
                "end": r.end,
                "turns": r.turns,
                "final_start": r.final_start,
            }
            for r in rows
        ],
        "texts": [tokenizer.decode(r.tokens, skip_special_tokens=False) for r in rows],
        "pool_calls": calls,
        "pages_free": all(p.all_free() for p in engine.pools),
    }
    _log(f"tools: statuses {[r.statuses for r in rows]}, this process's pool ran {calls} calls")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator-address", default=None)
    args = ap.parse_args(argv)
    os.environ["STARE_MH_PID"] = str(args.process_id)

    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )
    _log(
        f"process {jax.process_index()}/{jax.process_count()}, {jax.local_device_count()} local / "
        f"{jax.device_count()} global devices"
    )
    if jax.device_count() != 8:
        raise SystemExit(f"expected 8 global devices, got {jax.device_count()}")

    out: dict = {"process": jax.process_index(), "processes": jax.process_count()}
    _generate(out)
    _tools(out)
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"result_{jax.process_index()}.json").write_text(json.dumps(out))
    if args.num_processes > 1:
        from stare_jax import distributed

        distributed.barrier("stare_jax_engine_worker_done")
        jax.distributed.shutdown()
    _log("done")


if __name__ == "__main__":
    main()
