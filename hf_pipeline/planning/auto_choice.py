"""The rules of ``schedule="auto"`` / ``n_microbatches="auto"``: candidates, their simulated cost, the pick.

Every candidate (schedule, virtual stages, microbatches) that can train the planned batch is
costed by **simulating one training step** (:func:`choose_candidate`): each rank runs its actions in
the order torch's schedule lists them (:func:`hf_pipeline.planning.simulate.simulate_step`), an action
starting when its rank is free and its input exists (a forward after the previous stage's
forward, a backward after the next stage's backward, a weight-gradient pass after its input
pass). An action costs its stage's FLOPs per token (the planner's model, :class:`StagePlan`; on a mesh
those of one of the stage's tensor- or expert-parallel ranks, which run the stage together) times
the microbatch's tokens — forward 1x, full backward 2x, input and weight backward 1x each — plus a
fixed overhead per action (Python, communication, a smaller matmul's lower FLOP rate), written as
the compute of :data:`OVERHEAD_TOKENS` tokens of one rank's share of the model. The simulation
sees what the bubble formulas do not: stage imbalance, the schedule's real order and the cost of
many small microbatches. With ``max_memory``, candidates whose predicted training peak does not
fit are left out. The choice is pure arithmetic on the config, so every rank makes the same one.
Meshes with tp / ep / fsdp inside the stages are planned like any other: a pipeline's ranks are the
world over a stage's ranks and fsdp (``ParallelRequest``), its rows the batch over the data-parallel
ranks, and a candidate the loader would refuse there is left out with its reason.

Two inputs come from above this room and are passed in: the stage plan of a candidate's options
(the loader's own front end builds it on a meta model, ``loading.stages.recipe_front_end``; its FLOPs
those of one rank of a stage) and, with ``max_memory``, its predicted training peak on the mesh (the
memory planner's fake-tensor run, ``memory.mesh_report.mesh_report``).
:mod:`hf_pipeline.memory.auto_choice_costs` binds both; every rule of the choice stays here.
:func:`with_schedule` switches a loaded model's options to another schedule of the same stage
placement (``model.set_schedule``); measuring schedules by running them is a tool,
:mod:`hf_pipeline.tools.schedule_tuning`.

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="auto", n_microbatches="auto",
    ...                                              tune_batch=(16, 512))
    >>> print(model.auto_choice)            # every candidate, its estimate, and the one chosen
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InputError, PipelineError, PlanError
from .actions import peak_in_flight, schedule_actions
from .options import PipelineOptions, parse_size
from .plan import StagePlan
from .schedules import SCHEDULES, ScheduleSpec, check_layout, fitting_microbatches, get_schedule
from .simulate import simulate_step
from .tp_plan import ParallelRequest

__all__ = [
    "call_microbatches",
    "AUTO", "OVERHEAD_TOKENS", "AutoChoice", "Candidate", "Estimate", "PredictedPeak", "StagePlanOf",
    "DEFAULT_REFUSALS", "choose_candidate", "choose_default", "microbatch_counts", "same_placement", "with_schedule",
]

AUTO = "auto"
# Per-action overhead, as the compute of this many tokens of one rank's share of the model. CPU
# (gloo): ~1-3 ms of Python and messaging per action against ~0.3 ms per token of a 6-layer
# h384 share, and matmuls on 256-row microbatches ~10% slower than on 2048 rows (measured by the
# benchmark's microbatch cost); CUDA: kernel launches and NCCL latency are worth more tokens.
OVERHEAD_TOKENS = {"cpu": 24, "cuda": 256}
_DEFAULT_OVERHEAD_TOKENS = 64

# (config, options) -> the stage plan the loader builds for those options (FLOPs per stage: one of its ranks').
StagePlanOf = Callable[[Any, PipelineOptions], StagePlan]
# (config, options, candidate, rows, seq) -> the fullest rank's predicted training peak in bytes.
PredictedPeak = Callable[..., int]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    schedule: str
    virtual_stages: int
    n_microbatches: int

    def __str__(self) -> str:
        return f"{self.schedule} v={self.virtual_stages} m={self.n_microbatches}"


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One candidate's cost.

    Attributes:
        relative_step: simulated step time over the ideal (all compute spread evenly over the ranks,
            no bubble, no overhead); 1.0 is perfect overlap. None when the candidate was measured only.
        idle: the simulated idle fraction of the busiest rank's step.
        peak_bytes: predicted training peak of the fullest rank (with ``max_memory`` only).
        measured_seconds: median measured step time (:func:`~hf_pipeline.tools.schedule_tuning.tune` only).
        note: why the candidate was left out, if it was.
        stage_costs: FLOPs per token of each stage as simulated (one of its ranks'); empty when not simulated.
    """

    candidate: Candidate
    relative_step: float | None = None
    idle: float | None = None
    peak_bytes: int | None = None
    measured_seconds: float | None = None
    note: str = ""
    stage_costs: tuple[float, ...] = ()

    @property
    def usable(self) -> bool:
        return not self.note


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """What an automatic choice considered and what it picked (printable)."""

    chosen: Candidate
    estimates: tuple[Estimate, ...]
    basis: str  # "cost model" or "measured"
    batch: int
    seq: int

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """The chosen candidate's stage costs as the cost model simulated them (empty when measured): what a call's
        own microbatch count is simulated with (:func:`call_microbatches`), so it prices stages as the load did."""
        return next((e.stage_costs for e in self.estimates if e.candidate == self.chosen), ())

    def __str__(self) -> str:
        rows = [f"automatic schedule choice ({self.basis}; batch {self.batch} x {self.seq} tokens): {self.chosen}"]
        key = (lambda e: e.measured_seconds) if self.basis == "measured" else (lambda e: e.relative_step)
        for e in sorted(self.estimates, key=lambda e: (not e.usable, key(e) if key(e) is not None else float("inf"))):
            mark = "*" if e.candidate == self.chosen else " "
            figure = (f"{e.measured_seconds:.4f} s" if e.measured_seconds is not None else
                      f"{e.relative_step:.3f}x ideal, idle {e.idle:.1%}" if e.relative_step is not None else "-")
            mem = f", peak {e.peak_bytes / 2**20:.0f} MiB" if e.peak_bytes is not None else ""
            rows.append(f" {mark} {str(e.candidate):<34} {figure}{mem}{'  (' + e.note + ')' if e.note else ''}")
        return "\n".join(rows)


