"""The only loader: options -> agreement -> front end -> parallel dims -> wanted tensors -> load -> materialise.

``from_pretrained(path, pipeline=True)`` ends here, whichever way its stages are made. A *front
end* turns the config and the resolved :class:`~hf_pipeline.planning.options.PipelineOptions` into a
:class:`~hf_pipeline.loading.stages.StageMaker`: the stage plan and how to make this rank's stages
on the meta device. There are two, returning the same thing:

- :func:`hf_pipeline.loading.stages.recipe_front_end`: stages cut from the HF model by its recipe;
- :func:`hf_pipeline.loading.trace.trace_front_end`: stages split by torch.export (no recipe).

Everything after the front end is one code path: the pipeline groups (:class:`ParallelDims`),
the checkpoint keys this rank's stages need (:func:`~hf_pipeline.loading.key_plan.wanted_tensors`),
the shard-by-shard read (:func:`hf_pipeline.loading.weights.load_tensors`) and the materialisation
of every local stage with one Parameter per tied group across all of them (so an optimizer steps a
tied tensor once).

Example:
    >>> loaded = load_pipeline(transformers.AutoModelForCausalLM, path, LoadOptions(n_microbatches=4))
    >>> loaded.stage_maker.plan.num_stages, [s.spec.index for s in loaded.stages]
    (2, [0])
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..checked_files import is_regular_file, read_json
from ..compat import attn_implementation as set_attention
from ..distributed.agreement import check_same_on_all_ranks, collective_errors
from ..distributed.context import RankContext, init_distributed
from ..distributed.dims import ParallelDims
from ..distributed.groups import own_group
from ..errors import InputError
from ..load_options import LoadOptions
from ..log import get_logger
from ..planning.options import PipelineOptions, load_config
from ..planning.plan import StagePlan
from ..planning.tp_plan import ParallelRequest, parallel_request
from .checkpoint_files import CheckpointIndex, resolve_checkpoint
from .compiled import check_compile, compile_blocks
from .expert_parallel import apply_expert_parallel, expert_parts
from .fsdp import fsdp_parts, refuse_packed, set_buffers, shard_stages
from .identity import parallel_arguments, pipeline_identity
from .key_conversions import convert_tensors, load_conversions, merge_in_place, narrow_conversion
from .key_plan import UNEXPECTED_HINT, key_plan, log_load_report, wanted_tensors
from .missing_weights import agreed_rng_state, initialize_missing
from .stages import StageMaker, materialize
from .tensor_parallel import apply_tensor_parallel, local_slice, shard_parts
from .weights import LoadReport, load_tensors

__all__ = ["LoadedPipeline", "StageMaker", "load_pipeline", "wanted_tensors"]


@dataclass(kw_only=True)
class LoadedPipeline:
    """This rank's part of a loaded pipeline: what :class:`~hf_pipeline.model.PipelinedModel` wraps."""

    options: PipelineOptions
    stage_maker: StageMaker
    ctx: RankContext
    dims: ParallelDims
    stages: list[nn.Module]
    checkpoint_dir: pathlib.Path | None
    load_report: LoadReport
    auto_choice: Any = None  # what schedule="auto" / n_microbatches="auto" chose (planning.auto_choice.AutoChoice)


def check_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Raise if ``device`` cannot do a matmul in ``dtype`` (fp16 on some CPUs), naming the fix."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        raise InputError(
            f"dtype {dtype} is not supported on device {device} ({e}); load with dtype='float32'"
        ) from None


def front_end(config, options: PipelineOptions, device: torch.device) -> StageMaker:
    """The :class:`StageMaker` of ``config``'s model: from its recipe, or traced when ``options.traced``."""
    if options.traced:
        from .trace import trace_front_end  # torch.export machinery only when it is used

        return trace_front_end(config, options, device=device)
    from .stages import recipe_front_end

    return recipe_front_end(config, options)


def _refuse_remote_code(ckpt: pathlib.Path, config) -> None:
    """Raise for ``trust_remote_code=True`` on a checkpoint that ships modelling code (``auto_map``)."""
    auto_map = getattr(config, "auto_map", None) if config is not None else None
    if auto_map is None and is_regular_file(ckpt / "config.json", "the model config"):
        auto_map = read_json(ckpt / "config.json", "the model config", expect=dict).get("auto_map")
    if auto_map:
        raise InputError(
            f"trust_remote_code=True: {ckpt} has its own modelling code (auto_map {sorted(auto_map)} in config.json), "
            "which pipeline=True never runs: stages are built from transformers' own classes. Load it with "
            "pipeline=False to run that code, or without trust_remote_code to use transformers' class for its "
            "model_type"
        )


