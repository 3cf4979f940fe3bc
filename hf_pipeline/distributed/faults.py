"""Failures in the middle of a pipelined call: every rank gets an error that names the culprit, none hangs.

Errors found *before* communication are agreed through collectives (``dist.collective_errors``).
Inside a pipelined call that is not possible: when one stage raises (a bad label shape on the
last stage, an out-of-memory on one GPU) or its process dies (SIGKILL, segfault), its neighbours
sit in a receive that will never complete, and ranks further away sit behind them.
:func:`spread_failures` wraps one collective call (forward, training step, generate, save) on every
rank and turns any failure into an error on all of them:

* A rank whose own code raised writes what happened (type, message, stage) to the job's
  rendezvous store, the one channel that still works when the process group is stuck, as a small
  JSON record (see the Note on the store). If every
  rank raised in the same call (the same bad argument seen everywhere) nobody waits for anyone and
  each rank just raises its own error; the process group stays usable.
* Otherwise it *stops the process group* on this rank (see the Note), so that its peers' pending
  receives fail at once instead of after the timeout, and re-raises its own exception.
* A rank whose communication failed (a peer closed the connection, or the collective timeout of
  ``HF_PIPELINE_TIMEOUT`` seconds passed) stops its group too, so the failure travels down the
  pipeline, then reads the store: if a peer recorded an error it raises :class:`RankError` with the
  peer's original message; if not, the peers that never answered (killed, crashed, hung) are named
  as having stopped answering, with their stages.

After such a failure the process group of that rank is stopped: later calls raise at once, and the
job has to be restarted (torchrun ``--max-restarts`` or your scheduler can do it).

Note (stopping a gloo group): ``ProcessGroup.abort()`` does not wake a gloo receive, neither here
nor on the peer. What does is gloo's own timeout handling: when a receive times out, gloo signals
the failure to every connection of that communicator and closes them ("Connection closed by peer"
on the other side). So a receive with a 1 ms timeout, on a tag nobody sends on, stops the group.
NCCL groups are aborted with ``_abort_process_group``.

Note (the store is not trusted): the rendezvous store listens on all interfaces and any process that
reaches its port can list and write keys. Records are therefore JSON, never pickle, and a record is
used only if it is small and has exactly the expected keys and types (:func:`_decode`); anything
else under the prefix is ignored with a log line, so the worst a stranger can do is make a failure
message wrong, never run code in a rank.

Example (inside the library; ``describe`` names a rank's stages):
    >>> with spread_failures(ctx, "a training step", groups=(model.dims.pp_group,), describe=stage_names):
    ...     loss = schedule.step(**inputs)
"""

from __future__ import annotations

import datetime
import itertools
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..compat import abort_process_group, default_store
from ..errors import PipelineBroken, RankError
from ..log import get_logger
from .agreement import communication_failure, describe_error, is_lost_peer_error, rank_name
from .context import RankContext

__all__ = ["PipelineBroken", "is_communication_error", "raise_if_broken", "spread_failures"]

logger = get_logger(__name__)

_PREFIX = "hf_pipeline/faults"
_POISON_TAG = 0x7A11  # a tag no pipeline traffic uses: the receive on it can only time out
_POISON_CONTEXTS = 4  # gloo picks one communicator per tag (tag % number of devices); cover several
_AGREE_S = 2.0  # how long a failed rank waits to see whether every rank failed the same way
_IDENTIFY_S = 3.0  # how long a rank that lost contact waits for the peers' records
_POLL_S = 0.02
_MAX_MESSAGE = 2000
# A record's fields and types (bool is refused where int is expected), its kinds, and size bounds:
# describe_error cuts a message to 2000 characters plus a short tail; the other strings are short.
_RECORD_FIELDS: dict[str, type] = {
    "kind": str, "rank": int, "type": str, "message": str, "label": str, "what": str, "where": str, "call": int,
}
_RECORD_KINDS = ("error", "lost")
_MAX_FIELD = {"message": _MAX_MESSAGE + 100}
_MAX_OTHER_FIELD = 1000
_MAX_RECORD_BYTES = 16 * 1024
# Substrings of the errors gloo / NCCL / the store raise when a peer is gone or too slow.
_COMM_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
    "timed out", "Socket Timeout", "ProcessGroupGloo", "gloo/transport", "NCCL", "Connection refused",
)


def is_communication_error(error: BaseException) -> bool:
    """True for errors of the communication layer (a peer died, hung or closed the connection).

    torch raises ``DistError`` subclasses for some of them and plain ``RuntimeError`` with gloo's
    message for others (torch 2.13), so the message is looked at too.
    """
    if isinstance(error, RankError):
        return False  # already agreed (``collective_errors``) or already explained by a peer's record
    if isinstance(error, (dist.DistError, PipelineBroken)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in _COMM_MARKERS)


