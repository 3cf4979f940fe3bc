"""How the job's ranks form pipelines: ``dp_size`` data-parallel ranks of a ``pp_size``-rank pipeline
whose ranks are ``tp_size`` tensor-parallel ranks each. Of the data-parallel ranks, ``fsdp_size`` hold
one shard each of their stages' parameters (FSDP2): they take their own rows of the batch like
replicas, but hold 1/fsdp_size of the weights.

The mesh is ``(dp, pp, tp)``, tensor parallelism innermost (the ranks of one stage are neighbours):
global rank ``(d * pp_size + p) * tp_size + t``. With FSDP its data-parallel dim is named ``"fsdp"``
(``(fsdp, pp, tp)``): the FSDP ranks are data-parallel ranks, so the same formula places every rank and
everything that splits a batch over ``dp_size`` splits it over them. The fsdp dim is outermost because
it talks least often (one all-gather and one reduce-scatter per stage per step), the pipeline's
point-to-point traffic runs every microbatch, and tensor parallelism on every matmul.

Replicas of fsdp-sharded pipelines (HSDP: ``dp_size = replicas x fsdp_size``) make the mesh
``(dp, fsdp, pp, tp)``: the replica dim outermost (it talks least: one gradient all-reduce of 1/fsdp
of each tensor per step), global rank ``((r * fsdp_size + f) * pp_size + p) * tp_size + t``. That is
the formula above with data-parallel rank ``d = r * fsdp_size + f``, so the batch is split over all
``dp_size`` ranks as before; FSDP2 gets the 2-D ``(dp, fsdp)`` sub-mesh, shards over fsdp and
all-reduces the reduce-scattered gradient chunks over dp.

Example (``torchrun --nproc-per-node 4 script.py``, two-stage pipelines):
    >>> dims = ParallelDims.build(init_distributed(), pp_size=2)
    >>> dims.dp_size, dims.pp_rank, dims.dp_rank     # (2, 1, 1) on global rank 3
    >>> dims = ParallelDims.build(init_distributed(), pp_size=2, fsdp_size=2)
    >>> dims.dp_size, dims.fsdp_rank, dims.fsdp_mesh.size()     # (2, 1, 2) on global rank 3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import InputError, InternalError
from .context import RankContext
from .shards import EXPERT_MESH_DIMS

__all__ = ["ParallelDims"]


def _data_rank(mesh, names: tuple[str, ...], fsdp_size: int) -> int:
    """This rank's data-parallel index: its place on the mesh's first dim, or replica x fsdp + fsdp rank."""
    if len(names) == 3:
        return mesh.get_local_rank(names[0])
    return mesh.get_local_rank("dp") * fsdp_size + mesh.get_local_rank("fsdp")


def _data_group(ctx: RankContext, dp_size: int, pp_size: int, tp_size: int) -> dist.ProcessGroup:
    """This rank's group over every data-parallel rank of its pipeline slot (all replicas' fsdp ranks): the
    group the batch is split over. Collective over the job: every rank makes every slot's group, in order."""
    mine = None
    block = pp_size * tp_size
    for slot in range(block):
        group = dist.new_group([d * block + slot for d in range(dp_size)])
        if ctx.rank % block == slot:
            mine = group
    return mine


