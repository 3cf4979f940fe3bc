"""Model tensors transformers builds from several checkpoint tensors on load (fused MoE experts).

transformers 5 holds a mixture-of-experts layer's experts as one tensor per kind
(``mlp.experts.gate_up_proj``: (experts, 2 * intermediate, hidden)), while checkpoints keep one
tensor per expert (``mlp.experts.3.gate_proj.weight`` or Mixtral's ``block_sparse_moe.experts.3.w1.weight``).
Its ``from_pretrained`` merges them with the model class's conversion mapping: ``WeightConverter``
objects (source patterns, a target pattern, ``ConversionOps`` such as ``MergeModulelist`` and
``Concatenate``). This module asks transformers for those converters and plans them per model
tensor from the checkpoint's index alone (:func:`checkpoint_conversions`: which keys feed which
tensor, so a rank reads only its own stages' experts), then runs the converter's own operations on
the tensors read (:func:`convert_tensors`), or, for the merges it recognises (experts stacked, kinds
concatenated), has the reader read each source straight into its place in the merged tensor
(:func:`merge_in_place`). For saving, :func:`load_conversions` notes which transforms the
checkpoint's keys went through (as ``from_pretrained`` does) and :func:`saved_tensors` reverts them with
transformers' ``revert_weight_conversion``. No operation is re-implemented: the in-place merge lays tensors out
only as the two operations it recognises by type would, and leaves every other converter to transformers.

Example:
    >>> plan = checkpoint_conversions(skeleton, index.keys(), variants)
    >>> plan["model.layers.0.mlp.experts.gate_up_proj"].sources[:2]
    ('model.layers.0.mlp.experts.0.gate_proj.weight', 'model.layers.0.mlp.experts.1.gate_proj.weight')
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch
from torch import nn

from ..compat import revert_weight_conversion
from ..errors import CheckpointError
from .checkpoint_files import name_listing
from .weights import chunk_bounds

__all__ = [
    "Conversion", "InPlaceMerges", "checkpoint_conversions", "convert_tensors", "load_conversions", "merge_in_place",
    "narrow_conversion", "refuse_unconverted", "saved_shapes", "saved_tensors",
]


@dataclass(frozen=True, kw_only=True)
class Conversion:
    """One model tensor transformers builds from several checkpoint tensors.

    Attributes:
        target: the model's name of the tensor (``model.layers.0.mlp.experts.gate_up_proj``).
        sources: the checkpoint keys feeding it, in the order transformers collects them (natural key order).
        shapes: each source's stored shape (what transformers' own save of the model writes).
        patterns: the converter's source pattern each source matched (``mlp.experts.*.gate_proj.weight``).
        converter: transformers' ``WeightConverter`` for the target; :func:`convert_tensors` runs a copy.
    """

    target: str
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    patterns: tuple[str, ...]
    converter: Any


def _transformers_api():
    """transformers' conversion machinery, or None on a transformers without conversion mappings."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )
    except ImportError:
        return None
    return get_model_conversion_mapping, WeightConverter, WeightRenaming, dot_natural_key, rename_source_key, \
        revert_weight_conversion


@dataclass(frozen=True)
class _Expected:
    """What transformers' save of the model writes for its converted tensors, keyed by target."""

    keys: dict[str, list[tuple[str, tuple[int, ...]]]]  # target -> (saved key, shape), saved order
    converters: dict[str, Any]  # source pattern -> its WeightConverter
    renamings: list
    converter_list: list


def _expected_sources(model: nn.Module, api) -> _Expected | None:
    """The keys transformers would save each converted tensor of ``model`` under: its own reverse conversion
    (``revert_weight_conversion``) of the meta state dict, each saved key mapped back to its target by the
    forward renaming (``rename_source_key``), as ``from_pretrained`` maps checkpoint keys."""
    get_mapping, converter_cls, renaming_cls, _, rename, revert = api
    transforms = get_mapping(model)
    converters = [t for t in transforms if isinstance(t, converter_cls)]
    if not converters:
        return None
    renamings = [t for t in transforms if isinstance(t, renaming_cls)]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    saved = revert(model, dict(state))  # meta tensors: shapes only, nothing allocated
    keys: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for key, tensor in saved.items():
        renamed, pattern = rename(key, renamings, converters)
        target = _model_name(renamed, state, prefix)
        if pattern is not None and target is not None:
            keys.setdefault(target, []).append((key, tuple(tensor.shape)))
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    return _Expected(keys=keys, converters=by_pattern, renamings=renamings, converter_list=converters)


