"""The only loader: options -> front end -> parallel dims -> wanted tensors -> load -> materialise.

``from_pretrained(path, pipeline=True)`` ends here, whichever way its stages are made. A *front
end* turns the config and the resolved :class:`~hf_pipeline.planning.options.PipelineOptions` into a
:class:`StageBuild`: the stage plan and how to make this rank's stages on the meta device.
There are two, returning the same thing:

- :func:`hf_pipeline.loading.stages.recipe_front_end`: stages cut from the HF model by its recipe;
- :func:`hf_pipeline.loading.trace.trace_front_end`: stages split by torch.export (no recipe).

Everything after the front end is one code path: the pipeline groups (:class:`ParallelDims`),
the checkpoint keys this rank's stages need (:func:`wanted_tensors`), the shard-by-shard read
(:func:`hf_pipeline.loading.weights.load_tensors`) and the materialisation of every local stage with one
Parameter per tied group across all of them (so an optimizer steps a tied tensor once).

Example:
    >>> built = build_pipeline(transformers.AutoModelForCausalLM, path, n_microbatches=4)
    >>> built.build.plan.num_stages, [s.spec.index for s in built.stages]
    (2, [0])
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import AutoConfig

from ..compat import set_attn_implementation
from ..distributed.context import (
    ParallelDims,
    RankContext,
    check_same_on_all_ranks,
    collective_errors,
    init_distributed,
)
from ..errors import InputError
from ..planning.options import PipelineOptions
from ..planning.plan import ResolvedRecipe
from .identity import pipeline_identity
from .stages import StageBuild, materialize
from .weights import CheckpointIndex, LoadReport, checkpoint_key_renames, load_tensors, resolve_checkpoint

__all__ = ["BuiltPipeline", "StageBuild", "build_pipeline", "wanted_tensors"]


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
    auto_choice: Any = None  # what schedule="auto" / n_microbatches="auto" chose (autotune.AutoChoice)


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


@dataclass(frozen=True, kw_only=True)
class KeyPlan:
    """How the whole model's names meet one checkpoint's keys, as transformers' ``from_pretrained`` matches them.

    Attributes:
        variants: model name -> the checkpoint keys it may be stored under, in order (itself, the
            base-model prefix dropped or added, the legacy name transformers renames on load).
        expected: every checkpoint key the model reads or accepts (tied twins and variants included).
        ignored: checkpoint keys transformers ignores without a word (the class's
            ``_keys_to_ignore_on_load_unexpected``, old ``rotary_emb.inv_freq`` / ``position_ids`` buffers).
        unexpected: checkpoint keys transformers reports as UNEXPECTED and skips (another task's head,
            a pooler this class does not build); loaded models warn about them as transformers does.
        initialized: model names no checkpoint key serves that transformers initialises with the
            model's own ``_init_weights`` (a task head or pooler missing from a base or other-task
            checkpoint, or names the class declares in ``_keys_to_ignore_on_load_missing``).
    """

    variants: dict[str, list[str]]
    expected: set[str]
    ignored: set[str]
    unexpected: list[str]
    initialized: list[str]


def _transformers_ignores(skeleton: nn.Module, unexpected: set[str], missing: set[str]) -> tuple[set[str], set[str]]:
    """(unexpected, missing) left after transformers' own exception rules for ``skeleton``'s class."""
    try:  # transformers' own rules: class patterns plus the legacy inv_freq / position_ids buffers
        from transformers.utils.loading_report import LoadStateDictInfo

        info = LoadStateDictInfo(
            missing_keys=set(missing), unexpected_keys=set(unexpected), mismatched_keys=set(), error_msgs=[],
            conversion_errors={}, skipped_pp_keys=set(),
        )
        skeleton._adjust_missing_and_unexpected_keys(info)
        return set(info.unexpected_keys), set(info.missing_keys)
    except (ImportError, AttributeError, TypeError):  # an older transformers: the class lists only
        def keep(keys, attr):
            patterns = [re.compile(p) for p in (getattr(skeleton, attr, None) or ())]
            return {k for k in keys if not any(p.search(k) for p in patterns)}

        return keep(unexpected, "_keys_to_ignore_on_load_unexpected"), keep(missing, "_keys_to_ignore_on_load_missing")


def key_plan(skeleton: nn.Module, resolved: ResolvedRecipe, index: CheckpointIndex) -> KeyPlan:
    """The :class:`KeyPlan` of ``skeleton`` (the whole meta model) against ``index`` (reads no shard)."""
    ckpt_keys = index.keys()
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    groups = {name: g for g in resolved.tied for name in g}

    # Keys transformers renames on load (LayerNorm.gamma -> .weight, ...), by the name they load as.
    legacy: dict[str, str] = {}
    renamed = checkpoint_key_renames(skeleton, ckpt_keys)
    for key, new in renamed.items():
        legacy.setdefault(new, key)

    def variants(name: str) -> list[str]:
        # A base model (BertModel) can load a head checkpoint (bert.embeddings...) and a head model a
        # base checkpoint (embeddings...), as transformers allows.
        out = [name]
        if prefix and name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        elif prefix and not resolved.base:
            out.append(f"{prefix}.{name}")
        return out + [legacy[v] for v in out if v in legacy]

    state = skeleton.state_dict(keep_vars=True)
    all_variants = {name: [v for member in groups.get(name, (name,)) for v in variants(member)] for name in state}
    expected = {v for vs in all_variants.values() for v in vs}
    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    missing = {name for name in params if not any(v in ckpt_keys for v in all_variants[name])}
    # Unexpected keys in the model's own name space, where transformers matches its ignore patterns.
    extra = {k for k in ckpt_keys if k not in expected}
    unexpected, warned_missing = _transformers_ignores(skeleton, extra, missing)
    ignored = extra - unexpected

    # Of the missing weights, those transformers initialises and this loader follows it on: the task
    # head's modules (a head or pooler that the checkpoint's class did not have) and what the class
    # itself declares may be missing. Missing blocks, embeddings or norms mean the config does not
    # match the checkpoint: resolve_keys refuses those, naming them.
    head = tuple(m + "." for m in resolved.head.modules)
    initialized = sorted(n for n in missing if n.startswith(head) or n not in warned_missing)
    return KeyPlan(
        variants=all_variants, expected=expected, ignored=ignored, unexpected=sorted(_tolerated(skeleton, resolved, unexpected, prefix, renamed)),
        initialized=initialized,
    )


def _tolerated(skeleton: nn.Module, resolved: ResolvedRecipe, unexpected: set[str], prefix: str, renamed: dict[str, str]) -> set[str]:
    """The unexpected keys that transformers skips with a warning and this loader does too.

    All of them except keys of blocks the model does not have (``model.layers.7.*`` with a config of 6
    layers): transformers skips those too, but a config with fewer layers than its checkpoint is a
    mistake worth refusing, by name (``load_tensors`` raises for them).
    """
    stacks = [(s.blocks[0].rpartition(".")[0] + ".", set(s.blocks)) for s in resolved.stacks if s.blocks]
    out = set()
    for key in unexpected:
        name = renamed.get(key, key)
        names = {name, f"{prefix}.{name}" if prefix else name, name.removeprefix(f"{prefix}.") if prefix else name}
        beyond = False
        for container, blocks in stacks:
            for n in names:
                if n.startswith(container):
                    block = container + n[len(container) :].split(".", 1)[0]
                    beyond = beyond or block not in blocks
        if not beyond:
            out.add(key)
    return out


def wanted_tensors(skeleton: nn.Module, resolved: ResolvedRecipe, stages: Sequence[nn.Module], index: CheckpointIndex, dtype: torch.dtype):
    """What to read for these stages: names + (shape, dtype), alternative keys, the whole model's keys, keys to ignore.

    Returns:
        ``(wanted, aliases, expected, ignore)``: checkpoint name -> (shape, load dtype) of every
        parameter (and every buffer the checkpoint stores) of ``stages``, except the weights that
        are initialised instead (:attr:`KeyPlan.initialized`); name -> other keys the same tensor
        may be stored under (a tied twin, the base-model prefix added or dropped, a legacy name
        transformers renames on load); every key the whole model may load from or skips as
        transformers does; and the regexes of unexpected keys to accept (none left over: the keys
        transformers ignores are in ``expected``).
    """
    plan = key_plan(skeleton, resolved, index)
    ckpt_keys = index.keys()
    skip = set(plan.initialized)
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    aliases: dict[str, list[str]] = {}
    for stage in stages:
        sd = stage.state_dict(keep_vars=True)
        for name, t in sd.items():
            is_param = isinstance(t, nn.Parameter)
            alts = plan.variants.get(name, [name])
            if name in skip or (not is_param and not any(a in ckpt_keys for a in alts)):
                continue  # initialised like transformers, or a buffer the checkpoint does not store (kept as built)
            wanted[name] = (tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
            aliases[name] = [a for a in alts if a != name]
    return wanted, aliases, plan.expected | plan.ignored | set(plan.unexpected), []


def initialize_missing(skeleton: nn.Module, names: Sequence[str], *, dtype: torch.dtype, rng_state: torch.Tensor) -> dict[str, torch.Tensor]:
    """Initialise ``names`` (missing from the checkpoint) with the model's own ``_init_weights``, on CPU.

    As transformers' ``from_pretrained``: every other parameter counts as loaded (``_is_hf_initialized``),
    ``initialize_weights()`` walks the whole model in its own order and draws from torch's CPU
    generator. Every rank initialises every missing tensor of the whole model from the same
    ``rng_state`` (global rank 0's at load time), so each tensor gets the values transformers gives
    it after the same ``torch.manual_seed``, whichever rank keeps it, and a replica on two ranks is
    one value. The caller's generator is left as it was.

    Returns:
        name -> tensor, one tensor for the names of a tied group.
    """
    if not names:
        return {}
    model = copy.deepcopy(skeleton)  # meta parameters: cheap; the skeleton itself stays untouched
    wanted = set(names)
    made: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if name in wanted or id(param) in made:
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=param.requires_grad)
            owner._parameters[attr] = made[id(param)]
        else:
            param._is_hf_initialized = True
    for buf in model.buffers():
        buf._is_hf_initialized = True  # buffers keep the values the model was built with
    for module in model.modules():
        module._is_hf_initialized = False  # set when the meta model was built; the walk must visit every module
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        model.initialize_weights()
    values = dict(model.named_parameters(remove_duplicate=False))
    return {name: values[name].detach() for name in names}


def agreed_rng_state(ctx: RankContext) -> torch.Tensor:
    """Global rank 0's CPU generator state, on every rank (collective when distributed)."""
    state = [torch.get_rng_state()]
    if ctx.is_distributed and ctx.group is not None:
        dist.broadcast_object_list(state, src=0, group=ctx.group)
    return state[0]


# What a checkpoint with blocks the config lacks should do, said from from_pretrained's side.
_UNEXPECTED_HINT = (
    "it has more blocks than the config (num_hidden_layers / num_layers): load it with its own config.json, or a "
    "config with as many layers"
)


def log_load_report(skeleton: nn.Module, path, plan: KeyPlan) -> None:
    """Warn about initialised and skipped keys as transformers does (its report, on its logger)."""
    if not (plan.initialized or plan.unexpected):
        return
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    try:
        from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

        info = LoadStateDictInfo(
            missing_keys=set(plan.initialized), unexpected_keys=set(plan.unexpected), mismatched_keys=set(),
            error_msgs=[], conversion_errors={}, skipped_pp_keys=set(),
        )
        log_state_dict_report(model=skeleton, pretrained_model_name_or_path=str(path), ignore_mismatched_sizes=False, loading_info=info, logger=logger)
    except ImportError:  # an older transformers: the same facts, plainly
        logger.warning(
            f"{type(skeleton).__name__} from {path}: newly initialized (missing from the checkpoint): {plan.initialized}; "
            f"unexpected (skipped): {plan.unexpected}"
        )


def _refuse_remote_code(ckpt: pathlib.Path, config) -> None:
    """Raise for ``trust_remote_code=True`` on a checkpoint that ships modelling code (``auto_map``)."""
    auto_map = getattr(config, "auto_map", None) if config is not None else None
    if auto_map is None and (ckpt / "config.json").is_file():
        auto_map = json.loads((ckpt / "config.json").read_text()).get("auto_map")
    if auto_map:
        raise InputError(
            f"trust_remote_code=True: {ckpt} has its own modelling code (auto_map {sorted(auto_map)} in config.json), which "
            f"pipeline=True never runs: stages are built from transformers' own classes. Load it with pipeline=False to run "
            f"that code, or without trust_remote_code to use transformers' class for its model_type"
        )


_AGREE_HINT = (
    "Every rank must load the same checkpoint (the same files; the path may differ per host) with the same "
    "from_pretrained arguments: launch one script with one command line everywhere, and compute no argument from "
    "the rank or the host"
)


def build_pipeline(
    auto_class: str | type,
    path: str | os.PathLike,
    *,
    config=None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    subfolder: str = "",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device | None = None,
    progress: bool | None = None,
    agreed: dict[str, Any] | None = None,
    choose: Callable[..., tuple[dict[str, Any], Any]] | None = None,
    **option_kwargs: Any,
) -> BuiltPipeline:
    """Resolve the options, make this rank's stages and load their weights (collective).

    Args:
        auto_class: the transformers (Auto) class the checkpoint is loaded as.
        path: a local HF checkpoint directory, or a hub id in the local cache.
        config: a config to use instead of the checkpoint's ``config.json``.
        revision, cache_dir, subfolder: which cached hub snapshot, which cache, and the folder inside
            the directory or snapshot that holds the checkpoint (see :func:`resolve_checkpoint`).
        attn_implementation: ``"eager"``, ``"sdpa"``, ...: set on the config before the model is
            built, so every stage's attention runs it; transformers checks it there, as in its own
            ``from_pretrained``.
        trust_remote_code: True is refused for a checkpoint with its own modelling code (stages are
            built from transformers' classes only); for any other checkpoint it changes nothing.
        device: force a device ("cpu"); default ``cuda:LOCAL_RANK`` when available.
        progress: show a progress bar while reading (default: on the main process).
        agreed: the caller's other arguments that must be the same on every rank (``gather_output``).
        choose: ``choose(config, world_size, device_type=..., **option_kwargs) -> (option_kwargs, choice)``:
            replaces ``"auto"`` options before they are resolved (``autotune.choose``; the same
            arithmetic on every rank, so every rank resolves the same options).
        **option_kwargs: the options of :meth:`PipelineOptions.resolve`.

    Every step that can fail on one rank only is wrapped in an agreement, so a failure anywhere
    raises on every rank (naming the failing rank) instead of leaving the others waiting.
    """
    started = time.perf_counter()
    ctx = init_distributed(device=device)
    with collective_errors(ctx, "reading the checkpoint config"):
        ckpt = resolve_checkpoint(path, revision=revision, cache_dir=cache_dir, subfolder=subfolder)
        if trust_remote_code:
            _refuse_remote_code(ckpt, config)
        if config is None:
            config = AutoConfig.from_pretrained(ckpt)
        elif attn_implementation is not None:
            config = copy.deepcopy(config)  # as transformers: the caller's config is left as it was
        if attn_implementation is not None:
            # transformers' own setter (sub-configs too); the model's __init__ validates it when the meta model is built.
            set_attn_implementation(config, attn_implementation)
        auto_choice = None
        resolve_kwargs = {**option_kwargs, "auto_class": auto_class}
        if choose is not None:  # "auto" values replaced by concrete ones; the rest handed back as given
            resolve_kwargs, auto_choice = choose(config, ctx.world_size, device_type=ctx.device.type, **resolve_kwargs)
        options = PipelineOptions.resolve(config, ctx.world_size, **resolve_kwargs)
        check_dtype_supported(options.dtype, ctx.device)
        identity = pipeline_identity(options, config, ckpt, device_type=ctx.device.type, arguments={
            "split_method": option_kwargs.get("split_method", "auto"), "attn_implementation": attn_implementation,
            "trust_remote_code": trust_remote_code, **(agreed or {}),
        })
    # The same pipeline from the same checkpoint everywhere, or a named error on every rank: a split,
    # microbatch count or dtype of its own, or other files, on one rank would give wrong numbers or a hang.
    check_same_on_all_ranks(ctx, "from_pretrained arguments and checkpoint", identity, hint=_AGREE_HINT)
    agreed_at = time.perf_counter()
    with collective_errors(ctx, "tracing the model" if options.traced else "planning the stages"):
        build = front_end(config, options, ctx.device)
    dims = ParallelDims.build(ctx, options.pp_size)
    planned_at = time.perf_counter()

    local = build.plan.stages_for_rank(dims.pp_rank)
    stages: list[nn.Module] = []
    report = LoadReport(files_opened=[], keys_read=[], bytes_read=0)
    rng_state = agreed_rng_state(ctx)  # weights missing from the checkpoint are drawn from it, as transformers does
    def stages_of(rank: int) -> str:  # a rank's role in messages about it ("stage 1", "stages 0, 2")
        idx = [s.index for s in build.plan.stages_for_rank(rank % options.pp_size)]
        return f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"

    with collective_errors(ctx, "loading weights", describe=stages_of):
        index = CheckpointIndex.from_directory(ckpt)
        stages = build.make_stages(local)
        wanted, aliases, expected, ignore = wanted_tensors(build.skeleton, build.resolved, stages, index, options.dtype)
        staged_at = time.perf_counter()
        tensors, report = load_tensors(
            index, wanted, aliases=aliases, device=ctx.device, expected_keys=expected, ignore_unexpected=ignore,
            progress=ctx.is_main_process if progress is None else progress,
            floating=[n for n, (_, dt) in wanted.items() if dt.is_floating_point], unexpected_hint=_UNEXPECTED_HINT,
        )
        read_at = time.perf_counter()
        keys = key_plan(build.skeleton, build.resolved, index)
        local_names = {n for stage in stages for n in stage.state_dict()}
        fresh = initialize_missing(build.skeleton, keys.initialized, dtype=options.dtype, rng_state=rng_state)
        report.initialized = sorted(n for n in fresh if n in local_names)
        tensors.update({n: fresh[n] for n in report.initialized})
        del fresh
        if ctx.is_main_process:
            log_load_report(build.skeleton, ckpt, keys)
        made: dict = {}  # one Parameter per checkpoint tensor on this rank, across all its stages
        for stage in stages:
            materialize(stage, tensors, device=ctx.device, tied=build.resolved.tied, made=made)
            stage.eval()
        del tensors
        build.on_loaded(stages)
    # Where a load's wall time goes, for the benchmark's load-vs-read comparison (this rank's clock).
    report.seconds = {
        "config, options, agreement": agreed_at - started, "plan, dims": planned_at - agreed_at,
        "meta stages, wanted tensors": staged_at - planned_at, **report.seconds,
        "initialise missing, materialise": time.perf_counter() - read_at,
    }
    return BuiltPipeline(
        options=options, build=build, ctx=ctx, dims=dims, stages=stages, checkpoint_dir=ckpt, load_report=report,
        auto_choice=auto_choice,
    )
