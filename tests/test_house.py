"""The house rules a reader relies on, checked on the source: short modules and functions, one error
contract, private APIs only through ``compat.py``, no markers pinned on foreign objects, ruff clean.

Each rule is parsed from the code (``ast``), so a failure names the file and line to change. The
limits are the ones README's "Layout" section states; ``benchmarks/``, ``devtools/`` and ``scripts/``
are held to the same sizes as the package.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import shutil
import subprocess
import sys

import pytest

from devtools.house_rules import (
    BUILTIN_ERRORS,
    MAX_FUNCTION_LINES,
    MAX_MODULE_LINES,
    own_private_names,
    private_uses,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_pipeline"


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


def test_private_library_apis_only_through_compat():
    trees = {path: _tree(path) for path in _sources(PACKAGE)}
    own = own_private_names([t for p, t in trees.items() if p.name != "compat.py"])
    bad = [
        f"{_rel(path)}:{line} {what}"
        for path, tree in trees.items()
        if path.name != "compat.py"
        for line, what in private_uses(tree, own)
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
    assert [line for line, _ in private_uses(tree, {"_own"})] == [2, 3, 4]
    assert "ValueError" in BUILTIN_ERRORS and "PipelineError" not in BUILTIN_ERRORS


def test_test_modules_have_unique_basenames():
    # The test folders are not packages: pytest imports each test module by its basename, so two
    # folders holding test_x.py stop the whole collection ("import file mismatch").
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        seen.setdefault(path.name, []).append(_rel(path))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "__init__.py"}
    assert not shared, f"rename one of each: {shared}"


@pytest.mark.dist
def test_ruff_passes():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if not pathlib.Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
