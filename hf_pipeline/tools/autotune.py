"""Choosing the schedule, virtual stages and microbatch count: ``schedule="auto"``, ``n_microbatches="auto"``.

At load (:func:`choose`), every candidate (schedule, virtual stages, microbatches) that can train
the planned batch is costed by **simulating one training step**: each rank runs its actions in
the order torch's schedule lists them (:func:`hf_pipeline.planning.schedules.simulate_step`), an action
starting when its rank is free and its input exists (a forward after the previous stage's
forward, a backward after the next stage's backward, a weight-gradient pass after its input
pass). An action costs its stage's FLOPs per token (the planner's model, :class:`StagePlan`) times
the microbatch's tokens — forward 1x, full backward 2x, input and weight backward 1x each — plus a
fixed overhead per action (Python, communication, a smaller matmul's lower FLOP rate), written as
the compute of :data:`OVERHEAD_TOKENS` tokens of one rank's share of the model. The simulation
sees what the bubble formulas do not: stage imbalance, the schedule's real order and the cost of
many small microbatches. With ``max_memory``, candidates whose predicted training peak
(:func:`hf_pipeline.tools.memory.plan_report`) does not fit are left out. The choice is pure arithmetic
on the config, so every rank makes the same one.

:func:`tune` measures instead: on a loaded model and a real batch it times ``train_step`` for each
schedule that keeps the loaded stage placement and each microbatch count that fits the batch, and
switches the model to the fastest (collective; the step time is the slowest rank's).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="auto", n_microbatches="auto",
    ...                                              tune_batch=(16, 512))
    >>> print(model.auto_choice)            # every candidate, its estimate, and the one chosen
    >>> print(model.tune(batch))            # measured among the schedules of the loaded placement
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..errors import InputError
from ..planning.options import PipelineOptions, parse_size
from ..planning.schedules import SCHEDULES, ScheduleSpec, check_layout, get_schedule, simulate_step

__all__ = [
    "AUTO", "OVERHEAD_TOKENS", "AutoChoice", "Candidate", "Estimate", "SplitAdvice", "choose", "fit_stage_costs", "measure_split",
    "simulate_step", "tune", "with_schedule",
]

AUTO = "auto"
# Per-action overhead, as the compute of this many tokens of one rank's share of the model. CPU
# (gloo): ~1-3 ms of Python and messaging per action against ~0.3 ms per token of a 6-layer
# h384 share, and matmuls on 256-row microbatches ~10% slower than on 2048 rows (measured by the
# benchmark's microbatch cost); CUDA: kernel launches and NCCL latency are worth more tokens.
OVERHEAD_TOKENS = {"cpu": 24, "cuda": 256}
_DEFAULT_OVERHEAD_TOKENS = 64


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
        measured_seconds: median measured step time (``tune`` only).
        note: why the candidate was left out, if it was.
    """

    candidate: Candidate
    relative_step: float | None = None
    idle: float | None = None
    peak_bytes: int | None = None
    measured_seconds: float | None = None
    note: str = ""

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
def _microbatch_counts(rows: int, fixed: int | None) -> list[int]:
    if fixed is not None:
        return [fixed]
    return [m for m in range(1, min(rows, 64) + 1) if rows % m == 0]


