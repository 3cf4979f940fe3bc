"""Shared test set-up: import paths, offline hub, and a clean torch state around every test.

Fixtures that build models or checkpoints live next to the tests that use them (``tiny.py``);
keep this file to state that every test needs.
"""

from __future__ import annotations

import os
import pathlib
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
        from hf_pipeline.dist import destroy_distributed
    except ImportError:
        pass
    else:
        destroy_distributed()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_default_dtype(torch.float32)
