"""The house's figures for a source tree: module and function sizes, builtin raises, private API uses, ruff.

    python -m devtools.house_figures              # this checkout
    python -m devtools.house_figures OTHER_TREE   # another one (an older commit: git archive REV | tar -x -C DIR)

The rules and their limits are devtools/house_rules.py's, which tests/test_house.py enforces; this prints
how far a tree is from them with the same probes, so a before/after comparison counts the same things.
ruff runs with this checkout's configuration on both trees.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

from devtools import house_rules

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def _builtin_raises(trees, builtin_errors) -> int:
    count = 0
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                count += isinstance(exc, ast.Name) and exc.id in builtin_errors
    return count


def _ruff_violations(root: pathlib.Path) -> int:
    folders = [str(root / d) for d in ("hf_pipeline", "scripts", "tests", "benchmarks", "devtools")
               if (root / d).exists()]
    out = subprocess.run(
        ["ruff", "check", "--no-cache", "--statistics", "-q", "--config", str(ROOT / "pyproject.toml"), *folders],
        capture_output=True, text=True,
    ).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.split() and line.split()[0].isdigit())


def figures(root: pathlib.Path) -> dict[str, object]:
    """The figures of the checkout at ``root`` (this repository at any commit)."""
    package = sorted((root / "hf_pipeline").rglob("*.py"))
    others = sorted((root / "scripts").glob("*.py")) + sorted(
        p for folder in ("benchmarks", "devtools") for p in (root / folder).rglob("*.py"))
    trees = {p: ast.parse(p.read_text()) for p in package + others}
    functions = sorted(
        (node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.name}")
        for p, tree in trees.items() for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    )
    own = house_rules.own_private_names([trees[p] for p in package if p.name != "compat.py"])
    tests = sorted((root / "tests").rglob("test_*.py"))
    return {
        "package modules": len(package),
        "package folders": len({p.parent for p in package}),
        "largest module (package)": max(_lines(p) for p in package),
        "modules over 500 lines (package, scripts, benchmarks, devtools)": sum(
            _lines(p) > 500 for p in package + others),
        "largest module (scripts, benchmarks, devtools)": max(_lines(p) for p in others),
        "functions over 80 lines": sum(n > 80 for n, _ in functions),
        "longest function": f"{functions[-1][1]} ({functions[-1][0]} lines)",
        "builtin raises in hf_pipeline": _builtin_raises([trees[p] for p in package], house_rules.BUILTIN_ERRORS),
        "private library names reached outside compat.py": sum(
            len(house_rules.private_uses(trees[p], own)) for p in package if p.name != "compat.py"
        ),
        "ruff violations": _ruff_violations(root),
        "test files (folders)": f"{len(tests)} ({len({p.parent for p in tests})})",
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    root = pathlib.Path(args[0]).resolve() if args else ROOT
    for name, value in figures(root).items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
