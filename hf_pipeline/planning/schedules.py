"""Schedules as data: names and classes -> ``torch.distributed.pipelining`` schedules, and their rules.

We do not write a training scheduler: every schedule is torch's own. A :class:`ScheduleSpec`
holds what the rest of the package needs to know about one: its torch class, the stage layout it
expects (looped: rank r owns stages r, r+p, ...; V: rank r owns r and 2p-1-r), the virtual stages
per rank it takes, its microbatch rules, its warm-up and its bubble formula. Validation, profiling
and the memory planner read these fields; generic code does not branch on a schedule's name.

The rules are checked at two times:

* :func:`check_layout`, at load: what the stage placement needs (virtual stages per rank; a V
  schedule places exactly 2 per rank). Forward and generate need nothing more: they never run
  the training schedule (a forward-only call runs the schedule of
  :func:`hf_pipeline.runtime.forward_schedule.forward_schedule`, generation its own decode ring),
  so they work with any ``n_microbatches >= 1``, fewer than the stages too.
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
from dataclasses import dataclass
from typing import Callable

from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import get_schedule_class

from ..errors import ScheduleError

__all__ = [
    "BUBBLE_FORMULAS",
    "SCHEDULES",
    "ScheduleError",
    "ScheduleSpec",
    "accepted_schedules",
    "check_layout",
    "check_training",
    "choose_schedule",
    "default_schedule",
    "fitting_microbatches",
    "get_schedule",
    "rank_of_stage",
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
            raise ScheduleError(f"schedule {self.name!r}: layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.bubble not in BUBBLE_FORMULAS:
            raise ScheduleError(
                f"schedule {self.name!r}: bubble must be one of {sorted(BUBBLE_FORMULAS)}, got {self.bubble!r}"
            )
        if self.warmup not in _WARMUPS:
            raise ScheduleError(f"schedule {self.name!r}: warmup must be one of {_WARMUPS}, got {self.warmup!r}")
        if self.min_virtual < 1 or (self.max_virtual is not None and self.max_virtual < self.min_virtual):
            raise ScheduleError(
                f"schedule {self.name!r}: virtual stages {self.min_virtual}..{self.max_virtual} is an empty range"
            )
        if not self.multi and self.max_virtual != 1:
            raise ScheduleError(f"schedule {self.name!r}: a single-stage schedule takes max_virtual=1")

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
            what = (
                "the number of stages"
                if self.microbatches_per_stage == 1
                else f"{self.microbatches_per_stage} x the stages"
            )
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


def _specs() -> dict[str, ScheduleSpec]:
    single = dict(multi=False, layout="loop", min_virtual=1, max_virtual=1, forward_as="gpipe")
    looped = dict(multi=True, layout="loop", max_virtual=None, forward_as="looped-bfs")
    v_shape = dict(
        multi=True, layout="v", min_virtual=2, max_virtual=2, zero_bubble=True, microbatches_per_stage=1, bubble="zero"
    )
    specs = [
        ScheduleSpec(name="gpipe", cls=pp.ScheduleGPipe, **single),
        ScheduleSpec(name="1f1b", cls=pp.Schedule1F1B, microbatches_per_stage=1, warmup="remaining-stages", **single),
        ScheduleSpec(
            name="interleaved-1f1b",
            cls=pp.ScheduleInterleaved1F1B,
            min_virtual=2,
            rounds=True,
            bubble="interleaved",
            **looped,
        ),
        ScheduleSpec(name="looped-bfs", cls=pp.ScheduleLoopedBFS, min_virtual=1, bubble="interleaved", **looped),
        ScheduleSpec(
            name="interleaved-zero-bubble",
            cls=pp.ScheduleInterleavedZeroBubble,
            min_virtual=2,
            zero_bubble=True,
            rounds=True,
            bubble="zb-h1",
            **looped,
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
    raise _unknown(
        f"class {cls.__module__}.{cls.__qualname__}", " (not one of torch's schedules nor a subclass of one)"
    )


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


def choose_schedule(*, pp_size: int, virtual_stages: int, n_microbatches: int) -> tuple[ScheduleSpec, str]:
    """The schedule for a user who named none: one that trains these microbatches, chosen by the rules.

    The default (:func:`default_schedule`) when it trains them; else, among the schedules with the
    default's layout that take ``virtual_stages`` per rank and train ``n_microbatches`` (their
    ``training_problem`` is None), the one with the smallest :meth:`ScheduleSpec.theoretical_bubble`,
    then the one that runs its stages the same way as the default (single or multi), then the first
    in :data:`SCHEDULES`. E.g. 3 ranks, 1 stage each, 2 microbatches: 1F1B needs 3, GPipe trains (and
    ties looped BFS on the bubble). If none trains them, the default (``train_step`` then says why).

    Returns:
        The spec, and a note for reports: which schedule and why it was chosen.

    Example:
        >>> spec, note = choose_schedule(pp_size=3, virtual_stages=1, n_microbatches=2)
        >>> spec.name
        'gpipe'
    """
    preferred = get_schedule(default_schedule(virtual_stages))
    rules = dict(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches)
    problem = preferred.training_problem(**rules)
    if problem is None:
        return preferred, f"schedule {preferred.name!r}: the default (no schedule was named)"
    order = list(SCHEDULES)
    candidates = [
        s for s in SCHEDULES.values()
        if s.layout == preferred.layout and s.accepts_virtual(virtual_stages) and s.training_problem(**rules) is None
    ]
    if not candidates:
        return preferred, f"schedule {preferred.name!r}: the default (no schedule was named; it {problem})"
    best = min(
        candidates,
        key=lambda s: (
            s.theoretical_bubble(pp_size=pp_size, n_microbatches=n_microbatches, virtual_stages=virtual_stages),
            s.multi != preferred.multi,
            order.index(s.name),
        ),
    )
    return best, (
        f"schedule {best.name!r}: chosen because no schedule was named and the default {preferred.name!r} {problem}"
    )


def fitting_microbatches(
    spec: ScheduleSpec, *, pp_size: int, virtual_stages: int, n_microbatches: int, rows: int, training: bool
) -> int:
    """The most microbatches, up to ``n_microbatches``, that split a call of ``rows`` rows.

    For a count the default chose for a planned batch (``PipelineOptions.adapt_microbatches``): a
    call with fewer rows, or rows it does not divide, runs the largest count that fits instead of
    being refused. A forward takes any count up to its rows (it pads the last microbatch); a training
    step one that divides its rows and meets the schedule's rules. ``n_microbatches`` when none fits
    (the usual checks then say why).

    Example:
        >>> fitting_microbatches(get_schedule("1f1b"), pp_size=2, virtual_stages=1, n_microbatches=16, rows=12,
        ...                      training=True)
        12
    """
    for m in range(min(n_microbatches, rows), 0, -1):
        if not training:
            return m
        if rows % m == 0 and spec.training_problem(pp_size=pp_size, virtual_stages=virtual_stages,
                                                   n_microbatches=m) is None:
            return m
    return n_microbatches


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
        plural = "s" if virtual_stages != 1 else ""
        fix = (
            f"use schedule={_quoted(others[:3])} for {virtual_stages} stage{plural} per rank"
            if others and virtual_stages >= 1
            else f"use virtual_stages={spec.default_virtual_stages()}"
        )
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
    others = [
        s.name
        for s in SCHEDULES.values()
        if s.name != spec.name and s.accepts_virtual(virtual_stages) and trains(s, n_microbatches)
    ]
    if others:
        verb = "trains" if len(others[:2]) == 1 else "train"
        fixes.append(f"with schedule={_quoted(others[:2])}, which {verb} with {n_microbatches}")
    raise ScheduleError(
        f"schedule {spec.name!r} {problem}; {', or '.join(fixes)} (forward and generate run with any n_microbatches)"
    )


# ----------------------------------------------------------------------------- placement
def rank_of_stage(stage: int, pp_size: int, layout: str) -> int:
    """The pipeline rank that runs ``stage``: looped (rank r owns r, r+p, ...) or V (r and 2p-1-r)."""
    if layout == "loop":
        return stage % pp_size  # rank r owns stages r, r+p, r+2p, ...
    # V shape: rank r owns stages r and 2p-1-r, so the last stage sits next to the first
    wave, pos = divmod(stage, pp_size)
    return pos if wave % 2 == 0 else pp_size - 1 - pos
