"""How the job's ranks form pipelines: ``dp_size`` replicas of a ``pp_size``-rank pipeline.

Example (``torchrun --nproc-per-node 4 script.py``, two-stage pipelines):
    >>> dims = ParallelDims.build(init_distributed(), pp_size=2)
    >>> dims.dp_size, dims.pp_rank, dims.dp_rank     # (2, 1, 1) on global rank 3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import InputError
from .context import RankContext

__all__ = ["ParallelDims"]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How the job's ranks form pipelines: ``dp_size`` replicas of a ``pp_size``-rank pipeline.

    Global ranks ``[d * pp_size, (d + 1) * pp_size)`` form pipeline replica ``d``; with one
    replica the pipeline's group is the context's (``ctx.group``, None for one process) and no mesh
    is made. A mesh dimension that spans the whole job is given ``ctx.group`` too, so that a model
    loaded with a group of its own (``groups.own_group``) never communicates in WORLD.

    Attributes:
        pp_size, dp_size: ranks per pipeline, pipeline replicas.
        pp_rank, dp_rank: this rank's place in its pipeline, and its replica.
        pp_group, dp_group: this rank's pipeline group (``ctx.group`` with one replica, None for one
            process) and data-parallel group (None with one replica).
        mesh: the (dp, pp) device mesh with several replicas, else None.
    """

    pp_size: int
    dp_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mesh: Any = None

    @classmethod
    def build(cls, ctx: RankContext, pp_size: int) -> "ParallelDims":
        """The dims of ``ctx``'s job for ``pp_size``-rank pipelines (collective with several replicas)."""
        if ctx.world_size % pp_size:
            raise InputError(
                f"world size {ctx.world_size} is not a multiple of the pipeline size {pp_size} (= num_stages / "
                f"virtual_stages); launch a multiple of {pp_size} processes or change num_stages"
            )
        dp_size = ctx.world_size // pp_size
        if not ctx.is_distributed:
            return cls(pp_size=pp_size)
        if dp_size == 1:
            return cls(pp_size=pp_size, pp_rank=ctx.rank, pp_group=ctx.group)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
        # Sub-groups get torch's 30-minute default, not the job's timeout: a dead peer must not hang them.
        pp_group, dp_group = (
            ctx.group if g is dist.group.WORLD else g for g in (mesh.get_group("pp"), mesh.get_group("dp"))
        )
        ctx.apply_timeout(pp_group, dp_group)
        return cls(
            pp_size=pp_size, dp_size=dp_size, pp_rank=mesh.get_local_rank("pp"), dp_rank=mesh.get_local_rank("dp"),
            pp_group=pp_group, dp_group=dp_group, mesh=mesh,
        )

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's replica."""
        return pp_rank if self.pp_group is None else dist.get_global_rank(self.pp_group, pp_rank)
