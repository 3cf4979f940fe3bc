"""FSDP2 inside a loaded stage: ``fully_shard`` over the mesh's fsdp dim, each block one unit plus the stage as root.

The fsdp ranks of a stage are data-parallel ranks (each runs its own rows of the batch) that keep
1/fsdp of every parameter: dim-0 chunks as ``torch.chunk`` cuts them, which is FSDP2's own split
(``ceil(rows / fsdp)`` rows each, the last ranks fewer or none). Loading stays per rank and no rank
ever holds a whole tensor: :func:`fsdp_parts` names the chunk of each parameter the reader reads (a
contiguous byte range of the shard file), :func:`shard_stages` applies ``fully_shard`` to the stage
while it is still on the meta device and allocates only the local shards (``to_empty``), and the
reader reads each chunk straight into its shard (``load_tensors(into=...)``). A rank so holds each
byte once: reading chunks first and copying them into shards allocated afterwards held both at the
peak (freed heap is not given back to the system, so the peak stays in the RSS). With tensor
parallelism too (FSDP2 over the tp ``DTensor`` shards, as torchtitan composes them), the meta stage is
made tensor-parallel first, then sharded: a rank's shard of a tp-sharded tensor is the dim-0 chunk of
its tp slice, which :func:`fsdp_parts` names as the tp part then the chunk, so the reader reads just
those bytes (a colwise weight: one byte range; a rowwise one: the tp columns of the chunk's rows). A
tensor packed along dim 0 (GPT-2's fused ``c_attn`` bias) is the exception: each fsdp rank keeps its
whole tp slice, replicated over the fsdp ranks (see :func:`_whole_placement` for why).

``reshard_after_forward=False``: with several microbatches in flight a stage runs the forwards of
some before the backwards of others (1F1B), so resharding after each forward would all-gather every
block again for every microbatch; as torchtitan does under pipeline parallelism, the gathered
parameters stay until the step's last backward, after which torch's ``PipelineStage`` reduce-scatters
the gradients once and reshards (``perform_reduce_grad``). The reduce-scatter sums instead of
averaging: every microbatch loss is already divided by the global batch's item count (``step.py``),
so the sum over data-parallel ranks is the gradient of the whole batch, as ``flat_reduce`` sums replicas.

Example:
    >>> parts = fsdp_parts(stages, dims.fsdp_rank, dims.fsdp_size)          # name -> (0, fsdp rank, fsdp size)
    >>> # with tp: parts = fsdp_parts(..., tp_parts=shard_parts(...)); shard_stages(..., tp=(plan, tp_mesh, tp_parts))
    >>> shards = shard_stages(stages, dtypes, mesh=dims.fsdp_mesh, device=device, tied=resolved.tied)
    >>> tensors, report = load_tensors(index, wanted, parts=parts, into=shards, ...)
    >>> set_buffers(stages, tensors, device)
    >>> stage.get_submodule("model.layers.0.mlp.up_proj").weight.to_local().shape   # (ceil(inter / fsdp), hidden)
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Mapping

import torch
from torch import nn

from ..compat import unflatten_mesh, whole_placement
from ..distributed.shards import on_expert_mesh
from ..errors import InputError, InternalError
from ..planning.mesh_rules import parse_style
from .expert_parallel import apply_expert_parallel
from .tensor_parallel import apply_tensor_parallel
from .weights import chunk_bounds

__all__ = ["fsdp_parts", "gathered", "refuse_packed", "resharded_after", "set_buffers", "shard_stages"]


def fsdp_parts(
    stages: list[nn.Module], rank: int, count: int, tp_parts: Mapping[str, tuple] | None = None,
    unchunked: set[str] = frozenset(),
) -> dict[str, tuple]:
    """Stage parameter name -> ``(0, rank, count)``: the dim-0 chunk fsdp rank ``rank`` of ``count`` reads
    of it (every replica's fsdp rank ``rank`` alike, under HSDP); ``(tp part, (0, rank, count))`` for a
    tensor in ``tp_parts`` (:func:`~hf_pipeline.loading.tensor_parallel.shard_parts`): the chunk of the
    tp slice, as FSDP2 chunks a ``DTensor``'s local tensor; the tp part alone (the whole slice) for a tensor
    packed along dim 0, which every fsdp rank keeps whole (:func:`_whole_placement`), and for the names in
    ``unchunked`` (experts over the fsdp ranks, which FSDP leaves out: their ep part whole)."""
    tp_parts = tp_parts or {}
    chunk = (0, rank, count)
    # Kept whole on each fsdp rank (see _whole_placement), or left out by FSDP: the tp / ep part alone.
    whole = _packed_dim0(tp_parts) | set(unchunked)
    return {
        name: (tp_parts[name] if name in whole else (tp_parts[name], chunk)) if name in tp_parts else chunk
        for stage in stages for name, _ in stage.named_parameters(remove_duplicate=False)
    }


def _packed_dim0(tp_parts: Mapping[str, tuple]) -> set[str]:
    """The names whose tp part is a packed one along dim 0 (GPT-2's fused ``c_attn`` bias): a strided shard
    of the dim FSDP would chunk again."""
    return {name for name, part in tp_parts.items() if part[0] == 0 and len(part) > 3 and part[3] > 1}


def _packed_modules(plan: tuple[tuple[str, str], ...]) -> list[str]:
    """The plan's module patterns whose style packs blocks side by side (GPT-2's fused ``c_attn``)."""
    return [name for name, style in plan if (parse_style(style) or ("", 1))[1] > 1]


def _whole_mesh(mesh, plan: tuple[tuple[str, str], ...]):
    """The fsdp mesh as (fsdp ranks, 1) when the plan packs a projection, else None; collective over the
    world (made on every rank, whatever its stages hold, as the plan is the same everywhere)."""
    if not _packed_modules(plan):
        return None
    return unflatten_mesh(mesh, (mesh.size(), 1), ("fsdp_whole", "fsdp_one"))


def _whole_placement(stage: nn.Module, tp_parts: Mapping[str, tuple], whole_mesh):
    """``fully_shard``'s ``shard_placement_fn``: each tensor packed along dim 0 (GPT-2's fused ``c_attn`` bias)
    stays whole on every fsdp rank; every other parameter FSDP's default dim-0 chunk.

    Why: tp rank t holds such a bias as ``[q_t, k_t, v_t]`` (a strided shard of dim 0), and FSDP2 can only
    chunk a 1-D tensor along dim 0, keeping on fsdp rank f the f-th contiguous chunk of ``[q_t, k_t, v_t]``
    (``q_t`` and half of ``k_t`` on 2 fsdp ranks). The forward would be right (the all-gather concatenates
    the chunks) but no DTensor placement describes those chunks, so ``full_tensor`` (the gathered state, the
    saved checkpoint) would put the values out of order. FSDP2's own per-parameter mesh instead shards the
    bias over a 1-rank dim and replicates it over the fsdp ranks (HSDP's placement): ``(Replicate(),
    <1-rank shard>, <tp's strided shard>)``, which ``full_tensor`` gathers right, and whose gradient FSDP
    all-reduces over the fsdp ranks. Such a bias is small (3 x hidden); a weight packed along dim 0 would be
    kept whole the same way.
    """
    if whole_mesh is None:
        return None
    packed = _packed_dim0(tp_parts)
    held = {id(p) for name, p in stage.named_parameters(remove_duplicate=False) if name in packed}
    whole = whole_placement(whole_mesh)
    return lambda p: whole if id(p) in held else None


def _units(stage: nn.Module) -> list[nn.Module]:
    """The stage's whole blocks (decoder layers, T5 blocks), each its own FSDP unit so that one block's
    parameters are gathered at a time. A block cut at a stage boundary is not one: the glue calls its
    halves' modules, never the block, so FSDP's hooks on the block would never gather it; its
    parameters go with the stage's root unit."""
    return [layer for (_, layer), half in zip(stage.blocks, stage.block_halves) if half is None]


def _check_no_shared(stages: list[nn.Module], tied: tuple[tuple[str, ...], ...]) -> None:
    """Refuse one tensor held by two stages of this rank (a tied embedding and LM head on one rank of a
    V schedule): each stage is its own FSDP root, and one Parameter cannot be sharded by two."""
    groups = {name: g for g in tied for name in g}
    held: dict[str, int] = {}
    for i, stage in enumerate(stages):
        for name, _ in stage.named_parameters(remove_duplicate=False):
            key = min(groups.get(name, (name,)))
            if held.setdefault(key, i) != i:
                raise InputError(
                    f"fsdp_size > 1: {name!r} is one tensor with a parameter of another stage on the same rank; "
                    "FSDP shards each stage on its own. Use a schedule that puts those stages on different ranks "
                    "('1f1b', 'interleaved-1f1b', 'interleaved-zero-bubble') or load without fsdp_size"
                )


def _meta_parameters(
    stage: nn.Module, dtypes: Mapping[str, torch.dtype], tied: tuple[tuple[str, ...], ...],
    tp_parts: Mapping[str, tuple] | None = None,
) -> None:
    """One meta Parameter of the whole shape (of its tp slice, for a tensor in ``tp_parts``) per tensor (tied
    names within the stage share one), in the dtype it is read or initialised in, so FSDP shards each
    tensor once and the optimizer steps it once."""
    tp_parts = tp_parts or {}
    groups = {name: g for g in tied for name in g}
    made: dict[str, nn.Parameter] = {}
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        twin = next((made[n] for n in (name, *groups.get(name, ())) if n in made), None)
        if twin is None:
            if name not in dtypes:
                raise InternalError(f"no tensor read or initialised for stage parameter {name!r}")
            shape = list(p.shape)
            if name in tp_parts:
                dim, index, count = tp_parts[name][:3]
                shape[dim] = chunk_bounds(shape[dim], index, count)[1]
            twin = nn.Parameter(torch.empty(shape, dtype=dtypes[name], device="meta"), p.requires_grad)
        owner_name, _, attr = name.rpartition(".")
        setattr(stage.get_submodule(owner_name), attr, twin)
        made[name] = twin


def _allocate(stage: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Allocate the local shards module by module (``to_empty``: FSDP's sharded parameters, once per
    tied Parameter). Returns stage name -> its local shard (detached, one tensor per Parameter), the
    memory the reader reads into."""
    local: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for module_name, module in stage.named_modules():
        direct = list(module.named_parameters(recurse=False))
        if direct and not all(id(p) in local for _, p in direct):
            # A module with some parameters tied to an earlier module's (BERT's MLM decoder: its bias is the
            # head's ``bias``, its weight the embeddings' on another stage): those are allocated already, and
            # to_empty would allocate them again, so they stay off the module while it allocates its own.
            done = [(attr, p) for attr, p in direct if id(p) in local]
            for attr, _ in done:
                delattr(module, attr)
            module.to_empty(device=device, recurse=False)  # this module's shards only
            for attr, p in done:
                module.register_parameter(attr, p)
        for attr, p in module.named_parameters(recurse=False):
            shard = local.setdefault(id(p), p.to_local().detach())
            out[f"{module_name}.{attr}" if module_name else attr] = shard
    return out


def shard_stages(
    stages: list[nn.Module], dtypes: Mapping[str, torch.dtype], *, mesh, device: torch.device,
    tied: tuple[tuple[str, ...], ...] = (), tp: tuple | None = None, experts: tuple = ((), "auto", None, None),
) -> dict[str, torch.Tensor]:
    """Shard this rank's meta ``stages`` over ``mesh`` (FSDP2) and allocate only the local shards.

    Args:
        stages: this rank's stages, on the meta device (their buffers real, as built).
        dtypes: stage parameter name -> the dtype it is read (or initialised) in.
        mesh: the fsdp mesh (1-D: FSDP; 2-D (replicate, shard): HSDP).
        device: where the shards go.
        tied: the tied name groups (one Parameter per group within a stage).
        tp: ``(plan, tp_mesh, tp_parts)`` to make the stages tensor-parallel first (FSDP over tp; ``tp_parts``
            holds the expert-parallel parts too).
        experts: ``(ep_plan, ep_implementation, ep_mesh, batch_mesh)`` to make them expert-parallel first, over
            ``ep_mesh`` (None: ``tp_mesh``). An ep mesh over the fsdp ranks themselves (``batch_mesh`` given:
            experts over data-parallel ranks, torchtitan's layout) keeps each rank's experts whole: FSDP leaves
            them out (``ignored_params``), their gradients are summed over the expert-replica group by the step.

    Returns:
        stage parameter name -> its local shard, uninitialised: the part of :func:`fsdp_parts`,
        for :func:`~hf_pipeline.loading.weights.load_tensors` (``into``) to read into in place. Buffers
        keep their built values; :func:`set_buffers` puts in those read. Communicates nothing.
    """
    from torch.distributed.fsdp import fully_shard

    _check_no_shared(stages, tied)
    whole_mesh = _whole_mesh(mesh, tp[0]) if tp else None
    shards: dict[str, torch.Tensor] = {}
    for stage in stages:
        # Buffers (rotary frequencies, position ids) are real already; to_empty would drop them.
        buffers = dict(stage.named_buffers())
        _meta_parameters(stage, dtypes, tied, tp[2] if tp else None)
        ignored = None
        if tp:  # the meta tp slices become tp DTensors, which fully_shard then chunks (no data moves)
            if tp[1] is not None:  # none with experts over the fsdp ranks alone
                apply_tensor_parallel(stage, tp[0], tp[1])
            ep_plan, implementation, ep_mesh, batch_mesh = experts
            # This rank's experts, likewise (over tp: chunked by FSDP too; over the fsdp ranks: left out of it).
            apply_expert_parallel(stage, ep_plan, ep_mesh or tp[1], implementation, batch_mesh=batch_mesh)
            if batch_mesh is not None:
                ignored = {p for p in stage.parameters() if on_expert_mesh(p)}
        placement = _whole_placement(stage, tp[2], whole_mesh) if tp else None
        for unit in _units(stage):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False, shard_placement_fn=placement,
                        ignored_params=ignored)
        fully_shard(stage, mesh=mesh, reshard_after_forward=False, shard_placement_fn=placement, ignored_params=ignored)
        shards.update(_allocate(stage, device))
        set_buffers([stage], buffers, device)
        _sum_gradients(stage)
        stage.eval()
    return shards


def refuse_packed(plan: tuple[tuple[str, str], ...], *, replicas: int = 1) -> None:
    """Refuse HSDP (``replicas`` > 1) over a packed tensor-parallel projection (GPT-2's fused q, k, v): its
    bias is kept whole on each fsdp rank by a (fsdp ranks, 1) mesh (:func:`_whole_placement`), made from the
    1-D fsdp mesh only. Plain FSDP over such a plan is loaded."""
    packed = _packed_modules(plan)
    if packed and replicas > 1:
        raise InputError(
            f"fsdp_size with tp_size and {replicas} replicas: the tensor-parallel plan packs {packed} (fused "
            "projections sharded block by block), which HSDP cannot shard yet; launch fsdp_size x pp_size x "
            "tp_size processes (one replica) or load without tp_size"
        )


def _sum_gradients(stage: nn.Module) -> None:
    """Sum, not mean (see the module docstring); forced as a plain SUM, which gloo also runs."""
    from torch.distributed.fsdp import FSDPModule

    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_buffers(stages: list[nn.Module], tensors: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Put ``tensors``' values of the stages' buffers (stage name -> tensor) in, on ``device``."""
    for stage in stages:
        for name, _ in list(stage.named_buffers()):
            if name in tensors:
                owner_name, _, attr = name.rpartition(".")
                setattr(stage.get_submodule(owner_name), attr, tensors[name].to(device))


@contextlib.contextmanager
def resharded_after(stages: list[nn.Module], call: ContextManager) -> Iterator[None]:
    """Run ``call``'s block, then reshard every FSDP unit of ``stages`` (local, no communication).

    Note: an unsharded FSDP2 module holds its gathered plain tensors as its parameters, and with
    ``reshard_after_forward=False`` nothing reshards after a forward-only call (forward, generate). An
    optimizer made then (``AdamW(model.parameters())``) would hold tensors that the next reshard frees,
    and step freed memory; and one made before would step shards the gathered copies no longer match.
    So every pipelined call leaves the stages sharded, as they were loaded.
    """
    with call:
        try:
            yield
        finally:
            from torch.distributed.fsdp import FSDPModule

            for stage in stages:
                for module in stage.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()


@contextlib.contextmanager
def gathered(stages: list[nn.Module]) -> Iterator[None]:
    """Gather every FSDP unit of ``stages`` now, run the block, then reshard them (:func:`resharded_after`).

    Collective over each stage's fsdp group: every rank of the job enters it at the same point. With
    ``reshard_after_forward=False`` a gathered unit stays gathered through every forward in the block
    (FSDP2's pre-forward gather is then a no-op), so the block runs no collective of FSDP's: a loop whose
    fsdp ranks run different numbers of forwards (the continuous ring, each data-parallel replica on its
    own rows) cannot deadlock on a gather another rank never reaches. Units are gathered in module order,
    which is the same on every fsdp rank of a stage (they hold the same stages).
    """
    from torch.distributed.fsdp import FSDPModule

    with resharded_after(stages, contextlib.nullcontext()):
        for stage in stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        yield