_AGREE_HINT = (
    "Every rank must load the same checkpoint (the same files; the path may differ per host) with the same "
    "from_pretrained arguments: launch one script with one command line everywhere, and compute no argument from the "
    "rank or the host"
)


def _read_config(ckpt: pathlib.Path, config, *, attn_implementation: str | None, trust_remote_code: bool):
    """The config the stages are built from: the caller's (copied when changed) or the checkpoint's."""
    generation = ckpt / "generation_config.json"  # read later by transformers: a FIFO there must not block it
    if is_regular_file(generation, "the generation config"):
        read_json(generation, "the generation config", expect=dict)  # truncated or foreign: named now, on every rank
    if trust_remote_code:
        _refuse_remote_code(ckpt, config)
    if config is None:
        config = load_config(ckpt)  # the one config loader (a checkpoint directory: its config.json)
    elif attn_implementation is not None:
        config = copy.deepcopy(config)  # as transformers: the caller's config is left as it was
    if attn_implementation is not None:
        # transformers' own setter (sub-configs too); the model's __init__ validates it when the meta model is built.
        set_attention(config, attn_implementation)
    return config


def _resolve_options(
    config, ctx: RankContext, choose: Callable[..., tuple[dict[str, Any], Any]] | None, asked: LoadOptions,
    auto_class: str | type,
) -> tuple[PipelineOptions, Any]:
    """The resolved options and what ``choose`` picked for their ``"auto"`` values (None without it)."""
    auto_choice = None
    resolve_kwargs = {**asked.acting_in("resolve"), "auto_class": auto_class}
    parallel = _parallel(asked, ctx)
    if parallel is not None:
        resolve_kwargs["parallel"] = parallel
    if choose is not None:  # "auto" values replaced by concrete ones; the rest handed back as given
        resolve_kwargs, auto_choice = choose(config, ctx.world_size, device_type=ctx.device.type, **resolve_kwargs)
    options = PipelineOptions.resolve(config, ctx.world_size, **resolve_kwargs)
    check_dtype_supported(options.dtype, ctx.device)
    if options.schedule_note and ctx.is_main_process:
        get_logger(__name__).info(options.schedule_note)  # the user named no schedule; say which was chosen
    return options, auto_choice


def _stage_roles(plan: StagePlan, dims: ParallelDims) -> Callable[[int], str]:
    """A rank's role in messages about it ("stage 1", "stages 0, 2")."""

    def stages_of(rank: int) -> str:
        idx = [s.index for s in plan.stages_for_rank(dims.place(rank)[1])]
        return f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"

    return stages_of


def _build_dims(ctx: RankContext, maker: StageMaker, options: PipelineOptions) -> ParallelDims:
    """The job's mesh (collective when there is one), also written into the plan it reports."""
    dims = ParallelDims.build(ctx, options.pp_size, options.tp_size, options.fsdp_size, options.ep_data)
    maker.plan = dataclasses.replace(
        maker.plan, dp_size=dims.dp_size, tp_size=dims.tp_size, tp_plan=options.tp_plan, fsdp_size=dims.fsdp_size,
        ep_plan=options.ep_plan,
    )
    return dims


def _parallel(asked: LoadOptions, ctx: RankContext) -> ParallelRequest | None:
    """The one ``parallel`` request of :meth:`PipelineOptions.resolve` from the mesh options (``tp_size`` /
    ``fsdp_size`` / ``distributed_config`` / ``device_mesh``: see
    :func:`~hf_pipeline.planning.tp_plan.parallel_request`); None when they ask for none (the automatic
    schedule choice refuses, or its default passes over, one that asks for some)."""
    parallel = parallel_request(**asked.acting_in("mesh"), world_size=ctx.world_size)
    return None if parallel == ParallelRequest() else parallel


