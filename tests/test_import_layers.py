"""The import structure of ``src/medsrl``: no cycles between modules, and no package importing one
of a higher layer (lazy imports inside functions count; ``TYPE_CHECKING`` blocks do not)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first; a package may import its own layer and the ones below (docs/ARCHITECTURE.md).
LAYERS = [
    {"medsrl", "utils", "settings"},
    {"algo", "reward"},
    {"data"},
    {"models"},
    {"rollout"},
    {"step"},
    {"features"},  # the answer-token features and their clustering, read by methods and evaluation
    {"plugins"},
    {"methods", "evaluation"},  # side by side: neither imports the other
    {"callbacks", "module"},
    {"train", "eval", "export", "plan", "warmstart", "run_config", "config_files"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``medsrl`` modules ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for block in ast.walk(tree)
               if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "medsrl":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "medsrl"}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (SRC / "medsrl").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # ``from medsrl.pkg import sub``: the edge goes to the module, else to the package
        graph[name] = {m for m in _imports(path) if m in modules} - {name}
    return graph


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "medsrl"


def test_every_package_has_a_layer():
    assert {_area(m) for m in _graph()} <= set(LAYER_OF)


def test_no_package_imports_a_higher_layer():
    upward = sorted(f"{m} -> {dep}" for m, deps in _graph().items() for dep in deps
                    if LAYER_OF[_area(dep)] > LAYER_OF[_area(m)])
    assert not upward, upward


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles
