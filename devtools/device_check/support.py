"""Sizes, tolerances and measuring helpers of the device check (:mod:`devtools.device_check` states the bounds).

The model shapes of each ``--size``, the tolerances by dtype, timing with the device drained,
rank-0-only work that ends in a barrier, the inputs, and the comparison of two greedy generations.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from devtools.collectives import barrier, is_distributed
from devtools.llama import llama_config

__all__ = [
    "GRAD_RTOL", "HOST_SLACK_BYTES", "LOGITS_RTOL", "LOSS_RTOL", "SIZES", "WARMUP", "Size", "check", "empty_cache",
    "first_divergences", "format_value", "left_padded", "on_rank0", "param_bytes", "size_config", "sync", "timed",
]


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True, kw_only=True)
class Size:
    """Model shape and workload of one ``--size``."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    shard_bytes: int
    batch: int  # rows of the forward, generate and train batches
    seq: int  # forward sequence length
    prompt_len: int
    new_tokens: int
    train_seq: int
    reps: int  # timed repetitions of generate and of the train step


SIZES = {
    # Llama-3.2-1B's shape with an untied LM head: 1.50B parameters, 3.0 GB in bf16, 7 shards.
    "large": Size(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                  shard_bytes=500_000_000,
                  batch=8, seq=128, prompt_len=32, new_tokens=64, train_seq=512, reps=3),
    "small": Size(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000, shard_bytes=100_000_000,
                  batch=8, seq=128, prompt_len=32, new_tokens=32, train_seq=256, reps=3),
    # 3.4M parameters (13.6 MB in fp32) in 7 shards: big enough that the RSS figures are not noise.
    "tiny": Size(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=2048, shard_bytes=2_000_000,
                 batch=4, seq=32, prompt_len=16, new_tokens=8, train_seq=32, reps=1),
}
WARMUP = Size(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, shard_bytes=50_000,
               batch=2, seq=8, prompt_len=8, new_tokens=2, train_seq=8, reps=1)

# Tolerances by dtype, explained in the module docstring.
LOGITS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-4, torch.float16: 2.0**-7}
HOST_SLACK_BYTES = 256 << 20  # allocator and CUDA bookkeeping a load straight to the device may add on the host


def size_config(size: Size, dtype: torch.dtype):
    return llama_config(
        hidden=size.hidden, intermediate=size.intermediate, layers=size.layers, heads=size.heads,
        kv_heads=size.kv_heads, vocab=size.vocab,
        max_pos=max(256, size.seq, size.train_seq, size.prompt_len + size.new_tokens),
        dtype=str(dtype).removeprefix("torch."),
    )


def format_value(v: Any) -> str:
    """A figure as the summary prints it."""
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def check(checks: dict, name: str, value: float, *, lo: float | None = None, hi: float | None = None,
           why: str = "") -> bool:
    value = float(value)
    passed = math.isfinite(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    checks[name] = {"value": value, "min": lo, "max": hi, "passed": bool(passed), "why": why}
    return passed



# ----------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds) with every rank starting together and the device drained at both ends."""
    sync(device)
    barrier()
    t = time.perf_counter()
    out = fn()
    sync(device)
    barrier()
    return out, time.perf_counter() - t


def on_rank0(errors: list[str], fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only (reference work); its failure is noted and the ranks meet in a barrier either way."""
    out = None
    if not is_distributed() or dist.get_rank() == 0:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - raised after the barrier, so no rank waits for a dead peer
            errors.append(f"{type(e).__name__}: {e}")
    barrier()
    if errors:
        raise RuntimeError("; ".join(errors))
    return out


# ----------------------------------------------------------------------------- inputs
def left_padded(rows: int, length: int, vocab: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), row r left-padded by (r % 4) * length / 8 tokens of pad id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = (r % 4) * length // 8
        ids[r, :pad] = 0
        mask[r, :pad] = 0
    return ids, mask


def param_bytes(params) -> int:
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total



def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_divergences(pipelined: torch.Tensor, reference: torch.Tensor, logits: list[torch.Tensor]) -> list[dict]:
    """Where each row of two greedy generations first differs, and how close transformers was to a tie there.

    Args:
        pipelined, reference: ``(B, N)`` generated ids (prompts cut off).
        logits: transformers' ``N`` per-step ``(B, V)`` logits of ``reference``.

    Returns:
        One dict per differing row: ``row``, ``step``, both tokens and ``gap`` = transformers' logit of its
        own token minus its logit of the pipeline's token at that step (>= 0; near 0 is a tie).

    Example:
        >>> first_divergences(torch.tensor([[5, 6]]), torch.tensor([[5, 7]]), [torch.zeros(1, 8)] * 2)
        [{'row': 0, 'step': 1, 'reference_token': 7, 'pipelined_token': 6, 'gap': 0.0}]
    """
    out = []
    for row in range(reference.shape[0]):
        differ = (pipelined[row] != reference[row]).nonzero()
        if not len(differ):
            continue
        step = int(differ[0])
        want, got = int(reference[row, step]), int(pipelined[row, step])
        gap = float(logits[step][row, want] - logits[step][row, got])
        out.append({"row": row, "step": step, "reference_token": want, "pipelined_token": got, "gap": gap})
    return out

