"""Imports point down the layers of the package (docs/architecture.md), checked on the source with `ast`, so
function-local imports count as much as module-level ones, and through the import graph (package __init__s
included: importing a.b.c runs a and a.b first), so no module reaches a higher layer through another.

The layers, lowest first (a module may import its own layer and those below; a module's layer is that of the
longest prefix listed):
  0 foundation: the platform pick, the option machinery
  1 models, the multi-process helpers (they use the mesh rules), tasks, data, the toy's plain spec
  2 the components of one step: rewards, tools, sampling, rl, and the config sections they are built from
  3 the run config (loader) and its resume diff
  4 what the loop uses below it: collection of rollouts, checkpoints, metrics, run folders; the planner
  5 evaluation (it collects rollouts)
  6 the training loop, its set-up, SFT, policy load/export and the ahead-of-time compile of its programs
  7 the toy's assets (its warm start is an SFT run)
  8 experiments: demo, compare, plot
  9 the command line
Plus: rewards never import tasks (the caller hands the judge a task's check); rewards, sampling and tasks stay off
the checkpoint import/export (models.hf_io); only the entry points (cli, the demo) import the training loop."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG_DIR = pathlib.Path(__file__).resolve().parents[2] / "stare_jax"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("_platform", "config.options"),
    ("models", "distributed", "tasks", "data", "toy", "toy.spec"),
    ("rewards", "tools", "sampling", "rl", "config"),
    ("config.loader", "config.resume"),
    ("training.collect", "training.checkpoint", "training.metrics", "training.run_dir", "planning"),
    ("eval",),
    ("training",),
    ("toy.assets",),
    ("experiments",),
    ("cli",),
)
# (importer prefix, imported prefix) pairs forbidden even where the layers allow them
FORBIDDEN = (("rewards", "tasks"), ("rewards", "models.hf_io"), ("sampling", "models.hf_io"), ("tasks", "models.hf_io"))
# (importer, imported) pairs that are allowed anyway, each with its reason.  Keep this empty unless truly needed.
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, int]]:
    path = MODULES[name]
    return _imports_in_source(path.read_text(), name, is_package=path.name == "__init__.py")


def _imports_in_source(source: str, name: str, is_package: bool) -> list[tuple[str, int]]:
    """(stare_jax module, line) for every import in a module's source, at any depth (functions, classes, ifs,
    try blocks); `from pkg import sub` counts as importing pkg.sub when sub is a module; importlib.import_module /
    __import__ calls with a literal name count too."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.append((sub if sub in MODULES else mod, node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno))
    return [(m, line) for m, line in found if m == "stare_jax" or m.startswith("stare_jax.")]


def _loaded_with(module: str) -> set[str]:
    """Importing a.b.c runs the __init__ of a and a.b first."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(MODULES)


def _is_under(module: str, prefix: str) -> bool:
    full = f"stare_jax.{prefix}"
    return module == full or module.startswith(full + ".")


def layer_of(module: str) -> int:
    """The layer of a stare_jax module (longest listed prefix); an empty package __init__ (no imports) is in layer
    0: importing it runs nothing."""
    if module == "stare_jax" or (module in MODULES and MODULES[module].name == "__init__.py" and not _imports(module)):
        return 0
    best = max(((len(p), i) for i, layer in enumerate(LAYERS) for p in layer if _is_under(module, p)), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and docs/architecture.md)")
    return best[1]


def _violation(importer: str, imported: str) -> str | None:
    if (importer, imported) in ALLOWED:
        return None
    if layer_of(imported) > layer_of(importer):
        return f"layer {layer_of(importer)} imports layer {layer_of(imported)}"
    for low, high in FORBIDDEN:
        if _is_under(importer, low) and _is_under(imported, high):
            return f"{low} must not import {high}"
    return None


def _loaded_with(module: str) -> set[str]:
    """Importing a.b.c runs the __init__ of a and a.b first."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(MODULES)


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


@pytest.mark.parametrize("importer", sorted(MODULES))
def test_no_direct_import_reaches_up(importer):
    bad = [
        f"{MODULES[importer].relative_to(PKG_DIR.parent)}:{line} imports {mod}: {why}"
        for mod, line in _imports(importer)
        for why in [_violation(importer, mod)]
        if why
    ]
    assert not bad, "\n".join(bad)


def test_no_import_chain_reaches_up():
    """Through other stare_jax modules too (package __init__s included, since importing a.b runs a/__init__)."""
    graph = {m: set().union(set(), *[_loaded_with(i) for i, _ in _imports(m)]) for m in MODULES}
    bad = []
    for importer in MODULES:
        seen, stack, parent = {importer}, [importer], {}
        while stack:
            cur = stack.pop()
            for nxt in sorted(graph[cur] - seen):
                if (cur, nxt) in ALLOWED:
                    continue
                seen.add(nxt)
                parent[nxt] = cur
                if layer_of(nxt) > layer_of(importer):
                    chain = [nxt]
                    while chain[-1] != importer:
                        chain.append(parent[chain[-1]])
                    bad.append(" -> ".join(reversed(chain)))
                else:
                    stack.append(nxt)
    assert not bad, "\n".join(bad)


