"""The package's import graph: one direction only, no cycles, no reach into another module's privates.

Parsed from the source (every ``from . import`` / ``from .x import``, at module level or inside
functions), so it checks what the code says, not what one import order happens to load. The
layers are the package's own design (README "Architecture"): a module may import only modules of
lower layers or of its own layer's listed peers.
"""

from __future__ import annotations

import ast
import pathlib

import hf_pipeline

PACKAGE = pathlib.Path(hf_pipeline.__file__).parent

# Lowest first. A module may import any module of an earlier layer, never of a later one.
LAYERS: list[set[str]] = [
    {"errors", "compat", "log"},
    {"dist"},
    {"losses", "sampling", "glue", "weight_pass"},
    {"recipe", "schedules"},
    {"options"},
    {"plan", "validate"},
    {"stages"},
    {"trace"},
    {"weights"},
    {"build"},
    {"runtime", "faults"},
    {"ring"},
    {"train", "generate", "checkpoint", "profile", "data", "default_model"},
    {"memory", "convert"},
    {"autotune"},
    {"model"},
    {"auto"},
    {"__init__"},
    {"cli"},
]
# Same-layer imports that are part of the design (a peer's public helper).
PEERS = {("memory", "convert"): False, ("checkpoint", "generate"): True, ("profile", "stages"): True}


def _imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> [(imported module, names, line)] for every relative import in the package."""
    found: dict[str, list[tuple[str, list[str], int]]] = {}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            names = [a.name for a in node.names]
            if node.module is None:  # from . import validate: submodules (or package names)
                for n in names:
                    found.setdefault(path.stem, []).append((n if n in modules else "__init__", [], node.lineno))
            else:
                found.setdefault(path.stem, []).append((node.module.split(".")[0], names, node.lineno))
    return found


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i
    raise AssertionError(f"hf_pipeline/{module}.py is in no layer of tests/test_layering.py: add it where it belongs")


def test_every_module_has_a_layer():
    for path in PACKAGE.glob("*.py"):
        _layer(path.stem)


def test_no_module_imports_another_modules_private_names():
    bad = [
        f"{m}.py:{line} imports {target}.{n}"
        for m, items in _imports().items() for target, names, line in items for n in names
        if n.startswith("_") and n != "__version__"
    ]
    assert not bad, "\n".join(bad)


def test_imports_run_one_way():
    bad = []
    for m, items in _imports().items():
        for target, _, line in items:
            lm, lt = _layer(m), _layer(target)
            if lt > lm or (lt == lm and target != m and not PEERS.get((m, target))):
                bad.append(f"{m}.py:{line} imports {target} (layer {lt} >= {lm})")
    assert not bad, "\n".join(bad)


def test_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for m, items in _imports().items():
        graph.setdefault(m, set()).update(t for t, _, _ in items if t != m)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else nxt)
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
