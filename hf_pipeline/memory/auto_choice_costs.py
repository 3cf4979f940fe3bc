"""The load-time ``schedule="auto"`` choice, costed on what only the rooms above planning can build.

The rules of the choice (candidates, the simulated step, ties, the memory budget) are
:func:`hf_pipeline.planning.auto_choice.choose_candidate`'s. It needs two figures per candidate that
planning cannot compute, since both build the model on the meta device: the stage plan the loader
will build (``loading.stages.recipe_front_end``), its FLOPs per stage those of one rank of the stage
(:func:`~.mesh_shares.rank_flops_per_token`: a tensor-parallel rank's slices, an expert-parallel rank's
experts), and, with ``max_memory``, the fullest rank's predicted training peak on the load's mesh
(:func:`~hf_pipeline.memory.mesh_report.mesh_report`: parameters, gradients and AdamW state as the rank
holds them under tp / ep / fsdp, fsdp's gathers, and the activations of its routed tokens from a
fake-tensor run of those stages). This module passes both in, so it sits in the lowest room that
holds the memory planner; :func:`chooser` is what every load calls (``model.load_pipelined``).

Example:
    >>> kwargs, choice = choose(config, 2, device_type="cpu", tune_batch=(16, 512), schedule="auto",
    ...                         n_microbatches="auto", max_memory="20GiB")
    >>> print(choice)                      # every candidate, its estimate (and peak), and the one chosen
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..errors import InputError
from ..loading.stages import recipe_front_end
from ..planning.auto_choice import AutoChoice, Candidate, choose_candidate, choose_default
from ..planning.moe_costs import routed_shares
from ..planning.options import PipelineOptions
from ..planning.plan import StagePlan
from ..planning.resolve import hidden_size
from .mesh_report import mesh_report
from .mesh_shares import rank_flops_per_token

__all__ = ["choose", "chooser", "default_choice", "predicted_training_peak"]


def chooser(schedule: Any, n_microbatches: Any, *, tune_batch: Any, max_memory: Any):
    """What every load calls to replace ``"auto"`` options (``choose(config, world_size, device_type=...,
    **resolve_kwargs) -> (resolve_kwargs, choice)``), with ``tune_batch`` / ``max_memory`` bound: :func:`choose`
    when ``schedule`` or ``n_microbatches`` is ``"auto"``, :func:`default_choice` when neither is named; else
    None (and those two, which only plan the choice, are refused)."""
    if schedule == "auto" or n_microbatches == "auto":
        return functools.partial(choose, tune_batch=tune_batch, max_memory=max_memory)
    if schedule is None and n_microbatches is None:
        return functools.partial(default_choice, tune_batch=tune_batch, max_memory=max_memory)
    if tune_batch is not None or max_memory is not None:
        raise InputError(
            "tune_batch / max_memory plan the automatic choice: pass them with schedule='auto' or n_microbatches='auto'"
            ", or name neither schedule nor n_microbatches"
        )
    return None


def default_choice(
    config, world_size: int, *, device_type: str, tune_batch: tuple[int, int] | None = None, max_memory: Any = None,
    **option_kwargs: Any,
) -> tuple[dict[str, Any], AutoChoice | None]:
    """The schedule and microbatch count of a load that names neither
    (:func:`~hf_pipeline.planning.auto_choice.choose_default`, costed as :func:`choose`); never raises for the
    choice itself."""
    return choose_default(
        config, world_size, device_type=device_type, stage_plan=_loader_plan, predicted_peak=predicted_training_peak,
        tune_batch=tune_batch, max_memory=max_memory, **option_kwargs,
    )


def choose(
    config, world_size: int, *, device_type: str, tune_batch: tuple[int, int] | None = None, max_memory: Any = None,
    overhead_tokens: float | None = None, **option_kwargs: Any,
) -> tuple[dict[str, Any], AutoChoice]:
    """Replace ``schedule="auto"`` / ``n_microbatches="auto"`` in ``option_kwargs`` by the best candidate.

    :func:`~hf_pipeline.planning.auto_choice.choose_candidate` (whose arguments these are) with the
    loader's stage plan and :func:`predicted_training_peak` as its costs.

    Args:
        config: the model config.
        world_size: processes in the job.
        device_type: "cpu", "cuda", ...: picks the per-action overhead.
        tune_batch: ``(batch, seq)`` of the training steps to plan for.
        max_memory: per-rank budget (bytes or "20GiB"): candidates whose predicted training peak is
            larger are left out.
        overhead_tokens: overrides the per-action overhead.
        **option_kwargs: :meth:`PipelineOptions.resolve`'s arguments, ``"auto"`` where to choose.

    Returns:
        (the arguments with concrete values, the :class:`~hf_pipeline.planning.auto_choice.AutoChoice`).
    """
    return choose_candidate(
        config, world_size, device_type=device_type, stage_plan=_loader_plan, predicted_peak=predicted_training_peak,
        tune_batch=tune_batch, max_memory=max_memory, overhead_tokens=overhead_tokens, **option_kwargs,
    )


def _loader_plan(config, options: PipelineOptions) -> StagePlan:
    """The plan from_pretrained will build for these options (the loader's own front end), each stage's FLOPs per
    token those of one of its ranks (:func:`~.mesh_shares.rank_flops_per_token`; the whole stage without tp / ep)."""
    maker = recipe_front_end(config, options)
    if options.tp_size == 1:
        return maker.plan
    shares, hidden = routed_shares(maker.skeleton), hidden_size(maker.skeleton)
    stages = tuple(
        dataclasses.replace(spec, flops_per_token=rank_flops_per_token(
            stage, options, flops=spec.flops_per_token, attention=len(spec.attention_blocks), hidden=hidden,
            shares=shares))
        for spec, stage in zip(maker.plan.stages, maker.make_stages(maker.plan.stages)))
    return dataclasses.replace(maker.plan, stages=stages)


def predicted_training_peak(config, opts: PipelineOptions, c: Candidate, *, rows: int, seq: int) -> int:
    """The fullest rank's predicted training peak for candidate ``c`` on the options' mesh
    (:func:`.mesh_report.mesh_report`, ``rows`` per pipeline): weights, gradients and AdamW state as the rank
    holds them, fsdp's gathers, P2P buffers and its live activations, a mixture of experts' priced at the
    ``"worst"`` routing (an upper bound: every token's top_k experts on this rank as far as it holds them; with
    experts over data-parallel ranks, of every token of its ep group's replicas)."""
    # the stage's tp_size ranks split only the experts (experts over data: tp_size is the stage's own)
    ep_alone = opts.ep_size > 1 and not opts.tp_plan and opts.ep_data == 1
    report = mesh_report(
        config, num_processes=opts.dp_size * opts.pp_size * opts.tp_size, tp_size=1 if ep_alone else opts.tp_size,
        ep_size=opts.ep_size, ep_over=opts.ep_over, fsdp_size=opts.fsdp_size, stages=opts.num_stages,
        virtual_stages=opts.virtual_stages, batch=rows * opts.dp_size, schedule=c.schedule, dtype=opts.dtype, seq=seq,
        n_microbatches=c.n_microbatches, auto_class=opts.model_class, split=opts.split,
    )
    return max(r.train_peak_bytes for r in report.ranks)
