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

import contextlib
import json
import os
import pathlib
import re
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..compat import PROFILED_METHODS, PipelineStageBase, torch_schedules
from ..planning.actions import ACTION_KINDS, schedule_actions
from ..planning.schedules import ScheduleSpec, get_schedule
from ..planning.simulate import action_input

__all__ = [
    "ActionRecord",
    "host_peak_rss",
    "host_rss",
    "reset_host_peak",
    "trim_host_heap",
    "Recorder",
    "Timeline",
    "expected_vs_recorded",
    "record",
    "schedule_actions",
    "theoretical_bubble",
]

# Kinds that keep a rank busy ("setup": stage calls torch makes outside the schedule's actions, e.g.
# shape inference on a first step); "recv_wait" / "send_wait" (P2P waits) and gaps are idle time.
COMPUTE_KINDS = ("F", "B", "I", "W", "loss", "setup")


@dataclass(frozen=True, kw_only=True)
class ActionRecord:
    """One timed action on one rank. Times are seconds since the recording started (clocks aligned)."""

    rank: int  # pipeline rank
    stage: int | None  # stage index; None for a P2P wait
    microbatch: int | None
    kind: str  # F, B, I, W, loss, setup, recv_wait, send_wait
    start: float
    end: float
    step: int  # index of the schedule step (within this recording) the action ran in

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """torch's action notation: ``1F3`` = stage 1, forward, microbatch 3."""
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{'' if self.stage is None else self.stage}{self.kind}{mb}"


def _settle(device: Any) -> None:
    """On CUDA, wait for the work queued on ``device``'s current stream: a host timestamp taken next
    marks where the device is. (CUDA events would time the device without stopping the host, but a
    Gantt chart of host-side actions needs host times; the profiler is for looking, not for speed.)"""
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _module_device(module: Any) -> Any:
    p = next(module.parameters(), None)
    return p.device if p is not None else None


