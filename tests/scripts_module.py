"""The repository's scripts (``scripts/*.py``), imported as modules for the tests that call their functions.

Example:
    >>> bench = load_script("benchmark.py", "hf_pipeline_benchmark")
    >>> bench.main(["--quick", ...])
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(file: str, name: str) -> ModuleType:
    """``scripts/<file>`` run as the module ``name`` (registered in ``sys.modules`` first: dataclasses
    look their module up while the file runs)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
