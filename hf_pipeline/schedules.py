"""Schedule names -> ``torch.distributed.pipelining`` schedule classes, and what each needs.

We do not write a training scheduler: every schedule is torch's own. This module only maps the
names users pass (``schedule="interleaved-1f1b"``) to the class, the stage layout the class
expects (looped: rank r owns stages r, r+p, ...; V: rank r owns r and 2p-1-r) and the
microbatch / virtual-stage combinations it accepts, so a bad combination fails on every rank,
before any communication, with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining as pp

__all__ = ["ScheduleError", "ScheduleSpec", "SCHEDULES", "get_schedule", "validate_schedule"]


class ScheduleError(ValueError):
    """A schedule cannot run with the requested stages / microbatches."""


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    name: str
    cls: type
    multi: bool  # takes a list of stages per rank (PipelineScheduleMulti)
    layout: str  # "loop" or "v"
    min_virtual: int
    max_virtual: int | None
    zero_bubble: bool = False  # splits backward into input (I) and weight (W) gradients

    def default_virtual_stages(self) -> int:
        return max(self.min_virtual, 1 if self.max_virtual == 1 else 2)


def _specs() -> dict[str, ScheduleSpec]:
    specs = [
        ScheduleSpec(name="gpipe", cls=pp.ScheduleGPipe, multi=False, layout="loop", min_virtual=1, max_virtual=1),
        ScheduleSpec(name="1f1b", cls=pp.Schedule1F1B, multi=False, layout="loop", min_virtual=1, max_virtual=1),
        ScheduleSpec(name="interleaved-1f1b", cls=pp.ScheduleInterleaved1F1B, multi=True, layout="loop", min_virtual=2, max_virtual=None),
        ScheduleSpec(name="looped-bfs", cls=pp.ScheduleLoopedBFS, multi=True, layout="loop", min_virtual=1, max_virtual=None),
        ScheduleSpec(
            name="interleaved-zero-bubble", cls=pp.ScheduleInterleavedZeroBubble, multi=True, layout="loop",
            min_virtual=2, max_virtual=None, zero_bubble=True,
        ),
        ScheduleSpec(name="zbv-zero-bubble", cls=pp.ScheduleZBVZeroBubble, multi=True, layout="v", min_virtual=2, max_virtual=2, zero_bubble=True),
    ]
    if hasattr(pp, "ScheduleDualPipeV"):
        specs.append(ScheduleSpec(name="dualpipev", cls=pp.ScheduleDualPipeV, multi=True, layout="v", min_virtual=2, max_virtual=2, zero_bubble=True))
    return {s.name: s for s in specs}


SCHEDULES: dict[str, ScheduleSpec] = _specs()
_ALIASES = {"interleaved": "interleaved-1f1b", "zbv": "zbv-zero-bubble", "zero-bubble": "interleaved-zero-bubble", "1F1B": "1f1b", "GPipe": "gpipe"}


def get_schedule(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for a schedule name (case-insensitive, ``_`` or ``-``)."""
    key = _ALIASES.get(name, name).lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def validate_schedule(spec: ScheduleSpec, *, pp_size: int, virtual_stages: int, n_microbatches: int) -> None:
    """Raise :class:`ScheduleError` if ``spec`` cannot run this combination.

    The rules are the ones torch's schedule constructors enforce (plus the layout each needs),
    checked up front so every rank fails the same way before any communication.
    """
    if n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if virtual_stages < spec.min_virtual or (spec.max_virtual is not None and virtual_stages > spec.max_virtual):
        want = str(spec.min_virtual) if spec.max_virtual == spec.min_virtual else (
            f">= {spec.min_virtual}" if spec.max_virtual is None else f"{spec.min_virtual}..{spec.max_virtual}")
        raise ScheduleError(
            f"schedule {spec.name!r} needs virtual_stages {want} per rank, got {virtual_stages}; "
            + ("use schedule='1f1b' or 'gpipe' for one stage per rank" if virtual_stages == 1 else
               "use schedule='interleaved-1f1b' or 'looped-bfs' for several stages per rank")
        )
    num_stages = pp_size * virtual_stages
    if spec.name in ("1f1b", "zbv-zero-bubble", "dualpipev") and n_microbatches < num_stages:
        raise ScheduleError(
            f"schedule {spec.name!r} needs n_microbatches >= the number of stages ({num_stages}), got {n_microbatches}"
        )
    if spec.name in ("interleaved-1f1b", "interleaved-zero-bubble") and pp_size > 1:
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds != 0:
            raise ScheduleError(
                f"schedule {spec.name!r} needs n_microbatches to be a multiple of the number of rounds ({rounds} = "
                f"n_microbatches // pp_size), got {n_microbatches}; use a multiple of pp_size={pp_size}"
            )


class ScheduleForwardInOrder(pp.schedules._PipelineScheduleRuntime):
    """Forward-only schedule for any stage placement, looped or V-shaped.

    Torch's multi-stage schedules are training schedules: the V-shaped ones cannot run forward
    only (their action lists pair every F with a B). For inference every rank runs its stages in
    stage order, all microbatches of one stage before the next (breadth first), which cannot
    deadlock whatever the placement; torch's runtime adds the sends and receives.
    """

    def __init__(self, stages, n_microbatches: int, *, stage_to_rank: dict[int, int], **kwargs):
        self._stage_to_rank = dict(stage_to_rank)
        super().__init__(stages=stages, n_microbatches=n_microbatches, **kwargs)
        forward = pp.schedules._ComputationType.FORWARD
        actions: dict[int, list] = {r: [] for r in sorted(set(stage_to_rank.values()))}
        for stage in sorted(stage_to_rank):
            for mb in range(n_microbatches):
                actions[stage_to_rank[stage]].append(pp.schedules._Action(stage, forward, mb))
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