# ----------------------------------------------------------------------------- schedule theory
def theoretical_bubble(schedule: str | type | ScheduleSpec, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a training step the schedule's analysis predicts (equal stage costs).

    The spec's ``bubble`` formula (:data:`~hf_pipeline.planning.schedules.BUBBLE_FORMULAS`): GPipe and 1F1B
    (p-1)/(m+p-1); interleaved / looped with v stages per rank (p-1)/(v*m+p-1); interleaved
    zero-bubble (ZB-H1 family) a third of 1F1B's; ZBV and DualPipeV 0.
    """
    spec = get_schedule(schedule)
    return spec.theoretical_bubble(pp_size=pp_size, n_microbatches=n_microbatches, virtual_stages=virtual_stages)


# ----------------------------------------------------------------------------- the timeline
@dataclass(kw_only=True)
class Timeline:
    """Every rank's records of one recording (same object on every rank after ``Recorder.timeline()``)."""

    records: list[ActionRecord]
    steps: dict[int, list[tuple[float, float]]]  # rank -> (start, end) of each schedule step
    pp_size: int
    schedule: str | None = None
    virtual_stages: int = 1
    n_microbatches: int | None = None
    title: str = ""

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.steps) | {r.rank for r in self.records})

    def actions(self, rank: int, step: int | None = None) -> list[str]:
        """The schedule actions (F/B/I/W) rank ``rank`` ran, in execution order, as ``"1B3"`` labels."""
        return [
            r.label for r in sorted(self._of(rank, step), key=lambda r: r.start) if r.kind in ACTION_KINDS
        ]

    def _of(self, rank: int, step: int | None) -> list[ActionRecord]:
        return [r for r in self.records if r.rank == rank and (step is None or r.step == step)]

    def _window(self, rank: int, step: int | None) -> list[tuple[float, float]]:
        steps = self.steps.get(rank, [])
        if steps:
            return steps if step is None else [steps[step]]
        mine = self._of(rank, step)  # no torch schedule step (e.g. a decode loop): the span of the actions
        return [(min(r.start for r in mine), max(r.end for r in mine))] if mine else []

    def busy_seconds(self, rank: int, step: int | None = None) -> float:
        """Time rank ``rank`` spent computing (F/B/I/W and the loss), overlaps counted once."""
        spans = sorted((r.start, r.end) for r in self._of(rank, step) if r.kind in COMPUTE_KINDS)
        total, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start
        return total

    def wall_seconds(self, rank: int, step: int | None = None) -> float:
        return sum(e - s for s, e in self._window(rank, step))

    def idle_fraction(self, step: int | None = None) -> dict[int, float]:
        """1 - busy / wall time of the schedule step(s), per rank (all recorded steps together by default)."""
        out = {}
        for rank in self.ranks:
            wall = self.wall_seconds(rank, step)
            out[rank] = 1.0 - self.busy_seconds(rank, step) / wall if wall > 0 else 0.0
        return out

    def replayed_seconds(self, step: int | None = None, *, latency: float = 0.0) -> float:
        """The step's wall time if every compute action took its recorded time and messages were free.

        Each rank runs its recorded actions (F/B/I/W, the loss, setup calls) in the recorded order
        from the step's start, an action starting when its rank is free and its input exists: a
        forward after the previous stage's forward of its microbatch, the loss after the last
        stage's forward, a backward after the next stage's backward (the last stage's after its
        loss), a weight-gradient pass after its input-gradient pass. The result is the step as the
        schedule's order allows with these action times; the profiled step over it is the time the
        ranks waited beyond that (P2P latency, the runtime's work between actions). ``latency``:
        seconds a message takes, added where an action waits for one of another rank (a measured
        hop: what is left beyond that replay is the runtime's own time between actions). With
        ``step=None`` the replays of every recorded step are added.
        """
        steps = sorted({r.step for r in self.records}) if step is None else [step]
        return sum(self._replay(s, latency) for s in steps)

    def breakdown(self, step: int | None = None, *, latency: float | None = None) -> dict[str, Any]:
        """Where the step's wall time goes beyond the busiest rank's compute, as factors.

        ``imbalance`` = the busiest rank's compute over the ranks' mean; ``bubble`` = the step's wall
        time (the slowest rank's) over the busiest rank's compute, itself ``schedule`` (the replay with
        free messages over that compute: the idle the schedule's order leaves with these action times)
        x ``waits`` (the wall time over the replay). With ``latency`` (a measured message hop) also
        ``waits`` = ``messages`` (the replay with that hop on every dependency between ranks, over the
        replay without) x ``runtime`` (the wall time over it: the time between actions that is not
        the messages' flight). The seconds each factor comes from are in the dict too.
        """
        busy = [self.busy_seconds(r, step) for r in self.ranks]
        wall = max(self.wall_seconds(r, step) for r in self.ranks)
        replayed = self.replayed_seconds(step)
        out: dict[str, Any] = {
            "busy_seconds": busy, "wall_seconds": wall, "replayed_seconds": replayed,
            "imbalance": max(busy) * len(busy) / sum(busy), "bubble": wall / max(busy),
            "schedule": replayed / max(busy), "waits": wall / replayed,
        }
        if latency is not None:
            with_latency = self.replayed_seconds(step, latency=latency)
            out.update(latency=latency, replayed_with_latency_seconds=with_latency, messages=with_latency / replayed, runtime=wall / with_latency)
        return out

    def _replay(self, step: int, latency: float = 0.0) -> float:
        queues = {rank: sorted((r for r in self._of(rank, step) if r.kind in COMPUTE_KINDS), key=lambda r: r.start) for rank in self.ranks}
        queues = {rank: q for rank, q in queues.items() if q}
        if not queues:
            return 0.0
        staged = [r.stage for q in queues.values() for r in q if r.stage is not None]
        last = max(staged) if staged else None
        keys = [(r.stage, r.kind, r.microbatch) for q in queues.values() for r in q if r.kind != "setup"]
        recorded = set(keys)
        if len(recorded) < len(keys):
            # A decode loop runs each stage's forward once per token under the same microbatch index:
            # its records are not one schedule step's action graph.
            raise ValueError(f"step {step} repeats an action (stage, kind, microbatch): only a schedule's training or forward step can be replayed")

        def needs(r: ActionRecord) -> tuple[int | None, str, int | None] | None:
            s, i = r.stage, r.microbatch
            if s is None or i is None or r.kind == "setup":
                want = None
            elif r.kind == "loss":
                want = (s, "F", i)
            elif r.kind in ("B", "I") and s == last:  # the last stage's backward starts from its loss
                want = (s, "loss", i) if (s, "loss", i) in recorded else (s, "F", i)
            else:
                want = action_input(s, r.kind, i, last_stage=last, exists=recorded.__contains__)
            return want if want in recorded else None  # what was not recorded (another group's) is taken as ready

        done: dict[tuple[int | None, str, int | None], float] = {}
        where: dict[tuple[int | None, str, int | None], int] = {}  # the rank that ran each action
        free = dict.fromkeys(queues, 0.0)
        pos = dict.fromkeys(queues, 0)
        remaining = sum(len(q) for q in queues.values())
        while remaining:
            progressed = False
            for rank, q in queues.items():
                while pos[rank] < len(q):
                    r = q[pos[rank]]
                    want = needs(r)
                    if want is not None and want not in done:
                        break
                    ready = free[rank]
                    if want is not None:
                        ready = max(ready, done[want] + (latency if where[want] != rank else 0.0))
                    key = (r.stage, r.kind, r.microbatch)
                    free[rank] = done[key] = ready + r.duration
                    where[key] = rank
                    pos[rank] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {rank: q[pos[rank]].label for rank, q in queues.items() if pos[rank] < len(q)}
                raise ValueError(f"the recorded order of step {step} cannot be replayed: every rank waits ({stuck})")
        return max(free.values())

    def theoretical_idle_fraction(self) -> float | None:
        if self.schedule is None or self.n_microbatches is None:
            return None
        return theoretical_bubble(self.schedule, pp_size=self.pp_size, n_microbatches=self.n_microbatches, virtual_stages=self.virtual_stages)

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "pp_size": self.pp_size, "virtual_stages": self.virtual_stages,
            "n_microbatches": self.n_microbatches, "title": self.title,
            "idle_fraction": {str(k): v for k, v in self.idle_fraction().items()},
            "theoretical_idle_fraction": self.theoretical_idle_fraction(),
            "steps": {str(k): v for k, v in self.steps.items()},
            "records": [asdict(r) for r in self.records],
        }

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace events: one process per rank, one thread per stage (P2P waits on their own row)."""
        events: list[dict[str, Any]] = []
        wait_tid = -1
        for rank in self.ranks:
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
            for stage in sorted({r.stage for r in self.records if r.rank == rank and r.stage is not None}):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": wait_tid, "args": {"name": "p2p waits"}})
            for i, (s, e) in enumerate(self.steps.get(rank, [])):
                events.append({"name": f"step {i}", "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6, "pid": rank, "tid": -2, "cat": "step"})
        for r in self.records:
            events.append({
                "name": r.label, "cat": r.kind, "ph": "X", "ts": r.start * 1e6, "dur": r.duration * 1e6,
                "pid": r.rank, "tid": wait_tid if r.stage is None else r.stage,
                "args": {"microbatch": r.microbatch, "stage": r.stage, "kind": r.kind, "step": r.step},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": self.schedule, "title": self.title}}

    def save_chrome_trace(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def save_png(self, path: str | os.PathLike, *, step: int | None = None, dpi: int = 120) -> pathlib.Path:
        """A Gantt chart: one row per rank, actions coloured by microbatch, P2P waits grey, idle white."""
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        ranks = self.ranks
        records = [r for r in self.records if step is None or r.step == step]
        windows = {rank: self._window(rank, step) for rank in ranks}
        t0 = min([s for w in windows.values() for s, _ in w] + [r.start for r in records] or [0.0])
        n_mb = max([r.microbatch for r in records if r.microbatch is not None] + [0]) + 1
        cmap = plt.get_cmap("tab20" if n_mb > 10 else "tab10")
        fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.6))
        idle = self.idle_fraction(step)
        multi_stage = {rank: len({r.stage for r in records if r.rank == rank and r.stage is not None}) > 1 for rank in ranks}
        for row, rank in enumerate(ranks):
            y = len(ranks) - 1 - row
            for s, e in windows[rank]:
                ax.barh(y, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.8, color="white", edgecolor="0.6", linewidth=0.6)
            for r in records:
                if r.rank != rank:
                    continue
                left, width = (r.start - t0) * 1e3, r.duration * 1e3
                if r.kind in ("recv_wait", "send_wait"):
                    ax.barh(y, width, left=left, height=0.25, color="0.75")
                    continue
                color = cmap((r.microbatch or 0) % cmap.N)
                hatch = {"B": "//", "I": "\\\\", "W": "xx", "loss": ".."}.get(r.kind)
                ax.barh(y, width, left=left, height=0.8 if r.kind != "loss" else 0.4, color=color, hatch=hatch, edgecolor="black", linewidth=0.3)
                if width > 0:
                    text = r.label if multi_stage[rank] else f"{r.kind}{'' if r.microbatch is None else r.microbatch}"
                    ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=6, clip_on=True)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}\nidle {idle.get(r, 0.0):.0%}" for r in reversed(ranks)])
        ax.set_xlabel("time (ms)")
        theory = self.theoretical_idle_fraction()
        head = self.title or (self.schedule or "pipeline")
        ax.set_title(head + (f" — theoretical bubble {theory:.0%}" if theory is not None else ""))
        legend = [Patch(facecolor="white", edgecolor="black", label="F (forward)"), Patch(facecolor="white", edgecolor="black", hatch="//", label="B (backward)")]
        if any(r.kind == "I" for r in records):
            legend += [Patch(facecolor="white", edgecolor="black", hatch="\\\\", label="I (input grad)"), Patch(facecolor="white", edgecolor="black", hatch="xx", label="W (weight grad)")]
        legend += [Patch(facecolor="0.75", label="P2P wait"), Patch(facecolor="white", edgecolor="0.6", label="idle (step window)")]
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(legend), fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        return path


# ----------------------------------------------------------------------------- recording
_ACTIVE = threading.local()
_LOCK = threading.Lock()
_current: Recorder | None = None


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
        global _current
        with _LOCK:
            if _current is not None:
                raise RuntimeError("a profile recording is already active in this process; leave it before starting another")
            _current = self
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
        global _current
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        with _LOCK:
            _current = None

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
        self.records.append(
            ActionRecord(rank=self.rank, stage=stage, microbatch=microbatch, kind=kind, start=start, end=end, step=max(len(self.steps) - 1, 0))
        )

    def _wrap(self, owner: Any, name: str, make) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def _patch(self) -> None:
        rec = self
        base = PipelineStageBase

        def stage_action(kind_of):
            def make(original):
                def wrapper(stage, chunk_id, *args, **kwargs):
                    kind = kind_of(args, kwargs)
                    # Without backward (forward-only steps) torch still calls backward_one_chunk; it returns at once.
                    if not rec._mine(stage.submod) or (kind != "F" and not stage.has_backward):
                        return original(stage, chunk_id, *args, **kwargs)
                    _settle(stage.device)
                    start = rec._now()
                    rec._depth += 1
                    try:
                        return original(stage, chunk_id, *args, **kwargs)
                    finally:
                        rec._depth -= 1
                        _settle(stage.device)
                        rec._add(stage=stage.stage_index, microbatch=chunk_id, kind=kind, start=start, end=rec._now())

                return wrapper

            return make

        def backward_kind(args, kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return "B" if full else "I"

        self._wrap(base, "forward_one_chunk", stage_action(lambda a, k: "F"))
        self._wrap(base, "backward_one_chunk", stage_action(backward_kind))
        self._wrap(base, "backward_weight_one_chunk", stage_action(lambda a, k: "W"))

        def make_loss(original):
            def wrapper(schedule, stage, output, target_mbs, mb_index, *args, **kwargs):
                if not (rec._mine(stage.submod) and stage.is_last and schedule._loss_fn is not None):
                    return original(schedule, stage, output, target_mbs, mb_index, *args, **kwargs)
                _settle(stage.device)
                start = rec._now()
                try:
                    return original(schedule, stage, output, target_mbs, mb_index, *args, **kwargs)
                finally:
                    _settle(stage.device)
                    rec._add(stage=stage.stage_index, microbatch=mb_index, kind="loss", start=start, end=rec._now())

            return wrapper

        self._wrap(*PROFILED_METHODS[0], make_loss)

        def make_step(original):
            def wrapper(schedule, *args, **kwargs):
                stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
                if not any(s is not None and rec._mine(s.submod) for s in stages):
                    return original(schedule, *args, **kwargs)
                rec._schedule = schedule
                start = rec._now()
                rec.steps.append((start, start))
                rec._in_step = True
                try:
                    return original(schedule, *args, **kwargs)
                finally:
                    rec._in_step = False
                    rec.steps[-1] = (start, rec._now())

            return wrapper

        self._wrap(torch_schedules.PipelineScheduleSingle, "step", make_step)
        self._wrap(torch_schedules.PipelineScheduleMulti, "step", make_step)

        # P2P: remember whether each batch of work holds sends or receives, time the waits on it.
        def make_batch(original):
            def wrapper(p2p_ops, *args, **kwargs):
                works = original(p2p_ops, *args, **kwargs)
                if p2p_ops and isinstance(works, list):
                    recv = any(op.op is dist.irecv for op in p2p_ops)
                    rec._pending[id(works)] = "recv_wait" if recv else "send_wait"
                return works

            return wrapper

        def make_wait(original):
            def wrapper(work, *args, **kwargs):
                kind = rec._pending.pop(id(work), None)
                if not work or kind is None:
                    return original(work, *args, **kwargs)
                start = rec._now()
                try:
                    return original(work, *args, **kwargs)
                finally:
                    rec._add(stage=None, microbatch=None, kind=kind, start=start, end=rec._now())

            return wrapper

        self._wrap(*PROFILED_METHODS[1], make_batch)
        self._wrap(*PROFILED_METHODS[2], make_wait)

        # Stage calls outside torch's schedules (world size 1, decode loops): time the stage module.
        from ..loading.stages import StageModule

        def make_module_forward(original):
            def wrapper(module, *received, **inputs):
                if rec._depth or not rec._mine(module):
                    return original(module, *received, **inputs)
                cache = inputs.get("cache")
                key = (module.spec.index, id(cache))
                mb = None
                if cache is not None:
                    # One cache per (stage, microbatch): number the caches in order of first use.
                    mb = rec._caches.setdefault(key, sum(1 for s, _ in rec._caches if s == module.spec.index))
                device = _module_device(module)
                _settle(device)
                start = rec._now()
                kind = "setup" if rec._in_step else "F"  # inside a step but outside its actions: torch's own setup
                try:
                    return original(module, *received, **inputs)
                finally:
                    _settle(device)
                    rec._add(stage=module.spec.index, microbatch=mb, kind=kind, start=start, end=rec._now())

            return wrapper

        self._wrap(StageModule, "forward", make_module_forward)

        # The decode ring waits for its P2P messages in Mailbox.take (mailbox.py).
        from ..generation.mailbox import Mailbox

        def make_take(original):
            def wrapper(box, key, *args, **kwargs):
                if box.dims is not getattr(rec.model, "dims", None):
                    return original(box, key, *args, **kwargs)
                start = rec._now()
                try:
                    return original(box, key, *args, **kwargs)
                finally:
                    end = rec._now()
                    if end - start > 1e-6:
                        rec._add(stage=None, microbatch=None, kind="recv_wait", start=start, end=end)

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
            name = spec.forward_as or spec.name  # forward-only calls match that schedule's forward (ScheduleSpec.forward_only)
        if not any(steps.values()):
            name = None  # no torch schedule ran (a decode loop): its own theory applies, not the schedule's
        plan = getattr(model, "plan", None)
        return Timeline(
            records=sorted(records, key=lambda r: (r.rank, r.start)), steps=steps,
            pp_size=plan.pp_size if plan is not None else 1, schedule=name,
            virtual_stages=plan.virtual_stages if plan is not None else 1,
            n_microbatches=getattr(model, "n_microbatches", None), title=title,
        )


def record(model: Any) -> Recorder:
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


def expected_vs_recorded(timeline: Timeline, *, training: bool = True, step: int = 0) -> dict[int, tuple[list[str], list[str]]]:
    """rank -> (the schedule's action list, the recorded order) for one step; equal when the run followed the schedule."""
    expected = schedule_actions(
        timeline.schedule, pp_size=timeline.pp_size, n_microbatches=timeline.n_microbatches,
        virtual_stages=timeline.virtual_stages, training=training,
    )
    return {rank: (expected[rank], timeline.actions(rank, step)) for rank in range(timeline.pp_size)}


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