def _model_name(renamed: str, names: Collection[str], prefix: str) -> str | None:
    """The model name a renamed checkpoint key loads as (the base-model prefix added or dropped), or None."""
    for name in (renamed, f"{prefix}.{renamed}", renamed.removeprefix(f"{prefix}.")):
        if name in names:
            return name
    return None


def checkpoint_conversions(
    model: nn.Module, ckpt_keys: Collection[str], stored: Mapping[str, Collection[str]], *, directory: Any = ""
) -> dict[str, Conversion]:
    """Model name -> :class:`Conversion`, for each model tensor the checkpoint stores split (reads no shard).

    Args:
        model: the whole (meta-device) transformers model.
        ckpt_keys: the checkpoint's keys.
        stored: model name -> the checkpoint keys that hold it as it is (itself, prefix variants, legacy
            names): a tensor stored fused is read as it is, not converted.
        directory: the checkpoint, for messages.

    Raises:
        CheckpointError: the checkpoint holds some, not all, of the tensors transformers merges into a model
            tensor (an expert missing), or the class's converter makes several tensors from one, naming the
            model class and the missing keys.
    """
    api = _transformers_api()
    expected = _expected_sources(model, api) if api is not None else None
    if expected is None:
        return {}
    rename, natural = api[4], api[3]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    found: dict[str, list[tuple[str, str]]] = {}  # target -> (checkpoint key, source pattern)
    for key in sorted(ckpt_keys, key=natural):
        renamed, pattern = rename(key, expected.renamings, expected.converter_list)
        target = _model_name(renamed, state, prefix) if pattern is not None else None
        if target is not None and target in expected.keys:
            found.setdefault(target, []).append((key, pattern))

    def canonical(key: str) -> str:  # a key as transformers renames it, the base-model prefix dropped
        renamed, _ = rename(key, expected.renamings, [])
        return renamed.removeprefix(f"{prefix}.") if prefix else renamed

    cls = type(model).__name__
    out: dict[str, Conversion] = {}
    incomplete: list[str] = []
    for target, keys in found.items():
        if any(k in ckpt_keys for k in stored.get(target, (target,))):
            continue  # stored fused as well: read as it is
        converter = expected.converters[keys[0][1]]
        if len(converter.target_patterns) > 1:
            raise CheckpointError(
                f"transformers' conversion mapping for {cls} makes {converter.target_patterns} from "
                f"{converter.source_patterns}; the per-stage loader converts only into one tensor. Load with "
                "pipeline=False, or re-save the checkpoint with transformers' save_pretrained of the loaded model"
            )
        have = {canonical(k): (k, p) for k, p in keys}
        want = expected.keys[target]
        missing = [k for k, _ in want if canonical(k) not in have]
        if missing:
            incomplete.append(f"{target} lacks {name_listing(missing)}")
            continue
        shape_of = {canonical(k): shape for k, shape in want}
        used = sorted((have[canonical(k)] for k, _ in want), key=lambda kp: natural(kp[0]))
        out[target] = Conversion(
            target=target, sources=tuple(k for k, _ in used), patterns=tuple(p for _, p in used),
            shapes=tuple(shape_of[canonical(k)] for k, _ in used), converter=converter,
        )
    if incomplete:
        raise CheckpointError(
            f"checkpoint {directory} stores {cls}'s experts one tensor each, which transformers' conversion mapping "
            f"merges, but {len(incomplete)} merged tensor(s) miss some of theirs: {name_listing(incomplete)}. The "
            "checkpoint is incomplete (re-download it) or the config has more experts than it (num_experts / "
            "num_local_experts / n_routed_experts)"
        )
    return out


