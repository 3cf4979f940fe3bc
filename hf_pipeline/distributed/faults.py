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
  each rank just raises its own error; the process groups stay usable.
* Otherwise it *stops the call's process groups* on this rank (see the Note), so that its peers'
  pending receives fail at once instead of after the timeout, and re-raises its own exception.
* A rank whose communication failed (a peer closed the connection, or the collective timeout of
  ``HF_PIPELINE_TIMEOUT`` seconds passed) stops its groups too, so the failure travels down the
  pipeline, then reads the store: if a peer recorded an error it raises :class:`RankError` with the
  peer's original message; if not, the peers that never answered (killed, crashed, hung) are named
  as having stopped answering, with their stages.

Recovery: when every rank is still alive (a user's logits processor or stopping criterion raised,
one stage ran out of memory, a stage has a bug), the pipeline survives. Before raising, the ranks
meet in a recovery rendezvous through the store (``recover<epoch>``: each rank adds 1 and waits for
the world size, at most the collective timeout) and call the ``recover`` hook of
:func:`spread_failures`, which makes fresh process groups in place of the stopped ones
(``groups.renew_groups``): a stopped gloo group has its connections closed on every rank and can
never carry a message again. What the failed call had in flight goes with it (the model drops its
built torch stages and schedules; generate's ring, its messages and KV caches belong to the call;
a failed training step puts the gradients back as they were before it), and the next call runs
as if the failure had not happened. The groups stopped are the library's own (``ctx.group`` and
the model's pipeline / data-parallel groups), never WORLD, which the user's code may share.

Limit: a rank that finished its part of the failed call without waiting for the culprit (with
``gather_output=False`` the first stages of a forward pass do not wait for the last) learns of the
failure only in its next call's input agreement, which is outside this wrapper: it raises
``RankError`` there, and the culprit gives up waiting for it in the rendezvous after the timeout.

When a peer really is gone (killed, hung past the timeout, the store unreachable) nothing can be
recovered: the rendezvous is skipped (or times out), and every later call raises
:class:`PipelineBroken` at once; the job has to be restarted (torchrun ``--max-restarts`` or your
scheduler can do it).

Note (stopping a gloo group): ``ProcessGroup.abort()`` does not wake a gloo receive, neither here
nor on the peer. What does is gloo's own timeout handling: when a receive times out, gloo signals
the failure to every connection of that communicator and closes them ("Connection closed by peer"
on the other side). So a receive with a 1 ms timeout, on a tag nobody sends on, stops the group
-- if its connection was still open: a receive from a peer that already closed it fails at once and
closes nothing else (the peer that failed first in a 3-rank pipeline), so every peer is tried.
NCCL groups are aborted with ``_abort_process_group``; fresh groups replace them the same way.

Note (the store is not trusted): records are JSON data, checked before use (:mod:`.fault_records`).

