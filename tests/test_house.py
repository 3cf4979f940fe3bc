"""The house rules a reader relies on, checked on the source: short modules and functions, one error
contract, private APIs only through ``compat.py``, no markers pinned on foreign objects, ruff clean.

Each rule is parsed from the code (``ast``), so a failure names the file and line to change. The
limits are the ones README's "Layout" section states; ``benchmarks/``, ``devtools/`` and ``scripts/``
are held to the same sizes as the package.
"""

from __future__ import annotations

import ast
import builtins
import functools
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_pipeline"
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


def _sources(*folders: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def _code() -> list[pathlib.Path]:
    return _sources(PACKAGE, ROOT / "benchmarks", ROOT / "devtools", ROOT / "scripts")


@functools.cache  # each file parsed once for every test that walks it
def _tree(path: pathlib.Path) -> ast.AST:
    return ast.parse(path.read_text())


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_modules_are_short():
    long = [f"{_rel(p)}: {n} lines" for p in _code() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"split these modules along their concepts (at most {MAX_MODULE_LINES} lines):\n" + "\n".join(long)


def test_functions_are_short():
    long = []
    for path in _code():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"split these functions into named steps (at most {MAX_FUNCTION_LINES} lines):\n" + "\n".join(long)


def test_every_deliberate_error_is_a_library_class():
    # A raise of a builtin class (``raise ValueError(...)``) bypasses PipelineError: user code and the
    # CLI could not tell a refused input from a bug. Re-raising a caught exception is fine.
    bad = []
    for path in _sources(PACKAGE):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                    bad.append(f"{_rel(path)}:{node.lineno} raise {exc.id}")
    assert not bad, "raise a class from hf_pipeline/errors.py (it keeps the builtin base):\n" + "\n".join(bad)


def _own_private_names(trees: list[ast.AST]) -> set[str]:
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


def _private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
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


def test_private_library_apis_only_through_compat():
    trees = {path: _tree(path) for path in _sources(PACKAGE)}
    own = _own_private_names([t for p, t in trees.items() if p.name != "compat.py"])
    bad = [
        f"{_rel(path)}:{line} {what}"
        for path, tree in trees.items()
        if path.name != "compat.py"
        for line, what in _private_uses(tree, own)
    ]
    assert not bad, "reach private torch/transformers APIs through hf_pipeline/compat.py:\n" + "\n".join(bad)


def test_no_marker_attributes_on_foreign_objects():
    # Flags like ``error._hf_pipeline_handled = True`` or ``object.__setattr__(model, ...)`` signal between
    # modules through objects neither owns; state lives in typed objects of the package instead.
    bad = []
    for path in _sources(PACKAGE):
        text = path.read_text()
        allowed = set()  # object.__setattr__ in a frozen dataclass's __post_init__ is that idiom, not a marker
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
                allowed.update(range(node.lineno, node.end_lineno + 1))
        for i, line in enumerate(text.splitlines(), 1):
            if "_hf_pipeline_" in line or ("object.__setattr__" in line and i not in allowed):
                bad.append(f"{_rel(path)}:{i} {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_probes_above_can_fail(tmp_path):
    # The checks are only worth their silence if they see what they look for.
    tree = ast.parse("import torch\nfrom torch._utils import x\ny = torch._C\nz = m._own + getattr(m, '_theirs')\n")
    assert [line for line, _ in _private_uses(tree, {"_own"})] == [2, 3, 4]
    assert "ValueError" in BUILTIN_ERRORS and "PipelineError" not in BUILTIN_ERRORS


@pytest.mark.dist
def test_ruff_passes():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if not pathlib.Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