# ----------------------------------------------------------------------------- candidates
def microbatch_counts(rows: int, fixed: int | None) -> list[int]:
    """The microbatch counts to try for ``rows`` rows: ``fixed`` alone, or every divisor up to 64."""
    if fixed is not None:
        return [fixed]
    return [m for m in range(1, min(rows, 64) + 1) if rows % m == 0]


def _candidates(
    world_size: int, *, schedule: Any, virtual_stages: int | None, num_stages: int | None, n_microbatches: Any,
    rows: int, placement: PipelineOptions | None = None, parallel: ParallelRequest | None = None,
) -> list[Candidate]:
    # n_microbatches: AUTO (every count that divides the rows), None (the loader's default: one per
    # stage) or a fixed count. placement: only the schedules that run its stages as they are. parallel:
    # the mesh inside each stage; a pipeline rank is a stage's tp (or ep) ranks, and fsdp shards over replicas.
    specs = list(SCHEDULES.values()) if schedule == AUTO else [get_schedule(schedule)]
    if placement is not None:
        specs = [s for s in specs if same_placement(s, placement)]
        virtual_stages, num_stages = placement.virtual_stages, placement.num_stages
    stage_ranks = (parallel or ParallelRequest()).stage_ranks
    pipeline_slots = world_size // stage_ranks.tp_size  # pipeline ranks x data-parallel ranks (replicas x fsdp)
    pp_default = stage_ranks.pp_size or pipeline_slots // stage_ranks.fsdp_size
    out = []
    for spec in specs:
        vs = [v for v in ((virtual_stages,) if virtual_stages is not None else (1, 2)) if spec.accepts_virtual(v)]
        for v in vs:
            stages = num_stages if num_stages is not None else pp_default * v
            if not stages or stages % v or pipeline_slots % (stages // v):
                continue
            pp = stages // v
            fixed = None if n_microbatches == AUTO else n_microbatches
            counts = [stages] if n_microbatches is None else microbatch_counts(rows // (pipeline_slots // pp), fixed)
            for m in counts:
                if spec.training_problem(pp_size=pp, virtual_stages=v, n_microbatches=m) is None:
                    out.append(Candidate(schedule=spec.name, virtual_stages=v, n_microbatches=m))
    return out


def choose_candidate(
    config, world_size: int, *, device_type: str, stage_plan: StagePlanOf, predicted_peak: PredictedPeak,
    tune_batch: tuple[int, int] | None = None, max_memory: Any = None, overhead_tokens: float | None = None,
    placement: PipelineOptions | None = None, **option_kwargs: Any,
) -> tuple[dict[str, Any], AutoChoice]:
    """Replace ``schedule="auto"`` / ``n_microbatches="auto"`` in ``option_kwargs`` by the best candidate.

    Args:
        config: the model config.
        world_size: processes in the job.
        device_type: "cpu", "cuda", ...: picks the per-action overhead (:data:`OVERHEAD_TOKENS`).
        stage_plan: the stage plan of ``(config, options)``, as the loader will build it (costs per stage).
        predicted_peak: ``(config, options, candidate, rows=, seq=)`` -> the fullest rank's training
            peak in bytes; called with ``max_memory`` only.
        tune_batch: ``(batch, seq)`` of the training steps to plan for (default ``(8 x world_size,
            min(512, max positions))``).
        max_memory: per-rank budget (bytes or "20GiB"): candidates whose predicted training peak is
            larger are left out.
        overhead_tokens: overrides the per-action overhead.
        placement: the default's choice (:func:`choose_default`): only schedules that run these options'
            stages as placed, and, without ``max_memory``, no candidate that keeps more activations live
            on any rank than these options' schedule and count.
        **option_kwargs: :meth:`PipelineOptions.resolve`'s arguments, ``"auto"`` where to choose.

    Returns:
        (the arguments with concrete values, the :class:`AutoChoice`).

    Raises:
        InputError: when no candidate can train ``tune_batch`` (within ``max_memory``), naming why.
    """
    schedule, m_fixed = option_kwargs.get("schedule"), option_kwargs.get("n_microbatches")
    if schedule is None:  # n_microbatches="auto" alone: for the default schedule
        schedule = PipelineOptions.resolve(config, world_size,
                                           **{**option_kwargs, "n_microbatches": None}).schedule.name
    max_pos = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512)
    batch, seq = tune_batch if tune_batch is not None else (8 * world_size, min(512, max_pos))
    if batch < 1 or seq < 1:
        raise InputError(f"tune_batch must be (batch, seq) with both >= 1, got {tune_batch!r}")
    budget = parse_size(max_memory, what="max_memory") if max_memory is not None else None
    cands = _candidates(
        world_size, schedule=schedule, virtual_stages=option_kwargs.get("virtual_stages"),
        num_stages=option_kwargs.get("num_stages"),
        n_microbatches=m_fixed, rows=batch, placement=placement, parallel=option_kwargs.get("parallel"),
    )
    if not cands:
        raise InputError(
            f"no schedule trains a batch of {batch} rows on {world_size} processes with these settings "
            f"(schedule={schedule!r}, n_microbatches={m_fixed!r}); pass tune_batch=(batch, seq) with more rows, "
            "or fix the schedule"
        )
    tokens = overhead_tokens
    if tokens is None:
        tokens = OVERHEAD_TOKENS.get(device_type, _DEFAULT_OVERHEAD_TOKENS)
    plans: dict[tuple, Any] = {}  # one plan per distinct split (see _estimate)
    estimates = [
        _estimate(config, world_size, c, option_kwargs, plans, batch=batch, seq=seq, overhead_tokens=tokens,
                  budget=budget, stage_plan=stage_plan, predicted_peak=predicted_peak)
        for c in cands
    ]
    if placement is not None and budget is None:
        base = _live_rows(placement.schedule, placement.pp_size, placement.virtual_stages, placement.n_microbatches)
        estimates = [_within_live_rows(e, placement, base) for e in estimates]
    usable = [e for e in estimates if e.usable]
    if not usable:
        _refuse_none_usable(estimates, batch=batch, seq=seq, max_memory=max_memory)
    # Ties: fewer microbatches (bigger matmuls), then fewer stages per rank (fewer messages).
    best = min(usable,
               key=lambda e: (round(e.relative_step, 4), e.candidate.virtual_stages, e.candidate.n_microbatches))
    chosen = best.candidate
    choice = AutoChoice(chosen=chosen, estimates=tuple(estimates), basis="cost model", batch=batch, seq=seq)
    kwargs = {**option_kwargs, "schedule": chosen.schedule, "virtual_stages": chosen.virtual_stages,
              "n_microbatches": chosen.n_microbatches,
              "schedule_note": _auto_note(choice, best, option_kwargs, max_memory)}
    return kwargs, choice


def _refuse_none_usable(estimates: list[Estimate], *, batch: int, seq: int, max_memory: Any) -> None:
    """Raise the :class:`InputError` that says why every candidate was left out."""
    refused = [e for e in estimates if e.relative_step is None]  # options the loader refuses (the mesh's rules)
    if len(refused) == len(estimates):
        raise InputError(f"no schedule of these options loads on this mesh: {refused[0].candidate}: "
                         f"{refused[0].note}")
    if max_memory is None:  # the default's bound on live activations left every candidate out
        raise InputError(f"no candidate for a batch of {batch} x {seq} tokens keeps no more activations live than "
                         f"the fixed default: {estimates[0].note}")
    smallest = min(e.peak_bytes for e in estimates if e.peak_bytes is not None)
    raise InputError(
        f"no schedule fits max_memory={max_memory!r} for a batch of {batch} x {seq} tokens: the smallest predicted "
        f"peak is {smallest / 2**20:.0f} MiB; use more stages, a smaller tune_batch or a larger budget"
    )


def _auto_note(choice: AutoChoice, best: Estimate, asked: dict[str, Any], max_memory: Any) -> str:
    """``schedule_note`` of a load that asked for ``"auto"``: what was chosen, by what, against what budget."""
    c = choice.chosen
    by = " / ".join(f"{k}='auto'" for k in ("schedule", "n_microbatches") if asked.get(k) == AUTO)
    fits = "" if max_memory is None else f", among those whose predicted per-rank peak fits max_memory={max_memory!r}"
    return (f"schedule {c.schedule!r}, n_microbatches={c.n_microbatches}: chosen by {by} as the shortest simulated "
            f"training step of a {choice.batch} x {choice.seq} batch ({best.relative_step:.2f}x ideal, each stage "
            f"costed by one of its ranks){fits}")


def _estimate(
    config, world_size: int, c: Candidate, option_kwargs: dict[str, Any], plans: dict[tuple, Any], *, batch: int,
    seq: int, overhead_tokens: float, budget: int | None, stage_plan: StagePlanOf, predicted_peak: PredictedPeak,
) -> Estimate:
    """One candidate's simulated training step (and, with a memory budget, its predicted peak); a candidate
    the loader would refuse (a schedule fsdp or the tensor-parallel plan cannot run, more stages than blocks)
    is left out, saying why."""
    try:
        opts = PipelineOptions.resolve(config, world_size, **{  # the layout and mesh checks of loading, too
            **option_kwargs, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
            "n_microbatches": c.n_microbatches,
        })
        spec = opts.schedule
        # The split balances for the schedule and microbatch count (make_plan) when a rank holds
        # several stages; with one stage per rank it is the same for every candidate.
        key = (opts.virtual_stages, spec.layout, opts.pp_size)
        key += (spec.name, c.n_microbatches) if opts.virtual_stages > 1 else ()
        if key not in plans:
            # The loader's own front end (the plan from_pretrained will build); the tracer's split is
            # costed as balanced, since tracing every candidate would cost more than it tells.
            plans[key] = None if opts.traced else stage_plan(config, opts)
    except (InputError, PlanError) as e:
        return Estimate(candidate=c, note=str(e))
    plan = plans[key]
    # A pipeline's rows: fsdp's ranks are data-parallel (each runs its own rows, so its compute is not divided
    # further; its gathers are left to the per-action overhead), while a stage's tp / ep ranks share its rows
    # and split its compute (the stage plan's FLOPs are one such rank's).
    rows = batch // opts.dp_size
    mb_tokens = rows * seq / c.n_microbatches
    per_token = [s.flops_per_token for s in plan.stages] if plan is not None else [1.0] * opts.num_stages
    total = sum(per_token)
    share = total / opts.pp_size  # one rank's share of the model, per token
    step, busy = simulate_step(
        spec, pp_size=opts.pp_size, virtual_stages=opts.virtual_stages, n_microbatches=c.n_microbatches,
        stage_cost=[f * mb_tokens for f in per_token], overhead=overhead_tokens * share,
    )
    ideal = 3 * total * rows * seq / opts.pp_size
    peak, note = None, ""
    if budget is not None:
        peak = predicted_peak(config, opts, c, rows=rows, seq=seq)
        if peak > budget:
            note = f"predicted peak {peak / 2**20:.0f} MiB > max_memory {budget / 2**20:.0f} MiB"
    return Estimate(candidate=c, relative_step=step / ideal, idle=1 - max(busy.values()) / step, peak_bytes=peak,
                    note=note, stage_costs=tuple(per_token))


def _live_rows(spec: ScheduleSpec, pp_size: int, virtual_stages: int, n_microbatches: int) -> list[float]:
    """Each rank's peak activations in flight, in batch fractions (rows of microbatches from F to B / W).

    A rank's stages weigh alike; with one stage per rank this is its activation peak up to a constant
    of the stage, so two candidates of one placement compare exactly without the planner's fake run.
    """
    orders = schedule_actions(spec, pp_size=pp_size, n_microbatches=n_microbatches, virtual_stages=virtual_stages,
                              training=True)
    stages = range(pp_size * virtual_stages)
    return [peak_in_flight(orders[r], {s: 1.0 / n_microbatches for s in stages})[0] for r in range(pp_size)]


def _within_live_rows(e: Estimate, placement: PipelineOptions, base: list[float]) -> Estimate:
    """``e``, left out when a rank keeps more activations live than ``base`` (:func:`_live_rows` of
    ``placement``'s schedule and count)."""
    p, v = placement.pp_size, placement.virtual_stages
    mine = _live_rows(get_schedule(e.candidate.schedule), p, v, e.candidate.n_microbatches)
    worse = [r for r in range(p) if mine[r] > base[r] * (1 + 1e-9)]
    if not worse or e.note:
        return e
    return dataclasses.replace(e, note=(
        f"rank {worse[0]} keeps {mine[worse[0]]:.2f} of the batch's activations live, more than "
        f"{base[worse[0]]:.2f} under {placement.schedule.name} m={placement.n_microbatches}"
    ))


# What the default's automatic choice does not plan, read from today's default options and the config:
# (rule, why). Those loads keep today's default, and its schedule_note says why.
DEFAULT_REFUSALS: tuple[tuple[Callable[[PipelineOptions, Any], bool], str], ...] = (
    (lambda o, c: o.pp_size == 1, "one stage per pipeline leaves nothing to overlap"),
    (lambda o, c: o.traced, "the stages are traced, so the cost model has no per-stage costs"),
    (lambda o, c: bool(getattr(c, "is_encoder_decoder", False)),
     "the cost model counts one sequence length, and an encoder-decoder has two"),
)


def choose_default(
    config, world_size: int, *, device_type: str, stage_plan: StagePlanOf, predicted_peak: PredictedPeak,
    tune_batch: tuple[int, int] | None = None, max_memory: Any = None, overhead_tokens: float | None = None,
    **option_kwargs: Any,
) -> tuple[dict[str, Any], AutoChoice | None]:
    """The schedule and microbatch count for a load that names neither: :func:`choose_candidate`'s pick.

    Candidates are the schedules that run today's default placement as it is (the schedules
    ``model.set_schedule`` can switch to) with every microbatch count that trains ``tune_batch``, and,
    without ``max_memory``, none that keeps more activations live on a rank than the old default
    (1F1B, or interleaved 1F1B with virtual stages, one microbatch per stage). The count becomes the
    most a call splits into (``adapt_microbatches``). Where the choice cannot plan (:data:`DEFAULT_REFUSALS`)
    or fails, the old default, never an error: ``schedule_note`` says why, on every rank alike.

    Returns:
        (:meth:`PipelineOptions.resolve`'s arguments with ``schedule_note``, the choice or None).
    """
    base = PipelineOptions.resolve(config, world_size, **option_kwargs)  # invalid options raise as they always did
    why = next((why for rule, why in DEFAULT_REFUSALS if rule(base, config)), None)
    if why is None:
        try:
            kwargs, choice = choose_candidate(
                config, world_size, device_type=device_type, stage_plan=stage_plan, predicted_peak=predicted_peak,
                tune_batch=tune_batch, max_memory=max_memory, overhead_tokens=overhead_tokens, placement=base,
                **{**option_kwargs, "schedule": AUTO, "n_microbatches": AUTO},
            )
        except PipelineError as e:  # the default never refuses a load: it keeps the old default
            why = f"the automatic choice found none ({e})"
        else:
            note = _default_note(choice, base, placed=option_kwargs.get("virtual_stages") is not None)
            return {**kwargs, "schedule_note": note, "adapt_microbatches": True}, choice
    note = (f"schedule {base.schedule.name!r}, n_microbatches={base.n_microbatches}: the fixed default, not chosen "
            f"automatically because {why} ({base.schedule_note})")
    return {**option_kwargs, "schedule_note": note}, None


def _default_note(choice: AutoChoice, base: PipelineOptions, *, placed: bool) -> str:
    """The default's ``schedule_note``; ``placed``: the user named the stages per rank."""
    c = choice.chosen
    by = {e.candidate: e for e in choice.estimates}
    old = by.get(Candidate(schedule=base.schedule.name, virtual_stages=base.virtual_stages,
                           n_microbatches=base.n_microbatches))
    against = (f" against {old.relative_step:.2f}x for the old default {old.candidate.schedule} "
               f"m={old.candidate.n_microbatches}" if old is not None else "")
    return (
        f"schedule {c.schedule!r}, n_microbatches={c.n_microbatches}: chosen because no schedule or n_microbatches "
        f"was named, as the shortest simulated training step of a {choice.batch} x {choice.seq} batch among the "
        f"schedules of this placement ({by[c].relative_step:.2f}x ideal{against}), as the most a call runs: a "
        f"training step runs the count up to it simulated fastest for its own rows and length"
    ) + ("" if placed else (
        "; placements with more stages per rank (the interleaved and V schedules) are not considered: they change "
        "the stages each rank holds, hence its memory and how generate and serve run; schedule='auto' weighs them, "
        "and `hf-pipeline plan` compares"))


# ----------------------------------------------------------------------------- switching
def same_placement(spec: ScheduleSpec, options: PipelineOptions) -> bool:
    """Whether ``spec`` runs the stages ``options`` placed, as they are (same layout and count per rank)."""
    here = options.schedule
    return spec.layout == here.layout and spec.multi == here.multi and spec.accepts_virtual(options.virtual_stages)


def with_schedule(options: PipelineOptions, schedule: str, n_microbatches: int) -> PipelineOptions:
    """``options`` with another schedule of the same stage placement and another microbatch count."""
    spec = get_schedule(schedule)
    if not same_placement(spec, options):
        raise InputError(
            f"schedule {spec.name!r} places stages differently from the loaded {options.schedule.name!r} "
            f"({options.virtual_stages} per rank, {options.schedule.layout} layout); reload the model to use it"
        )
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise InputError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    check_layout(spec, pp_size=options.pp_size, virtual_stages=options.virtual_stages, n_microbatches=n_microbatches)
    return dataclasses.replace(options, schedule=spec, n_microbatches=n_microbatches, adapt_microbatches=False)


# ----------------------------------------------------------------------------- per call
@functools.lru_cache(maxsize=256)
def call_microbatches(
    schedule: str, *, pp_size: int, virtual_stages: int, n_microbatches: int, rows: int, training: bool,
    seq: int | None, flops: tuple[float, ...], device_type: str,
) -> int:
    """Microbatches a call of ``rows`` rows runs when the default chose ``n_microbatches`` for a planned batch
    (``PipelineOptions.adapt_microbatches``).

    A forward, or a step of unknown length: the most up to the chosen count that split the rows
    (:func:`~hf_pipeline.planning.schedules.fitting_microbatches`). A training step of ``seq`` tokens: among the
    counts up to the chosen one that split its rows and train with the schedule, the one whose simulated step
    is shortest for THIS call's shape, as the load chose for the planned one (the per-action overhead weighs
    more against short sequences: on 2 CPU ranks a 16 x 512 batch runs 1F1B best with 16 microbatches, a
    16 x 128 one with 8). Only counts of at least the schedule's training minimum are candidates, so no rank
    keeps more activations live than under the old default. Pure and cached: every rank computes the same.
    """
    spec = get_schedule(schedule)
    fit = fitting_microbatches(spec, pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches,
                               rows=rows, training=training)
    if not training or seq is None:
        return fit
    counts = [m for m in range(1, min(n_microbatches, rows) + 1) if rows % m == 0
              and spec.training_problem(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m) is None]
    if not counts:
        return fit
    share = sum(flops) / pp_size
    overhead = OVERHEAD_TOKENS.get(device_type, _DEFAULT_OVERHEAD_TOKENS) * share

    def step(m: int) -> float:
        return simulate_step(spec, pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m,
                             stage_cost=[f * rows * seq / m for f in flops], overhead=overhead)[0]

    # Ties (to 4 digits, as the load's choice): fewer microbatches, bigger matmuls.
    return min(counts, key=lambda m: (round(step(m) / step(fit), 4), m))