def refuse_unconverted(
    model: nn.Module, missing: Collection[str], unexpected: Collection[str], *, directory: Any = ""
) -> None:
    """Raise, naming the model class, for model tensors the checkpoint lacks while it stores tensors under the
    same module that no conversion of the class turns into them (transformers defines none, or the checkpoint
    has none of the tensors the class's conversion merges).

    Args:
        model: the whole (meta-device) model.
        missing: model names no checkpoint key serves, that transformers does not initialise.
        unexpected: checkpoint keys nothing in the model loads.
    """
    api = _transformers_api()
    expected = _expected_sources(model, api) if api is not None else None
    prefix = getattr(model, "base_model_prefix", "") or ""
    cls = type(model).__name__
    # Unexpected keys by the name transformers renames them to (Mixtral's block_sparse_moe -> mlp), so they
    # meet the module of the model tensor they were meant for.
    renamings = [] if api is None else [t for t in api[0](model) if isinstance(t, api[2])]
    renamed = {k: api[4](k, renamings, [])[0] if api is not None else k for k in unexpected}
    problems = []
    for name in sorted(missing):
        module = name.rpartition(".")[0] + "."
        heads = {module, module.removeprefix(f"{prefix}.")} if prefix else {module}
        stray = sorted(k for k in unexpected if renamed[k].startswith(tuple(heads)))
        merged = [k for k, _ in expected.keys.get(name, ())] if expected is not None else []
        if merged:
            problems.append(f"{name} (merged from {len(merged)} keys such as {merged[0]}, none stored)")
        elif stray:
            problems.append(f"{name} (the checkpoint has {len(stray)} keys such as {stray[0]} there instead)")
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} has no tensor for {len(problems)} of {cls}'s tensors, and transformers "
            f"{_version()}'s conversion mapping for {cls} builds none of them from what it stores: "
            f"{name_listing(problems)}. Does the config match the checkpoint (model_type, number of experts)? A "
            "checkpoint in another layout loads once converted with transformers' own save_pretrained"
        )


def _version() -> str:
    import transformers

    return transformers.__version__


