"""Per-action timings of pipelined calls: a Gantt PNG, a Chrome trace, idle fractions per rank.

``record(model)`` (or ``model.profile()``) wraps, for as long as the ``with`` block lasts, the
methods torch's schedules call on this model's ``PipelineStage`` objects —
``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I for the input-gradient half of a
zero-bubble schedule), ``backward_weight_one_chunk`` (W) — plus the loss computation on the last
stage, the P2P waits (``_wait_batch_p2p``) and each schedule ``step``. Stage calls that do not go
through a torch schedule (world size 1, a decode loop) are recorded from the stage module itself.
Every record is (rank, stage, microbatch, kind, start, end) with ``time.perf_counter``; the clocks
of the ranks are aligned by a barrier when recording starts. On CUDA a recorded action waits for
its stream's queued work before it starts and before it ends (:func:`_settle`), so its duration is
the device's time, not the host's time to queue kernels; recorded calls lose the host's run-ahead
and run a little slower than unrecorded ones.

``Recorder.timeline()`` (collective) gathers every rank's records into a :class:`Timeline`:
``idle_fraction()`` = 1 - busy / step wall time per rank, ``actions(rank)`` = the executed action
order (compare it with :func:`schedule_actions`), ``replayed_seconds()`` = the step replayed with
every action at its recorded time and free messages (what the schedule's order costs, apart from
the waits on messages), ``save_png`` and ``save_chrome_trace`` (load the JSON in
https://ui.perfetto.dev or chrome://tracing).

Example (``torchrun --nproc_per_node 2 script.py``):
    >>> with model.profile() as prof:
    ...     model.train_step(batch)
    >>> timeline = prof.timeline()              # every rank calls it
    >>> timeline.idle_fraction()                 # {0: 0.12, 1: 0.10}
    >>> if model.ctx.is_main_process:
    ...     timeline.save_png("timeline.png"); timeline.save_chrome_trace("trace.json")
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..compat import PROFILED_METHODS, PipelineStageBase, schedule_has_loss, schedule_stages, torch_schedules
from ..core import PipelineCore
from ..errors import UsageError
from .timeline import ActionRecord, Timeline, expected_vs_recorded, schedule_actions, theoretical_bubble

__all__ = [
    "ActionRecord",
    "Recorder",
    "Timeline",
    "expected_vs_recorded",
    "record",
    "schedule_actions",
    "theoretical_bubble",
]


def _settle(device: Any) -> None:
    """On CUDA, wait for the work queued on ``device``'s current stream: a host timestamp taken next
    marks where the device is. (CUDA events would time the device without stopping the host, but a
    Gantt chart of host-side actions needs host times; the profiler is for looking, not for speed.)"""
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _module_device(module: Any) -> Any:
    p = next(module.parameters(), None)
    return p.device if p is not None else None



# ----------------------------------------------------------------------------- recording
class _RecordingSlot:
    """The one recording a process may have active.

    A recording patches torch's stage, schedule and P2P functions process-wide (they are class and
    module attributes), so a second recording at the same time would wrap the first one's wrappers
    and restore them in the wrong order; this slot refuses it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.recorder: Recorder | None = None

    def claim(self, recorder: Recorder) -> None:
        with self._lock:
            if self.recorder is not None:
                raise UsageError(
                    "a profile recording is already active in this process; leave it before starting another"
                )
            self.recorder = recorder

    def release(self, recorder: Recorder) -> None:
        with self._lock:
            if self.recorder is recorder:
                self.recorder = None


ACTIVE_RECORDING = _RecordingSlot()


