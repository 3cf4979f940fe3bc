"""Tensor parallelism inside a loaded stage, with torch's own ``parallelize_module`` and DTensor placements.

Each module a plan pattern names is sharded by its style: ``"colwise"`` (output features),
``"rowwise"`` (input features, output all-reduced) or ``"packed_colwise:K"`` (K blocks side by side
in the output features, each sharded: GPT-2's fused q, k, v ``c_attn`` is ``"packed_colwise:3"`` and
a rank holds ``[q_r, k_r, v_r]``; plain ``"packed_colwise"`` is transformers' two blocks). Its
parameters become ``DTensor`` shards: ``Shard(dim)``, or torch's strided shard for a packed one, so
``full_tensor()`` gives the checkpoint's own layout back with no code of ours, and norms, optimizers
and the checkpoint writer see the whole tensor. The styles hand plain local tensors to the code
around them (``use_local_output``), so the attention finds its share of the heads, the KV cache
holds the rank's heads, and the tensors a stage sends to the next one stay whole, plain, the same
on every tensor-parallel rank.

Which dim a style shards depends on the module: ``nn.Linear`` weights are (out, in), GPT-2's
``Conv1D`` weights (in, out), an ``nn.Embedding``'s columns are its output features (T5's relative
attention bias, (buckets, heads), sharded by heads). After sharding, the attributes a family's
forward reads that count heads or widths (the recipe's ``[tp] local`` table) become this rank's.

Loading stays per rank: each rank reads only its slices of a sharded tensor (:func:`shard_parts`
tells the reader which: one range, or one per block of a packed tensor), so a stage's whole tensors
are never in one rank's memory.

Example:
    >>> parts = shard_parts([stage], options.tp_plan, dims.tp_mesh)   # name -> (dim, index, count[, packs])
    >>> apply_tensor_parallel(stage, options.tp_plan, dims.tp_mesh)
    >>> stage.get_submodule("model.layers.0.mlp.up_proj").weight.to_local().shape   # (intermediate / tp, hidden)
"""

from __future__ import annotations

import re
import types

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..compat import strided_shard
from ..errors import InternalError
from ..planning.mesh_rules import parse_style
from .weights import chunk_bounds

__all__ = ["apply_tensor_parallel", "local_slice", "plan_for_stage", "shard_parts"]


def _pattern(text: str) -> re.Pattern:
    """A plan key as a regex over the end of a module name (``*`` is one block index)."""
    return re.compile(r"(?:^|.*\.)" + re.escape(text).replace(r"\*", r"\d+") + "$")


