"""FSDP asked for and laid out, on one process (no ranks): the request, the options, the rank formula,
the chunks each fsdp rank reads.

The fsdp ranks of a stage are data-parallel ranks (outermost mesh dim), so the global rank formula is
the one without FSDP with ``dp_rank`` = fsdp rank; each reads the ``torch.chunk`` part of dim 0 that
FSDP2 keeps on it.
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny
import torch
from transformers.distributed import DistributedConfig

from hf_pipeline.distributed.context import RankContext
from hf_pipeline.distributed.dims import ParallelDims
from hf_pipeline.errors import InputError
from hf_pipeline.loading.weights import chunk_bounds
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.tp_plan import ParallelRequest, parallel_request


def _req(**kw):
    return parallel_request(**{"tp_size": None, "distributed_config": None, "device_mesh": None, "world_size": 4, **kw})


class _Mesh:
    def __init__(self, shape, names):
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.mesh_dim_names = names


def test_fsdp_is_asked_for_by_keyword_config_or_mesh():
    assert _req(fsdp_size=2) == ParallelRequest(fsdp_size=2)
    # transformers refuses fsdp_size with pp_size at construction: the depth then comes from num_stages.
    assert _req(distributed_config=DistributedConfig(fsdp_size=2)) == ParallelRequest(fsdp_size=2)
    assert _req(device_mesh=_Mesh((2, 2), ("fsdp", "pp"))) == ParallelRequest(fsdp_size=2, pp_size=2)
    assert _req(tp_size=1, fsdp_size=2) == ParallelRequest(fsdp_size=2)  # accepted together
    assert _req(tp_size=2, fsdp_size=2) == ParallelRequest(tp_size=2, fsdp_size=2)  # FSDP over tp's shards
    # Replicas of fsdp-sharded pipelines (HSDP): the mesh's dp dim.
    hsdp = ParallelRequest(fsdp_size=2, pp_size=1, dp_size=2)
    assert _req(device_mesh=_Mesh((2, 2, 1), ("dp", "fsdp", "pp"))) == hsdp
    assert _req(distributed_config=DistributedConfig(dp_replicate_size=2, fsdp_size=2)) == ParallelRequest(
        fsdp_size=2, dp_size=2)
    for kw, needle in [
        ({"fsdp_size": 2, "distributed_config": DistributedConfig(tp_size=2)}, "not fsdp_size and distributed_config"),
        ({"fsdp_size": 0}, "fsdp_size must be a positive integer"),
    ]:
        with pytest.raises(InputError) as e:
            _req(**kw)
        assert needle in str(e.value), str(e.value)


def test_options_size_the_pipeline_from_the_world_left_by_fsdp():
    llama = tiny.config_for("llama")
    opts = PipelineOptions.resolve(llama, 4, parallel=ParallelRequest(fsdp_size=2), auto_class="AutoModelForCausalLM")
    assert (opts.pp_size, opts.dp_size, opts.fsdp_size) == (2, 2, 2)
    # HSDP: 8 ranks of 2-stage pipelines leave 4 data-parallel ranks, 2 replicas of 2 fsdp ranks.
    hsdp = PipelineOptions.resolve(llama, 8, parallel=ParallelRequest(fsdp_size=2), num_stages=2,
                                   auto_class="AutoModelForCausalLM")
    assert (hsdp.pp_size, hsdp.dp_size, hsdp.fsdp_size) == (2, 4, 2)
    for world, kw, needle in [
        (4, {"parallel": ParallelRequest(fsdp_size=3)}, "fsdp_size=3 (x tp_size=1) does not divide the world size 4"),
        (8, {"parallel": ParallelRequest(fsdp_size=4), "num_stages": 4}, "fsdp_size=4 does not divide world size 8"),
        (8, {"parallel": ParallelRequest(fsdp_size=2, dp_size=4), "num_stages": 2}, "= 2 pipeline replicas"),
        (4, {"parallel": ParallelRequest(fsdp_size=2), "split_method": "trace"}, "split by the tracer"),
    ]:
        with pytest.raises(InputError) as e:
            PipelineOptions.resolve(llama, world, auto_class="AutoModelForCausalLM", **kw)
        assert needle in str(e.value), str(e.value)


def test_global_rank_places_fsdp_ranks_outermost():
    dims = ParallelDims(pp_size=2, dp_size=2, fsdp_size=2, dp_rank=1, pp_rank=0)
    assert [dims.place(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert dims.fsdp_rank == 1 and dims.sharded
    assert dims.ranks((0, 1), 0) == (0, 1, 2, 3)
    assert dims.ranks((0, 1), 0, (1,)) == (2, 3)  # a tied key's copies at fsdp rank 1
    assert not dataclasses.replace(dims, fsdp_size=1).sharded
    # HSDP: data-parallel rank = replica x fsdp_size + fsdp rank, so the formula is the same.
    hsdp = ParallelDims(pp_size=2, dp_size=4, fsdp_size=2, dp_rank=3, pp_rank=1)
    assert (hsdp.replicas, hsdp.fsdp_rank, hsdp.place(7)) == (2, 1, (3, 1, 0))
    # 8 ranks of 2-stage pipelines leave 4 data-parallel ranks: 3 fsdp ranks do not divide them.
    ctx = RankContext(rank=0, world_size=8, local_rank=0, local_world_size=8, device=torch.device("cpu"),
                      backend="none", group=None)
    with pytest.raises(InputError, match=r"fsdp_size=3 does not divide the 4 data-parallel ranks"):
        ParallelDims.build(ctx, pp_size=2, fsdp_size=3)


@pytest.mark.parametrize("rows,count", [(8, 2), (7, 2), (5, 4), (1, 2), (3, 3)])
def test_chunks_are_torch_chunk_as_fsdp2_cuts_them(rows, count):
    t = torch.arange(rows)
    want = list(torch.chunk(t, count)) + [t[:0]] * (count - len(torch.chunk(t, count)))
    for i in range(count):
        first, length = chunk_bounds(rows, i, count)
        assert torch.equal(t.narrow(0, first, length), want[i]), (rows, count, i)


@pytest.mark.parametrize("command", ["generate", "train"])
def test_cli_takes_fsdp_size_beside_tp_size(command, tmp_path):
    from hf_pipeline import cli
    from hf_pipeline.cli.arguments import load_kwargs

    (tmp_path / "d.txt").write_text("text\n")
    required = ["--data", str(tmp_path / "d.txt"), "--output-dir", str(tmp_path / "out")] if command == "train" else []
    args = cli.build_parser().parse_args([command, *required, "--fsdp-size", "2"])
    assert load_kwargs(args)["fsdp_size"] == 2
    assert "fsdp_size" not in load_kwargs(cli.build_parser().parse_args([command, *required]))