def test_the_layers_say_what_the_issue_asked():
    """The loop gets the toy's inputs from its caller and sits above the planner (it asks it for a number: the
    engine's slot count); experiments are above the loop; the judge does not import the tasks."""
    assert layer_of("stare_jax.training.setup") < layer_of("stare_jax.toy.assets")
    assert layer_of("stare_jax.planning.estimate") < layer_of("stare_jax.training.setup")
    assert _violation("stare_jax.rewards.reward_fn", "stare_jax.tasks") is not None
    assert _violation("stare_jax.training.loop", "stare_jax.experiments.demo") is not None


def test_the_check_sees_function_local_relative_and_dynamic_imports():
    source = (
        "import os\n"
        "def f():\n    from stare_jax.training import loop\n    from .. import toy\n"
        "    import stare_jax.planning.estimate\n"
        "    if True:\n        import importlib; importlib.import_module('stare_jax.cli')\n"
        "class C:\n    def g(self):\n        from ..models import hf_io\n"
    )
    found = {m for m, _ in _imports_in_source(source, "stare_jax.rewards.probe", is_package=False)}
    assert found == {
        "stare_jax.training.loop",
        "stare_jax.toy",
        "stare_jax.planning.estimate",
        "stare_jax.cli",
        "stare_jax.models.hf_io",
    }
    assert _violation("stare_jax.rewards.probe", "stare_jax.models.hf_io")
    assert not _violation("stare_jax.rl.probe", "stare_jax.models.hf_io")


def test_only_the_entry_points_import_the_training_loop():
    """policy (evaluation/export), aot and the lower layers use training.setup; only the command line and the demo run
    the loop."""
    importers = {m for m in MODULES for mod, _ in _imports(m) if mod == "stare_jax.training.loop"}
    assert importers <= {"stare_jax.cli.train", "stare_jax.experiments.demo"}, importers  # cli: its train command


# (module, imported module) pairs that are imported inside a function on purpose, each with its reason
LOCAL_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("stare_jax.training.metrics", "wandb"): "optional extra [wandb]: only logging.wandb_project needs it",
    ("stare_jax.training.metrics", "tensorboardX"): "only with logging.tensorboard; it imports torch when torch is "
    "installed "
    "(~2 s on every CLI start, --help included, otherwise)",
    ("stare_jax.training.aot", "libtpu"): "optional (test dependency): only `plan --compile` needs it; the "
    "import names "
    "the package to install when it is missing",
    ("stare_jax.models.gguf_convert", "torch"): "optional extra [convert]",
    ("stare_jax.models.gguf_convert", "transformers"): "optional extra [convert]",
    ("stare_jax.models.gguf_convert", "gguf"): "optional extra [convert]",
    ("stare_jax.models.gguf_convert", "fcntl"): "POSIX only; without it (Windows) the lock is skipped",
    ("stare_jax.rewards.pool", "resource"): "POSIX only, in the sandboxed worker process",
    ("stare_jax.rewards.math", "math_verify"): "the LaTeX grammar (seconds to load) only where math answers are "
    "scored: the reward workers, not the toy tasks' runs",
    ("stare_jax.rewards.math", "sympy"): "as math_verify (sympy is its dependency)",
    ("stare_jax.rewards._sympy_budget", "sympy"): "as math_verify: only inside the scoring of a math answer",
}


def _function_local_imports(name: str) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement inside a function or method of a module."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    found += [
                        (a.name.split(".")[0] if not a.name.startswith("stare_jax") else a.name, sub.lineno)
                        for a in sub.names
                    ]
                elif isinstance(sub, ast.ImportFrom) and sub.module:
                    top = sub.module if sub.module.startswith("stare_jax") or sub.level else sub.module.split(".")[0]
                    found.append((top, sub.lineno))
    return found


def test_imports_are_at_module_level_unless_truly_optional():
    bad = [
        f"{MODULES[m].relative_to(PKG_DIR.parent)}:{line} imports {mod} inside a function"
        for m in MODULES
        for mod, line in _function_local_imports(m)
        if (m, mod) not in LOCAL_IMPORTS_ALLOWED
    ]
    assert not bad, "\n".join(bad)


def test_the_tools_package_needs_only_the_standard_library():
    """`import stare_jax.tools` (the sandbox, the pool, call parsing) loads no jax or numpy: the unprivileged sandbox
    test (tests/unit/tools/test_sandbox.py::test_user_namespace_mode_without_root) imports it with the system
    interpreter, which has neither, and skips (hiding the attacks it runs) when the import fails."""
    code = "import sys; import stare_jax.tools; print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG_DIR.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
