"""The package's layout: one folder per concept, layered, with no import circle.

Imports are read from the source (`ast`, imports inside functions included), so a lazy import
cannot hide an upward dependency. A new folder must be placed in `LAYERS` to pass: say where the
concept sits before it grows.
"""
import ast
import os
from typing import Dict, List, Set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module may import its own concept and concepts of lower layers, never a concept of
# its own layer or above (the README's picture draws the same layers).
LAYERS: List[Set[str]] = [
    # catalog: the facts of estimators and reward workers, torch-free; sandbox: the code sandbox (the
    # code reward's and the python tool's)
    {"roll_gspo.utils", "roll_gspo.catalog", "roll_gspo.sandbox"},
    # schema: the config's dataclasses (and their read-only mode), named by every layer above
    {"roll_gspo.schema"},
    {"roll_gspo.algorithms", "roll_gspo.builtin", "roll_gspo.distributed", "roll_gspo.lifecycle",
     "roll_gspo.metrics", "roll_gspo.placement", "roll_gspo.rewards"},
    # report: the run report page, built from a run folder's files alone (no torch, no Ray); just above
    # metrics, whose stall rule (metrics/stalls.py) marks its timeline
    {"roll_gspo.report"},
    # Agentic environments and tools: config's --dry-run checks env declarations with them.
    {"roll_gspo.envs", "roll_gspo.tasks"},  # tasks: prompts plus their rule reward (reasoning-gym, built-in)
    {"roll_gspo.config", "roll_gspo.data", "roll_gspo.models", "roll_gspo.sync"},
    {"roll_gspo.strategies", "roll_gspo.agentic"},
    {"roll_gspo.workers", "roll_gspo.serving"},  # serving: the OpenAI-compatible endpoint in front of the ranks
    {"pipelines"},
    {"roll_gspo.eval"},  # the evaluation command (vLLM on a task set, no Ray); builds a warm start by its pipeline
    {"roll_gspo.cli"},
]
LAYER_OF = {concept: i for i, layer in enumerate(LAYERS) for concept in layer}


def _modules() -> Dict[str, str]:
    """Dotted module name -> file, for roll_gspo and pipelines."""
    found = {}
    for top in ("roll_gspo", "pipelines"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


MODULES = _modules()


def _imports(module: str, path: str) -> Set[str]:
    """The project modules `module` imports (a name imported from a package counts as its submodule
    when there is one)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    out.add(base)
    out.discard(module)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _concept(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "roll_gspo" and len(parts) > 1 else parts[0]


def test_the_package_root_holds_only_the_cli_the_face_and_folders():
    root = os.path.join(REPO, "roll_gspo")
    loose = sorted(name for name in os.listdir(root)
                   if os.path.isfile(os.path.join(root, name)) and name not in ("__init__.py", "cli.py"))
    assert loose == [], f"modules loose at the package root (put each in its concept's folder): {loose}"


def test_every_concept_has_a_layer():
    concepts = {_concept(m) for m in MODULES} - {"roll_gspo"}
    assert concepts - set(LAYER_OF) == set(), "place the new folder in LAYERS"


def test_no_module_imports_a_concept_of_its_own_layer_or_above():
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                   if _concept(m) != _concept(d) and _concept(m) in LAYER_OF
                   and LAYER_OF[_concept(d)] >= LAYER_OF[_concept(m)])
    assert wrong == []


def test_no_import_circle():
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: List[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_walk_sees_lazy_imports():
    # The walk is only as good as its reading: a lazy import inside a function must count.
    assert "roll_gspo.lifecycle.checkpoint" in GRAPH["roll_gspo.cli"]


def private_imports(module: str, source: str) -> List[str]:
    """`module -> other.name` for each private name `source` imports from another project module
    (relative imports included)."""
    reached = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        if not (node.level or (node.module or "").split(".")[0] in ("pipelines", "roll_gspo")):
            continue
        base = "." * node.level + (node.module or "")
        reached += [f"{module} -> {base}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return reached


def test_no_module_imports_another_modules_private_name():
    # Reaching into another module's underscore helpers is how the agentic pipeline came to lean on
    # the RLVR one; shared code is public in the module that owns it (`pipelines.common`, typed_walk's
    # `walk`, `losses.bool_mask`, ...).
    reached = [line for module, path in MODULES.items()
               for line in private_imports(module, open(path, encoding="utf-8").read())]
    assert reached == []


def test_the_private_import_scan_sees_relative_and_absolute_imports():
    found = private_imports("x", "from .losses import _mask, public\nfrom roll_gspo.a import _b\nimport os\n"
                                 "from os.path import _joinrealpath\nfrom __future__ import annotations\n")
    assert found == ["x -> .losses._mask", "x -> roll_gspo.a._b"]


# Who may import a module of roll_gspo.config.checks besides the checks themselves: the package's face
# (validate_config, preflight) and load/ (the loader runs the checks, the reference lists them,
# roll_check reports them). Run-time code reads the run plan (roll_gspo.config.plan) and the frozen config.
CHECK_READERS = {"roll_gspo.config", "roll_gspo.config.load.loader", "roll_gspo.config.load.config_reference",
                 "roll_gspo.config.load.roll_check"}


# Inside roll_gspo.config the four kinds are layered too, lowest first: ROLL's names and keys, what a run
# decides (read by run-time code), the checks (which read the plan's rules), loading (which runs the
# checks). The root's shared modules (errors, findings, typed_walk) and the package's face are outside it.
CONFIG_KINDS = ["roll", "plan", "checks", "load"]


def test_the_kinds_of_config_import_only_lower_kinds():
    def kind(module: str) -> str:
        parts = module.split(".")
        return parts[2] if parts[:2] == ["roll_gspo", "config"] and len(parts) > 3 else ""

    assert {kind(m) for m in MODULES} - {""} == set(CONFIG_KINDS)
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                   if kind(m) and kind(d) and CONFIG_KINDS.index(kind(d)) > CONFIG_KINDS.index(kind(m)))
    assert wrong == []


def test_no_run_time_module_imports_a_check_module():
    assert CHECK_READERS <= set(MODULES)
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                   if d.startswith("roll_gspo.config.checks.") and not m.startswith("roll_gspo.config.checks.")
                   and m not in CHECK_READERS)
    assert wrong == []
