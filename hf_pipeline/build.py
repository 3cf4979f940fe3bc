"""The only loader: options -> front end -> parallel dims -> wanted tensors -> load -> materialise.

``from_pretrained(path, pipeline=True)`` ends here, whichever way its stages are made. A *front
end* turns the config and the resolved :class:`~hf_pipeline.options.PipelineOptions` into a
:class:`StageBuild`: the stage plan and how to make this rank's stages on the meta device.
There are two, returning the same thing:

- :func:`hf_pipeline.stages.recipe_front_end`: stages cut from the HF model by its recipe;
- :func:`hf_pipeline.trace.trace_front_end`: stages split by torch.export (no recipe).

Everything after the front end is one code path: the pipeline groups (:class:`ParallelDims`),
the checkpoint keys this rank's stages need (:func:`wanted_tensors`), the shard-by-shard read
(:func:`hf_pipeline.weights.load_tensors`) and the materialisation of every local stage with one
Parameter per tied group across all of them (so an optimizer steps a tied tensor once).

Example:
    >>> built = build_pipeline(transformers.AutoModelForCausalLM, path, n_microbatches=4)
    >>> built.build.plan.num_stages, [s.spec.index for s in built.stages]
    (2, [0])
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from transformers import AutoConfig

from .dist import ParallelDims, RankContext, collective_errors, init_distributed
from .errors import InputError
from .options import PipelineOptions
from .plan import ResolvedRecipe
from .stages import StageBuild, materialize
from .weights import CheckpointIndex, LoadReport, checkpoint_key_renames, load_tensors, resolve_checkpoint

__all__ = ["BuiltPipeline", "StageBuild", "build_pipeline", "check_dtype_supported", "front_end", "wanted_tensors"]


@dataclass(kw_only=True)
class BuiltPipeline:
    """This rank's part of a loaded pipeline: what :class:`~hf_pipeline.model.PipelinedModel` wraps."""

    options: PipelineOptions
    build: StageBuild
    ctx: RankContext
    dims: ParallelDims
    stages: list[nn.Module]
    checkpoint_dir: pathlib.Path | None
    load_report: LoadReport


def check_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Raise if ``device`` cannot do a matmul in ``dtype`` (fp16 on some CPUs), naming the fix."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        raise InputError(f"dtype {dtype} is not supported on device {device} ({e}); load with dtype='float32'") from None


def front_end(config, options: PipelineOptions, device: torch.device) -> StageBuild:
    """The :class:`StageBuild` of ``config``'s model: from its recipe, or traced when ``options.traced``."""
    if options.traced:
        from .trace import trace_front_end  # torch.export machinery only when it is used

        return trace_front_end(config, options, device=device)
    from .stages import recipe_front_end

    return recipe_front_end(config, options)


