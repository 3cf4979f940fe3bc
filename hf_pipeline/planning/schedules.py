"""Schedules as data: names and classes -> ``torch.distributed.pipelining`` schedules, and their rules.

We do not write a training scheduler: every schedule is torch's own. A :class:`ScheduleSpec`
holds what the rest of the package needs to know about one: its torch class, the stage layout it
expects (looped: rank r owns stages r, r+p, ...; V: rank r owns r and 2p-1-r), the virtual stages
per rank it takes, its microbatch rules, its warm-up and its bubble formula. Validation, profiling
and the memory planner read these fields; generic code does not branch on a schedule's name.

The rules are checked at two times:

* :func:`check_layout`, at load: what the stage placement needs (virtual stages per rank; a V
  schedule places exactly 2 per rank). Forward and generate need nothing more: they never run
  the training schedule (a forward-only call runs :meth:`ScheduleSpec.forward_only`, generation
  its own decode ring), so they work with any ``n_microbatches >= 1``, fewer than the stages too.
* :func:`check_training`, at the start of a training step: the training schedule's microbatch
  rules (1F1B: at least one microbatch per stage; interleaved: a multiple of its rounds).

Both read only options every rank has alike, so a bad combination fails on every rank before any
communication, with a message that says what to change. :func:`check_training` runs both.

:func:`get_schedule` accepts this package's names (``"interleaved-1f1b"``; case, ``_`` / ``-``
and a few aliases do not matter), torch's names (what ``torch.distributed.pipelining.schedules.
get_schedule_class`` accepts: ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"ZBVZeroBubble"``, ...),
torch's class names (``"ScheduleGPipe"``), the classes themselves (``pp.ScheduleInterleaved1F1B``,
or a subclass of one) and a :class:`ScheduleSpec`.

Example:
    >>> spec = get_schedule("Interleaved1F1B")
    >>> spec.name, spec.cls is pp.ScheduleInterleaved1F1B, spec.layout
    ('interleaved-1f1b', True, 'loop')
    >>> check_training(get_schedule("1f1b"), pp_size=3, virtual_stages=1, n_microbatches=2)
    Traceback (most recent call last):
    ScheduleError: schedule '1f1b' needs n_microbatches >= the number of stages (3) to train, got 2; ...
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import nn
from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import get_schedule_class

from ..compat import Action, ComputationType, PipelineScheduleRuntime
from ..errors import ScheduleError

__all__ = [
    "ACTION_KINDS",
    "ACTION_WEIGHTS",
    "BUBBLE_FORMULAS",
    "SCHEDULES",
    "ScheduleError",
    "ScheduleForwardInOrder",
    "ScheduleSpec",
    "action_input",
    "check_layout",
    "check_training",
    "default_schedule",
    "fuse_backward",
    "fuse_schedule_backward",
    "get_schedule",
    "rank_of_stage",
    "schedule_actions",
    "simulate_step",
]

# Idle fraction of a training step at equal stage costs, by name: p ranks, m microbatches, v stages
# per rank. (formula as documented, function)
BUBBLE_FORMULAS: dict[str, tuple[str, Callable[[int, int, int], float]]] = {
    "fill-drain": ("(p-1)/(m+p-1)", lambda p, m, v: (p - 1) / (m + p - 1)),  # GPipe, 1F1B
    "interleaved": ("(p-1)/(v*m+p-1)", lambda p, m, v: (p - 1) / (v * m + p - 1)),  # looped, v chunks
    "zb-h1": ("(p-1)/(m+p-1)/3", lambda p, m, v: (p - 1) / (m + p - 1) / 3),  # about a third of 1F1B's
    "zero": ("0", lambda p, m, v: 0.0),  # ZBV, DualPipeV
}
_LAYOUTS = ("loop", "v")
_WARMUPS = ("all", "remaining-stages")


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """One torch schedule and its rules.

    Attributes:
        name: this package's name (what checkpoints and reports record).
        cls: the torch schedule class.
        multi: takes a list of stages per rank (``PipelineScheduleMulti``).
        layout: where virtual stages go: "loop" (rank r owns r, r+p, ...) or "v" (r and 2p-1-r).
        min_virtual, max_virtual: stages per rank it takes (``max_virtual=None``: no upper bound).
        zero_bubble: splits backward into input (I) and weight (W) gradients.
        microbatches_per_stage: training needs ``n_microbatches >= microbatches_per_stage x stages``.
        rounds: training on more than one rank needs ``n_microbatches`` to be a multiple of torch's
            number of rounds, ``max(1, n_microbatches // pp_size)``.
        bubble: a key of :data:`BUBBLE_FORMULAS`.
        warmup: single-stage schedules: forwards run before the first backward; "all" (GPipe) or
            "remaining-stages" (1F1B: ``min(m, stages - stage index)``, then one backward, one forward).
        forward_as: the schedule whose forward actions and bubble a forward-only call matches (for
            single-stage schedules GPipe's, for looped ones looped BFS's); None: this one's.
    """

    name: str
    cls: type
    multi: bool
    layout: str
    min_virtual: int
    max_virtual: int | None
    zero_bubble: bool = False
    microbatches_per_stage: int = 0
    rounds: bool = False
    bubble: str = "fill-drain"
    warmup: str = "all"
    forward_as: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in _LAYOUTS:
            raise ValueError(f"schedule {self.name!r}: layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.bubble not in BUBBLE_FORMULAS:
            raise ValueError(f"schedule {self.name!r}: bubble must be one of {sorted(BUBBLE_FORMULAS)}, got {self.bubble!r}")
        if self.warmup not in _WARMUPS:
            raise ValueError(f"schedule {self.name!r}: warmup must be one of {_WARMUPS}, got {self.warmup!r}")
        if self.min_virtual < 1 or (self.max_virtual is not None and self.max_virtual < self.min_virtual):
            raise ValueError(f"schedule {self.name!r}: virtual stages {self.min_virtual}..{self.max_virtual} is an empty range")
        if not self.multi and self.max_virtual != 1:
            raise ValueError(f"schedule {self.name!r}: a single-stage schedule takes max_virtual=1")

    # ------------------------------------------------------------------ rules
    def default_virtual_stages(self) -> int:
        return max(self.min_virtual, 1 if self.max_virtual == 1 else 2)

    def accepts_virtual(self, virtual_stages: int) -> bool:
        """Whether the schedule places ``virtual_stages`` stages per rank."""
        return virtual_stages >= self.min_virtual and (self.max_virtual is None or virtual_stages <= self.max_virtual)

    def min_microbatches(self, *, pp_size: int, virtual_stages: int) -> int:
        """The fewest microbatches a training step of this schedule takes."""
        return max(1, self.microbatches_per_stage * pp_size * virtual_stages)

    def training_problem(self, *, pp_size: int, virtual_stages: int, n_microbatches: int) -> str | None:
        """Why a training step cannot run with these settings (None: it can)."""
        need = self.min_microbatches(pp_size=pp_size, virtual_stages=virtual_stages)
        if n_microbatches < need:
            what = "the number of stages" if self.microbatches_per_stage == 1 else f"{self.microbatches_per_stage} x the stages"
            return f"needs n_microbatches >= {what} ({need}) to train, got {n_microbatches}"
        if self.rounds and pp_size > 1:
            rounds = max(1, n_microbatches // pp_size)
            if n_microbatches % rounds:
                return (
                    f"needs n_microbatches to be a multiple of the number of rounds ({rounds} = n_microbatches // "
                    f"pp_size) to train, got {n_microbatches}"
                )
        return None

    @property
    def bubble_formula(self) -> str:
        """The documented formula of :meth:`theoretical_bubble` (p ranks, m microbatches, v stages per rank)."""
        return BUBBLE_FORMULAS[self.bubble][0]

    def theoretical_bubble(self, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1) -> float:
        """The idle fraction of a training step the schedule's analysis predicts (equal stage costs)."""
        if pp_size <= 1:
            return 0.0
        return BUBBLE_FORMULAS[self.bubble][1](pp_size, n_microbatches, virtual_stages)

    @property
    def torch_name(self) -> str | None:
        """The name torch's ``get_schedule_class`` knows this class by (None: it knows none)."""
        short = self.cls.__name__.removeprefix("Schedule")
        try:
            return short if get_schedule_class(short) is self.cls else None
        except ValueError:
            return None

    # ------------------------------------------------------------------ schedules
    def forward_only(self, stages: list, *, n_microbatches: int, stage_to_rank: dict[int, int], **kwargs: Any):
        """The schedule a forward-only (inference) call runs over this rank's torch ``PipelineStage`` objects.

        Training schedules are not used for inference: one stage per rank runs GPipe's forward
        actions, several stages per rank (looped or V) :class:`ScheduleForwardInOrder`. Either
        runs any number of microbatches.
        """
        if not self.multi:
            return SCHEDULES[self.forward_as or self.name].cls(stages[0], n_microbatches=n_microbatches, **kwargs)
        return ScheduleForwardInOrder(stages, n_microbatches, stage_to_rank=stage_to_rank)


def _specs() -> dict[str, ScheduleSpec]:
    single = dict(multi=False, layout="loop", min_virtual=1, max_virtual=1, forward_as="gpipe")
    looped = dict(multi=True, layout="loop", max_virtual=None, forward_as="looped-bfs")
    v_shape = dict(multi=True, layout="v", min_virtual=2, max_virtual=2, zero_bubble=True, microbatches_per_stage=1, bubble="zero")
    specs = [
        ScheduleSpec(name="gpipe", cls=pp.ScheduleGPipe, **single),
        ScheduleSpec(name="1f1b", cls=pp.Schedule1F1B, microbatches_per_stage=1, warmup="remaining-stages", **single),
        ScheduleSpec(name="interleaved-1f1b", cls=pp.ScheduleInterleaved1F1B, min_virtual=2, rounds=True, bubble="interleaved", **looped),
        ScheduleSpec(name="looped-bfs", cls=pp.ScheduleLoopedBFS, min_virtual=1, bubble="interleaved", **looped),
        ScheduleSpec(
            name="interleaved-zero-bubble", cls=pp.ScheduleInterleavedZeroBubble, min_virtual=2, zero_bubble=True,
            rounds=True, bubble="zb-h1", **looped,
        ),
        ScheduleSpec(name="zbv-zero-bubble", cls=pp.ScheduleZBVZeroBubble, **v_shape),
    ]
    if hasattr(pp, "ScheduleDualPipeV"):
        specs.append(ScheduleSpec(name="dualpipev", cls=pp.ScheduleDualPipeV, **v_shape))
    out = {s.name: s for s in specs}
    for s in specs:
        assert s.forward_as is None or s.forward_as in out, f"{s.name}: forward_as {s.forward_as!r} is not a schedule"
    return out


SCHEDULES: dict[str, ScheduleSpec] = _specs()
_ALIASES = {"interleaved": "interleaved-1f1b", "zbv": "zbv-zero-bubble", "zero-bubble": "interleaved-zero-bubble"}
_BY_CLASS: dict[type, ScheduleSpec] = {s.cls: s for s in SCHEDULES.values()}
_BY_CLASS_NAME: dict[str, ScheduleSpec] = {s.cls.__name__.lower(): s for s in SCHEDULES.values()}


def accepted_schedules() -> dict[str, list[str]]:
    """What :func:`get_schedule` accepts, for messages: this package's names, torch's names, torch's classes."""
    return {
        "names": list(SCHEDULES),
        "torch names": [s.torch_name for s in SCHEDULES.values() if s.torch_name],
        "classes": [f"torch.distributed.pipelining.{s.cls.__name__}" for s in SCHEDULES.values()],
    }


def _unknown(what: str, why: str = "") -> ScheduleError:
    acc = accepted_schedules()
    return ScheduleError(
        f"unknown schedule {what}{why}; choose one of {acc['names']}, or torch's names {acc['torch names']}, "
        "or their classes (torch.distributed.pipelining.ScheduleInterleaved1F1B, ...)"
    )


def _from_class(cls: type) -> ScheduleSpec:
    for base in cls.__mro__:
        if base in _BY_CLASS:
            spec = _BY_CLASS[base]
            # A subclass of a known schedule keeps its rules and runs as itself.
            return spec if base is cls else dataclasses.replace(spec, cls=cls)
    raise _unknown(f"class {cls.__module__}.{cls.__qualname__}", " (not one of torch's schedules nor a subclass of one)")


def get_schedule(schedule: str | type | ScheduleSpec) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for a schedule name, a torch schedule class or a spec.

    Args:
        schedule: this package's name (``"1f1b"``, ``"interleaved-1f1b"``, ...; case-insensitive,
            ``_`` or ``-``), torch's (``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"ZBVZeroBubble"``,
            anything ``get_schedule_class`` accepts), a torch class name (``"ScheduleGPipe"``), the
            class (``pp.ScheduleInterleaved1F1B``, or a subclass of one), or a ``ScheduleSpec``.

    Returns:
        The spec; its ``name`` is always this package's name.

    Raises:
        ScheduleError: anything else, with a message listing what is accepted.

    Example:
        >>> get_schedule(pp.ScheduleZBVZeroBubble).name
        'zbv-zero-bubble'
    """
    if isinstance(schedule, ScheduleSpec):
        return schedule
    if isinstance(schedule, type):
        return _from_class(schedule)
    if not isinstance(schedule, str):
        raise _unknown(repr(schedule), f" (got {type(schedule).__name__}; pass a name or a schedule class)")
    key = schedule.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key in SCHEDULES:
        return SCHEDULES[key]
    if schedule.strip().lower() in _BY_CLASS_NAME:
        return _BY_CLASS_NAME[schedule.strip().lower()]
    try:
        cls = get_schedule_class(schedule.strip())
    except ValueError:
        raise _unknown(repr(schedule)) from None
    if cls not in _BY_CLASS:  # torch's abstract bases (PipelineScheduleSingle / Multi) schedule nothing
        raise _unknown(repr(schedule), f" (torch's {cls.__name__} is a base class, not a schedule)")
    return _BY_CLASS[cls]


def default_schedule(virtual_stages: int | None = None) -> str:
    """The schedule used when none is given: "1f1b", or "interleaved-1f1b" with several stages per rank."""
    return "interleaved-1f1b" if (virtual_stages or 1) > 1 else "1f1b"


def _quoted(names: list[str]) -> str:
    return " or ".join(repr(n) for n in names)


def check_layout(spec: ScheduleSpec, *, pp_size: int, virtual_stages: int, n_microbatches: int | None = None) -> None:
    """Raise :class:`ScheduleError` if ``spec`` cannot place ``virtual_stages`` stages per rank (load time).

    This is all a forward or generate call needs: they run with any ``n_microbatches >= 1``
    (given, it is checked to be one). Training's microbatch rules are :func:`check_training`'s.
    """
    if pp_size < 1:
        raise ScheduleError(f"pp_size must be >= 1, got {pp_size}")
    if n_microbatches is not None and (not isinstance(n_microbatches, int) or n_microbatches < 1):
        raise ScheduleError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
    if not spec.accepts_virtual(virtual_stages):
        want = str(spec.min_virtual) if spec.max_virtual == spec.min_virtual else (
            f">= {spec.min_virtual}" if spec.max_virtual is None else f"{spec.min_virtual}..{spec.max_virtual}")
        others = [s.name for s in SCHEDULES.values() if s.accepts_virtual(virtual_stages)]
        fix = f"use schedule={_quoted(others[:3])} for {virtual_stages} stage{'s' if virtual_stages != 1 else ''} per rank" if others and virtual_stages >= 1 else (
            f"use virtual_stages={spec.default_virtual_stages()}")
        raise ScheduleError(f"schedule {spec.name!r} needs virtual_stages {want} per rank, got {virtual_stages}; {fix}")


def check_training(spec: ScheduleSpec, *, pp_size: int, virtual_stages: int, n_microbatches: int) -> None:
    """Raise :class:`ScheduleError` if a training step of ``spec`` cannot run these microbatches.

    The rules are the ones torch's schedule constructors enforce, read from the spec's fields,
    checked before any communication so every rank fails the same way. The message names the
    fix: the ``n_microbatches`` to load with, or a schedule that trains with these settings.
    """
    check_layout(spec, pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches)
    problem = spec.training_problem(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches)
    if problem is None:
        return

    def trains(s: ScheduleSpec, m: int) -> bool:
        return s.training_problem(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m) is None

    # The nearest counts that train, found through the same rules (no rule is written twice).
    bound = n_microbatches + spec.min_microbatches(pp_size=pp_size, virtual_stages=virtual_stages) + pp_size
    above = next((m for m in range(n_microbatches + 1, bound + 1) if trains(spec, m)), None)
    below = next((m for m in range(n_microbatches - 1, 0, -1) if trains(spec, m)), None)
    counts = [m for m in (above, below) if m is not None]
    fixes = [f"load the model with n_microbatches={' or '.join(map(str, counts))}"] if counts else []
    others = [s.name for s in SCHEDULES.values() if s.name != spec.name and s.accepts_virtual(virtual_stages) and trains(s, n_microbatches)]
    if others:
        fixes.append(f"with schedule={_quoted(others[:2])}, which train{'s' if len(others[:2]) == 1 else ''} with {n_microbatches}")
    raise ScheduleError(
        f"schedule {spec.name!r} {problem}; {', or '.join(fixes)} (forward and generate run with any n_microbatches)"
    )


def fuse_backward(order: dict[int, list], stage_to_rank: Callable[[int], int]) -> dict[int, list]:
    """``order`` with each input-gradient pass merged into the weight-gradient pass that follows it
    where the split buys nothing, as one full backward (B).

    Zero-bubble schedules split a stage's backward into the input gradient (I), which the previous
    stage waits for, and the weight gradient (W), which fills a bubble later. The split has a
    price: two autograd passes over the graph instead of one, ~5% more backward time measured on a
    LLaMA block on CPU. Where a rank's list has ``I(s, i)`` immediately followed by ``W(s, i)`` and
    no other rank waits for that input gradient (``s`` is the first stage, so there is none, or
    stage ``s - 1`` is on the same rank, whose backward comes later in the same list anyway), one
    full backward finishes at the same time with less work, and nothing else moves. Where the
    gradient goes to another rank the pair stays split: merging would hold its send back by W.

    Args:
        order: rank -> compute actions (torch's ``pipeline_order``; ``None`` bubbles are dropped).
        stage_to_rank: the rank of a stage index.
    Returns:
        rank -> the actions, merged pairs as one FULL_BACKWARD action each.
    """
    i_kind, w_kind, b_kind = ComputationType.BACKWARD_INPUT, ComputationType.BACKWARD_WEIGHT, ComputationType.FULL_BACKWARD
    out: dict[int, list] = {}
    for rank, actions in order.items():
        acts = [a for a in actions if a is not None]
        merged: list = []
        k = 0
        while k < len(acts):
            a, nxt = acts[k], acts[k + 1] if k + 1 < len(acts) else None
            if (
                nxt is not None and a.computation_type == i_kind and nxt.computation_type == w_kind
                and (a.stage_index, a.microbatch_index) == (nxt.stage_index, nxt.microbatch_index)
                and (a.stage_index == 0 or stage_to_rank(a.stage_index - 1) == rank)
            ):
                merged.append(Action(a.stage_index, b_kind, a.microbatch_index))
                k += 2
            else:
                merged.append(a)
                k += 1
        out[rank] = merged
    return out


def fuse_schedule_backward(schedule) -> None:
    """Apply :func:`fuse_backward` to a built torch runtime schedule (zero-bubble ones) and lower it again."""
    mapping = dict(schedule.stage_index_to_group_rank)
    fused = fuse_backward(schedule.pipeline_order, mapping.__getitem__)
    if all(len(fused[r]) == sum(a is not None for a in acts) for r, acts in schedule.pipeline_order.items()):
        return  # nothing merged: torch's lowering stands as built
    schedule.pipeline_order = fused
    schedule._prepare_schedule_with_comms(fused)  # torch's own lowering: sends, receives, grad reduction


# ----------------------------------------------------------------------------- placement and action order
def rank_of_stage(stage: int, pp_size: int, layout: str) -> int:
    """The pipeline rank that runs ``stage``: looped (rank r owns r, r+p, ...) or V (r and 2p-1-r)."""
    if layout == "loop":
        return stage % pp_size  # rank r owns stages r, r+p, r+2p, ...
    # V shape: rank r owns stages r and 2p-1-r, so the last stage sits next to the first
    wave, pos = divmod(stage, pp_size)
    return pos if wave % 2 == 0 else pp_size - 1 - pos


ACTION_KINDS = ("F", "B", "I", "W")  # a schedule's own compute actions (what pipeline_order lists)


def _single_stage_actions(spec: ScheduleSpec, stage: int, num_stages: int, m: int) -> list[str]:
    # What ScheduleGPipe / Schedule1F1B._step_microbatches execute: ``spec.warmup`` forwards, then
    # one backward and one forward while forwards remain, then the remaining backwards. Note:
    # torch 2.13's Schedule1F1B.pipeline_order numbers the last rank's forwards 1..m (off by one),
    # so the order is derived from the step's own loops instead.
    warmup = m if spec.warmup == "all" else min(m, num_stages - stage)
    out = [f"{stage}F{i}" for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < m:
        out += [f"{stage}B{bwd}", f"{stage}F{fwd}"]
        bwd, fwd = bwd + 1, fwd + 1
    out += [f"{stage}B{i}" for i in range(bwd, m)]
    return out


def _flatten(actions) -> Iterator[Any]:
    for a in actions:
        if a is None:
            continue
        if a.sub_actions:
            yield from _flatten(a.sub_actions)
        else:
            yield a


def schedule_actions(
    schedule: str | ScheduleSpec, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1, training: bool = True
) -> dict[int, list[str]]:
    """The compute actions each pipeline rank runs in one step, in order (``["0F0", "0F1", "0B0", ...]``).

    Multi-stage schedules: torch's own ``pipeline_order`` (built from stand-in stage objects, so no
    process group is needed), with the backward passes merged as the runtime runs them
    (:func:`fuse_backward`). Single-stage GPipe / 1F1B: the order their ``step`` executes.
    ``training=False``: the forward actions only (what a forward-only step runs).
    """
    spec = get_schedule(schedule)
    p, v, m = pp_size, virtual_stages, n_microbatches
    if not training:
        # A forward-only call runs every rank's stages in stage order, all microbatches of one
        # stage before the next (GPipe's forward for one stage per rank, looped BFS's for looped
        # stages, ScheduleForwardInOrder's for any layout): see ScheduleSpec.forward_only.
        num_stages = p * (v if spec.multi else 1)
        return {r: [f"{s}F{i}" for s in range(num_stages) if rank_of_stage(s, p, spec.layout) == r for i in range(m)] for r in range(p)}
    if not spec.multi:
        return {r: _single_stage_actions(spec, r, p, m) for r in range(p)}
    num_stages = p * v

    def stand_in(index: int) -> types.SimpleNamespace:
        # The attributes PipelineScheduleMulti.__init__ reads from its stages.
        return types.SimpleNamespace(
            stage_index=index, num_stages=num_stages, group_size=p, group_rank=0,
            is_first=index == 0, is_last=index == num_stages - 1, submod=nn.Module(),
        )

    local = [stand_in(i) for i in range(num_stages) if rank_of_stage(i, p, spec.layout) == 0]
    order = spec.cls(local, n_microbatches=m, loss_fn=lambda out, target: out).pipeline_order
    if spec.zero_bubble:  # as the runtime runs it (PipelineRuntime.get)
        order = fuse_backward(order, lambda s: rank_of_stage(s, p, spec.layout))
    return {r: [str(a) for a in _flatten(order[r]) if a.computation_type.value in ACTION_KINDS] for r in range(p)}


# ----------------------------------------------------------------------------- simulated steps
# Cost of each kind of action in units of its stage's forward: a full backward does twice a
# forward's matmuls, its input and weight halves one each.
ACTION_WEIGHTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def action_input(stage: int, kind: str, microbatch: int, *, last_stage: int, exists: Callable[[tuple[int, str, int]], bool]) -> tuple[int, str, int] | None:
    """The action whose output ``(stage, kind, microbatch)`` waits for, or None (a pipeline input,
    or the last stage's backward, which starts from its own forward's loss).

    A forward waits for the previous stage's forward of its microbatch; a full or input-gradient
    backward for the next stage's full backward, or its input-gradient pass where that stage's
    backward is split (``exists`` says which ran); a weight-gradient pass for its own input pass.
    """
    if kind == "F":
        return (stage - 1, "F", microbatch) if stage > 0 else None
    if kind in ("B", "I"):
        if stage == last_stage:
            return None
        full = (stage + 1, "B", microbatch)
        return full if exists(full) else (stage + 1, "I", microbatch)
    if kind == "W":
        return (stage, "I", microbatch)
    raise ValueError(f"unknown action kind {kind!r}; expected one of {ACTION_KINDS}")


@functools.lru_cache(maxsize=256)
def _step_graph(spec: ScheduleSpec, pp_size: int, virtual_stages: int, n_microbatches: int) -> tuple[tuple[int, int, str, int], ...]:
    """Every action of one training step as (rank, stage, kind, index of the action it waits for or -1), in an order
    where each comes after what it waits for: the previous action of its rank (implicit, by order) and its data.

    The graph depends on the schedule alone, so a simulation with any stage costs is one pass over it.
    """
    orders = schedule_actions(spec, pp_size=pp_size, n_microbatches=n_microbatches, virtual_stages=virtual_stages, training=True)
    last = max(int(re.match(r"\d+", a).group()) for acts in orders.values() for a in acts)
    parsed = {r: [(int(s), k, int(i)) for s, k, i in (re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups() for a in acts)] for r, acts in orders.items()}
    kinds = {(s, k, i) for acts in parsed.values() for s, k, i in acts}
    index: dict[tuple[int, str, int], int] = {}
    graph: list[tuple[int, int, str, int]] = []
    pos = {r: 0 for r in parsed}
    remaining = sum(len(a) for a in parsed.values())
    while remaining:
        progressed = False
        for r, acts in parsed.items():
            while pos[r] < len(acts):
                s, k, i = acts[pos[r]]
                need = action_input(s, k, i, last_stage=last, exists=kinds.__contains__)
                if need is not None and need not in index:
                    break
                index[(s, k, i)] = len(graph)
                graph.append((r, s, k, -1 if need is None else index[need]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"schedule {spec.name!r}: the simulated step deadlocks (an action waits for one that never runs)")
    return tuple(graph)


def simulate_step(
    spec: ScheduleSpec | str, *, pp_size: int, virtual_stages: int, n_microbatches: int,
    stage_cost: Sequence[float], overhead: float = 0.0,
) -> tuple[float, dict[int, float]]:
    """Simulated wall time of one training step, and each rank's busy time.

    Each rank runs its actions in the order torch's schedule lists them; an action starts when its
    rank is free and its input exists (a forward after the previous stage's forward, a backward
    after the next stage's backward, a weight-gradient pass after its input pass). Messages are free.

    Args:
        stage_cost: forward cost of one microbatch on each stage (any unit; each kind of action costs
            :data:`ACTION_WEIGHTS` times it).
        overhead: added to every action, in the same unit.
    """
    spec = get_schedule(spec)
    graph = _step_graph(spec, pp_size, virtual_stages, n_microbatches)
    done = [0.0] * len(graph)
    free = [0.0] * pp_size
    busy = [0.0] * pp_size
    for n, (r, s, k, need) in enumerate(graph):
        cost = ACTION_WEIGHTS[k] * stage_cost[s] + overhead
        start = free[r] if need < 0 or done[need] <= free[r] else done[need]
        done[n] = free[r] = start + cost
        busy[r] += cost
    return max(free), dict(enumerate(busy))


class ScheduleForwardInOrder(PipelineScheduleRuntime):
    """Forward-only schedule for any stage placement, looped or V-shaped.

    Torch's multi-stage schedules are training schedules: the V-shaped ones cannot run forward
    only (their action lists pair every F with a B). For inference every rank runs its stages in
    stage order, all microbatches of one stage before the next (breadth first), which cannot
    deadlock whatever the placement; torch's runtime adds the sends and receives.
    """

    def __init__(self, stages, n_microbatches: int, *, stage_to_rank: dict[int, int], **kwargs):
        self._stage_to_rank = dict(stage_to_rank)
        super().__init__(stages=stages, n_microbatches=n_microbatches, **kwargs)
        forward = ComputationType.FORWARD
        actions: dict[int, list] = {r: [] for r in sorted(set(stage_to_rank.values()))}
        for stage in sorted(stage_to_rank):
            for mb in range(n_microbatches):
                actions[stage_to_rank[stage]].append(Action(stage, forward, mb))
        self._prepare_schedule_with_comms(actions)

    def _prepare_schedule_with_comms(self, actions, format="compute_only") -> None:
        # torch's version validates that every forward has a backward (it is built for training
        # schedules); the placement is known from the plan, so set it and run the same lowering.
        lib = pp.schedules
        self.stage_index_to_group_rank = dict(self._stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order = dict(actions)
        lowered = {r: lib._add_reduce_grad(lib._add_unshard_reshard(a), self._n_microbatches) for r, a in actions.items()}
        self.pipeline_order_with_comms = lib._add_send_recv(
            lowered, stage_to_rank=lambda s: self.stage_index_to_group_rank[s], num_stages=self._num_stages
        )