def _own_experts(
    mine: dict, experts: dict, conversions: dict, parts: dict, wanted: dict,
) -> tuple[dict, set[str], dict[str, torch.dtype]]:
    """The conversions a rank runs, reading only the experts it keeps (``mine``: name -> its dim-0 part of
    the merged tensor, :func:`_expert_parts_kept`; ``experts``: the expert-parallel parts alone).

    Where the checkpoint stores experts one tensor each, a kept tensor is merged from this rank's experts'
    tensors alone (already its part: the other experts' keys leave ``wanted``); else an expert-parallel
    tensor is sliced as it is read (its part joins ``parts``; FSDP chunks are added by the caller).
    ``parts`` and ``wanted`` are updated in place.

    Returns:
        (the conversions, the names merged from their own experts alone, name -> dtype of those keeping no
        expert: an FSDP chunk past the last expert, read from nothing and left out of the conversions).
    """
    conversions = dict(conversions)
    narrowed: set[str] = set()
    empty: dict[str, torch.dtype] = {}
    for name, part in mine.items():
        cut = narrow_conversion(conversions[name], part) if name in conversions else None
        if cut is None:
            if name in experts:
                parts[name] = experts[name]
            continue
        if not cut.sources and conversions[name].sources[0] in wanted:
            empty[name] = wanted[conversions[name].sources[0]][1]
        for key in set(conversions[name].sources) - set(cut.sources):
            wanted.pop(key, None)
        conversions[name] = cut
        narrowed.add(name)
    for name in empty:
        del conversions[name]
    return conversions, narrowed, empty


def _expert_parts_kept(experts: dict, conversions: dict, fsdp: tuple[int, int] | None, *, over_fsdp: bool) -> dict:
    """Stage name -> the dim-0 part of its merged tensor a rank keeps, for each tensor merged from experts
    stored one tensor each (and each expert-parallel one): its ep part, then under FSDP its chunk of that
    (FSDP2 chunks dim 0, the experts' dim, whole experts each, the last chunks shorter or empty). With experts
    over the fsdp ranks (``over_fsdp``) FSDP leaves the expert-parallel ones out: each rank keeps its ep part whole."""
    names = set(experts) | (set(conversions) if fsdp else set())
    out = {}
    for name in names:
        ep = experts.get(name, (0, 0, 1))
        out[name] = ep if fsdp is None or (over_fsdp and name in experts) else (ep, (0, *fsdp))
    return out