def wanted_tensors(skeleton: nn.Module, resolved: ResolvedRecipe, stages: Sequence[nn.Module], index: CheckpointIndex, dtype: torch.dtype):
    """What to read for these stages: names + (shape, dtype), alternative keys, the whole model's keys, keys to ignore.

    Returns:
        ``(wanted, aliases, expected, ignore)``: checkpoint name -> (shape, load dtype) of every
        parameter (and every buffer the checkpoint stores) of ``stages``; name -> other keys the
        same tensor may be stored under (a tied twin, the base-model prefix added or dropped, a
        legacy name transformers renames on load); every key the whole model may load from; and
        the regexes of unexpected keys to accept.
    """
    ckpt_keys = index.keys()
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    full_sd = skeleton.state_dict(keep_vars=True)
    groups = {name: g for g in resolved.tied for name in g}

    # Keys transformers renames on load (LayerNorm.gamma -> .weight, ...), by the name they load as.
    legacy: dict[str, str] = {}
    for key, renamed in checkpoint_key_renames(skeleton, ckpt_keys).items():
        legacy.setdefault(renamed, key)

    def variants(name: str) -> list[str]:
        # A base model (BertModel) can load a head checkpoint (bert.embeddings...) and a head model a
        # base checkpoint (embeddings...), as transformers allows.
        out = [name]
        if prefix and name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        elif prefix and not resolved.base:
            out.append(f"{prefix}.{name}")
        return out + [legacy[v] for v in out if v in legacy]

    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    aliases: dict[str, list[str]] = {}
    for stage in stages:
        sd = stage.state_dict(keep_vars=True)
        for name, t in sd.items():
            is_param = isinstance(t, nn.Parameter)
            alts = [v for member in groups.get(name, (name,)) for v in variants(member)]
            if not is_param and not any(a in ckpt_keys for a in alts):
                continue  # a buffer the checkpoint does not store keeps its constructed value
            wanted[name] = (tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
            aliases[name] = [a for a in alts if a != name]
    expected = {v for name in full_sd for member in groups.get(name, (name,)) for v in variants(member)}
    ignore = list(getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or [])
    if prefix and not resolved.base and any(k.startswith(prefix + ".") for k in ckpt_keys):
        ignore.append(rf"^(?!{prefix}\.)")  # a head checkpoint loaded as its base model: heads are ignored
    return wanted, aliases, expected, ignore


def build_pipeline(
    auto_class: str | type,
    path: str | os.PathLike,
    *,
    config=None,
    revision: str | None = None,
    device: str | torch.device | None = None,
    progress: bool | None = None,
    **option_kwargs: Any,
) -> BuiltPipeline:
    """Resolve the options, make this rank's stages and load their weights (collective).

    Args:
        auto_class: the transformers (Auto) class the checkpoint is loaded as.
        path: a local HF checkpoint directory, or a hub id in the local cache.
        config: a config to use instead of the checkpoint's ``config.json``.
        revision: hub revision of a cached id.
        device: force a device ("cpu"); default ``cuda:LOCAL_RANK`` when available.
        progress: show a progress bar while reading (default: on the main process).
        **option_kwargs: the options of :meth:`PipelineOptions.resolve`.

    Every step that can fail on one rank only is wrapped in an agreement, so a failure anywhere
    raises on every rank (naming the failing rank) instead of leaving the others waiting.
    """
    ctx = init_distributed(device=device)
    with collective_errors(ctx, "reading the checkpoint config"):
        ckpt = resolve_checkpoint(path, revision=revision)
        if config is None:
            config = AutoConfig.from_pretrained(ckpt)
        options = PipelineOptions.resolve(config, ctx.world_size, auto_class=auto_class, **option_kwargs)
        check_dtype_supported(options.dtype, ctx.device)
    with collective_errors(ctx, "tracing the model" if options.traced else "planning the stages"):
        build = front_end(config, options, ctx.device)
    dims = ParallelDims.build(ctx, options.pp_size)

    local = build.plan.stages_for_rank(dims.pp_rank)
    stages: list[nn.Module] = []
    report = LoadReport(files_opened=[], keys_read=[], bytes_read=0)
    with collective_errors(ctx, "loading weights"):
        index = CheckpointIndex.from_directory(ckpt)
        stages = build.make_stages(local)
        wanted, aliases, expected, ignore = wanted_tensors(build.skeleton, build.resolved, stages, index, options.dtype)
        tensors, report = load_tensors(
            index, wanted, aliases=aliases, device=ctx.device, expected_keys=expected, ignore_unexpected=ignore,
            progress=ctx.is_main_process if progress is None else progress,
        )
        made: dict = {}  # one Parameter per checkpoint tensor on this rank, across all its stages
        for stage in stages:
            materialize(stage, tensors, device=ctx.device, tied=build.resolved.tied, made=made)
            stage.eval()
        del tensors
        build.on_loaded(stages)
    return BuiltPipeline(
        options=options, build=build, ctx=ctx, dims=dims, stages=stages, checkpoint_dir=ckpt, load_report=report,
    )