def _candidates(
    world_size: int, *, schedule: Any, virtual_stages: int | None, num_stages: int | None, n_microbatches: Any, rows: int,
) -> list[Candidate]:
    # n_microbatches: AUTO (every count that divides the rows), None (the loader's default: one per
    # stage) or a fixed count.
    specs = list(SCHEDULES.values()) if schedule == AUTO else [get_schedule(schedule)]
    out = []
    for spec in specs:
        vs = [virtual_stages] if virtual_stages is not None else [v for v in (1, 2) if spec.accepts_virtual(v)]
        for v in vs:
            stages = num_stages if num_stages is not None else world_size * v
            if stages % v or world_size % (stages // v):
                continue
            pp = stages // v
            counts = [stages] if n_microbatches is None else _microbatch_counts(rows // (world_size // pp), None if n_microbatches == AUTO else n_microbatches)
            for m in counts:
                if spec.training_problem(pp_size=pp, virtual_stages=v, n_microbatches=m) is None:
                    out.append(Candidate(schedule=spec.name, virtual_stages=v, n_microbatches=m))
    return out


def choose(
    config, world_size: int, *, device_type: str, tune_batch: tuple[int, int] | None = None, max_memory: Any = None,
    overhead_tokens: float | None = None, **option_kwargs: Any,
) -> tuple[dict[str, Any], AutoChoice]:
    """Replace ``schedule="auto"`` / ``n_microbatches="auto"`` in ``option_kwargs`` by the best candidate.

    Args:
        config: the model config.
        world_size: processes in the job.
        device_type: "cpu", "cuda", ...: picks the per-action overhead (:data:`OVERHEAD_TOKENS`).
        tune_batch: ``(batch, seq)`` of the training steps to plan for (default ``(8 x world_size,
            min(512, max positions))``).
        max_memory: per-rank budget (bytes or "20GiB"): candidates whose predicted training peak is
            larger are left out.
        overhead_tokens: overrides the per-action overhead.
        **option_kwargs: :meth:`PipelineOptions.resolve`'s arguments, ``"auto"`` where to choose.

    Returns:
        (the arguments with concrete values, the :class:`AutoChoice`).

    Raises:
        InputError: when no candidate can train ``tune_batch`` (within ``max_memory``), naming why.
    """
    from ..loading.stages import recipe_front_end

    schedule, m_fixed = option_kwargs.get("schedule"), option_kwargs.get("n_microbatches")
    if schedule is None:  # n_microbatches="auto" alone: for the default schedule
        schedule = PipelineOptions.resolve(config, world_size, **{**option_kwargs, "n_microbatches": None}).schedule.name
    max_pos = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512)
    batch, seq = tune_batch if tune_batch is not None else (8 * world_size, min(512, max_pos))
    if batch < 1 or seq < 1:
        raise InputError(f"tune_batch must be (batch, seq) with both >= 1, got {tune_batch!r}")
    budget = parse_size(max_memory, what="max_memory") if max_memory is not None else None
    cands = _candidates(
        world_size, schedule=schedule, virtual_stages=option_kwargs.get("virtual_stages"), num_stages=option_kwargs.get("num_stages"),
        n_microbatches=m_fixed, rows=batch,
    )
    if not cands:
        raise InputError(
            f"no schedule trains a batch of {batch} rows on {world_size} processes with these settings "
            f"(schedule={schedule!r}, n_microbatches={m_fixed!r}); pass tune_batch=(batch, seq) with more rows, or fix the schedule"
        )
    tokens = overhead_tokens if overhead_tokens is not None else OVERHEAD_TOKENS.get(device_type, _DEFAULT_OVERHEAD_TOKENS)
    plans: dict[tuple[int, str, int], Any] = {}
    estimates = []
    for c in cands:
        opts = PipelineOptions.resolve(config, world_size, **{  # the layout checks of loading, too
            **option_kwargs, "schedule": c.schedule, "virtual_stages": c.virtual_stages, "n_microbatches": c.n_microbatches,
        })
        spec = opts.schedule
        # The split balances for the schedule and microbatch count (make_plan) when a rank holds
        # several stages; with one stage per rank it is the same for every candidate.
        key = (opts.virtual_stages, spec.layout, opts.pp_size) + ((spec.name, c.n_microbatches) if opts.virtual_stages > 1 else ())
        if key not in plans:
            # The loader's own front end (the plan from_pretrained will build); the tracer's split is
            # costed as balanced, since tracing every candidate would cost more than it tells.
            plans[key] = None if opts.traced else recipe_front_end(config, opts).plan
        plan = plans[key]
        rows = batch // opts.dp_size
        mb_tokens = rows * seq / c.n_microbatches
        per_token = [s.flops_per_token for s in plan.stages] if plan is not None else [1.0] * opts.num_stages
        total = sum(per_token)
        share = total / opts.pp_size  # one rank's share of the model, per token
        step, busy = simulate_step(
            spec, pp_size=opts.pp_size, virtual_stages=opts.virtual_stages, n_microbatches=c.n_microbatches,
            stage_cost=[f * mb_tokens for f in per_token], overhead=tokens * share,
        )
        ideal = 3 * total * rows * seq / opts.pp_size
        peak, note = None, ""
        if budget is not None:
            from .memory import plan_report

            report = plan_report(
                config, stages=opts.num_stages, virtual_stages=opts.virtual_stages, schedule=c.schedule, dtype=opts.dtype,
                batch=rows, seq=seq, n_microbatches=c.n_microbatches, auto_class=opts.model_class, split=opts.split,
            )
            peak = max(r.train_peak_bytes for r in report.ranks)
            if peak > budget:
                note = f"predicted peak {peak / 2**20:.0f} MiB > max_memory {budget / 2**20:.0f} MiB"
        estimates.append(Estimate(candidate=c, relative_step=step / ideal, idle=1 - max(busy.values()) / step, peak_bytes=peak, note=note))
    usable = [e for e in estimates if e.usable]
    if not usable:
        raise InputError(
            f"no schedule fits max_memory={max_memory!r} for a batch of {batch} x {seq} tokens: the smallest predicted peak is "
            f"{min(e.peak_bytes for e in estimates) / 2**20:.0f} MiB; use more stages, a smaller tune_batch or a larger budget"
        )
    # Ties: fewer microbatches (bigger matmuls), then fewer stages per rank (fewer messages).
    best = min(usable, key=lambda e: (round(e.relative_step, 4), e.candidate.virtual_stages, e.candidate.n_microbatches))
    chosen = best.candidate
    kwargs = {**option_kwargs, "schedule": chosen.schedule, "virtual_stages": chosen.virtual_stages, "n_microbatches": chosen.n_microbatches}
    return kwargs, AutoChoice(chosen=chosen, estimates=tuple(estimates), basis="cost model", batch=batch, seq=seq)


# ----------------------------------------------------------------------------- measured
def tune(
    model: Any, batch: Mapping[str, Any], *, schedules: Sequence[str] | None = None, n_microbatches: Sequence[int] | None = None,
    steps: int = 2,
) -> AutoChoice:
    """Time ``train_step`` on ``batch`` for each schedule of the loaded placement and microbatch
    count, and switch the model to the fastest (collective: every rank passes the same batch).

    Gradients are cleared afterwards (set to None); the weights are not changed.

    Args:
        model: a loaded :class:`~hf_pipeline.model.PipelinedModel`.
        batch: a training batch, as for ``train_step``.
        schedules: the schedules to try (default: every schedule that places the stages as loaded).
        n_microbatches: the counts to try (default: every count that divides the batch's rows per
            replica, 1..64, and that the schedule trains).
        steps: timed steps per candidate, after one untimed.
    """
    import torch.distributed as dist

    plan, dims = model.plan, model.dims
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    rows, seq = int(first.shape[0]), int(first.shape[-1])
    names = list(schedules) if schedules is not None else [s.name for s in SCHEDULES.values() if _same_placement(s, model.options)]
    cands = []
    for name in names:
        # Refused before any step when it would need other stages (the message of set_schedule).
        spec = with_schedule(model.options, name, model.n_microbatches).schedule
        for m in (list(n_microbatches) if n_microbatches is not None else _microbatch_counts(rows // dims.dp_size, None)):
            if (rows // dims.dp_size) % m == 0 and spec.training_problem(pp_size=plan.pp_size, virtual_stages=plan.virtual_stages, n_microbatches=m) is None:
                cands.append(Candidate(schedule=spec.name, virtual_stages=plan.virtual_stages, n_microbatches=m))
    if not cands:
        raise InputError(f"no schedule of the loaded placement trains a batch of {rows} rows; pass n_microbatches= counts that divide it")
    before = (model.schedule.name, model.n_microbatches)
    estimates = []
    try:
        for c in cands:
            model.set_schedule(c.schedule, n_microbatches=c.n_microbatches)
            times = []
            for i in range(steps + 1):
                t = time.perf_counter()
                model.train_step(batch)
                took = torch.tensor([time.perf_counter() - t])
                if dist.is_initialized():
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the pipeline is as slow as its slowest rank
                if i:
                    times.append(float(took))
            estimates.append(Estimate(candidate=c, measured_seconds=statistics.median(times)))
    except BaseException:
        model.set_schedule(before[0], n_microbatches=before[1])
        raise
    finally:
        for p in model.parameters():
            p.grad = None
    best = min(estimates, key=lambda e: e.measured_seconds)
    model.set_schedule(best.candidate.schedule, n_microbatches=best.candidate.n_microbatches)
    return AutoChoice(chosen=best.candidate, estimates=tuple(estimates), basis="measured", batch=rows, seq=seq)


def _same_placement(spec: ScheduleSpec, options: PipelineOptions) -> bool:
    """Whether ``spec`` runs the stages ``options`` placed, as they are (same layout and count per rank)."""
    here = options.schedule
    return spec.layout == here.layout and spec.multi == here.multi and spec.accepts_virtual(options.virtual_stages)


def with_schedule(options: PipelineOptions, schedule: str, n_microbatches: int) -> PipelineOptions:
    """``options`` with another schedule of the same stage placement and another microbatch count."""
    spec = get_schedule(schedule)
    if not _same_placement(spec, options):
        raise InputError(
            f"schedule {spec.name!r} places stages differently from the loaded {options.schedule.name!r} "
            f"({options.virtual_stages} per rank, {options.schedule.layout} layout); reload the model to use it"
        )
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise InputError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    check_layout(spec, pp_size=options.pp_size, virtual_stages=options.virtual_stages, n_microbatches=n_microbatches)
    return dataclasses.replace(options, schedule=spec, n_microbatches=n_microbatches)


# ----------------------------------------------------------------------------- measured split
@dataclass(frozen=True, kw_only=True)
class SplitAdvice:
    """A split balanced on measured stage costs (:func:`measure_split`); pass ``split`` to ``from_pretrained``.

    Attributes:
        split: what starts stages 1..S-1 in the balanced split (``from_pretrained(split=...)``).
        current: the same for the loaded split.
        stage_seconds: measured compute per microbatch of each loaded stage (forward, backward, loss).
        seconds_per_flop: the fitted cost of the blocks: seconds per microbatch per FLOP per token.
        measured_flops: the modules whose cost was measured apart from the blocks' (the head and its
            loss), as the FLOPs of a block per token that cost the same time.
        counted_flops: the FLOP count of those modules, per token.
        block_flops: one block's FLOPs per token (the mean over the loaded stages' blocks).
        rank_seconds: measured compute per microbatch of each rank, as loaded.
        predicted_rank_seconds: the same predicted for ``split``.
    """

    split: tuple[str, ...]
    current: tuple[str, ...]
    stage_seconds: tuple[float, ...]
    seconds_per_flop: float
    measured_flops: dict[str, float]
    counted_flops: dict[str, float]
    block_flops: float
    rank_seconds: tuple[float, ...]
    predicted_rank_seconds: tuple[float, ...]

    @property
    def changed(self) -> bool:
        return self.split != self.current

    def head_blocks(self) -> dict[str, tuple[float, float]]:
        """Each module measured apart, as (measured, by FLOPs) in blocks' worth of cost."""
        return {m: (f / self.block_flops, self.counted_flops[m] / self.block_flops) for m, f in self.measured_flops.items()}

    def to_dict(self) -> dict[str, Any]:
        """The figures, for JSON (the benchmark's results, the device check's)."""
        heads = self.head_blocks()
        return {
            "planned": list(self.current), "split": list(self.split), "stage_seconds": list(self.stage_seconds),
            "rank_seconds": list(self.rank_seconds), "predicted_rank_seconds": list(self.predicted_rank_seconds),
            "head_blocks": {m: b for m, (b, _) in heads.items()}, "head_blocks_by_flops": {m: c for m, (_, c) in heads.items()},
        }

    def __str__(self) -> str:
        def ms(xs):
            return ", ".join(f"{x * 1e3:.1f}" for x in xs)

        def spread(xs):
            return max(xs) / (sum(xs) / len(xs))

        head = ", ".join(f"{m} {b:.2f} blocks ({c:.2f} by FLOPs)" for m, (b, c) in self.head_blocks().items()) or "none"
        return "\n".join([
            f"measured split ({'a new split' if self.changed else 'the loaded split is balanced'}):",
            f"  loaded   {list(self.current)}: stages {ms(self.stage_seconds)} ms per microbatch; ranks {ms(self.rank_seconds)} ms "
            f"(busiest {spread(self.rank_seconds):.3f}x the mean)",
            f"  balanced {list(self.split)}: ranks {ms(self.predicted_rank_seconds)} ms predicted "
            f"(busiest {spread(self.predicted_rank_seconds):.3f}x the mean)",
            f"  measured apart from the blocks: {head}",
        ])


def fit_stage_costs(block_flops: Sequence[float], extra_flops: Sequence[Mapping[str, float]], seconds: Sequence[float]) -> tuple[float, dict[str, float]]:
    """Fit measured stage times to the planner's FLOP counts.

    The blocks of every stage cost the same seconds per FLOP (``alpha``), fitted on the stages whose
    other modules do no matmul (embedding lookups, norms: counted as free); what a stage with
    matmul-doing extra modules (the LM head, its loss) takes beyond its blocks is measured for those
    modules, shared among them by their FLOPs, and given back as the block FLOPs that cost as much.

    Args:
        block_flops: each stage's block FLOPs per token (:func:`hf_pipeline.planning.plan.stage_flops_parts`).
        extra_flops: each stage's other modules, by name, with their FLOPs per token.
        seconds: each stage's measured seconds per microbatch.

    Returns:
        (alpha, {module: FLOPs per token of a block that cost as much as the module measured}).
    """
    bearing = [{m: f for m, f in extra.items() if f > 0} for extra in extra_flops]
    fit = [s for s in range(len(seconds)) if not bearing[s] and block_flops[s] > 0]
    if not fit:
        raise InputError("no stage runs blocks without a head: the blocks' cost cannot be told apart from the head's; use more stages")
    alpha = sum(seconds[s] for s in fit) / sum(block_flops[s] for s in fit)
    measured: dict[str, float] = {}
    for s, mods in enumerate(bearing):
        if mods:
            rest = max(seconds[s] - alpha * block_flops[s], 0.0) / alpha
            total = sum(mods.values())
            for m, f in mods.items():
                measured[m] = measured.get(m, 0.0) + rest * f / total
    return alpha, measured


def measure_split(model: Any, batch: Mapping[str, Any], *, steps: int = 2) -> SplitAdvice:
    """Time each stage's compute on ``batch`` and balance the split on those times.

    The planner's split balances FLOPs, which rate an LM head and its loss against the blocks as a
    matmul-bound device would; on a real device the blocks' non-matmul work (norms, rotary
    embeddings, attention's softmax, elementwise products) and the loss's make the ratio differ. This
    runs ``steps`` training steps (after one untimed) under :func:`hf_pipeline.tools.profile.record`, fits
    the stages' times to their FLOPs (:func:`fit_stage_costs`) and plans the split again with the head's
    measured cost, for the loaded schedule and microbatch count. Collective: every rank passes the same
    batch and gets the same advice (data-parallel replicas' times are averaged). Gradients are cleared
    afterwards; the weights are not changed and the loaded split stays: pass ``advice.split`` to
    ``from_pretrained(split=...)`` when loading next.

    Example:
        >>> advice = model.measure_split(batch)
        >>> print(advice)                  # measured and predicted per-rank times
        >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="zbv-zero-bubble", split=advice.split)
    """
    import torch.distributed as dist

    from ..planning.plan import make_plan, stage_flops_parts
    from .profile import record

    plan, maker = model.plan, model.stage_maker
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer, got {steps!r}")
    if plan.pp_size < 2:
        raise InputError("measure_split balances the stages of a pipeline of 2 or more ranks; this model runs on one")
    try:
        model.train_step(batch)  # untimed (torch builds its stages and schedule on a first step); checks the batch
        with record(model) as prof:
            for _ in range(steps):
                model.train_step(batch)
        timeline = prof.timeline()  # collective over the pipeline group
    finally:
        for p in model.parameters():
            p.grad = None
    seq = int(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[-1])  # attention's length, as the planner costs it
    # A stage's cost per microbatch: the median over microbatches (and steps) of all its work on one
    # microbatch (forward, loss, backward: whole or as input and weight halves). A median, as a
    # core's stall (another tenant, a page fault) lands on a few actions and would move a mean.
    work: dict[tuple[int, int, int], float] = {}
    for r in timeline.records:
        if r.stage is not None and r.microbatch is not None and r.kind in ("F", "B", "I", "W", "loss"):
            key = (r.stage, r.step, r.microbatch)
            work[key] = work.get(key, 0.0) + r.duration
    seconds = torch.tensor(
        [statistics.median(w for (s, _, _), w in work.items() if s == stage) for stage in range(plan.num_stages)], dtype=torch.float64,
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank of a replica holds its replica's figures: the sum over all ranks is pp_size x the
        # sum over replicas, and its quotient by the world size the replicas' mean, the same on every rank.
        dist.all_reduce(seconds)
        seconds /= dist.get_world_size()
    seconds_list = [float(x) for x in seconds]
    parts = [stage_flops_parts(maker.skeleton, maker.resolved, s, seq_len=seq) for s in plan.stages]
    alpha, measured = fit_stage_costs([b for b, _ in parts], [e for _, e in parts], seconds_list)
    balanced = make_plan(
        maker.skeleton, maker.resolved, pp_size=plan.pp_size, virtual_stages=plan.virtual_stages, layout=plan.layout,
        split="auto", dtype=plan.dtype, seq_len=seq, schedule=model.schedule, n_microbatches=model.n_microbatches,
        measured_flops=measured,
    )

    def per_rank(values: Sequence[float], p) -> tuple[float, ...]:
        return tuple(sum(values[s.index] for s in p.stages if s.rank == r) for r in range(p.pp_size))

    counted = {m: f for _, extra in parts for m, f in extra.items() if m in measured}
    n_blocks = sum(len(s.blocks) - 0.5 * len(s.halves) for s in plan.stages)
    return SplitAdvice(
        split=balanced.split_points, current=plan.split_points, stage_seconds=tuple(seconds_list), seconds_per_flop=alpha,
        measured_flops=measured, counted_flops=counted, block_flops=sum(b for b, _ in parts) / n_blocks,
        rank_seconds=per_rank(seconds_list, plan),
        predicted_rank_seconds=per_rank([alpha * s.flops_per_token for s in balanced.stages], balanced),
    )
