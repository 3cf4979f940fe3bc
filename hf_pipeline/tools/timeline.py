"""What a recording of pipelined calls shows: per-action records, every rank's :class:`Timeline`.

A :class:`Timeline` (from ``Recorder.timeline()``, :mod:`hf_pipeline.tools.profile`) holds every
rank's :class:`ActionRecord` list: ``idle_fraction()`` = 1 - busy / step wall time per rank,
``actions(rank)`` = the executed action order (compare it with :func:`schedule_actions`),
``replayed_seconds()`` = the step replayed with every action at its recorded time and free
messages (what the schedule's order costs, apart from the waits on messages), ``save_png`` and
``save_chrome_trace`` (load the JSON in https://ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InputError
from ..planning.actions import ACTION_KINDS, schedule_actions
from ..planning.schedules import ScheduleSpec, get_schedule
from ..planning.simulate import action_input

__all__ = [
    "COMPUTE_KINDS",
    "ActionRecord",
    "Timeline",
    "expected_vs_recorded",
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



# ----------------------------------------------------------------------------- schedule theory
def theoretical_bubble(
    schedule: str | type | ScheduleSpec, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1
) -> float:
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
        return [r.label for r in sorted(self._of(rank, step), key=lambda r: r.start) if r.kind in ACTION_KINDS]

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
            "busy_seconds": busy,
            "wall_seconds": wall,
            "replayed_seconds": replayed,
            "imbalance": max(busy) * len(busy) / sum(busy),
            "bubble": wall / max(busy),
            "schedule": replayed / max(busy),
            "waits": wall / replayed,
        }
        if latency is not None:
            with_latency = self.replayed_seconds(step, latency=latency)
            out.update(
                latency=latency,
                replayed_with_latency_seconds=with_latency,
                messages=with_latency / replayed,
                runtime=wall / with_latency,
            )
        return out

    def _replay(self, step: int, latency: float = 0.0) -> float:
        queues = {
            rank: sorted((r for r in self._of(rank, step) if r.kind in COMPUTE_KINDS), key=lambda r: r.start)
            for rank in self.ranks
        }
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
            raise InputError(
                f"step {step} repeats an action (stage, kind, microbatch): only a schedule's training or "
                "forward step can be replayed"
            )

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
                raise InputError(f"the recorded order of step {step} cannot be replayed: every rank waits ({stuck})")
        return max(free.values())

    def theoretical_idle_fraction(self) -> float | None:
        if self.schedule is None or self.n_microbatches is None:
            return None
        return theoretical_bubble(
            self.schedule, pp_size=self.pp_size, n_microbatches=self.n_microbatches, virtual_stages=self.virtual_stages
        )

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "pp_size": self.pp_size,
            "virtual_stages": self.virtual_stages,
            "n_microbatches": self.n_microbatches,
            "title": self.title,
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
                events.append(
                    {"name": "thread_name", "ph": "M", "pid": rank, "tid": stage, "args": {"name": f"stage {stage}"}}
                )
            events.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": wait_tid, "args": {"name": "p2p waits"}}
            )
            for i, (s, e) in enumerate(self.steps.get(rank, [])):
                events.append(
                    {
                        "name": f"step {i}",
                        "ph": "X",
                        "ts": s * 1e6,
                        "dur": (e - s) * 1e6,
                        "pid": rank,
                        "tid": -2,
                        "cat": "step",
                    }
                )
        for r in self.records:
            events.append(
                {
                    "name": r.label,
                    "cat": r.kind,
                    "ph": "X",
                    "ts": r.start * 1e6,
                    "dur": r.duration * 1e6,
                    "pid": r.rank,
                    "tid": wait_tid if r.stage is None else r.stage,
                    "args": {"microbatch": r.microbatch, "stage": r.stage, "kind": r.kind, "step": r.step},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"schedule": self.schedule, "title": self.title},
        }

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
        multi_stage = {
            rank: len({r.stage for r in records if r.rank == rank and r.stage is not None}) > 1 for rank in ranks
        }
        for row, rank in enumerate(ranks):
            y = len(ranks) - 1 - row
            for s, e in windows[rank]:
                ax.barh(
                    y, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.8, color="white", edgecolor="0.6", linewidth=0.6
                )
            for r in records:
                if r.rank != rank:
                    continue
                left, width = (r.start - t0) * 1e3, r.duration * 1e3
                if r.kind in ("recv_wait", "send_wait"):
                    ax.barh(y, width, left=left, height=0.25, color="0.75")
                    continue
                color = cmap((r.microbatch or 0) % cmap.N)
                hatch = {"B": "//", "I": "\\\\", "W": "xx", "loss": ".."}.get(r.kind)
                ax.barh(
                    y,
                    width,
                    left=left,
                    height=0.8 if r.kind != "loss" else 0.4,
                    color=color,
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.3,
                )
                if width > 0:
                    text = r.label if multi_stage[rank] else f"{r.kind}{'' if r.microbatch is None else r.microbatch}"
                    ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=6, clip_on=True)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}\nidle {idle.get(r, 0.0):.0%}" for r in reversed(ranks)])
        ax.set_xlabel("time (ms)")
        theory = self.theoretical_idle_fraction()
        head = self.title or (self.schedule or "pipeline")
        ax.set_title(head + (f" — theoretical bubble {theory:.0%}" if theory is not None else ""))
        legend = [
            Patch(facecolor="white", edgecolor="black", label="F (forward)"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="B (backward)"),
        ]
        if any(r.kind == "I" for r in records):
            legend += [
                Patch(facecolor="white", edgecolor="black", hatch="\\\\", label="I (input grad)"),
                Patch(facecolor="white", edgecolor="black", hatch="xx", label="W (weight grad)"),
            ]
        legend += [
            Patch(facecolor="0.75", label="P2P wait"),
            Patch(facecolor="white", edgecolor="0.6", label="idle (step window)"),
        ]
        ax.legend(
            handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(legend), fontsize=7, frameon=False
        )
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        return path


def expected_vs_recorded(
    timeline: Timeline, *, training: bool = True, step: int = 0
) -> dict[int, tuple[list[str], list[str]]]:
    """rank -> (the schedule's action list, the recorded order) for one step; equal when the run followed
    the schedule."""
    expected = schedule_actions(
        timeline.schedule,
        pp_size=timeline.pp_size,
        n_microbatches=timeline.n_microbatches,
        virtual_stages=timeline.virtual_stages,
        training=training,
    )
    return {rank: (expected[rank], timeline.actions(rank, step)) for rank in range(timeline.pp_size)}
