"""Shared test set-up: import paths, offline hub, and a clean torch state around every test.

Fixtures that build models or checkpoints live next to the tests that use them (``tiny.py``);
keep this file to state that every test needs.

Tiers (markers registered in pyproject.toml), assigned here by rule so a new test file needs no
marks of its own:

- ``dist``: the test starts other processes: ranks through the harness (``run_distributed``,
  ``expect_errors``), ``subprocess`` (torchrun, the CLI, pip), ``multiprocessing`` or a notebook
  kernel. Found by following the names the test, its fixtures and the module-level helpers they
  call refer to (see :func:`_spawns`).
- ``unit``: every other test: one process, in-process equivalence included.
- ``slow``: tests listed in ``_SLOW`` (measured: 15 s or more each on a 2-core machine); added on
  top of ``dist``, and instead of ``unit``, so ``-m unit`` stays under a minute.

A test already marked ``unit`` or ``dist`` by hand keeps its mark.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import sys
import types

import pytest
import torch
import torch.distributed as dist

_HERE = pathlib.Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):  # repo root (hf_pipeline) and tests (harness, tiny)
    if _p not in sys.path:
        sys.path.insert(0, _p)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _clean_state():
    """Seed before each test; after it, drop any process group, rank context and default dtype change."""
    torch.manual_seed(0)
    yield
    try:
        from hf_pipeline.dist import destroy_distributed
    except ImportError:
        pass
    else:
        destroy_distributed()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------ tiers
TIERS = ("unit", "dist", "slow")
# Names that start processes: the harness's entry points, and modules or functions that spawn.
_SPAWNERS = frozenset({
    "run_distributed", "expect_errors", "subprocess", "multiprocessing", "Popen", "nbclient",
    "NotebookClient", "notebook_launcher", "start_processes",
})
# Long tests: node ids (without parameters, for all of them) or file names (for all their tests).
_SLOW = frozenset({
    "tests/test_benchmark.py::test_quick_benchmark_runs_every_section",  # ~45 s: every section, 1, 2 ranks
    "tests/test_cli.py::test_regular_install_ships_recipes_default_model_and_the_console_script",  # ~25 s: pip builds a wheel
    "tests/test_trace.py::test_world_size_1_runs_traced_stages_in_sequence_and_retraces_without_reloading",  # ~16 s in process
})


def _in_tests(obj) -> bool:
    module = obj if isinstance(obj, types.ModuleType) else inspect.getmodule(obj)
    return str(getattr(module, "__file__", "") or "").startswith(str(_HERE))


def _code_names(code: types.CodeType):
    """Global, imported and attribute names a code object and the functions, lambdas and comprehensions in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _spawns(fn, seen: set) -> bool:
    """Whether ``fn``, or a tests-directory function it refers to at any depth, names a spawner."""
    try:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
    except ValueError:
        return False
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    scope = getattr(fn, "__globals__", {})
    names = list(_code_names(code))
    helpers = []  # modules of the tests directory this code reaches into (``tiny.x``, ``from harness import y``)
    for name in names:
        if name in _SPAWNERS:
            return True
        obj = scope.get(name, sys.modules.get(name))
        if isinstance(obj, types.ModuleType):
            if set(obj.__name__.split(".")) & _SPAWNERS:
                return True
            if _in_tests(obj):
                helpers.append(obj)
        elif inspect.isfunction(obj) and _in_tests(obj) and _spawns(obj, seen):
            return True
    for module in helpers:
        for name in names:
            obj = getattr(module, name, None)
            if inspect.isfunction(obj) and _in_tests(obj) and _spawns(obj, seen):
                return True
    return False


def _fixture_functions(item):
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:
            func = getattr(fixturedef, "func", None)
            if func is not None and _in_tests(func):
                yield func


def pytest_collection_modifyitems(config, items):
    """Mark every test ``dist``, ``slow`` or ``unit`` (see the module docstring)."""
    for item in items:
        name = item.nodeid.split("[")[0]
        if name in _SLOW or pathlib.Path(str(item.path)).name in _SLOW:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("unit") or item.get_closest_marker("dist"):
            continue
        seen: set = set()
        fn = getattr(item, "function", None)
        if fn is not None and (_spawns(fn, seen) or any(_spawns(f, seen) for f in _fixture_functions(item))):
            item.add_marker(pytest.mark.dist)
        elif not item.get_closest_marker("slow"):  # ``-m unit`` is the quick tier: slow tests stay out
            item.add_marker(pytest.mark.unit)
