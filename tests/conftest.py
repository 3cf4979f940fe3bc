"""Shared test set-up: import paths, offline hub, and a clean torch state around every test.

Fixtures that build models or checkpoints live next to the tests that use them (``tiny.py``);
keep this file to state that every test needs.

Tiers (markers registered in pyproject.toml), marked explicitly in each test file:

- ``dist``: the test starts other processes: ranks through the harness (``run_distributed``,
  ``expect_errors``), ``subprocess`` (torchrun, the CLI, pip), ``multiprocessing`` or a notebook
  kernel. ``@pytest.mark.dist`` on the test, or ``pytestmark = pytest.mark.dist`` for a whole file.
  The harness, ``subprocess`` and ``multiprocessing`` refuse to start a process for a test without it
  (:func:`_dist_tests_are_marked`).
- ``slow``: measured 15 s or more on a 2-core machine; ``@pytest.mark.slow`` (with ``dist`` when it
  spawns). Never in the quick tier.
- ``equiv``: one process, but an in-process equivalence run long enough to matter (tiny models through
  training steps, generation, compile or the tracer); ``@pytest.mark.equiv``. It runs in the full suite,
  not in the quick tier; each area keeps at least one quick equivalence test in ``unit``.
- ``unit``: every other test (added here): one process, its quick equivalence checks included;
  ``-m unit -n 2`` runs them all in under a minute on 2 cores (pytest-xdist workers). A test marked
  ``unit`` by hand and also ``dist``, ``slow`` or ``equiv`` is a collection error (``-m unit`` would run it).

Test folders mirror the package's subpackages (``tests/loading`` tests ``hf_pipeline/loading``);
``tests/model`` holds what goes through the model facade as a whole, ``tests/examples`` the
scripts, notebooks and benchmark.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import platform
import sys

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
        from hf_pipeline.distributed.context import destroy_distributed
    except ImportError:
        pass
    else:
        destroy_distributed()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------ tiers
TIERS = ("unit", "dist", "slow", "equiv")


def pytest_collection_modifyitems(config, items):
    """Mark every test that is none of ``dist``, ``slow``, ``equiv`` ``unit`` (see the module docstring)."""
    both = []
    for item in items:
        outside = [name for name in TIERS[1:] if item.get_closest_marker(name)]
        if not outside:
            item.add_marker(pytest.mark.unit)
        elif item.get_closest_marker("unit"):
            both.append(f"{item.nodeid} ({', '.join(outside)})")
    if both:
        raise pytest.UsageError(
            "marked unit and also outside the quick tier (drop the unit mark, often a module's pytestmark): "
            + "; ".join(both)
        )


@pytest.fixture(autouse=True)
def _dist_tests_are_marked(request):
    """A test that starts ranks through the harness must be marked ``dist``, or ``-m unit`` would run it.

    The harness asks :data:`harness.SPAWN_GUARD` before it spawns; this fixture points it at the
    current test's markers, so a forgotten mark fails the test with a message instead of slowing the
    quick tier.
    """
    import harness

    marked = request.node.get_closest_marker("dist") is not None
    harness.SPAWN_GUARD = None if marked else request.node.nodeid
    if marked:
        yield
    else:  # nor may it start any other process (torchrun, the CLI, a fresh interpreter) unmarked
        with _no_processes(request.node.nodeid):
            yield
    harness.SPAWN_GUARD = None


@contextlib.contextmanager
def _no_processes(nodeid: str):
    """``subprocess`` and ``multiprocessing`` refuse to start a process for the duration of an unmarked test."""
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{nodeid} starts a process: mark it @pytest.mark.dist (it is not a quick-tier test)")

    # Python's platform module asks ``uname -p`` once per interpreter, the first time anything reads the
    # platform (``hf-pipeline env`` does, as transformers' env does): ask it before the guard, so whether a test
    # "starts a process" does not depend on which test happened to run first on its worker.
    platform.processor()
    saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    subprocess.Popen.__init__ = refuse
    multiprocessing.process.BaseProcess.start = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = saved