def plan_for_stage(stage: nn.Module, plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Module name in ``stage`` -> style, for every module a pattern of ``plan`` names."""
    compiled = [(_pattern(k), style) for k, style in plan]
    out: dict[str, str] = {}
    for name, _ in stage.named_modules():
        for pattern, style in compiled:
            if name and pattern.match(name):
                out[name] = style
                break
    return out


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _shard_dims(module: nn.Module, style: str) -> dict[str, int]:
    """Parameter name -> the dim ``style`` shards it along in ``module``; a rowwise bias is whole on every rank."""
    kind, _ = parse_style(style) or (None, 1)
    transposed = _is_conv1d(module) or isinstance(module, nn.Embedding)  # output features in the weight's dim 1
    if kind == "colwise":
        return {"weight": 1, "bias": 0} if transposed else {"weight": 0, "bias": 0}
    if kind == "rowwise":
        return {"weight": 0} if transposed else {"weight": 1}
    raise InternalError(f"tensor-parallel style {style!r} reached the stage unchecked")


def shard_parts(stages, plan: tuple[tuple[str, str], ...], tp_mesh) -> dict[str, tuple[int, ...]]:
    """Stage parameter name -> ``(dim, index, count)``, or ``(dim, index, count, packs)`` for a packed
    tensor (part ``index`` of ``count`` of each of its ``packs`` blocks): the slices this rank reads of it."""
    if not plan:
        return {}
    rank, count = tp_mesh.get_local_rank(), tp_mesh.size()
    out = {}
    for stage in stages:
        for name, style in plan_for_stage(stage, plan).items():
            module = stage.get_submodule(name)
            packs = parse_style(style)[1]
            for attr, dim in _shard_dims(module, style).items():
                if getattr(module, attr, None) is not None:
                    out[f"{name}.{attr}"] = (dim, rank, count) if packs == 1 else (dim, rank, count, packs)
    return out


def local_slice(tensor: torch.Tensor, part: tuple) -> torch.Tensor:
    """This rank's slice ``part`` (from :func:`shard_parts`, or a tuple of such parts, each cut from the one
    before: FSDP's chunk of a tp slice) of a whole ``tensor``, with its own storage."""
    if part and isinstance(part[0], tuple):
        for step in part:
            tensor = local_slice(tensor, step)
        return tensor
    dim, index, count, *packs = part
    blocks = tensor.chunk(packs[0], dim) if packs else (tensor,)
    # Cut as torch.chunk (and FSDP2) cut, by bounds: chunk() gives fewer than ``count`` parts when they run out.
    return torch.cat([b.narrow(dim, *chunk_bounds(b.shape[dim], index, count)) for b in blocks], dim).clone()


def _wrap_read_slices(stage: nn.Module, by_name: dict[str, str], tp_mesh) -> None:
    """The slices read from the checkpoint become the DTensor shards ``parallelize_module`` would cut
    (it keeps a DTensor of the right placement as it is)."""
    from torch.distributed.tensor import DTensor, Shard

    for module_name, style in by_name.items():
        module = stage.get_submodule(module_name)
        packs = parse_style(style)[1]
        for attr, dim in _shard_dims(module, style).items():
            p = getattr(module, attr, None)
            if p is not None and not isinstance(p, DTensor):
                placement = Shard(dim) if packs == 1 else strided_shard(dim, packs)
                shard = DTensor.from_local(p.detach(), tp_mesh, [placement], run_check=False)
                module.register_parameter(attr, nn.Parameter(shard, requires_grad=p.requires_grad))


def _copy_to_ranks(x: torch.Tensor, mesh) -> torch.Tensor:
    """``x`` as it is, its gradient summed over the tensor-parallel ranks (each saw only its columns)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _sum_over_ranks(x: torch.Tensor, mesh) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (each holds a partial sum); its gradient passes as it is."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class LocalParallel(ParallelStyle):
    """Colwise / rowwise sharding of a module torch's ``ColwiseParallel`` / ``RowwiseParallel`` refuse
    (they take ``nn.Linear`` and ``nn.Embedding`` only, and shard by plain ``Shard``): GPT-2's ``Conv1D``
    (weight (in, out)) and packed weights (a strided shard, which DTensor's matmul rules do not
    propagate). The module's forward runs on the local shards, as transformers' packed styles do: a
    colwise input is copied in (its gradient summed over the ranks), a rowwise output summed out;
    the parameters stay DTensors, so their gradients come back as shards of the same placement."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        kind, conv = self.kind, _is_conv1d(module)

        def forward(mod, x):
            weight = mod.weight.to_local()
            bias = mod.bias
            bias = None if bias is None else bias.to_local() if hasattr(bias, "to_local") else bias
            if kind == "colwise":
                x = _copy_to_ranks(x, device_mesh)
            out = x @ weight if conv else x @ weight.t()
            if kind == "rowwise":
                out = _sum_over_ranks(out, device_mesh)
            return out if bias is None else out + bias

        module.forward = types.MethodType(forward, module)
        return module


def _localise(stage: nn.Module, sharded: dict[str, str], tp_size: int) -> None:
    """Divide by ``tp_size`` the head / width attributes the family's forward reads (its recipe's
    ``tp_local``) on each module holding a sharded child: they now count this rank's share."""
    resolved = getattr(stage, "resolved", None)
    rules = [(_pattern(k), attrs) for k, attrs in (resolved.recipe.tp_local if resolved is not None else ())]
    for name, module in stage.named_modules():
        attrs = next((a for pattern, a in rules if name and pattern.match(name)), None)
        if attrs is None or not any(s.startswith(name + ".") for s in sharded):
            continue
        for attr in attrs:
            value = getattr(module, attr)
            if value % tp_size:
                raise InternalError(f"{name}.{attr}={value} is not divisible by tp_size={tp_size} (unchecked)")
            setattr(module, attr, value // tp_size)


def apply_tensor_parallel(stage: nn.Module, plan: tuple[tuple[str, str], ...], tp_mesh) -> dict[str, str]:
    """Shard ``stage``'s planned modules over ``tp_mesh`` in place. Their sharded parameters hold this
    rank's slices already (read with :func:`shard_parts`); no communication.

    Returns:
        The module name -> style it applied.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    by_name = plan_for_stage(stage, plan)
    if any(parse_style(s) is None for s in by_name.values()):
        raise InternalError(f"tensor-parallel styles {sorted(set(by_name.values()))} reached the stage unchecked")
    _wrap_read_slices(stage, by_name, tp_mesh)
    parallel = {}
    for name, style in by_name.items():
        kind, packs = parse_style(style)
        module = stage.get_submodule(name)
        # torch's RowwiseParallel makes a bias a replicated DTensor, which the gradient norm would count once
        # per tensor-parallel rank (it sums the shards' parts over them): a rowwise bias stays plain here.
        rowwise_bias = kind == "rowwise" and getattr(module, "bias", None) is not None
        if packs > 1 or rowwise_bias or not isinstance(module, (nn.Linear, nn.Embedding)):
            parallel[name] = LocalParallel(kind)
        else:
            parallel[name] = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
            parallel[name].src_data_rank = None  # a whole tensor left (a rowwise bias) is the same on every rank
    if parallel:
        parallelize_module(stage, tp_mesh, parallel)
    _localise(stage, by_name, tp_mesh.size())
    return by_name
