"""Helpers the example scripts share: host-memory figures, the random LLaMA config, object collectives.

The scripts are run as files (``python scripts/x.py``, ``torchrun scripts/x.py``) or loaded from
their path (``hf-pipeline bench``, the tests), so each puts its own folder on ``sys.path`` before
``import _common``. Nothing in the ``hf_pipeline`` package uses these; they live beside their users.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import resource
from typing import Any

__all__ = [
    "barrier",
    "broadcast_object",
    "gather_objects",
    "host_peak_rss",
    "host_rss",
    "is_distributed",
    "llama_config",
    "reset_host_peak",
    "trim_host_heap",
]


# ----------------------------------------------------------------------------- host memory
# The figures the benchmark and the device check report for loading: this process's resident
# memory and its high-water mark, read from Linux's /proc (psutil / getrusage elsewhere).
def _status_bytes(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", pathlib.Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def host_rss() -> int:
    """Bytes of this process's resident memory now."""
    found = _status_bytes("VmRSS")
    if found is not None:
        return found
    import psutil

    return psutil.Process().memory_info().rss


def host_peak_rss() -> int:
    """Bytes of this process's resident-memory high-water mark (since the last :func:`reset_host_peak`)."""
    found = _status_bytes("VmHWM")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_host_peak() -> bool:
    """Reset the high-water mark to the current RSS (Linux: ``5`` to ``clear_refs``); False where that is impossible."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def trim_host_heap() -> None:
    """Give memory glibc keeps after frees back to the OS, so a later peak counts every byte it touches."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ----------------------------------------------------------------------------- models
def llama_config(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int, dtype: str,
    **overrides: Any,
):
    """A ``transformers.LlamaConfig`` of this shape with an untied LM head (pad id 0, bos id 1, no eos).

    Args:
        hidden, intermediate, layers, heads, kv_heads, vocab, max_pos: the shape.
        dtype: the weights' dtype name, e.g. ``"bfloat16"``.
        **overrides: any other ``LlamaConfig`` field (e.g. a tokenizer's special token ids).
    """
    import transformers

    fields = dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max_pos, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, dtype=dtype,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


# ----------------------------------------------------------------------------- collectives
# Over the default process group, for scripts that run with or without torchrun.
def is_distributed() -> bool:
    """Whether a default process group of more than one rank is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()


def gather_objects(obj: Any, *, who: str = "script") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; a broken group gives this rank's alone.

    Args:
        obj: this rank's object.
        who: the script's name, for the line printed when the group is broken.
    """
    import torch.distributed as dist

    if not is_distributed():
        return [obj]
    try:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    except Exception as e:  # noqa: BLE001 - the group is gone (an earlier failure): keep going locally
        print(f"[{who}] gathering from the other ranks failed ({type(e).__name__}: {e}); this rank's figures only",
              flush=True)
        return [obj]


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` as it is when not distributed)."""
    import torch.distributed as dist

    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