def _original(error: BaseException) -> BaseException:
    """The stage's own exception inside torch's "[Stage i] failed to run forward/backward" wrapper."""
    while (
        isinstance(error, RuntimeError) and isinstance(error.__cause__, Exception)
        and "[Stage " in str(error) and "failed to run" in str(error)
    ):
        error = error.__cause__
    return error


def _record(kind: str, rank: int, error: BaseException, label: str, what: str, call: int) -> bytes:
    """What this rank tells the others through the store: ``kind`` "error" (its own code raised) or "lost"."""
    type_name, message, where = describe_error(error)
    rec = {"kind": kind, "rank": rank, "type": type_name[:_MAX_OTHER_FIELD], "message": message,
           "label": label[:_MAX_OTHER_FIELD], "what": what[:_MAX_OTHER_FIELD], "where": where[:_MAX_OTHER_FIELD],
           "call": call}
    return json.dumps(rec).encode()


def _decode(raw: bytes) -> tuple[dict | None, str]:
    """A record read from the store, or ``(None, why it is not one)``: data only, never code (see the Note).

    Accepted: at most 16 KiB of UTF-8 JSON holding an object with exactly the keys of
    ``_RECORD_FIELDS``, each of its type and within its length bound, ``kind`` one of
    ``_RECORD_KINDS`` and non-negative ``rank`` / ``call``.
    """
    if len(raw) > _MAX_RECORD_BYTES:
        return None, f"{len(raw)} bytes, more than {_MAX_RECORD_BYTES}"
    try:
        rec = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, "not UTF-8 JSON"
    if not isinstance(rec, dict) or set(rec) != set(_RECORD_FIELDS):
        return None, "not an object with the expected keys"
    for name, kind in _RECORD_FIELDS.items():
        value = rec[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return None, f"field {name!r} must be {kind.__name__}"
        if isinstance(value, str) and len(value) > _MAX_FIELD.get(name, _MAX_OTHER_FIELD):
            return None, f"field {name!r} is too long"
        if isinstance(value, int) and not 0 <= value < 1 << 31:
            return None, f"field {name!r} is out of range"
    if rec["kind"] not in _RECORD_KINDS:
        return None, f"kind {rec['kind'][:20]!r} is not one of {_RECORD_KINDS}"
    return rec, ""


class _Store:
    """The rendezvous store, tolerant of its own death (it lives in rank 0 under plain env:// init)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.ignored: set[str] = set()  # keys whose malformed value was logged (the reads poll: log once)
        try:
            self.store = default_store()
        except Exception as e:  # noqa: BLE001 - no default group / store
            self.store, self.error = None, f"{type(e).__name__}: {e}"

    def set(self, key: str, value: bytes) -> None:
        if self.store is None:
            return
        try:
            self.store.set(key, value)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"

    def get(self, key: str) -> dict | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            self.store = None  # unreachable: stop trying (each try may block)
            return None
        rec, why = _decode(raw)
        if rec is None and key not in self.ignored:
            self.ignored.add(key)
            logger.warning(
                "hf_pipeline: ignored the value under %r in the rendezvous store: %s, not a failure record of this "
                "library (something else wrote to the job's store)", key, why,
            )
        return rec

    def first_failure(self, record: bytes) -> None:
        """Keep the first one-sided failure of the job, for ranks that only see its consequences later."""
        if self.store is None:
            return
        try:
            if self.store.add(f"{_PREFIX}/first/count", 1) == 1:
                self.store.set(f"{_PREFIX}/first", record)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"


def _key(call: int, rank: int) -> str:
    return f"{_PREFIX}/call{call}/rank{rank}"


def _wait_records(
    store: _Store, call: int, ranks: Sequence[int], seconds: float, done: Callable[[dict[int, dict]], bool]
) -> dict[int, dict]:
    """The records of ``ranks`` for call ``call`` that arrive within ``seconds`` (sooner once ``done`` says so)."""
    records: dict[int, dict] = {}
    deadline = time.monotonic() + seconds
    while True:
        for r in ranks:
            if r not in records:
                rec = store.get(_key(call, r))
                if rec is not None:
                    records[r] = rec
        if done(records) or time.monotonic() >= deadline or store.store is None:
            return records
        time.sleep(_POLL_S)


def _stop(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Stop this rank's communicators so that peers waiting on it fail now (see the module Note)."""
    seen: set[int] = set()
    for group in [*groups, dist.group.WORLD]:
        if group is None or id(group) in seen or not dist.is_initialized():
            continue
        seen.add(id(group))
        try:
            size = dist.get_world_size(group)
            own_rank = dist.get_rank(group)
        except Exception:  # noqa: BLE001 - not a member, or already destroyed
            continue
        if size < 2 or own_rank < 0:
            continue
        backend = str(dist.get_backend(group))
        if "nccl" in backend:
            try:
                abort_process_group(group)
            except Exception:  # noqa: BLE001 - best effort: the timeout still bounds the wait
                pass
        if "gloo" not in backend:
            continue
        peer = dist.get_global_rank(group, 1 if own_rank == 0 else 0)
        for i in range(_POISON_CONTEXTS):
            try:
                work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_POISON_TAG + i)
                work.wait(timeout=datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the expected outcome: the timeout closes the connections
                pass


@dataclass
class _FaultState:
    """What this process remembers between pipelined calls (one per process: ``_STATE``)."""

    calls: Iterator[int] = field(default_factory=itertools.count)  # calls entered: the same on every rank
    broken: str | None = None  # set once this process stopped its group: later calls fail at once
    broken_world: object = None  # ... that group: a job that destroys it and makes a new one may go on
    depth: int = 0  # calls running now (one may run inside another: generate's forward passes)
    # Errors a call running now already told every rank about; an enclosing call re-raises them as
    # they are. Held only while a call runs (builtin exceptions cannot be weakly referenced).
    handled: list[BaseException] = field(default_factory=list)

    def is_handled(self, error: BaseException) -> bool:
        return any(error is seen for seen in self.handled)

    def stop(self, reason: str) -> None:
        """Remember that this rank's process group was stopped, and why."""
        self.broken, self.broken_world = reason, dist.group.WORLD


_STATE = _FaultState()


def raise_if_broken(what: str) -> None:
    """Raise :class:`PipelineBroken` if an earlier failure stopped this rank's process group.

    Args:
        what: the call about to run, for the message ("a forward pass").
    """
    if _STATE.broken is not None and (not dist.is_initialized() or dist.group.WORLD is not _STATE.broken_world):
        _STATE.broken = _STATE.broken_world = None  # the stopped group is gone; a new one works
    if _STATE.broken is not None:
        raise PipelineBroken(
            f"cannot run {what}: {_STATE.broken} This rank's process group was stopped then; restart the job"
        )


@contextmanager
def spread_failures(
    ctx: RankContext,
    what: str,
    *,
    groups: Sequence[dist.ProcessGroup | None] = (),
    describe: Callable[[int], str] | None = None,
) -> Iterator[None]:
    """Run one collective pipelined call; if it fails anywhere, fail everywhere (see the module docstring).

    Every rank of the job must enter it for the same call (calls are counted to match records).

    Args:
        ctx: the rank context.
        what: the call, for messages ("a training step", "generate").
        groups: the process groups the call communicates in (pipeline, data parallel); the world
            group is always included.
        describe: global rank -> its role (``"stage 1"``), for messages.

    Raises:
        The local exception (on the rank that raised); :class:`RankError` on the others (its
        ``failures`` map the failing rank to (type, message, label)); :class:`PipelineBroken` for
        calls after a failure stopped this rank's group.
    """
    raise_if_broken(what)
    if not ctx.is_distributed:
        yield
        return
    call = next(_STATE.calls)
    _STATE.depth += 1
    try:
        yield
    except Exception as caught:
        if _STATE.is_handled(caught) or isinstance(caught, PipelineBroken):
            raise  # an inner spread_failures already told everyone
        raised, cause = _spread(ctx, caught, _Call(what=what, number=call, groups=tuple(groups), describe=describe))
        _STATE.handled.append(raised)
        if cause is None:
            raise raised  # noqa: B904 - this rank's own error, with its own cause and context
        raise raised from cause
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0:
            _STATE.handled.clear()  # the outermost call is over: nothing encloses it to re-raise into


@dataclass(frozen=True)
class _Call:
    """One pipelined call, as the failure handling below needs it."""

    what: str
    number: int
    groups: tuple[dist.ProcessGroup | None, ...]
    describe: Callable[[int], str] | None

    def name(self, rank: int) -> str:
        return rank_name(rank, self.describe)

    def label(self, rank: int) -> str | None:
        return self.describe(rank) if self.describe is not None else None


def _spread(ctx: RankContext, caught: Exception, call: _Call) -> tuple[BaseException, BaseException | None]:
    """The exception this rank raises for ``caught`` (and its cause, for a RankError), after telling (or hearing
    from) the other ranks."""
    # An agreement inside the call that lost a peer (agreement.lost_peer_error) is a lost peer of this
    # call: reported below as one, naming the call, from the communication error underneath.
    lost = is_lost_peer_error(caught)
    error = caught.__cause__ if lost and isinstance(caught.__cause__, Exception) else _original(caught)
    if error is not caught and not lost:
        # Raise what the stage raised (a ValueError stays a ValueError); torch's wrapper says where.
        error.add_note(f"raised inside torch.distributed.pipelining: {str(caught).strip()[:500]}")
    store = _Store()
    comm = lost or is_communication_error(error)
    record = _record("lost" if comm else "error", ctx.rank, error, call.label(ctx.rank) or "", call.what, call.number)
    store.set(_key(call.number, ctx.rank), record)
    if not comm:
        return _local_failure(ctx, error, call, store, record), None
    return _lost_contact(ctx, error, call, store), error


def _local_failure(ctx: RankContext, error: BaseException, call: _Call, store: _Store, record: bytes) -> BaseException:
    """This rank's own code raised ``error``: unless every rank raised too, stop the group so the peers learn it."""
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    # The same bad argument raises on every rank at about the same time: then nobody is blocked.
    seen = _wait_records(store, call.number, others, _AGREE_S, lambda recs: len(recs) == len(others))
    if len(seen) == len(others) and all(rec["kind"] == "error" for rec in seen.values()):
        return error
    store.first_failure(record)
    _stop(call.groups)
    who = call.name(ctx.rank)
    _STATE.stop(f"{who} failed during {call.what}: {type(error).__name__}: {str(error)[:300]}.")
    error.add_note(
        f"hf_pipeline: {who} raised during {call.what} while other ranks were waiting for it; they "
        "were told and raise RankError. This rank's process group is stopped: restart the job"
    )
    return error


def _lost_contact(ctx: RankContext, error: BaseException, call: _Call, store: _Store) -> RankError:
    """This rank's communication failed: stop its group too, and name the peer that caused it.

    The :class:`RankError` returned is raised from ``error``.
    """
    _stop(call.groups)
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    # Who caused it? A peer that raised has left a record (at the latest right before it stopped
    # its group, which is what woke us); a peer that died or hangs never will.
    records = _wait_records(
        store, call.number, others, _IDENTIFY_S,
        lambda recs: any(rec["kind"] == "error" for rec in recs.values()) or len(recs) >= len(others) - 1,
    )
    culprits = {r: rec for r, rec in records.items() if rec["kind"] == "error"}
    if not culprits:
        earlier = store.get(f"{_PREFIX}/first")  # a failure in an earlier call that this rank did not wait on
        if earlier is not None:
            culprits = {earlier["rank"]: earlier}
    if culprits:
        message, failures = _culprits_message(culprits)
    else:
        silent = [r for r in others if r not in records]
        message, failures = _silence_message(ctx, error, call, silent)
        if store.error is not None:
            message += (
                f". The rendezvous store is unreachable too ({store.error[:200]}): the process hosting it (rank 0, "
                "or torchrun's agent on the first node) has probably died"
            )
    _STATE.stop(message.splitlines()[0])
    return RankError(message, failures=failures)


_Failures = dict[int, tuple[str, str, "str | None"]]


def _culprits_message(culprits: dict[int, dict]) -> tuple[str, _Failures]:
    """The message and ``RankError.failures`` for peers that recorded their own error."""
    failures: _Failures = {}
    lines = []
    for r, rec in sorted(culprits.items()):
        where = f" [at {rec['where']}]" if rec["where"] else ""
        who = f"rank {r}" + (f" ({rec['label']})" if rec["label"] else "")
        lines.append(f"{who} failed during {rec['what']}: {rec['type']}: {rec['message']}{where}")
        failures[r] = (rec["type"], rec["message"], rec["label"] or None)
    return "\n".join(lines), failures


def _silence_message(ctx: RankContext, error: BaseException, call: _Call, silent: list[int]) -> tuple[str, _Failures]:
    """The message and ``RankError.failures`` when no peer recorded an error: the ``silent`` ones never answered."""
    reason = communication_failure(error, ctx.timeout.total_seconds())
    if silent:
        names = ", ".join(call.name(r) for r in silent)
        message = (
            f"{names} stopped answering during {call.what}: {call.name(ctx.rank)} lost contact, {reason}; check its log"
        )
        failures = {r: ("ConnectionError", f"stopped answering during {call.what}", call.label(r)) for r in silent}
        return message, failures
    message = f"{call.name(ctx.rank)} lost contact with its peers during {call.what}: {reason}"
    return message, {ctx.rank: (type(error).__name__, str(error)[:_MAX_MESSAGE], call.label(ctx.rank) or None)}
