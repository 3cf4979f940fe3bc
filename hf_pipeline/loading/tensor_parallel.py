"""Tensor parallelism inside a loaded stage, with torch's own ``parallelize_module`` and DTensor placements.

Each module a plan pattern names is sharded by its style: ``"colwise"`` (output features),
``"rowwise"`` (input features, output all-reduced) or ``"packed_colwise:K"`` (K blocks side by side
in the output features, each sharded: GPT-2's fused q, k, v ``c_attn`` is ``"packed_colwise:3"`` and
a rank holds ``[q_r, k_r, v_r]``; plain ``"packed_colwise"`` is transformers' two blocks), and
transformers' other styles of ``planning/mesh_rules.STYLES``: ``"colwise_gather_output"`` /
``"rowwise_split_input"`` (the activations between them stay whole: OLMo 2, Phi-3, GLM),
``"embedding_rowwise"`` (an embedding's vocabulary rows, the ranks' lookups summed: GPT-NeoX, GPT-J)
and ``"replicated_with_grad_allreduce"`` (a whole module whose gradient is summed: Qwen3's per-head
norms). :func:`check_plan` refuses, at planning, a plan that leaves parameters between sharded
projections out or shards a tied tensor. Its
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

import functools
import re
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..compat import strided_shard
from ..errors import InputError, InternalError
from ..planning.mesh_rules import match_plan, parse_style, plan_pattern
from .weights import chunk_bounds

__all__ = [
    "apply_tensor_parallel", "check_plan", "copy_to_ranks", "local_slice", "plan_for_stage", "shard_parts",
    "sum_over_ranks",
]


def plan_for_stage(stage: nn.Module, plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Module name in ``stage`` -> style, for every module a pattern of ``plan`` names."""
    return match_plan((name for name, _ in stage.named_modules()), plan)


def check_plan(model: nn.Module, plan: tuple[tuple[str, str], ...]) -> None:
    """Refuse a plan that leaves out a module with parameters running between a block's sharded projections.

    Between a colwise and a rowwise child of one module (attention, MLP) each rank holds only its share
    of the activations (its heads, its MLP columns), so a child with parameters there that the plan does
    not name (Apertus's XIELU activation, a per-head norm) gets a partial gradient on each rank. A child
    that sees whole activations there (MLA's ``q_a_layernorm``, before the colwise ``q_b_proj``) cannot be
    told apart by the module tree: the plan must name it too.

    Raises:
        InputError: naming the model class, the modules and their parameters, and the plan entry to add.
    """
    by_name = plan_for_stage(model, plan)
    _check_untied(model, by_name)
    for name, parent in model.named_modules():
        children = [(f"{name}.{n}" if name else n, c) for n, c in parent.named_children()]
        kinds = {(parse_style(by_name[c]) or ("", 1))[0] for c, _ in children if c in by_name}
        if not ({"colwise", "rowwise"} <= kinds):
            continue
        planned = [c for c, _ in children if c in by_name or any(k.startswith(c + ".") for k in by_name)]
        loose = {c: sorted(n for n, _ in m.named_parameters()) for c, m in children if c not in planned}
        loose = {c: names for c, names in loose.items() if names}
        if loose:
            prefix = getattr(model, "base_model_prefix", "") + "."  # the plan names modules of the base model
            pattern = re.sub(r"\.\d+\.", ".*.", next(iter(loose))).removeprefix(prefix)
            raise InputError(
                f"{type(model).__name__}: tp_plan shards the projections of {name} but leaves out {loose} (module "
                f"-> parameters), which run on each rank's share of the sharded activations, so their gradients "
                f"would be partial; name them in the plan, e.g. distributed_config=DistributedConfig(tp_size=..., "
                f"tp_plan={{**config.base_model_tp_plan, {pattern!r}: "
                f"'replicated_with_grad_allreduce'}}), or load with tp_size=1"
            )


def _check_untied(model: nn.Module, by_name: dict[str, str]) -> None:
    """A sharded parameter must be one module's alone: a tied LM head would read the embedding's slice."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for module_name, style in by_name.items():
        module = model.get_submodule(module_name)
        for attr in _shard_dims(module, style):
            p = getattr(module, attr, None)
            tied = [n for n in names.get(id(p), []) if n != f"{module_name}.{attr}"] if p is not None else []
            if tied:
                raise InputError(
                    f"{type(model).__name__}: tp_plan shards {module_name}.{attr} ({style!r}), which is tied to "
                    f"{tied} (config.tie_word_embeddings): the tied module would read this rank's slice; pass a plan "
                    f"leaving {module_name} out (DistributedConfig(tp_size=..., tp_plan=...)), or load with tp_size=1"
                )


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _shard_dims(module: nn.Module, style: str) -> dict[str, int]:
    """Parameter name -> the dim ``style`` shards it along in ``module``; a rowwise bias is whole on every rank."""
    kind, _ = parse_style(style) or (None, 1)
    transposed = _is_conv1d(module) or isinstance(module, nn.Embedding)  # output features in the weight's dim 1
    if kind in ("colwise", "colwise_gather"):
        return {"weight": 1, "bias": 0} if transposed else {"weight": 0, "bias": 0}
    if kind in ("rowwise", "rowwise_split"):
        return {"weight": 0} if transposed else {"weight": 1}
    if kind == "replicated":
        return {}
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


def copy_to_ranks(x: torch.Tensor, mesh) -> torch.Tensor:
    """``x`` as it is, its gradient summed over the tensor-parallel ranks (each saw only its columns)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_over_ranks(x: torch.Tensor, mesh) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (each holds a partial sum); its gradient passes as it is."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _gather_last(x: torch.Tensor, size: int, mesh) -> torch.Tensor:
    """The ranks' slices ``x`` of a last dim of ``size`` (cut as torch.chunk cuts), whole on every rank; the
    gradient (the same on every rank: what follows runs whole) gives each rank its slice back."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = (*x.shape[:-1], size)
    stride = torch.empty(shape, device="meta").stride()
    whole = DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False, shape=shape, stride=stride)
    return whole.redistribute(mesh, [Replicate()]).to_local()


def _share_last(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's slice of ``x``'s last dim, as the weights are cut; the ranks' gradients summed (each
    gives only its slice's)."""
    return copy_to_ranks(x, mesh).narrow(-1, *chunk_bounds(x.shape[-1], mesh.get_local_rank(), mesh.size()))


