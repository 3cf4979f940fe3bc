"""The house rules' limits and probes, shared by ``tests/test_house.py`` (which enforces them) and
``python -m devtools.house_figures`` (which prints how far any tree is from them), so both count the same things.

May import: the standard library only.
"""

from __future__ import annotations

import ast
import builtins

__all__ = [
    "BUILTIN_ERRORS", "DOCUMENTED_UNDERSCORED", "GUARDED", "MAX_FUNCTION_LINES", "MAX_MODULE_LINES",
    "own_private_names", "private_uses",
]

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# Libraries whose private names are reached only through hf_pipeline/compat.py.
GUARDED = ("torch", "transformers", "accelerate", "safetensors", "peft", "huggingface_hub")
# Underscored names that are public contracts all the same: transformers' PreTrainedModel documents these
# class attributes as the ones a model class overrides ("Class attributes (overridden by derived classes)").
DOCUMENTED_UNDERSCORED = frozenset({
    "_keys_to_ignore_on_save", "_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected",
    "_tied_weights_keys", "_no_split_modules",
})
BUILTIN_ERRORS = {
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
}


def own_private_names(trees: list[ast.AST]) -> set[str]:
    """``_names`` the package defines itself: functions, classes, module names, attributes it assigns."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[-1])
    return {n for n in own if n.startswith("_")} | DOCUMENTED_UNDERSCORED


def private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """Private names of other libraries this code reaches: imports of ``_`` modules or names, and
    ``obj._attr`` / ``getattr(obj, "_attr")`` for an ``_attr`` the package does not define itself."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in GUARDED:
            if any(p.startswith("_") for p in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            found += [
                (node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in GUARDED and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
            and node.args[1].value not in own
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found
