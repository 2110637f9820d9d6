"""The floors of the package (docs/architecture.md): every import goes down, never up, never in a circle.

Every `import` / `from ... import` of every module under pyramidkv/ is read from its source (inside
functions and `if TYPE_CHECKING:` blocks too). An import may go to a lower floor, or stay inside its
own unit (allocation -> allocation); anything else fails, as does any circle of modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyramidkv"

# The floor table (docs/architecture.md and shared/STYLE.md keep the same one).
FLOORS = {
    "pyramidkv.components": 0,      # settings base and checks
    "pyramidkv.native": 0,          # C kernels (built on first use, loaded with ctypes): imports nothing of ours
    "pyramidkv.allocation": 1,      # the units of a method, one folder per axis
    "pyramidkv.merging": 1,
    "pyramidkv.quantization": 1,
    "pyramidkv.sparse_prefill": 1,
    "pyramidkv.sizing": 1,          # how many tokens a head keeps: tokens, ratio, keep_all, threshold
    "pyramidkv.capabilities": 1,   # page selection, key channels, layer sharing, decode budget, selection knobs
    "pyramidkv.core": 2,            # the engine: context, scoring, selection, prefill, stores, decoding, cache
    "pyramidkv.methods": 3,
    "pyramidkv.models": 4,          # attention glue, patching, loading
    "pyramidkv.generation": 5,
    "pyramidkv.runner": 6,
    "pyramidkv.benchmarks": 7,
    "pyramidkv.viz": 8,
    "pyramidkv.leaderboard": 8,     # the leaderboard grid: runs the benchmark runners, reads their outputs
    "pyramidkv": 9,                 # the facade (pyramidkv/__init__.py): imported by users, never from inside
    "pyramidkv.doc_tables": 9,      # the docs' generated tables (reads the registry and the engine's docstrings)
}
# Floor 9 also holds what lives outside the package and only uses it: run_*.py, eval.py, scripts/ (the
# product's scripts), measure/ (the measuring scripts behind docs/ figures) and examples/.


# Core's own order (docs/architecture.md): the contract and helpers < the layer stores < the prefill pipeline and
# decode-time compression < the cache. Inside core an import goes to its own group or a lower one.
CORE_ORDER = {
    **{f"pyramidkv.core.{m}": (0, "contract and helpers") for m in (
        "context", "scoring", "selection", "kept", "layout", "rotary", "pages", "channels", "cross_layer",
        "token_stats", "fused_column_sums", "in_place")},
    **{f"pyramidkv.core.{m}": (1, "stores") for m in ("store", "full_precision", "paged", "quantized", "merged_pair",
                                                                            "store_kinds")},
    **{f"pyramidkv.core.{m}": (2, "pipeline and decoding") for m in ("prefill", "decoding", "reconstruction", "threshold",
                                                                                 "chunked", "drop_one", "running_top",
                                                                                 "reconstructing")},
    "pyramidkv.core.cache": (3, "cache"),
    "pyramidkv.core.snapshot": (3, "cache"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The pyramidkv modules `path` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if is_module(submodule) else base)
    return {name for name in found if name == "pyramidkv" or name.startswith("pyramidkv.")}


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> tuple[int, str]:
    """(floor, unit): the longest prefix of the floor table that names the module."""
    unit = max((prefix for prefix in FLOORS if module == prefix or module.startswith(prefix + ".")), key=len)
    return FLOORS[unit], unit


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that do not go down the floors (same-floor imports only inside the same unit)."""
    bad = []
    for module, targets in graph.items():
        floor, unit = floor_of(module)
        for target in sorted(targets):
            target_floor, target_unit = floor_of(target)
            if target == "pyramidkv" and module != "pyramidkv":
                bad.append(f"{module} imports the facade pyramidkv (import the module that defines the name)")
            elif target_floor > floor or (target_floor == floor and target_unit != unit):
                bad.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def core_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside core that go up its own order (CORE_ORDER)."""
    bad = []
    for module, targets in graph.items():
        if module not in CORE_ORDER:
            continue
        for target in sorted(t for t in targets if t in CORE_ORDER):
            if CORE_ORDER[target][0] > CORE_ORDER[module][0]:
                bad.append(f"{module} ({CORE_ORDER[module][1]}) imports {target} ({CORE_ORDER[target][1]})")
    return bad


def test_core_imports_go_down_its_own_order():
    graph = import_graph()
    core = {m for m in graph if m.startswith("pyramidkv.core.")}
    assert core == set(CORE_ORDER), f"core modules without a row in CORE_ORDER (or rows for none): {core ^ set(CORE_ORDER)}"
    bad = core_upward_imports(graph)
    assert not bad, "imports against core's order:\n  " + "\n  ".join(bad)


def test_core_order_check_can_fail():
    graph = {"pyramidkv.core.store": {"pyramidkv.core.cache"}, "pyramidkv.core.cache": {"pyramidkv.core.store"}}
    assert core_upward_imports(graph) == ["pyramidkv.core.store (stores) imports pyramidkv.core.cache (cache)"]


def test_every_import_goes_down_the_floors():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the floors:\n  " + "\n  ".join(bad)


def test_no_circle_of_imports():
    found = circles(import_graph())
    assert not found, "circles of imports:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_floor():
    for module in import_graph():
        floor_of(module)  # max() of an empty sequence raises for a module outside the table


def test_no_module_loads_source_files_by_path():
    """A package module never executes a file from outside the package (an installed package has none)."""
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if "spec_from_file_location" in p.read_text(encoding="utf-8")]
    assert not offenders, offenders


# ---- the checker itself catches what the redesign removed ----------------------------------------
REMOVED_UPWARD = [
    ("pyramidkv.components", "pyramidkv.methods.base"),
    ("pyramidkv.core.cache", "pyramidkv.methods.base"),
    ("pyramidkv.core.decoding", "pyramidkv.methods.base"),
    ("pyramidkv.allocation.head_scoring", "pyramidkv.benchmarks.needle"),
    ("pyramidkv.allocation.head_tables", "pyramidkv.models.default_model"),
    ("pyramidkv.benchmarks.longbench.run", "pyramidkv"),
    ("pyramidkv.benchmarks.ruler.run", "pyramidkv"),
    ("pyramidkv.viz.data", "pyramidkv"),
]


@pytest.mark.parametrize("source,target", REMOVED_UPWARD)
def test_checker_reports_each_removed_upward_import(source, target):
    graph = import_graph()
    graph.setdefault(source, set()).add(target)
    assert any(line.startswith(f"{source} ") for line in upward_imports(graph))


@pytest.mark.parametrize("edges", [
    [("pyramidkv.components", "pyramidkv.methods.base"), ("pyramidkv.methods.base", "pyramidkv.allocation"),
     ("pyramidkv.allocation", "pyramidkv.allocation.base"), ("pyramidkv.allocation.base", "pyramidkv.components")],
    [("pyramidkv.core.cache", "pyramidkv.core.decoding"), ("pyramidkv.core.decoding", "pyramidkv.core.cache")],
])
def test_checker_reports_the_removed_circles(edges):
    graph = {module: set(targets) for module, targets in import_graph().items()}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    members = {source for source, _ in edges}
    assert any(members <= set(circle) for circle in circles(graph))


# Private attributes of objects we do not own, read because their libraries offer no public name for them.
FOREIGN_PRIVATE = {"_flash_attn_uses_top_left_mask",   # transformers' flash attention modules
                   "_attn_implementation",             # transformers' PretrainedConfig
                   "_supports_sdpa", "_supports_flash_attn_2",  # transformers' model classes: their implementations
                   "_option_string_actions", "_actions",  # argparse's parser (flag aliases, help texts)
                   "_pyramidkv_patch"}                 # our marker on the patched model object


def test_no_module_reads_another_objects_private_state():
    """Stores, the cache and the pipeline talk through public methods: `x._name` only on self or cls."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in FOREIGN_PRIVATE):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private state read across objects:\n  " + "\n  ".join(bad)


def test_engine_files_stay_short():
    """Each file of the engine reads in one sitting: at most 300 lines."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted((PACKAGE / "core").glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 300}
    assert not long, f"files of pyramidkv/core over 300 lines: {long}"