def _lookup(module: nn.Embedding, ids: torch.Tensor, weight: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's part of the embedding of ``ids``: the vectors of the vocabulary rows it holds, zeros
    for the others (summed over the ranks, every id finds its vector once)."""
    first, rows = chunk_bounds(module.num_embeddings, mesh.get_local_rank(), mesh.size())
    local = ids - first
    inside = (local >= 0) & (local < rows)  # (B, T)
    pad = module.padding_idx
    pad = pad - first if pad is not None and 0 <= pad - first < rows else None  # its row, if this rank holds it
    out = F.embedding(torch.where(inside, local, 0), weight, pad)  # (B, T, H)
    return out * inside.unsqueeze(-1).to(out.dtype)


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
        if isinstance(module, nn.Embedding):
            if kind != "rowwise" or type(module).forward is not nn.Embedding.forward:
                raise InputError(
                    f"tensor-parallel style {kind!r} on {type(module).__name__}: an embedding is sharded here by its "
                    "vocabulary rows ('embedding_rowwise') and only as torch's nn.Embedding (not a subclass with "
                    "its own forward); leave it out of tp_plan"
                )
            module.forward = types.MethodType(lambda mod, ids: sum_over_ranks(
                _lookup(mod, ids, mod.weight.to_local(), device_mesh), device_mesh), module)
            return module
        size = module.weight.shape[1 if conv else 0] if kind == "colwise_gather" else None  # out features, whole

        def forward(mod, x):
            weight = mod.weight.to_local()
            bias = mod.bias
            bias = None if bias is None else bias.to_local() if hasattr(bias, "to_local") else bias
            if kind in ("colwise", "colwise_gather"):
                x = copy_to_ranks(x, device_mesh)
            if kind == "rowwise_split":
                x = _share_last(x, device_mesh)
            out = x @ weight if conv else x @ weight.t()
            if kind in ("rowwise", "rowwise_split"):
                out = sum_over_ranks(out, device_mesh)
            out = out if bias is None else out + bias
            return _gather_last(out, size, device_mesh) if size is not None else out

        module.forward = types.MethodType(forward, module)
        return module


class SummedGradients(ParallelStyle):
    """A module kept whole on every rank whose gradient each rank computes from its share only (Qwen3's
    per-head ``q_norm`` sees this rank's heads): each backward's gradient is summed over the ranks before
    it is accumulated, so ``.grad`` is the whole model's on every rank (over microbatches too)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        hooked: set[int] = set()  # ids of the parameter tensors hooked, each forgotten when its tensor goes
        hook = functools.partial(_hook_parameters, group=device_mesh.get_group(), hooked=hooked)
        hook(module, ())
        # FSDP2 (tp x fsdp) swaps its own unsharded parameter into the module for each forward, a tensor that
        # never had the hook: each forward hooks whatever parameters the module holds then, each tensor once.
        module.register_forward_pre_hook(hook)
        return module


def _hook_parameters(module: nn.Module, args, *, group, hooked: set[int]) -> None:
    for p in module.parameters(recurse=False):
        if p.requires_grad and id(p) not in hooked:
            hooked.add(id(p))
            weakref.finalize(p, hooked.discard, id(p))
            p.register_hook(functools.partial(_summed, group=group))


def _summed(grad: torch.Tensor, *, group) -> torch.Tensor:
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _localise(stage: nn.Module, sharded: dict[str, str], tp_size: int) -> None:
    """Divide by ``tp_size`` the head / width attributes the family's forward reads (its recipe's
    ``tp_local``) on each module holding a sharded child: they now count this rank's share."""
    resolved = getattr(stage, "resolved", None)
    rules = [(plan_pattern(k), attrs) for k, attrs in (resolved.recipe.tp_local if resolved is not None else ())]
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
        # An embedding's vocabulary rows: torch's RowwiseParallel would zero the gradient of padding_idx's
        # local row on every rank, not only on the rank holding it.
        vocab = kind == "rowwise" and isinstance(module, nn.Embedding)
        if kind == "replicated":
            parallel[name] = SummedGradients()
        elif packs > 1 or rowwise_bias or vocab or kind.endswith(("_gather", "_split")) or not isinstance(
            module, (nn.Linear, nn.Embedding)
        ):
            parallel[name] = LocalParallel(kind)
        else:
            parallel[name] = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
            parallel[name].src_data_rank = None  # a whole tensor left (a rowwise bias) is the same on every rank
    if parallel:
        parallelize_module(stage, tp_mesh, parallel)
    _localise(stage, by_name, tp_mesh.size())
    return by_name
