"""``model.measure_split(batch)``: each stage's measured time per microbatch, and the split that balances it.

A profiled training step gives each stage's device time per microbatch; a least-squares fit turns
the times into the cost of a block and of each head module (:func:`fit_stage_costs`), and the
planner's balancing then splits the model on those costs (:class:`SplitAdvice`; pass its ``split``
to ``from_pretrained(split=...)`` when loading next).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..core import PipelineCore
from ..errors import InputError

__all__ = ["SplitAdvice", "fit_stage_costs", "measure_split"]


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
        return {
            m: (f / self.block_flops, self.counted_flops[m] / self.block_flops)
            for m, f in self.measured_flops.items()
        }

    def to_dict(self) -> dict[str, Any]:
        """The figures, for JSON (the benchmark's results, the device check's)."""
        heads = self.head_blocks()
        return {
            "planned": list(self.current), "split": list(self.split), "stage_seconds": list(self.stage_seconds),
            "rank_seconds": list(self.rank_seconds), "predicted_rank_seconds": list(self.predicted_rank_seconds),
            "head_blocks": {m: b for m, (b, _) in heads.items()},
            "head_blocks_by_flops": {m: c for m, (_, c) in heads.items()},
        }

    def __str__(self) -> str:
        def ms(xs):
            return ", ".join(f"{x * 1e3:.1f}" for x in xs)

        def spread(xs):
            return max(xs) / (sum(xs) / len(xs))

        head = ", ".join(f"{m} {b:.2f} blocks ({c:.2f} by FLOPs)" for m, (b, c) in self.head_blocks().items()) or "none"
        return "\n".join([
            f"measured split ({'a new split' if self.changed else 'the loaded split is balanced'}):",
            f"  loaded   {list(self.current)}: stages {ms(self.stage_seconds)} ms per microbatch; ranks "
            f"{ms(self.rank_seconds)} ms "
            f"(busiest {spread(self.rank_seconds):.3f}x the mean)",
            f"  balanced {list(self.split)}: ranks {ms(self.predicted_rank_seconds)} ms predicted "
            f"(busiest {spread(self.predicted_rank_seconds):.3f}x the mean)",
            f"  measured apart from the blocks: {head}",
        ])


def fit_stage_costs(block_flops: Sequence[float], extra_flops: Sequence[Mapping[str, float]],
                    seconds: Sequence[float]) -> tuple[float, dict[str, float]]:
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
        raise InputError(
            "no stage runs blocks without a head: the blocks' cost cannot be told apart from the head's; "
            "use more stages"
        )
    alpha = sum(seconds[s] for s in fit) / sum(block_flops[s] for s in fit)
    measured: dict[str, float] = {}
    for s, mods in enumerate(bearing):
        if mods:
            rest = max(seconds[s] - alpha * block_flops[s], 0.0) / alpha
            total = sum(mods.values())
            for m, f in mods.items():
                measured[m] = measured.get(m, 0.0) + rest * f / total
    return alpha, measured


def measure_split(model: PipelineCore, batch: Mapping[str, Any], *, steps: int = 2) -> SplitAdvice:
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
        >>> model = AutoModelForCausalLM.from_pretrained(
        ...     path, pipeline=True, schedule="zbv-zero-bubble", split=advice.split)
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
    # attention's length, as the planner costs it
    seq = int(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[-1])
    # A stage's cost per microbatch: the median over microbatches (and steps) of all its work on one
    # microbatch (forward, loss, backward: whole or as input and weight halves). A median, as a
    # core's stall (another tenant, a page fault) lands on a few actions and would move a mean.
    work: dict[tuple[int, int, int], float] = {}
    for r in timeline.records:
        if r.stage is not None and r.microbatch is not None and r.kind in ("F", "B", "I", "W", "loss"):
            key = (r.stage, r.step, r.microbatch)
            work[key] = work.get(key, 0.0) + r.duration
    seconds = torch.tensor(
        [statistics.median(w for (s, _, _), w in work.items() if s == stage) for stage in range(plan.num_stages)],
        dtype=torch.float64,
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
        split=balanced.split_points, current=plan.split_points, stage_seconds=tuple(seconds_list),
        seconds_per_flop=alpha,
        measured_flops=measured, counted_flops=counted, block_flops=sum(b for b, _ in parts) / n_blocks,
        rank_seconds=per_rank(seconds_list, plan),
        predicted_rank_seconds=per_rank([alpha * s.flops_per_token for s in balanced.stages], balanced),
    )