def _expert_groups(ctx: RankContext, dp_size: int, pp_size: int, tp_size: int, k: int):
    """This rank's expert-parallel group (its stage's tp ranks in ``k`` consecutive data-parallel ranks: replicas, or
    the fsdp ranks of one sharded pipeline; ordered replica-major
    so its place is ``(replica - first) x tp_size + tp_rank``) and expert-replica group (the ranks at its place in
    the other ep groups; None when ``dp_size == k``). Collective over the job: every rank makes every group,
    in order."""
    d, rest = divmod(ctx.rank, pp_size * tp_size)
    p, t = divmod(rest, tp_size)
    ep = replica = None
    for b in range(dp_size // k):
        for q in range(pp_size):
            group = dist.new_group([(e * pp_size + q) * tp_size + s for e in range(b * k, (b + 1) * k)
                                    for s in range(tp_size)])
            if (b, q) == (d // k, p):
                ep = group
    if dp_size > k:
        for q in range(pp_size):
            for j in range(k):
                for s in range(tp_size):
                    group = dist.new_group([((b * k + j) * pp_size + q) * tp_size + s for b in range(dp_size // k)])
                    if (q, j, s) == (p, d % k, t):
                        replica = group
    return ep, replica


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How the job's ranks form pipelines: ``dp_size`` replicas of a ``pp_size``-rank pipeline, each
    pipeline rank made of ``tp_size`` tensor-parallel ranks.

    Global rank ``(d * pp_size + p) * tp_size + t`` is tensor-parallel slot ``t`` of pipeline rank ``p``
    in replica ``d``. With one replica and no tensor parallelism the pipeline's group is the context's
    (``ctx.group``, None for one process) and no mesh is made. A mesh dimension that spans the whole job
    is given ``ctx.group`` too, so that a model loaded with a group of its own (``groups.own_group``)
    never communicates in WORLD.

    Attributes:
        pp_size, dp_size, tp_size: ranks per pipeline, data-parallel ranks (pipeline replicas, or FSDP
            ranks), tensor-parallel ranks per stage.
        fsdp_size: of the ``dp_size`` data-parallel ranks, how many shard each stage's parameters (1: none;
            ``dp_size``: one replica of FSDP-sharded pipelines; a divisor of it: ``dp_size / fsdp_size`` replicas).
        pp_rank, dp_rank, tp_rank: this rank's place in its pipeline, its replica, its place in its stage.
        pp_group, dp_group, tp_group: this rank's pipeline group (``ctx.group`` when it spans the job,
            None for one process), data-parallel group (every replica's and fsdp rank: the batch's
            split) and tensor-parallel group (None when not needed).
        fsdp_group: the ranks sharing this rank's stage parameters' shards (None without FSDP).
        mesh: the (dp, pp, tp) device mesh with several replicas or tensor-parallel ranks ((fsdp, pp, tp)
            with FSDP, (dp, fsdp, pp, tp) with replicas of FSDP pipelines), else None.
        ep_data: data-parallel ranks (replicas, or fsdp ranks) one expert-parallel group spans (1: a stage's experts
            split over its own ranks).
        ep_mesh: with ``ep_data > 1``, the 1-D ``("ep",)`` mesh of this rank's expert-parallel group: its stage's
            tp ranks in ``ep_data`` consecutive replicas, or fsdp ranks (``planning/ep_plan.py``); else None.
        expert_replica_group: with ``ep_data > 1`` and more replicas, the ranks holding the same experts in
            the other ep groups (their gradients are summed over it); else None.
    """

    pp_size: int
    dp_size: int = 1
    tp_size: int = 1
    fsdp_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    fsdp_group: dist.ProcessGroup | None = None
    mesh: Any = None
    ep_data: int = 1
    ep_mesh: Any = None
    expert_replica_group: dist.ProcessGroup | None = None

    @classmethod
    def build(
        cls, ctx: RankContext, pp_size: int, tp_size: int = 1, fsdp_size: int = 1, ep_data: int = 1,
    ) -> "ParallelDims":
        """The dims of ``ctx``'s job for ``pp_size``-rank pipelines of ``tp_size``-rank stages, sharded over
        ``fsdp_size`` data-parallel ranks, experts over ``ep_data`` replicas (collective when a mesh is made)."""
        if ctx.world_size % (pp_size * tp_size):
            raise InputError(
                f"world size {ctx.world_size} is not a multiple of pp_size x tp_size = {pp_size} x {tp_size} "
                f"(pp_size = num_stages / virtual_stages); launch a multiple of {pp_size * tp_size} processes or "
                "change num_stages / tp_size"
            )
        dp_size = ctx.world_size // (pp_size * tp_size)
        if fsdp_size > 1 and dp_size % fsdp_size:
            raise InputError(
                f"fsdp_size={fsdp_size} does not divide the {dp_size} data-parallel ranks (world size "
                f"{ctx.world_size} / (pp_size {pp_size} x tp_size {tp_size})); launch a multiple of "
                f"{pp_size * tp_size * fsdp_size} processes or change fsdp_size"
            )
        if ep_data > 1 and (dp_size % ep_data or (fsdp_size > 1 and fsdp_size % ep_data)):
            # PipelineOptions refuses these layouts by name before any mesh is built; the groups below need them.
            raise InternalError(
                f"experts over {ep_data} data-parallel ranks reached the mesh with {dp_size} data-parallel ranks and "
                f"fsdp_size={fsdp_size}, a layout the options refuse"
            )
        if not ctx.is_distributed:
            return cls(pp_size=pp_size)
        if dp_size == 1 and tp_size == 1:
            return cls(pp_size=pp_size, pp_rank=ctx.rank, pp_group=ctx.group)
        from torch.distributed.device_mesh import init_device_mesh

        replicas = dp_size // fsdp_size
        names: tuple[str, ...] = ("fsdp" if fsdp_size > 1 else "dp", "pp", "tp")
        shape: tuple[int, ...] = (dp_size, pp_size, tp_size)
        if fsdp_size > 1 and replicas > 1:  # HSDP: replicas of fsdp-sharded pipelines
            names, shape = ("dp", *names), (replicas, fsdp_size, pp_size, tp_size)
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        groups = {name: mesh.get_group(name) for name in names}
        if len(names) == 4:  # every data-parallel rank of this pipeline slot: replicas x fsdp ranks
            groups["data"] = _data_group(ctx, dp_size, pp_size, tp_size)
        # Sub-groups get torch's 30-minute default, not the job's timeout: a dead peer must not hang them.
        groups = {name: ctx.group if g is dist.group.WORLD else g for name, g in groups.items()}
        ctx.apply_timeout(*groups.values())
        data = groups.get("data", groups[names[0]])
        experts: dict[str, Any] = {}
        if ep_data > 1:
            from torch.distributed.device_mesh import DeviceMesh

            ep, replica = _expert_groups(ctx, dp_size, pp_size, tp_size, ep_data)
            ctx.apply_timeout(*(g for g in (ep, replica) if g is not None))
            experts = {"ep_data": ep_data, "expert_replica_group": replica,
                       "ep_mesh": DeviceMesh.from_group(ep, ctx.device.type, mesh_dim_names=EXPERT_MESH_DIMS)}
        return cls(**experts,
            pp_size=pp_size, dp_size=dp_size, tp_size=tp_size, fsdp_size=fsdp_size, pp_rank=mesh.get_local_rank("pp"),
            dp_rank=_data_rank(mesh, names, fsdp_size), tp_rank=mesh.get_local_rank("tp"), pp_group=groups["pp"],
            dp_group=data if dp_size > 1 else None, tp_group=groups["tp"] if tp_size > 1 else None,
            fsdp_group=groups["fsdp"] if fsdp_size > 1 else None, mesh=mesh,
        )

    @property
    def replicas(self) -> int:
        """Replicas of the fsdp-sharded pipeline (``dp_size / fsdp_size``; > 1 with FSDP: HSDP)."""
        return self.dp_size // self.fsdp_size

    @property
    def fsdp_mesh(self) -> Any:
        """The FSDP sub-mesh of this rank's stage: 1-D ``("fsdp",)``, or 2-D ``("dp", "fsdp")`` with
        replicas (HSDP: FSDP2 shards over fsdp and replicates over dp); None without FSDP."""
        if self.fsdp_size == 1:
            return None
        return self.mesh["dp", "fsdp"] if self.replicas > 1 else self.mesh["fsdp"]

    @property
    def fsdp_rank(self) -> int:
        """This rank's FSDP shard index (0 without FSDP); its replica is ``dp_rank // fsdp_size``."""
        return self.dp_rank % self.fsdp_size

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The group over which a stage's DTensor shards are split: the tensor-parallel ranks, or the fsdp
        ranks (None when stages hold whole tensors)."""
        return self.fsdp_group if self.fsdp_size > 1 else self.tp_group

    @property
    def sharded(self) -> bool:
        """Whether stages hold DTensor shards (tensor parallelism or FSDP), bound to this mesh's groups."""
        return self.tp_size > 1 or self.fsdp_size > 1

    @property
    def expert_mesh(self) -> Any:
        """The mesh a stage's experts are split over: the ep mesh across replicas, else the stage's own ranks."""
        return self.ep_mesh if self.ep_data > 1 else self.tp_mesh

    @property
    def expert_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups of experts over replicas (ep group, expert-replica group) this rank is in; () without."""
        if self.ep_mesh is None:
            return ()
        return tuple(g for g in (self.ep_mesh.get_group(), self.expert_replica_group) if g is not None)

    @property
    def batch_mesh(self) -> Any:
        """The 1-D mesh of the ranks sharing this rank's batch (its tensor-parallel ranks; size 1 without them)."""
        return None if self.mesh is None else self.mesh["tp"]

    @property
    def tp_mesh(self) -> Any:
        """The 1-D tensor-parallel sub-mesh of this rank's stage (None without tensor parallelism)."""
        return self.mesh["tp"] if self.tp_size > 1 else None

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's replica (and tensor-parallel slot)."""
        return pp_rank if self.pp_group is None else dist.get_global_rank(self.pp_group, pp_rank)

    def place(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, tp_rank)`` of global rank ``rank``."""
        return rank // (self.pp_size * self.tp_size), (rank // self.tp_size) % self.pp_size, rank % self.tp_size

    def ranks(self, pp_ranks: tuple[int, ...], tp_rank: int, dp_ranks=None) -> tuple[int, ...]:
        """Global ranks of pipeline ranks ``pp_ranks`` at tensor-parallel slot ``tp_rank`` in every replica
        (in data-parallel ranks ``dp_ranks`` only, when given)."""
        pp, tp = self.pp_size, self.tp_size
        dps = range(self.dp_size) if dp_ranks is None else dp_ranks
        return tuple(sorted((d * pp + r) * tp + tp_rank for d in dps for r in pp_ranks))
