"""Test session set-up: 8 fake CPU devices (for mesh tests), an opt-in persistent JAX compilation cache, the tiers.

Tiers (markers, one per test, from its folder: tests/unit/<package>/ mirrors stare_jax/, tests/integration/,
tests/system/): `unit` - one module's functions against an independent reference,
in-process; `integration` - whole programs as users run them (subprocesses, the real SmolLM2, parity with
transformers' generate); `system` - the pod and cluster machinery (TPU ahead-of-time compiles, the launch scripts,
multi-process runs): opt-in with --system or STARE_JAX_RUN_SYSTEM=1, and always run by .ci/run after the default
suite; `slow` - opt-in (--runslow or STARE_JAX_RUN_SLOW=1). The default run is unit + integration; `-m unit` /
`-m integration` select one tier, and every run ends with each tier's time. Shared fixtures are defined here;
helpers without fixtures live in tests/support/ (imported as `support.x`: pyproject.toml puts tests/ on sys.path)."""

import gc
import json
import os
import signal
import sys

# Must happen before jax is imported anywhere: 8 host devices so mesh tests can build a (2, 4) mesh.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The default tiers are dominated by XLA:CPU compiles of tiny programs: LLVM at -O0 compiles them ~1.5x faster and
# computes the same IEEE results (fast math stays off), so the suite's references and tolerances are unchanged. Not
# for the system tier (it compiles TPU programs whose memory and cost figures it checks) nor when the flag is set.
_system = "--system" in sys.argv or os.environ.get("STARE_JAX_RUN_SYSTEM") == "1"
if not _system and "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags
# A suite started in the background of a non-interactive shell (or under nohup) inherits SIGINT ignored, and so do
# its subprocesses: the Ctrl-C tests would then test that state. Python's own Ctrl-C handling for the session (a
# handled signal is reset to the default in every child at exec, so the CLI subprocesses get theirs too).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pathlib

import jax
import pytest

from support.models import FAMILIES, make_hf_model
from support.tokenizers import QWEN25_TEMPLATE, QWEN_PATTERN, _added_tokens_decoder, _train_bpe

_REPO = pathlib.Path(__file__).resolve().parents[1]
# The persistent cache only pays when the same checkout runs the suite again (a clean CI clone starts cold and the
# in-process jit caches already share programs between tests), and writing engine programs to it has crashed jaxlib
# in a full run (docs/perf_history.md): opt in with STARE_JAX_TEST_CACHE=1 for local reruns. Off means off:
# stare_jax.experiments.compare sets a cache dir when it runs in-process, so the cache itself is disabled.
if os.environ.get("STARE_JAX_TEST_CACHE") == "1":
    jax.config.update("jax_compilation_cache_dir", str(_REPO / ".cache" / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
else:
    jax.config.update("jax_enable_compilation_cache", False)

SHARED_DATA = _REPO.parent / "shared" / "data"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption(
        "--system",
        action="store_true",
        default=False,
        help="run the system tier (TPU compiles, launch scripts, multi-process runs)",
    )


TIERS = ("unit", "integration", "system", "slow")
_TESTS_DIR = pathlib.Path(__file__).resolve().parent
_TIER_SECONDS = dict.fromkeys(TIERS, 0.0)


def tier_of(item) -> str:
    if "slow" in item.keywords:
        return "slow"
    folder = pathlib.Path(str(item.path)).resolve().relative_to(_TESTS_DIR).parts[0]
    if folder not in TIERS[:3]:
        raise pytest.UsageError(
            f"{item.path}: a test module must live in tests/unit, tests/integration or tests/system"
        )
    return folder


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        if tier != "slow":
            item.add_marker(getattr(pytest.mark, tier))
    run_slow = config.getoption("--runslow") or os.environ.get("STARE_JAX_RUN_SLOW") == "1"
    run_system = config.getoption("--system") or os.environ.get("STARE_JAX_RUN_SYSTEM") == "1"
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or STARE_JAX_RUN_SLOW=1")
    skip_system = pytest.mark.skip(reason="system tier: run with --system or STARE_JAX_RUN_SYSTEM=1 (.ci/run does)")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        elif tier_of(item) == "system" and not run_system:
            item.add_marker(skip_system)


def pytest_runtest_logreport(report):
    """Adds each test's set-up, call and tear-down time to its tier."""
    tier = next((t for t in TIERS if t in report.keywords), None)
    if tier is not None:
        _TIER_SECONDS[tier] += report.duration


def pytest_terminal_summary(terminalreporter):
    ran = {t: s for t, s in _TIER_SECONDS.items() if s >= 0.5}
    if ran:
        terminalreporter.write_line("time per tier: " + ", ".join(f"{t} {s:.0f} s" for t, s in ran.items()))


# XLA's CPU client maps each compiled executable's code into memory regions of its own, and jit caches of
# module-level functions keep every program a test compiled alive for the whole session: the full suite compiles
# thousands, enough to reach the kernel's vm.max_map_count (65,530 by default), where pthread_create fails ("can't
# start new thread" in orbax's save) or native code segfaults. Dropping the caches after a module once the count
# passes a third of the limit frees them (the measurements: docs/perf_history.md).
_MAPS_BEFORE_CLEARING = 20_000


def memory_mappings() -> int:
    """This process's number of memory mappings (0 where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs_when_mappings_pile_up():
    """After each test module: clear JAX's caches when the mapping count is high (see _MAPS_BEFORE_CLEARING)."""
    yield
    if memory_mappings() > _MAPS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data (read in place, never copied into the repo)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{family: (folder, torch model)} for the three tiny checkpoints (support.models.make_hf_model)."""
    out = {}
    for fam in FAMILIES:
        folder = tmp_path_factory.mktemp(f"hf_{fam}")
        model = make_hf_model(fam)
        model.save_pretrained(folder)
        out[fam] = (folder, model)
    return out


@pytest.fixture(scope="session")
def qwen_sft_dir(tmp_path_factory):
    """A Qwen2.5-Instruct-style tokenizer folder (small trained BPE; the real chat template, eos <|im_end|>)."""
    folder = tmp_path_factory.mktemp("qwen_sft")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _train_bpe(QWEN_PATTERN, specials)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "added_tokens_decoder": _added_tokens_decoder(tok, specials),
        "bos_token": None,
        "chat_template": QWEN25_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "split_special_tokens": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