def convert_tensors(
    conversions: Mapping[str, Conversion], tensors: dict[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """Run transformers' converters on the tensors read: each conversion whose sources are all in ``tensors``
    takes them out and gives its target (model name -> tensor). Each target gets its own converter copy, as in
    ``from_pretrained``; the operations are transformers' own.
    """
    out: dict[str, torch.Tensor] = {}
    for target, conv in conversions.items():
        if not all(k in tensors for k in conv.sources):
            continue  # another stage's
        converter = copy.deepcopy(conv.converter)
        for key, pattern in zip(conv.sources, conv.patterns):
            converter.add_tensor(target, key, pattern, tensors.pop(key))
        made = converter.convert(target, model=model, config=getattr(model, "config", None))
        out[target] = made[target][0] if isinstance(made[target], list) else made[target]
        del converter, made
        _release_freed_heap()
    return out


def _release_freed_heap() -> None:
    """Give the pages of the tensors just merged back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    Why: glibc keeps freed memory in its heap, and the merged tensor (all experts stacked) is larger than any
    one expert's freed block, so it cannot reuse them: without this a rank's RSS while loading a mixture of
    experts reached about 2x what it keeps (1.87x measured on one process), with it 1.15x. Only the
    converters :func:`merge_in_place` leaves to transformers get here.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes

        try:  # the process's own symbols: libc's, without looking the library up (no subprocess)
            _MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", False)
        except OSError:
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None  # libc's malloc_trim once looked up, False where there is none


@dataclass(frozen=True, kw_only=True)
class InPlaceMerges:
    """What :func:`merge_in_place` planned: ``targets`` (model name -> its merged tensor, allocated once),
    ``views`` (checkpoint key -> the part of its target it is read into) and ``rest`` (the conversions
    transformers' converters still run, :func:`convert_tensors`)."""

    targets: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor]
    rest: dict[str, Conversion]


def merge_in_place(
    conversions: Mapping[str, Conversion], wanted: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
    device: torch.device, into: Mapping[str, torch.Tensor] | None = None,
) -> InPlaceMerges:
    """Allocate each merged tensor whose sources are all ``wanted`` once, and give each source key a view of its
    place in it, for the reader to read it straight there (``load_tensors(into=...)``).

    Why not transformers' own converter for the copy: it takes every source tensor of the merge materialised
    (``MergeModulelist`` stacks a list of them, ``Concatenate`` joins the stacks), so a rank held all of a
    stage's per-expert tensors beside the merged ones: peak RSS 1.1-1.2x of what it keeps. The layout stays
    the converter's: only a converter of exactly ``MergeModulelist(dim=0)`` (one source pattern), or that then
    ``Concatenate(dim >= 1)`` (several), in its ``source_patterns`` order, is planned here, where every
    source's place is a contiguous block; any other (a transpose, another op, a subclass) stays in ``rest``
    for the converter to run, as before.

    Args:
        conversions: model name -> :class:`Conversion` (narrowed to this rank's experts where it reads those).
        wanted: checkpoint key -> (shape, dtype) the reader reads it as.
        device: where the merged tensors go.
        into: model name -> a tensor to merge into instead of a new one, where its shape and dtype match (FSDP's
            local shard).
    """
    targets: dict[str, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    rest: dict[str, Conversion] = {}
    for name, conv in conversions.items():
        placed = _merge_views(conv, wanted, device, (into or {}).get(name))
        if placed is None:
            rest[name] = conv
        else:
            targets[name], found = placed
            views.update(found)
    return InPlaceMerges(targets=targets, views=views, rest=rest)


def _merge_layout(conv: Conversion) -> tuple[int, list[list[int]]] | None:
    """``(concat dim, source indices by pattern in the converter's order)`` of a merge :func:`merge_in_place`
    can do in place, or None. The concat dim is 1 (unused) for a plain stack."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(conv.converter, "operations", ()))
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return None
    by_pattern: dict[str, list[int]] = {}
    for i, pattern in enumerate(conv.patterns):
        by_pattern.setdefault(pattern, []).append(i)
    order = [p for p in conv.converter.source_patterns if p in by_pattern]
    if len(order) != len(by_pattern) or len({len(g) for g in by_pattern.values()}) != 1:
        return None
    if len(ops) == 1 and len(order) == 1:
        return 1, [by_pattern[order[0]]]
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1 and len(order) > 1:
        return ops[1].dim, [by_pattern[p] for p in order]
    return None


def _merge_views(conv: Conversion, wanted: Mapping, device: torch.device, given: torch.Tensor | None):
    """``(merged tensor, checkpoint key -> its view)`` of one conversion (:func:`merge_in_place`), or None."""
    layout = _merge_layout(conv)
    if layout is None or not all(k in wanted for k in conv.sources):
        return None
    dim, groups = layout
    dtypes = {wanted[k][1] for k in conv.sources}
    shapes = [{tuple(wanted[conv.sources[i]][0]) for i in g} for g in groups]
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or any(len(s) != 1 for s in shapes):
        return None
    stacks = [(len(g), *next(iter(s))) for g, s in zip(groups, shapes)]  # each pattern's MergeModulelist result
    if dim >= len(stacks[0]) or any(len(s) != len(stacks[0]) for s in stacks):
        return None
    if any(s[:dim] + s[dim + 1:] != stacks[0][:dim] + stacks[0][dim + 1:] for s in stacks):
        return None
    shape = (*stacks[0][:dim], sum(s[dim] for s in stacks), *stacks[0][dim + 1:])  # the Concatenate result
    dtype = next(iter(dtypes))
    fits = given is not None and (tuple(given.shape), given.dtype, given.device) == (shape, dtype, device)
    if fits and given.is_contiguous() and not given.requires_grad:
        merged = given
    else:
        merged = torch.empty(shape, dtype=dtype, device=device)
    views, at = {}, 0
    for g, stack in zip(groups, stacks):
        block = merged.narrow(dim, at, stack[dim]) if len(stacks) > 1 else merged
        for j, i in enumerate(g):
            views[conv.sources[i]] = block[j]  # (*source shape): expert j of this pattern
        at += stack[dim]
    if not all(v.is_contiguous() for v in views.values()):
        return None
    return merged, views


def narrow_conversion(conv: Conversion, part: tuple) -> Conversion | None:
    """``conv`` reading only the experts of ``part`` of the merged tensor's dim 0, or None when its converter
    does not build dim 0 by stacking one source per expert, or ``part`` cuts another dim.

    ``part`` is a loader part along dim 0, ``(0, index, count)``, or a tuple of them each cut from the one
    before (an expert-parallel rank's experts, then its FSDP chunk of them), cut as ``torch.chunk`` and FSDP2
    cut: the last chunks may be shorter or empty (an empty one reads no source).

    transformers' expert converters first stack each source pattern's tensors, one per expert in natural key
    order (``MergeModulelist(dim=0)``), then join the kinds along another dim (``Concatenate(dim=1)``): the
    stacked experts ``[lo, hi)`` are then the same operations run on those experts' sources alone, so a rank
    reads only the bytes it keeps instead of reading every expert and slicing.
    """
    ops = list(getattr(conv.converter, "operations", ()))
    first = type(ops[0]).__name__ if ops else ""
    if first != "MergeModulelist" or getattr(ops[0], "dim", None) != 0:
        return None
    if any(getattr(op, "dim", 1) == 0 for op in ops[1:]):
        return None
    groups: dict[str, list[int]] = {}
    for i, pattern in enumerate(conv.patterns):
        groups.setdefault(pattern, []).append(i)
    sizes = {len(g) for g in groups.values()}
    steps = part if part and isinstance(part[0], tuple) else (part,)
    if len(sizes) != 1 or any(len(step) != 3 or step[0] != 0 for step in steps):
        return None
    lo, size = 0, next(iter(sizes))
    for _, index, count in steps:
        first_row, size = chunk_bounds(size, index, count)
        lo += first_row
    keep = sorted(i for g in groups.values() for i in g[lo:lo + size])
    return Conversion(
        target=conv.target, sources=tuple(conv.sources[i] for i in keep), shapes=tuple(conv.shapes[i] for i in keep),
        patterns=tuple(conv.patterns[i] for i in keep), converter=conv.converter,
    )


# --------------------------------------------------------------------------------------------
# Saving: transformers' reverse conversions
# --------------------------------------------------------------------------------------------
def load_conversions(model: nn.Module, ckpt_keys: Collection[str]) -> list | None:
    """The transforms of ``model``'s conversion mapping (legacy renames included) that ``ckpt_keys`` match, as
    ``from_pretrained`` keeps them for its ``save_pretrained`` to revert: experts stored one tensor each are
    saved so again, a checkpoint already holding the merged tensors is saved as it is. None on a transformers
    without conversion mappings.
    """
    api = _transformers_api()
    if api is None:
        return None
    get_mapping, converter_cls, renaming_cls, natural, rename, _ = api
    transforms = get_mapping(model)  # fresh copies: their "used" marks start clear
    renamings = [t for t in transforms if isinstance(t, renaming_cls)]
    converters = [t for t in transforms if isinstance(t, converter_cls)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    for key in sorted(ckpt_keys, key=natural):  # the call from_pretrained makes per key; it marks what matched
        rename(key, renamings, converters, prefix, meta)
    return [t for t in transforms if t.was_used()]


def saved_tensors(
    model: nn.Module, tensors: dict[str, torch.Tensor], conversions: list | None
) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes for ``tensors`` (model name -> tensor): its own
    ``revert_weight_conversion`` (merged experts split one tensor per expert, renames undone).

    Args:
        model: the whole (meta-device) model.
        tensors: model names (tied copies removed, as transformers removes them first) -> tensors.
        conversions: what the model was loaded through (:func:`load_conversions`); None: the class's default.
    """
    if _transformers_api() is None:
        return dict(tensors)
    return revert_weight_conversion(model, tensors, conversions)


def saved_shapes(model: nn.Module, keys: Collection[str], conversions: list | None) -> dict[str, tuple[int, ...]]:
    """Saved key -> shape, for the model tensors ``keys`` (reverted on the meta device: nothing allocated)."""
    state = model.state_dict()
    return {k: tuple(t.shape) for k, t in saved_tensors(model, {k: state[k] for k in keys}, conversions).items()}
