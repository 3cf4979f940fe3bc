import os
import pathlib
import sys

import pytest
import torch

_HERE = pathlib.Path(__file__).resolve().parent
for p in (str(_HERE.parent), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _clean_state():
    torch.manual_seed(0)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_default_dtype(torch.float32)
    try:
        from hf_pipeline.dist import destroy_distributed

        destroy_distributed()
    except ImportError:
        pass
