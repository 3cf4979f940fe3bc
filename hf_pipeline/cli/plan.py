"""``hf-pipeline plan`` and ``hf-pipeline convert``: a checkpoint's stage plan, and its files re-sharded by stage."""

from __future__ import annotations

from ..errors import CLIError
from .arguments import auto_class_for, load_config, split_option

__all__ = ["cmd_convert", "cmd_plan"]


def cmd_plan(args) -> int:
    """``hf-pipeline plan``: the stage table and per-rank memory, from the config alone (for a mesh with
    ``--num-processes`` / ``--tp-size`` / ``--fsdp-size`` / ``--ep-size`` / ``--ep-over``)."""
    config = load_config(args.path, args.download)
    auto = auto_class_for(config, args.auto_class)
    from ..memory.planner import plan_report
    from ..runtime.checks import max_positions

    limit = max_positions(config)
    if args.seq is not None and limit is not None and args.seq > limit:
        raise CLIError(
            f"--seq {args.seq} is longer than the {limit} positions the model has (config.max_position_embeddings); "
            f"pass --seq {limit} or less"
        )

    common = dict(
        virtual_stages=args.virtual_stages, schedule=args.schedule, dtype=args.dtype, batch=args.batch, seq=args.seq,
        n_microbatches=args.n_microbatches, auto_class=auto, split=split_option(args.split),
        checkpoint_every_n_layers=args.checkpoint_every_n_layers, moe_routing=args.moe_routing,
    )
    if args.schedule is None and args.n_microbatches is None:
        common.update(_default_choice(config, args, auto))
    if args.mesh_processes is None and args.tp_size == 1 and args.fsdp_size == 1 and args.ep_size == 1:
        report = plan_report(config, stages=args.stages or 2, ep_over=args.ep_over, **common)
    else:  # a mesh: every rank's share of it
        from ..memory.mesh_report import mesh_report

        report = mesh_report(config, num_processes=args.mesh_processes, tp_size=args.tp_size,
                             fsdp_size=args.fsdp_size, ep_size=args.ep_size, ep_over=args.ep_over, stages=args.stages,
                             **common)
    print(report.to_json() if args.json else report)
    return 0


def _default_choice(config, args, auto) -> dict:
    """The schedule, count and note a load naming neither would choose for these stages and mesh (on this
    machine's device); the stages and world as ``mesh_report`` takes them (one replica unless ``--num-processes``)."""
    import torch

    from ..memory.auto_choice_costs import default_choice
    from ..memory.mesh_report import mesh_layout, mesh_shape
    from ..planning.tp_plan import ParallelRequest

    stages, world = mesh_layout(args.mesh_processes, args.stages, virtual_stages=args.virtual_stages,
                                tp_size=args.tp_size, fsdp_size=args.fsdp_size, ep_size=args.ep_size,
                                ep_over=args.ep_over)
    # the mesh's own checks first, worded for the flags (the report repeats them)
    mesh_shape(world, pp_size=max(1, stages // (args.virtual_stages or 1)), tp_size=args.tp_size,
               fsdp_size=args.fsdp_size, ep_size=args.ep_size, ep_over=args.ep_over)
    parallel = ParallelRequest(tp_size=args.tp_size, ep_size=args.ep_size, fsdp_size=args.fsdp_size,
                               ep_over=args.ep_over)
    common = dict(device_type="cuda" if torch.cuda.is_available() else "cpu", auto_class=auto,
                  split=split_option(args.split), parallel=None if parallel == ParallelRequest() else parallel)
    kwargs, choice = default_choice(config, world, virtual_stages=args.virtual_stages, num_stages=stages, **common)
    if choice is not None and args.virtual_stages is None:  # the placement the default does not weigh, compared
        kwargs["schedule_note"] += _two_per_rank(config, world, stages, choice, common)
    return {k: kwargs.get(k, None) for k in ("schedule", "n_microbatches", "virtual_stages", "schedule_note")}


def _two_per_rank(config, world: int, stages: int, default, common: dict) -> str:
    """What ``schedule="auto"`` chooses for the same pipeline ranks holding 2 stages each, against the default's
    simulated step (the same cost model), as a sentence for the schedule note."""
    from ..errors import PipelineError
    from ..memory.auto_choice_costs import choose

    try:
        _, auto = choose(config, world, schedule="auto", n_microbatches="auto", virtual_stages=2,
                         num_stages=2 * stages, **common)
    except PipelineError as e:
        return f". With 2 stages per rank schedule='auto' finds no schedule ({e})"
    step = {e.candidate: e.relative_step for e in (*default.estimates, *auto.estimates)}
    ours, theirs = step[default.chosen], step[auto.chosen]
    verdict = ("slower or no faster: the default loses nothing" if theirs >= ours else
               f"{ours / theirs - 1:.0%} faster: load with schedule='auto' (or {auto.chosen.schedule!r} with "
               f"n_microbatches={auto.chosen.n_microbatches}) to take it")
    return (f". With 2 stages per rank schedule='auto' would choose {auto.chosen} ({theirs:.2f}x ideal against "
            f"{ours:.2f}x for this default, same batch and cost model): {verdict}")


def cmd_convert(args) -> int:
    """``hf-pipeline convert``: per-stage files (``--stages N``) or standard shards (``--merge``)."""
    from ..tools.convert import convert_to_stages, merge_shards

    if args.merge:
        report = merge_shards(args.path, args.output, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    else:
        report = convert_to_stages(
            args.path, args.output, num_stages=args.stages, virtual_stages=args.virtual_stages,
            schedule=args.schedule, split=split_option(args.split), auto_class=args.auto_class,
            overwrite=args.overwrite,
        )
    for name, keys in report.files.items():
        print(f"  {name}: {len(keys)} tensors")
    for stage, files in report.stage_files.items():
        print(f"  stage {stage} opens {', '.join(files)}")
    print(f"wrote {report.output} ({len(report.files)} files, {report.bytes_written / 1e6:.1f} MB)")
    return 0