Example (inside the library; ``describe`` names a rank's stages):
    >>> with spread_failures(ctx, "a training step", groups=(model.dims.pp_group,), describe=stage_names,
    ...                      recover=make_fresh_groups):
    ...     loss = schedule.step(**inputs)
"""

from __future__ import annotations

import datetime
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..compat import abort_process_group, default_store
from ..errors import PipelineBroken, RankError
from ..log import get_logger
from .agreement import communication_failure, is_lost_peer_error, rank_name
from .context import RankContext
from .fault_records import FaultStore, make_record

__all__ = ["PipelineBroken", "is_communication_error", "raise_if_broken", "spread_failures"]

logger = get_logger(__name__)

_PREFIX = "hf_pipeline/faults"
_POISON_TAG = 0x7A11  # a tag no pipeline traffic uses: the receive on it can only time out
_POISON_CONTEXTS = 4  # gloo picks one communicator per tag (tag % number of devices); cover several
_AGREE_S = 2.0  # how long a failed rank waits to see whether every rank failed the same way
_IDENTIFY_S = 3.0  # how long a rank that lost contact waits for the peers' records
_POLL_S = 0.02
_MAX_RANK_MESSAGE = 2000  # characters of a rank's own message in RankError.failures
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


def _key(call: int, rank: int) -> str:
    return f"{_PREFIX}/call{call}/rank{rank}"


def _first_key() -> str:
    return f"{_PREFIX}/epoch{_STATE.epoch}/first"


def _wait_records(
    store: FaultStore, call: int, ranks: Sequence[int], seconds: float, done: Callable[[dict[int, dict]], bool]
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


def _stop(groups: Sequence[dist.ProcessGroup | None]) -> bool:
    """Stop this rank's communicators in ``groups`` so that peers waiting on it fail now (see the module Note).

    Returns:
        Whether WORLD was among them (a context not made by a model's loader): then nothing can be renewed.
    """
    seen: set[int] = set()
    world = dist.group.WORLD if dist.is_initialized() else None
    stopped_world = False
    for group in groups:
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
        stopped_world = stopped_world or group is world
        backend = str(dist.get_backend(group))
        if "nccl" in backend:
            try:
                abort_process_group(group)
            except Exception:  # noqa: BLE001 - best effort: the timeout still bounds the wait
                pass
        if "gloo" not in backend:
            continue
        # Every peer in turn: a receive from a peer whose connection is already closed fails at once,
        # without the timeout that closes the others (see the Note).
        for peer in (dist.get_global_rank(group, r) for r in range(size) if r != own_rank):
            for i in range(_POISON_CONTEXTS):
                try:
                    work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_POISON_TAG + i)
                    work.wait(timeout=datetime.timedelta(milliseconds=1))
                except Exception:  # noqa: BLE001 - the expected outcome: the timeout closes the connections
                    pass
    return stopped_world


@dataclass
class _FaultState:
    """What this process remembers between pipelined calls (one per process: ``_STATE``)."""

    calls: Iterator[int] = field(default_factory=itertools.count)  # calls entered: the same on every rank
    broken: str | None = None  # set once this process stopped its group: later calls fail at once
    broken_world: object = None  # ... that group: a job that destroys it and makes a new one may go on
    epoch: int = 0  # recovery rendezvous entered: the same sequence on every rank
    depth: int = 0  # calls running now (one may run inside another: generate's forward passes)
    # Errors a call running now already told every rank about; an enclosing call re-raises them as
    # they are. Held only while a call runs (builtin exceptions cannot be weakly referenced).
    handled: list[BaseException] = field(default_factory=list)

    def is_handled(self, error: BaseException) -> bool:
        return any(error is seen for seen in self.handled)

    def stop(self, reason: str) -> None:
        """Remember that this rank's process groups were stopped, and why (until they are renewed)."""
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
            f"cannot run {what}: {_STATE.broken} This rank's process groups were stopped then and could not be made "
            "afresh (a rank is gone); restart the job"
        )


@contextmanager
def spread_failures(
    ctx: RankContext,
    what: str,
    *,
    groups: Sequence[dist.ProcessGroup | None] = (),
    describe: Callable[[int], str] | None = None,
    recover: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run one collective pipelined call; if it fails anywhere, fail everywhere (see the module docstring).

    Every rank of the job must enter it for the same call (calls are counted to match records).

    Args:
        ctx: the rank context.
        what: the call, for messages ("a training step", "generate").
        groups: the process groups the call communicates in (pipeline, data parallel); ``ctx.group``
            is always included. Only these are stopped when the call fails on one rank.
        describe: global rank -> its role (``"stage 1"``), for messages.
        recover: called on every rank, after the recovery rendezvous, when the failure stopped the
            groups but every rank is alive: make fresh groups in place of ``groups`` (collective).
            Without it a stopped group stays stopped.

    Raises:
        The local exception (on the rank that raised); :class:`RankError` on the others (its
        ``failures`` map the failing rank to (type, message, label)); :class:`PipelineBroken` for
        calls after a failure stopped this rank's groups for good.
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
        groups = (*groups, ctx.group)
        raised, cause, renewable = _spread(ctx, caught, _Call(what=what, number=call, groups=groups, describe=describe))
        if renewable:
            _recover(ctx, recover, raised)
        elif _STATE.broken is not None:
            raised.add_note(
                "hf_pipeline: this rank's process groups stay stopped (a rank is gone); restart the job"
            )
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


def _spread(
    ctx: RankContext, caught: Exception, call: _Call
) -> tuple[BaseException, BaseException | None, bool]:
    """The exception this rank raises for ``caught`` (and its cause, for a RankError), after telling (or hearing
    from) the other ranks, and whether the groups were stopped for a failure every rank survived (renewable)."""
    # An agreement inside the call that lost a peer (agreement.lost_peer_error) is a lost peer of this
    # call: reported below as one, naming the call, from the communication error underneath.
    lost = is_lost_peer_error(caught)
    error = caught.__cause__ if lost and isinstance(caught.__cause__, Exception) else _original(caught)
    if error is not caught and not lost:
        # Raise what the stage raised (a ValueError stays a ValueError); torch's wrapper says where.
        error.add_note(f"raised inside torch.distributed.pipelining: {str(caught).strip()[:500]}")
    store = FaultStore()
    comm = lost or is_communication_error(error)
    kind = "lost" if comm else "error"
    record = make_record(kind, ctx.rank, error, call.label(ctx.rank) or "", call.what, call.number)
    store.set(_key(call.number, ctx.rank), record)
    if not comm:
        raised, renewable = _local_failure(ctx, error, call, store, record)
        return raised, None, renewable
    raised, renewable = _lost_contact(ctx, error, call, store)
    return raised, error, renewable


def _local_failure(
    ctx: RankContext, error: BaseException, call: _Call, store: FaultStore, record: bytes
) -> tuple[BaseException, bool]:
    """This rank's own code raised ``error``: unless every rank raised too, stop the groups so the peers learn it."""
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    # The same bad argument raises on every rank at about the same time: then nobody is blocked.
    seen = _wait_records(store, call.number, others, _AGREE_S, lambda recs: len(recs) == len(others))
    if len(seen) == len(others) and all(rec["kind"] == "error" for rec in seen.values()):
        return error, False
    store.first_failure(_first_key(), record)
    stopped_world = _stop(call.groups)
    who = call.name(ctx.rank)
    _STATE.stop(f"{who} failed during {call.what}: {type(error).__name__}: {str(error)[:300]}.")
    error.add_note(
        f"hf_pipeline: {who} raised during {call.what} while other ranks were waiting for it; they "
        "were told and raise RankError"
    )
    return error, not stopped_world and store.store is not None


def _lost_contact(ctx: RankContext, error: BaseException, call: _Call, store: FaultStore) -> tuple[RankError, bool]:
    """This rank's communication failed: stop its groups too, and name the peer that caused it.

    The :class:`RankError` returned is raised from ``error``; the flag says whether a peer's own error
    explains it (every rank is alive: the groups may be renewed).
    """
    stopped_world = _stop(call.groups)
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    # Who caused it? A peer that raised has left a record (at the latest right before it stopped
    # its group, which is what woke us); a peer that died or hangs never will.
    records = _wait_records(
        store, call.number, others, _IDENTIFY_S,
        lambda recs: any(rec["kind"] == "error" for rec in recs.values()) or len(recs) >= len(others) - 1,
    )
    culprits = {r: rec for r, rec in records.items() if rec["kind"] == "error"}
    if not culprits:
        earlier = store.get(_first_key())  # a failure in an earlier call that this rank did not wait on
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
    return RankError(message, failures=failures), bool(culprits) and not stopped_world and store.store is not None


def _recover(ctx: RankContext, recover: Callable[[], None] | None, raised: BaseException) -> None:
    """Every rank alive: meet the others in the store, then let ``recover`` make fresh groups (see the module
    docstring). Bounded by the collective timeout; on failure the groups stay stopped (:class:`PipelineBroken`
    later)."""
    epoch = _STATE.epoch
    _STATE.epoch += 1
    if recover is None:
        raised.add_note("hf_pipeline: this rank's process groups are stopped; restart the job")
        return
    try:
        why = _meet(ctx, f"{_PREFIX}/recover{epoch}")
        if why is None:
            recover()
    except Exception as e:  # noqa: BLE001 - any failure here leaves the job as it was before recovery existed
        why = f"{type(e).__name__}: {str(e)[:300]}"
    if why is not None:
        logger.warning("hf_pipeline: could not make the process groups afresh: %s", why)
        raised.add_note(f"hf_pipeline: the process groups could not be made afresh ({why}); restart the job")
        return
    _STATE.broken = _STATE.broken_world = None
    raised.add_note("hf_pipeline: every rank is alive; the process groups were made afresh and the next call can run")


def _meet(ctx: RankContext, key: str) -> str | None:
    """The recovery rendezvous: each rank adds 1 under ``key`` and waits for the world size, at most the
    collective timeout. Returns None once every rank came, else why not."""
    store = default_store()
    timeout_s = ctx.timeout.total_seconds()
    deadline = time.monotonic() + timeout_s
    arrived = store.add(key, 1)
    while arrived < ctx.world_size:
        if time.monotonic() >= deadline:
            return f"{arrived} of {ctx.world_size} ranks came to recover within the collective timeout {timeout_s:g} s"
        time.sleep(_POLL_S)
        arrived = store.add(key, 0)
    return None


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
    return message, {ctx.rank: (type(error).__name__, str(error)[:_MAX_RANK_MESSAGE], call.label(ctx.rank) or None)}
