"""FSDP2 inside a loaded stage: ``fully_shard`` over the mesh's fsdp dim, each block one unit plus the stage as root.

The fsdp ranks of a stage are data-parallel ranks (each runs its own rows of the batch) that keep
1/fsdp of every parameter: dim-0 chunks as ``torch.chunk`` cuts them, which is FSDP2's own split
(``ceil(rows / fsdp)`` rows each, the last ranks fewer or none). Loading stays per rank and no rank
ever holds a whole tensor: :func:`fsdp_parts` names the chunk of each parameter the reader reads (a
contiguous byte range of the shard file), :func:`shard_stages` applies ``fully_shard`` to the stage
while it is still on the meta device, allocates only the local shards (``to_empty``) and copies the
chunks in.

``reshard_after_forward=False``: with several microbatches in flight a stage runs the forwards of
some before the backwards of others (1F1B), so resharding after each forward would all-gather every
block again for every microbatch; as torchtitan does under pipeline parallelism, the gathered
parameters stay until the step's last backward, after which torch's ``PipelineStage`` reduce-scatters
the gradients once and reshards (``perform_reduce_grad``). The reduce-scatter sums instead of
averaging: every microbatch loss is already divided by the global batch's item count (``step.py``),
so the sum over data-parallel ranks is the gradient of the whole batch, as ``flat_reduce`` sums replicas.

Example:
    >>> parts = fsdp_parts(stages, dims.fsdp_mesh)          # name -> (0, fsdp rank, fsdp size)
    >>> shard_stages(stages, tensors, mesh=dims.fsdp_mesh, device=device, tied=resolved.tied)
    >>> stage.get_submodule("model.layers.0.mlp.up_proj").weight.to_local().shape   # (ceil(inter / fsdp), hidden)
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Mapping

import torch
from torch import nn

from ..errors import InputError, InternalError

__all__ = ["fsdp_parts", "resharded_after", "shard_stages"]


def fsdp_parts(stages: list[nn.Module], mesh) -> dict[str, tuple[int, int, int]]:
    """Stage parameter name -> ``(0, index, count)``: the dim-0 chunk this fsdp rank reads of it."""
    rank, count = mesh.get_local_rank(), mesh.size()
    return {name: (0, rank, count) for stage in stages for name, _ in stage.named_parameters(remove_duplicate=False)}


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


def _meta_parameters(stage: nn.Module, chunks: Mapping[str, torch.Tensor], tied: tuple[tuple[str, ...], ...]) -> None:
    """One meta Parameter of the whole shape per tensor (tied names within the stage share one), in the
    dtype read, so FSDP shards each tensor once and the optimizer steps it once."""
    groups = {name: g for g in tied for name in g}
    made: dict[str, nn.Parameter] = {}
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        twin = next((made[n] for n in (name, *groups.get(name, ())) if n in made), None)
        if twin is None:
            if name not in chunks:
                raise InternalError(f"no tensor loaded for stage parameter {name!r}")
            twin = nn.Parameter(torch.empty(p.shape, dtype=chunks[name].dtype, device="meta"), p.requires_grad)
        owner_name, _, attr = name.rpartition(".")
        setattr(stage.get_submodule(owner_name), attr, twin)
        made[name] = twin


def _fill(stage: nn.Module, chunks: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate the local shards module by module (``to_empty``), copy each chunk in and drop it from
    ``chunks``: a rank never holds much more than what it keeps (all chunks plus all shards would be 2x)."""
    filled: set[int] = set()
    for module_name, module in stage.named_modules():
        direct = list(module.named_parameters(recurse=False))
        if not direct or all(id(p) in filled for _, p in direct):
            continue  # a module sharing another's (tied) parameter: allocated and filled there
        # A module with some parameters tied to an earlier module's (BERT's MLM decoder: its bias is the
        # head's ``bias``, its weight the embeddings' on another stage): those are filled already, and
        # to_empty would empty them again, so they stay off the module while it allocates its own.
        done = [(attr, p) for attr, p in direct if id(p) in filled]
        for attr, _ in done:
            delattr(module, attr)
        module.to_empty(device=device, recurse=False)  # this module's shards only (FSDP's sharded parameters)
        for attr, p in done:
            module.register_parameter(attr, p)
        with torch.no_grad():
            for attr, p in module.named_parameters(recurse=False):
                if id(p) in filled:
                    continue
                name = f"{module_name}.{attr}" if module_name else attr
                chunk, local = chunks.pop(name), p.to_local()
                if local.shape != chunk.shape:
                    raise InternalError(f"{name}: shard {tuple(local.shape)}, read {tuple(chunk.shape)}")
                local.copy_(chunk)
                filled.add(id(p))


def shard_stages(
    stages: list[nn.Module], chunks: dict[str, torch.Tensor], *, mesh, device: torch.device,
    tied: tuple[tuple[str, ...], ...] = (),
) -> None:
    """Shard this rank's meta ``stages`` over ``mesh`` (FSDP2) and fill the local shards with ``chunks``
    (stage name -> this rank's dim-0 chunk, read with :func:`fsdp_parts`; each is dropped from it once
    copied). Communicates nothing: ``fully_shard`` and the copies are local; the first forward all-gathers."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    _check_no_shared(stages, tied)
    for stage in stages:
        # Buffers (rotary frequencies, position ids) are real already or read; to_empty would drop them.
        buffers = {name: chunks.get(name, b) for name, b in stage.named_buffers()}
        _meta_parameters(stage, chunks, tied)
        for unit in _units(stage):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        fully_shard(stage, mesh=mesh, reshard_after_forward=False)
        _fill(stage, chunks, device)
        for name, buf in buffers.items():
            owner_name, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner_name), attr, buf.to(device))
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                # Sum, not mean (see the module docstring); forced as a plain SUM, which gloo also runs.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        stage.eval()


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