def _fsdp_shards(
    stages: list[nn.Module], maker: StageMaker, options: PipelineOptions, dims: ParallelDims, device: torch.device,
    *, parts: dict, experts: dict, wanted: dict, fresh: dict, conversions: dict, empty: dict,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """An FSDP rank's parts (with tensor / expert parallelism: each tp slice's fsdp chunk, ``parts`` being the
    tp ones and ``experts`` the ep ones) and the local shards they are read into, each in the dtype it is read or
    drawn in."""
    split = options.tp_plan or options.ep_plan
    parts = {**parts, **experts}
    tp = (options.tp_plan, dims.tp_mesh, parts) if split else None
    # Experts over the fsdp ranks (ep_over="data"): FSDP leaves them out, each rank reads its ep part whole.
    whole = set(experts) if dims.ep_data > 1 else set()
    parts = fsdp_parts(stages, dims.fsdp_rank, dims.fsdp_size, tp_parts=parts, unchunked=whole)
    dtypes = {**{n: dt for n, (_, dt) in wanted.items()}, **{n: t.dtype for n, t in fresh.items()}}
    dtypes.update({n: wanted[c.sources[0]][1] for n, c in conversions.items() if c.sources[0] in wanted})
    dtypes.update(empty)  # chunks past the last expert: no source left to say their dtype
    shards = shard_stages(
        stages, dtypes, mesh=dims.fsdp_mesh, device=device, tied=maker.resolved.tied, tp=tp,
        experts=(options.ep_plan, options.ep_implementation, dims.expert_mesh, _batch_mesh(dims)),
    )
    return parts, shards


def _batch_mesh(dims: ParallelDims):
    """With experts over data-parallel ranks, the ranks sharing this rank's batch (transformers' tp_mesh for the
    dispatch): the tp shards' mesh object, so that renewing the groups after a failure (distributed/groups.py:
    rebind_meshes, which finds meshes on parameters) rebinds it too. None otherwise (the ep mesh shares one batch)."""
    return (dims.tp_mesh or dims.batch_mesh) if dims.ep_data > 1 else None


def _place_stages(stages: list[nn.Module], tensors: dict, maker: StageMaker, options: PipelineOptions,
                  dims: ParallelDims, device: torch.device) -> None:
    """Make ``stages``' parameters of the tensors read, then split them over the stage's ranks (tp, ep)."""
    made: dict = {}  # one Parameter per checkpoint tensor on this rank, across all its stages
    tp_mesh, batch_mesh = dims.tp_mesh, _batch_mesh(dims)
    for stage in stages:
        materialize(stage, tensors, device=device, tied=maker.resolved.tied, made=made)
        stage.eval()
        if options.tp_plan:  # each tensor-parallel rank keeps its slice of the whole tensors it loaded
            apply_tensor_parallel(stage, options.tp_plan, tp_mesh)
        apply_expert_parallel(stage, options.ep_plan, dims.expert_mesh, options.ep_implementation,
                              batch_mesh=batch_mesh)


def _load_stages(
    maker: StageMaker, ckpt: pathlib.Path, local, *, ctx: RankContext, options: PipelineOptions,
    rng_state: torch.Tensor, progress: bool | None, started: float, dims: ParallelDims,
) -> tuple[list[nn.Module], LoadReport, float]:
    """Make this rank's meta stages, read their tensors, initialise what the checkpoint lacks, materialise.

    Returns:
        ``(stages, report, read_at)``: the loaded stages, what was read (its ``seconds`` so far) and
        when the read ended (the caller times what follows it).
    """
    if dims.fsdp_size > 1:
        refuse_packed(options.tp_plan, replicas=dims.replicas)
    index = CheckpointIndex.from_directory(ckpt)
    stages = maker.make_stages(local)
    wanted, aliases, expected, ignore = wanted_tensors(maker.skeleton, maker.resolved, stages, index, options.dtype)
    keys = key_plan(maker.skeleton, maker.resolved, index)
    # What save_pretrained reverts: the conversions these keys went through (none for merged experts stored as such).
    maker.load_conversions = load_conversions(maker.skeleton, index.weight_map)
    local_names = {n for stage in stages for n in stage.state_dict()}
    fresh = initialize_missing(maker.skeleton, keys.initialized, dtype=options.dtype, rng_state=rng_state)
    fresh = {n: t for n, t in fresh.items() if n in local_names}  # drawn whole, as transformers draws them
    # A tensor-parallel or FSDP rank reads only its slices; an FSDP rank reads them into its shards.
    parts = shard_parts(stages, options.tp_plan, dims.tp_mesh)
    experts = expert_parts(stages, options.ep_plan, dims.expert_mesh)
    shards: dict[str, torch.Tensor] = {}
    on_meta = dims.fsdp_size > 1
    # Under FSDP a rank keeps the dim-0 chunk of its ep part (of the whole tensor without ep): whole experts.
    mine = _expert_parts_kept(experts, keys.conversions, (dims.fsdp_rank, dims.fsdp_size) if on_meta else None,
                              over_fsdp=dims.ep_data > 1)
    conversions, merged_mine, empty = _own_experts(mine, experts, keys.conversions, parts, wanted)
    if on_meta:
        parts, shards = _fsdp_shards(stages, maker, options, dims, ctx.device, parts=parts, experts=experts,
                                     wanted=wanted, fresh=fresh, conversions=conversions, empty=empty)
    for n in set(fresh) & set(parts):  # keep the slice
        fresh[n] = local_slice(fresh[n], parts[n])
    # Tensors stored split (experts one tensor each): each source read straight into its place in the merged
    # tensor where the converter is a stack (and concatenation) merge_in_place knows, so no source outlives its
    # read; else merged by transformers' own converters. Then placed like the initialised ones (a tp / fsdp
    # rank keeps its part of the merged tensor; an fsdp shard is merged into where it fits).
    merges = merge_in_place(conversions, wanted, device=ctx.device, into=shards)
    staged_at = time.perf_counter()
    tensors, report = load_tensors(
        index, wanted, aliases=aliases, device=ctx.device, expected_keys=expected, ignore_unexpected=ignore,
        progress=ctx.is_main_process if progress is None else progress,
        floating=[n for n, (_, dt) in wanted.items() if dt.is_floating_point], unexpected_hint=UNEXPECTED_HINT,
        parts=parts, into={**shards, **merges.views},
    )
    for key in merges.views:
        del tensors[key]
    converted = {**convert_tensors(merges.rest, tensors, maker.skeleton), **merges.targets}
    converted.update({n: shards[n] for n in empty})  # an FSDP chunk past the last expert: nothing to read
    for n in set(converted) & set(parts) - merged_mine:
        converted[n] = local_slice(converted[n], parts[n])
    fresh.update(converted)
    read_at = time.perf_counter()
    report.initialized = sorted(set(fresh) - set(converted))
    if ctx.is_main_process:
        log_load_report(maker.skeleton, ckpt, keys)
    if on_meta:
        with torch.no_grad():
            for n, t in fresh.items():
                if t is not shards[n]:  # a merge read straight into its shard is there already
                    shards[n].copy_(t)
        set_buffers(stages, tensors, ctx.device)
    tensors.update(fresh)
    del fresh
    if not on_meta:
        _place_stages(stages, tensors, maker, options, dims, ctx.device)
    del tensors
    maker.on_loaded(stages)
    report.seconds = {"meta stages, wanted tensors": staged_at - started, **report.seconds}
    return stages, report, read_at


def _agreed_context(asked: LoadOptions) -> RankContext:
    """The model's own group over every rank (groups.py: a failure inside a call stops it, never WORLD), once
    every rank gave the same mesh arguments: compared as given, before any rank resolves them (one may be
    invalid on its own rank, or resolve to another mesh), so the error names the argument."""
    ctx = own_group(init_distributed(device=asked.device))
    given = parallel_arguments(asked.acting_in("mesh"))
    check_same_on_all_ranks(ctx, "from_pretrained's mesh arguments", given, hint=_AGREE_HINT)
    return ctx


def load_pipeline(
    auto_class: str | type,
    path: str | os.PathLike,
    asked: LoadOptions | None = None,
    *,
    choose: Callable[..., tuple[dict[str, Any], Any]] | None = None,
) -> LoadedPipeline:
    """Resolve the options, make this rank's stages and load their weights (collective).

    Args:
        auto_class: the transformers (Auto) class the checkpoint is loaded as.
        path: a local HF checkpoint directory, or a hub id in the local cache.
        asked: what the caller asked for (default: every option's default). Each concern goes where it acts
            (:meth:`~hf_pipeline.load_options.LoadOptions.acting_in`): ``"read"`` to finding the checkpoint
            (:func:`resolve_checkpoint`) and its config (:func:`_read_config`), ``"mesh"`` and ``"resolve"`` to
            :meth:`PipelineOptions.resolve`, ``"place"`` to the device and the progress bar here.
        choose: ``choose(config, world_size, device_type=..., **resolve_kwargs) -> (resolve_kwargs, choice)``:
            replaces ``"auto"`` options, or chooses the default's, before they are resolved
            (``memory.auto_choice_costs.chooser``; the same arithmetic on every rank, so every rank resolves the
            same options).

    Returns:
        This rank's :class:`LoadedPipeline`.

    Every step that can fail on one rank only is wrapped in an agreement, so a failure anywhere
    raises on every rank (naming the failing rank) instead of leaving the others waiting.
    """
    asked = LoadOptions() if asked is None else asked
    read = asked.acting_in("read")
    started = time.perf_counter()
    ctx = _agreed_context(asked)
    with collective_errors(ctx, "reading the checkpoint config"):
        ckpt = resolve_checkpoint(path, revision=read["revision"], cache_dir=read["cache_dir"],
                                  subfolder=read["subfolder"])
        config = _read_config(ckpt, read["config"], attn_implementation=read["attn_implementation"],
                              trust_remote_code=read["trust_remote_code"])
        options, auto_choice = _resolve_options(config, ctx, choose, asked, auto_class)
        identity = pipeline_identity(options, config, ckpt, device_type=ctx.device.type,
                                     arguments=asked.agreed_as_given())
    # The same pipeline from the same checkpoint everywhere, or a named error on every rank: a split,
    # microbatch count or dtype of its own, or other files, on one rank would give wrong numbers or a hang.
    check_same_on_all_ranks(ctx, "from_pretrained arguments and checkpoint", identity, hint=_AGREE_HINT)
    agreed_at = time.perf_counter()
    with collective_errors(ctx, "tracing the model" if options.traced else "planning the stages"):
        maker = front_end(config, options, ctx.device)
    dims = _build_dims(ctx, maker, options)
    planned_at = time.perf_counter()

    with collective_errors(ctx, "checking compile"):
        compile_kwargs = check_compile(asked.compile, options)
    rng_state = agreed_rng_state(ctx)  # weights missing from the checkpoint are drawn from it, as transformers does
    with collective_errors(ctx, "loading weights", describe=_stage_roles(maker.plan, dims)):
        stages, report, read_at = _load_stages(
            maker, ckpt, maker.plan.stages_for_rank(dims.pp_rank), ctx=ctx, options=options, rng_state=rng_state,
            progress=asked.progress, started=planned_at, dims=dims)
        compile_blocks(stages, compile_kwargs)  # lazily: each block compiles on its first call
    # Where a load's wall time goes, for the benchmark's load-vs-read comparison (this rank's clock).
    report.seconds = {
        "config, options, agreement": agreed_at - started, "plan, dims": planned_at - agreed_at, **report.seconds,
        "initialise missing, materialise": time.perf_counter() - read_at,
    }
    return LoadedPipeline(
        options=options, stage_maker=maker, ctx=ctx, dims=dims, stages=stages, checkpoint_dir=ckpt,
        load_report=report, auto_choice=auto_choice,
    )