@dataclass(kw_only=True)
class Recorder:
    """Records per-action timings of one model's pipelined calls while active (see :func:`record`)."""

    model: Any
    records: list[ActionRecord] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    _t0: float = 0.0
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    _pending: dict[int, str] = field(default_factory=dict)  # id(work list) -> "recv_wait" / "send_wait"
    _caches: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, id(cache)) -> microbatch
    _schedule: Any = None
    _depth: int = 0  # > 0 inside a torch stage action: the stage module's own call is not recorded twice
    _in_step: bool = False  # inside a torch schedule step

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Recorder:
        ACTIVE_RECORDING.claim(self)
        try:
            group = self._pp_group()
            if dist.is_available() and dist.is_initialized():
                dist.barrier(group=group)  # align the ranks' clocks: every rank starts its origin here
            self._t0 = time.perf_counter()
            self._patch()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        ACTIVE_RECORDING.release(self)

    # ------------------------------------------------------------------ helpers
    @property
    def rank(self) -> int:
        dims = getattr(self.model, "dims", None)  # a PipelinedModel's ParallelDims; 0 for anything else
        return int(dims.pp_rank) if dims is not None else 0

    def _pp_group(self):
        dims = getattr(self.model, "dims", None)
        return dims.pp_group if dims is not None else None

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _mine(self, submod: Any) -> bool:
        return any(submod is s for s in self.model.stages)

    def _add(self, *, stage, microbatch, kind, start, end) -> None:
        self.records.append(ActionRecord(
            rank=self.rank, stage=stage, microbatch=microbatch, kind=kind, start=start, end=end,
            step=max(len(self.steps) - 1, 0),
        ))

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def _timed(self, call: Callable[[], Any], *, device: Any, **where: Any) -> Any:
        """``call()`` recorded as one action (``where``: stage, microbatch, kind), the device settled at both ends."""
        _settle(device)
        start = self._now()
        try:
            return call()
        finally:
            _settle(device)
            self._add(start=start, end=self._now(), **where)

    # ------------------------------------------------------------------ what is wrapped
    def _patch(self) -> None:
        """Wrap, until ``__exit__``, every function whose calls are recorded (each step names its own)."""
        self._patch_stage_actions()
        self._patch_loss()
        self._patch_schedule_steps()
        self._patch_p2p()
        self._patch_stage_modules()
        self._patch_decode_ring()

    def _patch_stage_actions(self) -> None:
        """F, B / I and W: the stage methods torch's schedules run each action through."""

        def stage_action(kind_of):
            def make(original):
                def wrapper(stage, chunk_id, *args, **kwargs):
                    kind = kind_of(args, kwargs)
                    # Without backward (forward-only steps) torch still calls backward_one_chunk; it returns at once.
                    if not self._mine(stage.submod) or (kind != "F" and not stage.has_backward):
                        return original(stage, chunk_id, *args, **kwargs)
                    self._depth += 1
                    try:
                        return self._timed(
                            lambda: original(stage, chunk_id, *args, **kwargs), device=stage.device,
                            stage=stage.stage_index, microbatch=chunk_id, kind=kind,
                        )
                    finally:
                        self._depth -= 1

                return wrapper

            return make

        def backward_kind(args, kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return "B" if full else "I"

        self._wrap(PipelineStageBase, "forward_one_chunk", stage_action(lambda a, k: "F"))
        self._wrap(PipelineStageBase, "backward_one_chunk", stage_action(backward_kind))
        self._wrap(PipelineStageBase, "backward_weight_one_chunk", stage_action(lambda a, k: "W"))

    def _patch_loss(self) -> None:
        """The loss on the last stage (a schedule built with a loss function)."""

        def make_loss(original):
            def wrapper(schedule, stage, output, target_mbs, mb_index, *args, **kwargs):
                def call():
                    return original(schedule, stage, output, target_mbs, mb_index, *args, **kwargs)

                if not (self._mine(stage.submod) and stage.is_last and schedule_has_loss(schedule)):
                    return call()
                return self._timed(call, device=stage.device, stage=stage.stage_index, microbatch=mb_index, kind="loss")

            return wrapper

        self._wrap(*PROFILED_METHODS[0], make_loss)

    def _patch_schedule_steps(self) -> None:
        """Each schedule ``step`` of this model: the steps' (start, end), and whether a call runs inside one."""

        def make_step(original):
            def wrapper(schedule, *args, **kwargs):
                if not any(s is not None and self._mine(s.submod) for s in schedule_stages(schedule)):
                    return original(schedule, *args, **kwargs)
                self._schedule = schedule
                start = self._now()
                self.steps.append((start, start))
                self._in_step = True
                try:
                    return original(schedule, *args, **kwargs)
                finally:
                    self._in_step = False
                    self.steps[-1] = (start, self._now())

            return wrapper

        self._wrap(torch_schedules.PipelineScheduleSingle, "step", make_step)
        self._wrap(torch_schedules.PipelineScheduleMulti, "step", make_step)

    def _patch_p2p(self) -> None:
        """P2P: remember whether each batch of work holds sends or receives, time the waits on it."""

        def make_batch(original):
            def wrapper(p2p_ops, *args, **kwargs):
                works = original(p2p_ops, *args, **kwargs)
                if p2p_ops and isinstance(works, list):
                    recv = any(op.op is dist.irecv for op in p2p_ops)
                    self._pending[id(works)] = "recv_wait" if recv else "send_wait"
                return works

            return wrapper

        def make_wait(original):
            def wrapper(work, *args, **kwargs):
                kind = self._pending.pop(id(work), None)
                if not work or kind is None:
                    return original(work, *args, **kwargs)
                start = self._now()
                try:
                    return original(work, *args, **kwargs)
                finally:
                    self._add(stage=None, microbatch=None, kind=kind, start=start, end=self._now())

            return wrapper

        self._wrap(*PROFILED_METHODS[1], make_batch)
        self._wrap(*PROFILED_METHODS[2], make_wait)

    def _cache_microbatch(self, module: Any, cache: Any) -> int | None:
        """One cache per (stage, microbatch): the caches numbered in order of first use."""
        if cache is None:
            return None
        key = (module.spec.index, id(cache))
        return self._caches.setdefault(key, sum(1 for s, _ in self._caches if s == module.spec.index))

    def _patch_stage_modules(self) -> None:
        """Stage calls outside torch's schedules (world size 1, decode loops): time the stage module."""
        from ..loading.stages import StageModule

        def make_module_forward(original):
            def wrapper(module, *received, **inputs):
                if self._depth or not self._mine(module):
                    return original(module, *received, **inputs)
                microbatch = self._cache_microbatch(module, inputs.get("cache"))
                kind = "setup" if self._in_step else "F"  # inside a step but outside its actions: torch's own setup
                return self._timed(
                    lambda: original(module, *received, **inputs), device=_module_device(module),
                    stage=module.spec.index, microbatch=microbatch, kind=kind,
                )

            return wrapper

        self._wrap(StageModule, "forward", make_module_forward)

    def _patch_decode_ring(self) -> None:
        """The decode ring waits for its P2P messages in ``Mailbox.take`` (generation/mailbox.py)."""
        from ..generation.mailbox import Mailbox

        def make_take(original):
            def wrapper(box, key, *args, **kwargs):
                if box.dims is not getattr(self.model, "dims", None):
                    return original(box, key, *args, **kwargs)
                start = self._now()
                try:
                    return original(box, key, *args, **kwargs)
                finally:
                    end = self._now()
                    if end - start > 1e-6:
                        self._add(stage=None, microbatch=None, kind="recv_wait", start=start, end=end)

            return wrapper

        self._wrap(Mailbox, "take", make_take)

    # ------------------------------------------------------------------ results
    def local_timeline(self, title: str = "") -> Timeline:
        """This rank's records only (no communication)."""
        return self._timeline(list(self.records), {self.rank: list(self.steps)}, title)

    def timeline(self, title: str = "") -> Timeline:
        """Every rank's records (collective over the pipeline group: call it on every rank)."""
        records, steps = list(self.records), {self.rank: list(self.steps)}
        if dist.is_available() and dist.is_initialized():
            group = self._pp_group()
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (self.rank, records, steps[self.rank]), group=group)
            records = [r for _, recs, _ in gathered for r in recs]
            steps = {rank: st for rank, _, st in gathered}
        return self._timeline(records, steps, title)

    def _timeline(self, records, steps, title) -> Timeline:
        model = self.model
        spec = getattr(model, "schedule", None)
        training = any(r.kind in ("B", "I", "W") for r in records)
        name = spec.name if spec is not None else None
        if spec is not None and not training:
            # forward-only calls match that schedule's forward (ScheduleSpec.forward_only)
            name = spec.forward_as or spec.name
        if not any(steps.values()):
            name = None  # no torch schedule ran (a decode loop): its own theory applies, not the schedule's
        plan = getattr(model, "plan", None)
        return Timeline(
            records=sorted(records, key=lambda r: (r.rank, r.start)),
            steps=steps,
            pp_size=plan.pp_size if plan is not None else 1,
            schedule=name,
            virtual_stages=plan.virtual_stages if plan is not None else 1,
            n_microbatches=_microbatches_run(records, model),
            title=title,
        )


def _microbatches_run(records: list, model: PipelineCore) -> int | None:
    """The microbatches the recorded steps ran: a default-chosen count adapts to each call's rows
    (``model.microbatches_for``), so the model's own ``n_microbatches`` may not be what ran."""
    ran = [r.microbatch for r in records if r.kind == "F" and r.microbatch is not None]
    return max(ran) + 1 if ran else getattr(model, "n_microbatches", None)


def record(model: PipelineCore) -> Recorder:
    """Context manager recording per-action timings of ``model``'s pipelined calls on this rank.

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel`.

    Returns:
        A :class:`Recorder`; after the block, ``recorder.timeline()`` (collective) gives the
        :class:`Timeline` of every rank.

    Example:
        >>> with record(model) as prof:
        ...     model(**inputs)
        >>> prof.timeline().actions(0)
        ['0F0', '0F1', '0F2', '0F3']
    """
    return Recorder(model=model)
