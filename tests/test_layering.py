"""The package's import graph: one direction only, no cycles, no reach into another module's privates.

Parsed from the source (every relative import, at module level or inside functions), so it checks
what the code says, not what one import order happens to load. The package is a stack of rooms:
the base modules (errors, compat, log), then one subpackage per concern, then the model facade,
the Auto classes and the command line. A module may import modules of its own room (without a
cycle) and of lower rooms, never of a higher one.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import hf_pipeline

PACKAGE = pathlib.Path(hf_pipeline.__file__).parent

# Lowest first: each entry is a top-level module or a subpackage (all the modules under it).
LAYERS: list[set[str]] = [
    {"errors"},
    {"compat", "log", "checked_files"},
    {"load_options"},
    {"distributed"},
    {"families"},
    {"planning"},
    {"runtime"},
    {"loading"},
    {"core"},
    {"generation"},
    {"continuous_batching"},
    {"training"},
    {"recompute"},
    {"checkpointing"},
    {"memory"},
    {"integrations"},
    {"tools"},
    {"serving"},
    {"model"},
    {"auto"},
    {"__init__"},
    {"cli"},
]


@functools.cache  # one walk of the package for every test and every import resolved
def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name below hf_pipeline ("loading.weights", "errors", "training") -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, level: int, target: str | None) -> str:
    """The dotted name (below hf_pipeline) a relative import in ``module`` refers to."""
    path = _modules()[module]
    package = list(path.relative_to(PACKAGE).parent.parts)
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + (target.split(".") if target else [])) or "__init__"


@functools.cache  # parsed once for the three tests that read the graph
def _imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> [(imported module, names, line)] for every relative import in the package."""
    modules = _modules()
    found: dict[str, list[tuple[str, list[str], int]]] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            names = [a.name for a in node.names]
            target = _resolve(module, node.level, node.module)
            if node.module is None or target in modules and all(f"{target}.{n}" in modules for n in names):
                # from . import x / from ..runtime import weight_pass: submodules (or package names)
                for n in names:
                    sub = f"{target}.{n}" if target != "__init__" else n
                    found.setdefault(module, []).append((sub if sub in modules else target, [], node.lineno))
            else:
                found.setdefault(module, []).append((target, names, node.lineno))
    return found


def _room(module: str) -> str:
    return module.split(".")[0]


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if _room(module) in layer:
            return i
    raise AssertionError(
        f"hf_pipeline/{module.replace('.', '/')} is in no layer of tests/test_layering.py: add it where it belongs"
    )


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module)


def test_every_subpackage_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 20 and "import" in doc, (
            f"{init}: the docstring should say what lives here and what it may import"
        )


def test_no_module_imports_another_modules_private_names():
    bad = [
        f"{m}:{line} imports {target}.{n}"
        for m, items in _imports().items()
        for target, names, line in items
        for n in names
        if n.startswith("_") and n != "__version__"
    ]
    assert not bad, "\n".join(bad)


def test_imports_run_one_way():
    bad = []
    for m, items in _imports().items():
        for target, _, line in items:
            lm, lt = _layer(m), _layer(target)
            if lt > lm or (lt == lm and _room(target) != _room(m)):
                bad.append(f"{m}:{line} imports {target} (layer {lt} >= {lm})")
    assert not bad, "\n".join(bad)


def test_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for m, items in _imports().items():
        graph.setdefault(m, set()).update(t for t, _, _ in items if t != m and t != _room(m))
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(
                    "import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]) if nxt in path else nxt
                )
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def _core_members() -> set[str]:
    from torch import nn

    from hf_pipeline.core import PipelineCore

    return set(dir(PipelineCore)) | set(PipelineCore.__annotations__) | set(dir(nn.Module)) | {"training"}


def _untyped_model_reads(tree: ast.AST, declared: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each ``model`` parameter left unannotated or ``Any``, and each attribute a function reads
    off a ``model: PipelineCore`` that the protocol does not declare."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            if a.arg != "model":
                continue
            ann = ast.unparse(a.annotation) if a.annotation else None
            if ann in (None, "Any"):
                bad.append((node.lineno, f"{node.name}(model: {ann}): annotate it as PipelineCore"))
            elif ann == "PipelineCore":
                reads = {n.attr for n in ast.walk(node)
                         if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "model"}
                bad += [(node.lineno, f"{node.name} reads model.{r}, which PipelineCore does not declare")
                        for r in sorted(reads - declared)]
    return bad


def test_rooms_below_the_model_read_it_only_through_the_core():
    # The rooms between hf_pipeline.core and the model facade are handed the pipelined model but cannot import its
    # class: each types it as PipelineCore (nn.Module where a peft or Trainer wrapper may come instead) and reads
    # only what that protocol declares, so the contract is the protocol, not prose.
    start, end = _layer("core"), _layer("model")
    declared = _core_members()
    bad = [
        f"hf_pipeline/{m.replace('.', '/')}.py:{line} {what}"
        for m, path in _modules().items()
        if start < _layer(m) < end
        for line, what in _untyped_model_reads(ast.parse(path.read_text()), declared)
    ]
    assert not bad, "\n".join(bad)


def test_the_model_implements_the_core():
    from hf_pipeline.core import PipelineCore
    from hf_pipeline.model import PipelinedModel

    members = {n for n in PipelineCore.__annotations__} | {n for n in vars(PipelineCore) if not n.startswith("_")}
    # Attributes set in __init__ are checked on a loaded model by the equivalence tests; the class must at least
    # define every method and property the protocol declares.
    missing = sorted(n for n in members - set(PipelineCore.__annotations__) if not hasattr(PipelinedModel, n))
    assert not missing, f"PipelinedModel lacks {missing} of PipelineCore"


def test_the_core_probe_can_fail():
    tree = ast.parse("def f(model):\n    pass\ndef g(model: PipelineCore):\n    return model.secret + model.plan\n")
    assert _untyped_model_reads(tree, {"plan"}) == [
        (1, "f(model: None): annotate it as PipelineCore"),
        (3, "g reads model.secret, which PipelineCore does not declare"),
    ]
