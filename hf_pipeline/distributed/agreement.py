"""Error agreement across ranks: a failure or a differing input on one rank becomes an error on every rank.

A failure on one rank must become a clear error on every rank instead of a hang in the next
collective: ``collective_errors`` / ``raise_on_any_rank`` agree on failures after a local step,
and ``check_same_on_all_ranks`` catches inputs that differ across ranks before they are used
(through a :func:`fingerprint` of each value, hashing every byte of a tensor). When the
agreement's own collective fails (a peer died or hangs), :func:`lost_peer_error` names the peers
that stopped answering.

Example (``torchrun --nproc-per-node 2 script.py``):
    >>> ctx = init_distributed()
    >>> with collective_errors(ctx, "loading weights", label=f"stage {ctx.rank}"):
    ...     tensors = load_my_stage()          # raises on rank 1 -> RankError on rank 0
    >>> check_same_on_all_ranks(ctx, "input_ids", input_ids)
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ..compat import default_store
from ..errors import InputError, InternalError, RankError
from .context import TIMEOUT_ENV, RankContext
from .exchange import all_gather_json

__all__ = [
    "RankError",
    "check_same_on_all_ranks",
    "collective_errors",
    "communication_failure",
    "describe_error",
    "fingerprint",
    "is_lost_peer_error",
    "lost_peer_error",
    "raise_on_any_rank",
    "rank_name",
]

_MAX_MESSAGE = 2000  # characters of a remote error message carried to the other ranks
_MAX_SUMMARY = 300  # characters of a value's description in a mismatch message
_MAX_FIELDS = 6  # differing fields named in a mismatch message
_LOST_WAIT_S = 3.0  # after a failed agreement: how long a rank waits for the live peers to say so
_LOST_POLL_S = 0.02
_LOST_PREFIX = "hf_pipeline/agreement"
# Substrings of backend errors that mean "no answer in time" / "the peer went away".
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Socket Timeout", "timeout")
_CLOSED_MARKERS = (
    "Connection closed", "Connection reset", "Broken pipe", "Connection refused", "recvValue failed", "failed to recv",
)

_AGREEMENTS = itertools.count()  # agreements this process entered: the same sequence on every rank
# The RankErrors lost_peer_error made (it made them, so it may remember them; weak: forgotten with them).
_LOST_PEER_ERRORS: weakref.WeakSet[RankError] = weakref.WeakSet()


def describe_error(error: BaseException) -> tuple[str, str, str]:
    """(type name, message, innermost frame) of a local exception, small enough to all-gather.

    Args:
        error: the exception this rank caught.

    Returns:
        Its type's name, its message (cut after 2000 characters) and ``"file.py:line in function"``.
    """
    message = str(error)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + f"... ({len(message) - _MAX_MESSAGE} more characters)"
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return type(error).__name__, message, where


def communication_failure(error: BaseException, timeout_s: float) -> str:
    """What a communication error means, in the library's words (the backend's text stays in ``__cause__``).

    Args:
        error: the error a collective or a receive raised.
        timeout_s: the collective timeout, for the message.

    Returns:
        A short reason, e.g. ``"no answer within the collective timeout of 300 s ..."``.
    """
    text = str(error)
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        return (
            f"no answer before the collective timeout {timeout_s:.0f} s ran out: the process hangs, was stopped or is "
            f"far behind (set {TIMEOUT_ENV} to change the timeout)"
        )
    if any(marker in text for marker in _CLOSED_MARKERS):
        return "its connection closed: the process exited, crashed or was killed (out of memory, a signal)"
    return f"communication with it failed ({type(error).__name__})"


def _default_store():
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no default group / store
        return None


def _silent_peers(ctx: RankContext, group: dist.ProcessGroup, number: int) -> tuple[list[int], str | None]:
    """After a failed agreement: the group's global ranks that did not say they are alive (and a store error).

    Every live rank whose agreement failed writes one key to the rendezvous store (the channel that
    still works when the group does not) and waits up to ``_LOST_WAIT_S`` for the others' keys; the
    ranks whose key never comes are the ones that died, hang or were stopped.
    """
    ranks = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    others = [r for r in ranks if r != ctx.rank]
    store = _default_store()
    if store is None:
        return others, "no rendezvous store"
    prefix = f"{_LOST_PREFIX}/{number}"
    try:
        store.set(f"{prefix}/rank{ctx.rank}", b"1")
        seen: set[int] = set()
        deadline = time.monotonic() + _LOST_WAIT_S
        while True:
            seen |= {r for r in others if r not in seen and store.check([f"{prefix}/rank{r}"])}
            if len(seen) == len(others) or time.monotonic() >= deadline:
                return [r for r in others if r not in seen], None
            time.sleep(_LOST_POLL_S)
    except Exception as e:  # noqa: BLE001 - the store's host (rank 0 under env:// init) is gone too
        return ([ranks[0]] if ranks[0] != ctx.rank else others), f"{type(e).__name__}: {str(e)[:200]}"


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_failure(value: Any) -> bool:
    """None, or [type, message, where, label or None] as :func:`raise_on_any_rank` sends it."""
    return value is None or (
        isinstance(value, list) and len(value) == 4 and all(isinstance(v, str) for v in value[:3])
        and (value[3] is None or isinstance(value[3], str))
    )


def _is_details(value: Any) -> bool:
    """[summary, {path: [digest, summary]}] as :func:`check_same_on_all_ranks` sends it."""
    return (
        isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict)
        and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value[1].values())
    )


def rank_name(rank: int, describe: Callable[[int], str] | None) -> str:
    """``"rank 1 (stage 1)"``: a global rank with its role from ``describe`` (``"rank 1"`` without one)."""
    label = describe(rank) if describe is not None else ""
    return f"rank {rank}" + (f" ({label})" if label else "")


def lost_peer_error(
    ctx: RankContext,
    error: BaseException,
    *,
    what: str,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
    number: int | None = None,
) -> RankError:
    """The :class:`RankError` for an agreement whose collective failed: which peers stopped answering, and why.

    Call it on every rank whose collective raised (it waits up to a few seconds for the other live
    ranks). The backend's message is not repeated (raise the result ``from error`` to keep it).

    Args:
        ctx: the rank context.
        error: what the collective raised.
        what: the step, for the message ("loading weights").
        group: the group of the collective; default ``ctx.group``.
        describe: global rank -> its role (``"stage 1"``), for the message.
        number: the agreement's number (from the same sequence on every rank); default a fresh one.

    Returns:
        The error (``failures`` maps each silent peer to ``("ConnectionError", ..., its role)``),
        remembered (:func:`is_lost_peer_error`) so that :func:`hf_pipeline.distributed.faults.spread_failures`
        treats this rank's group as stopped.
    """
    group = group if group is not None else ctx.group
    silent, store_error = _silent_peers(ctx, group, next(_AGREEMENTS) if number is None else number)
    reason = communication_failure(error, ctx.timeout.total_seconds())
    if silent:
        names = ", ".join(rank_name(r, describe) for r in silent)
        message = f"{names} stopped answering while {what}: {reason}; check its log"
        failures = {
            r: ("ConnectionError", f"stopped answering while {what}", describe(r) if describe else None) for r in silent
        }
    else:
        message = f"{rank_name(ctx.rank, describe)} lost contact with its peers while {what}: {reason}"
        failures = {ctx.rank: ("ConnectionError", message, describe(ctx.rank) if describe else None)}
    if store_error is not None:
        message += (
            f". The rendezvous store is unreachable too ({store_error}): the process hosting it (rank 0, or torchrun's "
            "agent on the first node) has probably died"
        )
    raised = RankError(message, failures=failures)
    _LOST_PEER_ERRORS.add(raised)
    return raised


def is_lost_peer_error(error: BaseException) -> bool:
    """Whether ``error`` is one :func:`lost_peer_error` made: an agreement that lost a peer.

    Args:
        error: any exception.

    Returns:
        True for the :class:`RankError` objects :func:`lost_peer_error` returned.
    """
    return isinstance(error, RankError) and error in _LOST_PEER_ERRORS


def raise_on_any_rank(
    ctx: RankContext,
    error: BaseException | None,
    *,
    what: str,
    label: str | None = None,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
) -> None:
    """Collective: raise on every rank if the local step just run failed on any rank.

    Every rank of the group must call this, passing the exception it caught (or ``None``). A
    failing rank re-raises its own exception (same type, same traceback; a note names the other
    failing ranks); every other rank raises :class:`RankError` naming the failing rank(s) and
    their messages. With no group this just re-raises ``error`` if there is one.

    Args:
        ctx: the rank context.
        error: the exception this rank caught, or ``None``.
        what: the step, for the message (``"loading weights"`` -> "... failed while loading weights").
        label: this rank's role, shown next to its rank (e.g. ``"stage 2"``).
        group: group to agree in; default ``ctx.group``.
        describe: global rank -> its role, for naming a peer that stopped answering (``label``
            is this rank's when not given).

    Raises:
        BaseException: this rank's own ``error``.
        RankError: another rank failed, or stopped answering (died, hangs, was stopped) before it
            could say.
    """
    group = group if group is not None else ctx.group
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    if label is None and describe is not None:
        label = describe(ctx.rank)
    number = next(_AGREEMENTS)
    mine = (*describe_error(error), label) if error is not None else None
    try:
        gathered = all_gather_json(ctx, mine, group=group, check=_is_failure)
    except InternalError:
        raise  # not a lost peer: a part that is not what this exchange sends (said on every rank)
    except Exception as gather_error:
        lost = lost_peer_error(ctx, gather_error, what=what, group=group, describe=describe, number=number)
        if error is not None:
            error.add_note(f"(the other ranks could not be told: {lost})")
            raise error  # noqa: B904 - this rank's own error; the lost contact is in its note
        raise lost from gather_error
    # gathered is ordered by rank within the group; messages name global ranks
    failed = {dist.get_global_rank(group, i): item for i, item in enumerate(gathered) if item is not None}
    if not failed:
        return
    failures = {r: (t, m, lab) for r, (t, m, _, lab) in failed.items()}
    lines = [
        f"rank {r}{f' ({lab})' if lab else ''} failed while {what}: {t}: {m}{f' [at {where}]' if where else ''}"
        for r, (t, m, where, lab) in sorted(failed.items())
    ]
    if error is not None:
        others = [line for r, line in zip(sorted(failed), lines) if r != ctx.rank]
        if others:
            error.add_note("other ranks failed too:\n" + "\n".join(others))
        raise error
    message = lines[0] if len(lines) == 1 else f"{len(lines)} ranks failed while {what}:\n" + "\n".join(lines)
    raise RankError(message, failures=failures)


@contextmanager
def collective_errors(
    ctx: RankContext, what: str, *, label: str | None = None, group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
) -> Iterator[None]:
    """Run a local step on every rank; if it raises on any rank, raise on all (see :func:`raise_on_any_rank`).

    Note: the block must not itself run collectives that a failing rank would skip — a rank that
    raised early and reached the agreement would otherwise wait for peers stuck in the skipped
    collective until the timeout.

    Args:
        ctx: the rank context.
        what: the step, for the message.
        label: this rank's role, for the message (e.g. ``"stage 1"``).
        group: group to agree in; default ``ctx.group``.
        describe: global rank -> its role, for the messages (see :func:`raise_on_any_rank`).

    Example:
        >>> with collective_errors(ctx, "loading weights"):
        ...     tensors, report = load_tensors(index, wanted, device=ctx.device)
    """
    error: Exception | None = None
    try:
        yield
    except Exception as caught:  # KeyboardInterrupt/SystemExit propagate: launchers stop every rank for those
        error = caught
    raise_on_any_rank(ctx, error, what=what, label=label, group=group, describe=describe)


def _tensor_fingerprint(t: torch.Tensor) -> tuple[str, str]:
    """(digest, summary) of a tensor: shape, dtype and a hash of all of its bytes.

    Every byte is hashed: a sample (both ends plus a sum) missed inputs that differ only in order,
    e.g. two rows swapped in the middle of a batch. Cost (blake2b, CPU, 2-core machine under load):
    about 2 ms for a 256x1024 int64 batch (2 MiB) and 18 ms for a 16 MB float tensor, far less than
    the forward pass those inputs feed. A GPU tensor is copied to the host first.
    """
    head = f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}"
    if t.is_meta or t.layout != torch.strided or t.is_quantized:
        return f"{head},{t.layout}", head + ")"
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(digest_size=8)
    h.update(raw.cpu().numpy())  # the buffer itself, no extra bytes copy
    checksum = h.hexdigest()
    return f"{head},{checksum}", f"{head}, checksum={checksum[:8]})"


def fingerprint(value: Any) -> tuple[str, str]:
    """(digest material, readable summary) of a value; recursive over containers."""
    if isinstance(value, torch.Tensor):
        return _tensor_fingerprint(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.Size)):
        r = repr(value)
        return r, r if len(r) <= 60 else r[:57] + "..."
    if isinstance(value, torch.device):
        return repr(value), str(value)
    if isinstance(value, Mapping):
        items = [(repr(k), fingerprint(v)) for k, v in value.items()]
        items.sort(key=lambda kv: kv[0])
        return (
            "{" + ",".join(f"{k}:{d}" for k, (d, _) in items) + "}",
            "{" + ", ".join(f"{k}: {s}" for k, (_, s) in items) + "}",
        )
    if isinstance(value, (list, tuple)):
        parts = [fingerprint(v) for v in value]
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        return open_ + ",".join(d for d, _ in parts) + close, open_ + ", ".join(s for _, s in parts) + close
    if is_dataclass(value) and not isinstance(value, type):
        return fingerprint({f.name: getattr(value, f.name) for f in fields(value)})
    try:  # any other picklable object: compare its pickle (repr may contain per-process addresses)
        digest = hashlib.blake2b(pickle.dumps(value), digest_size=8).hexdigest()
    except Exception:  # noqa: BLE001 - unpicklable: compare the type only
        digest = "unpicklable"
    name = type(value).__qualname__
    return f"{name}:{digest}", f"{name}(#{digest[:8]})"


def _fields(value: Any, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """The named parts of ``value`` to tell apart in a mismatch message: mapping keys and dataclass
    fields, ``depth`` levels deep (``config.rope_scaling``); anything else is one unnamed part."""
    if depth and is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if not depth or not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_fields(v, f"{prefix}.{k}" if prefix else str(k), depth - 1))
    return out


def _short(summary: str, limit: int) -> str:
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


def _variants(values: list[tuple[int, str, str]]) -> str:
    """``rank 0: a; ranks 1, 2: b`` from (rank, digest, summary), grouped by digest in rank order."""
    by_digest: dict[str, list[int]] = {}
    summaries: dict[str, str] = {}
    for rank, d, summary in values:
        by_digest.setdefault(d, []).append(rank)
        summaries[d] = summary
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {summaries[d]}"
        for d, ranks in sorted(by_digest.items(), key=lambda item: item[1][0])
    )


def check_same_on_all_ranks(
    ctx: RankContext,
    name: str,
    value: Any,
    *,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
    hint: str | None = None,
) -> None:
    """Collective: raise on every rank if ``value`` is not the same on all of them.

    Compares one digest (structure; for tensors shape, dtype and a hash of all their bytes; for
    other leaves their repr or pickle), not the full values: a mismatch is always reported (up to
    a hash collision, 1 in 2**64 per tensor), whatever part of a tensor differs. Only when the digests
    differ is a second, larger exchange made, to name what differs: for a mapping or a dataclass
    the keys (two levels deep, ``config.hidden_size``) whose values differ, and which ranks hold
    which value. A no-op without a group.

    Args:
        ctx: the rank context.
        name: what the value is, for the message (e.g. ``"input_ids"``).
        value: a tensor, number, string, or a dict/list/tuple/dataclass of those.
        group: group that must agree; default ``ctx.group``.
        describe: global rank -> its role, for naming a peer that stopped answering.
        hint: what to do, for the message (default: pass the same inputs and seed everywhere).

    Raises:
        InputError: (a ValueError) on every rank, naming ``name``, the differing keys and which ranks hold which value.
        RankError: a peer stopped answering (died, hangs, was stopped) during the exchange.

    Example:
        >>> check_same_on_all_ranks(ctx, "input_ids", input_ids)
    """
    group = group if group is not None else ctx.group
    if group is None or dist.get_world_size(group) == 1:
        return
    number = next(_AGREEMENTS)
    digest_material, summary = fingerprint(value)
    digest = hashlib.blake2b(digest_material.encode(), digest_size=16).hexdigest()
    world = dist.get_world_size(group)
    try:
        gathered = all_gather_json(ctx, digest, group=group, check=_is_str)
        if len(set(gathered)) == 1:
            return
        # They differ (every rank sees it): exchange the parts, to say which differ.
        details = all_gather_json(ctx, [_short(summary, _MAX_SUMMARY), _part_digests(value)], group=group,
                                  check=_is_details)
    except InternalError:
        raise  # not a lost peer: a part that is not what this exchange sends (said on every rank)
    except Exception as e:
        what = f"comparing {name} across ranks"
        raise lost_peer_error(ctx, e, what=what, group=group, describe=describe, number=number) from e
    ranks = [dist.get_global_rank(group, i) for i in range(world)]
    hint = hint or (
        f"Pass the same {name} on every rank (same inputs and seed everywhere, or broadcast them from rank 0)"
    )
    raise _mismatch_error(name, hint, ranks, gathered, details)


def _part_digests(value: Any) -> dict[str, tuple[str, str]]:
    """Named part of ``value`` (see :func:`_fields`) -> (its digest, its short summary)."""
    parts = {}
    for path, part in _fields(value).items():
        material, part_summary = fingerprint(part)
        parts[path] = (hashlib.blake2b(material.encode(), digest_size=8).hexdigest(), _short(part_summary, 160))
    return parts


def _mismatch_error(
    name: str, hint: str, ranks: list[int], digests: list[str], details: list[tuple[str, dict[str, tuple[str, str]]]]
) -> InputError:
    """The error for a value that differs across ranks: which of its parts differ, and which ranks hold what.

    ``digests`` and ``details`` hold every rank's whole-value digest and (summary, part digests), in
    the order of ``ranks`` (global ranks).
    """
    paths = list(dict.fromkeys(path for _, p in details for path in p))
    differing = [
        path for path in paths
        if len({p.get(path, ("<absent>", ""))[0] for _, p in details}) > 1
    ]
    if differing == [""] or not differing:
        variants = _variants([(r, d, summ) for r, d, (summ, _) in zip(ranks, digests, details)])
        return InputError(f"{name} must be the same on every rank but differs: {variants}. {hint}")
    shown = differing[:_MAX_FIELDS]
    per_field = " | ".join(
        f"{path}: " + _variants([(r, *p.get(path, ("<absent>", "(not given)"))) for r, (_, p) in zip(ranks, details)])
        for path in shown
    )
    more = f" (and {len(differing) - len(shown)} more)" if len(differing) > len(shown) else ""
    if len(differing) == 1:
        which = shown[0]
    else:
        which = ", ".join(shown[:-1]) + (" and " if not more else ", ") + shown[-1] + more
    return InputError(
        f"{name} must be the same on every rank but {which} differ{'s' if len(differing) == 1 else ''}: "
        f"{per_field}. {hint}"
    )
