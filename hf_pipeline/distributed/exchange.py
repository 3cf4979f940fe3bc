"""Data-only exchanges between the job's ranks: JSON in uint8 tensors, never pickle.

``dist.all_gather_object`` pickles each rank's object and unpickles every peer's: a peer that sends
a crafted pickle (or just a different library version) runs code or fails obscurely on the
receivers. :func:`all_gather_json` moves JSON data instead, checked after decoding; the library's
agreements (:mod:`.agreement`) exchange their error descriptions and digests through it.
:func:`broadcast_random_state` and :func:`adopt_random_state` give every rank one rank's random stream, as bytes.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import InternalError
from .context import RankContext

__all__ = ["adopt_random_state", "all_gather_json", "broadcast_random_state"]


def _exchange_device(ctx: RankContext) -> torch.device:
    # An NCCL-only group moves CUDA tensors only; gloo (alone or beside NCCL) takes CPU tensors.
    return ctx.device if "nccl" in ctx.backend and "gloo" not in ctx.backend else torch.device("cpu")


def all_gather_json(
    ctx: RankContext, value: Any, *, group: dist.ProcessGroup | None = None, check: Callable[[Any], bool] | None = None
) -> list[Any]:
    """Collective: every rank's ``value`` as JSON data, in rank order; data only, never pickle.

    ``dist.all_gather_object`` would unpickle what a peer sends; here each rank encodes its value
    as JSON into a uint8 tensor, the lengths are gathered first, then the bytes padded to the
    longest, and every part is decoded and checked. Tuples come back as lists.

    Args:
        ctx: the rank context (its device and backend pick where the tensors live).
        value: JSON-serialisable data (None, bool, int, finite float, str, lists/tuples and str-keyed
            dicts of those).
        group: the group; default ``ctx.group``.
        check: what a decoded part must satisfy (e.g. a string), else :class:`InternalError`.

    Returns:
        The decoded values of the group's ranks, in group rank order.

    Raises:
        InternalError: on every rank when a rank's value is not JSON data (the sender says why) or a
            decoded part fails ``check``. Errors of the collective itself (a lost peer) propagate as raised.

    Example:
        >>> all_gather_json(ctx, {"digest": "ab12"})      # [{'digest': 'ab12'}, {'digest': 'ab12'}] on 2 ranks
    """
    group = group if group is not None else ctx.group
    device = _exchange_device(ctx)
    refusal = None
    try:
        raw = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:  # a set, a tensor, nan, a non-str key...: refused here, told everywhere
        raw, refusal = b"", f"{type(e).__name__}: {e}"
    world = dist.get_world_size(group)
    length = torch.tensor([-1 if refusal else len(raw)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    width = max(1, *sizes)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    if refusal is not None:
        raise InternalError(f"cannot send {type(value).__name__} to the other ranks: it is not JSON data ({refusal})")
    refused = [dist.get_global_rank(group, i) for i, n in enumerate(sizes) if n < 0]
    if refused:
        raise InternalError(f"rank(s) {refused} could not encode their part of an exchange as JSON; see their error")
    out = []
    for i, (n, part) in enumerate(zip(sizes, parts)):
        try:
            decoded = json.loads(part[:n].cpu().numpy().tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            decoded, ok = None, False
        else:
            ok = check is None or check(decoded)
        if not ok:
            raise InternalError(
                f"rank {dist.get_global_rank(group, i)} sent {n} bytes that are not what this exchange expects; "
                "is the same hf_pipeline version installed on every rank?"
            )
        out.append(decoded)
    return out


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def broadcast_random_state(ctx: RankContext, device: torch.device, src: int) -> torch.Tensor:
    """Collective: the state of ``device``'s default generator on the group's rank ``src``, on every rank (its bytes
    in a tensor, never pickle); this rank's own state on one process."""
    state = _generator_state(device)
    if not ctx.is_distributed or ctx.group is None:
        return state
    state = state.to(_exchange_device(ctx))
    dist.broadcast(state, group=ctx.group, group_src=src)
    return state.cpu()


def adopt_random_state(ctx: RankContext, device: torch.device, drew: int) -> None:
    """Collective: every rank takes the random state of ``device``'s default generator from the first rank
    that ``drew`` the most (ranks that drew nothing pass -1); a no-op on one process.

    A collective operation whose random draws one process would make in one place (pipelined sampling draws on
    the last stage) leaves every rank's stream where that process's would be: the ranks go on drawing alike
    (dropout, shuffles, the next call's samples), as their one process would.
    """
    if not ctx.is_distributed:
        return
    drawn = all_gather_json(ctx, int(drew), check=lambda v: isinstance(v, int))
    state = broadcast_random_state(ctx, device, max(range(len(drawn)), key=lambda r: (drawn[r], -r)))
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)
