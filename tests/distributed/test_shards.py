"""The gradient norm over tensor-parallel DTensors counts a replicated tensor once.

One process stands for a group of two identical ranks: ``all_reduce`` is replaced by a doubling, which
is what summing two ranks' equal parts gives. A shard's part is summed over the group (each rank holds
other elements); a DTensor replicated on every mesh dim is whole on each rank and must not be.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


def test_a_replicated_dtensor_counts_once_and_a_shard_over_the_group(one_rank_mesh, monkeypatch):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hf_pipeline.distributed import shards

    def doubled(t, op=None, group=None):  # two ranks holding equal parts
        t.mul_(2)

    monkeypatch.setattr(shards.dist, "all_reduce", doubled)
    g = torch.tensor([3.0, 4.0])  # norm 5
    replicated = DTensor.from_local(g, one_rank_mesh, [Replicate()], run_check=False)
    shard = DTensor.from_local(g, one_rank_mesh, [Shard(0)], run_check=False)
    plain = torch.tensor([12.0])  # norm 12
    group = object()  # passed through to the patched all_reduce
    assert shards.is_replicated(replicated) and not shards.is_replicated(shard) and not shards.is_replicated(g)
    power = shards.norm_power([replicated, plain], 2.0, device=torch.device("cpu"), tp_group=group)
    # sums of squares of small integers, exact in fp32 (default 1e-6 relative absorbs nothing more); a replica
    # counted twice or a shard once moves the power by 25.
    assert power.item() == pytest.approx(25 + 144)  # the replicated 25 once, not doubled
    power = shards.norm_power([shard, plain], 2.0, device=torch.device("cpu"), tp_group=group)
    assert power.item() == pytest.approx(2 * 25 + 144)  # the shard's part summed over both ranks
    inf = shards.norm_power([replicated, plain], float("inf"), device=torch.device("cpu"), tp_group=group)
    assert inf.item() == pytest.approx(12.0)
