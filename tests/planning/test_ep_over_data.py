"""Experts over data-parallel ranks (``ep_over="data"``, transformers' ``ep_size > tp_size``), asked for and
planned on one process: the request keeps ``ep_size`` alone meaning the stage's own ranks, ``ep_over="data"``
makes ``ep_size / tp_size`` replicas per expert group, and what cannot run is refused by name (an ``ep_size``
that is no multiple k > 1 of ``tp_size``, k not dividing the replicas, FSDP, all-reduce dispatch, serving),
and replicas generating in lock step (beam search too) cut their rows into the same microbatch count.
"""

from __future__ import annotations

import pytest
from decoders import decoder_config
from transformers.distributed import DistributedConfig

from hf_pipeline.errors import InputError
from hf_pipeline.generation.microbatches import replica_share
from hf_pipeline.load_options import LoadOptions
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.tp_plan import ParallelRequest, parallel_request

pytestmark = pytest.mark.unit


def _req(**kw):
    args = {"tp_size": None, "distributed_config": None, "device_mesh": None, "world_size": 4, **kw}
    return parallel_request(**args)


def test_ep_over_data_spans_replicas_and_ep_size_alone_keeps_its_meaning():
    assert _req(ep_size=2).stage_ranks == ParallelRequest(tp_size=2, ep_size=2, plan=())
    data = _req(ep_size=2, ep_over="data")
    assert (data.tp_size, data.ep_size, data.ep_data) == (1, 2, 2) and data.stage_ranks is data
    assert ParallelRequest(tp_size=2, ep_size=4, ep_over="data").ep_data == 2
    assert "ep_over" in LoadOptions.from_kwargs({"ep_over": "data"}).acting_in("mesh")
    opts = PipelineOptions.resolve(decoder_config("mixtral"), 4, num_stages=2, parallel=data)
    assert (opts.pp_size, opts.dp_size, opts.tp_size, opts.ep_size, opts.ep_data, opts.tp_plan) == (2, 2, 1, 2, 2, ())
    assert dict(opts.ep_plan)["layers.*.mlp.experts"] == "ep_dispatch_experts"
    one = PipelineOptions.resolve(decoder_config("qwen3_moe"), 2, num_stages=1, parallel=data)
    assert (one.pp_size, one.dp_size, one.ep_data) == (1, 2, 2)


@pytest.mark.parametrize(("ask", "wants"), [
    ({"ep_size": 2, "ep_over": "replicas"}, "ep_over must be one of ['stage', 'data']"),
    ({"ep_size": 3, "tp_size": 2, "ep_over": "data"}, "ep_size must be a multiple k > 1 of tp_size"),
    ({"ep_size": 2, "tp_size": 2, "ep_over": "data"}, "ep_size must be a multiple k > 1 of tp_size"),
    ({"ep_over": "data"}, "ep_size must be a multiple k > 1 of tp_size"),
    ({"ep_size": 4, "tp_size": 2}, "for experts across data-parallel ranks pass ep_over='data'"),
])
def test_requests_that_cannot_run_are_refused_by_name(ask, wants):
    with pytest.raises(InputError) as e:
        _req(**ask)
    assert wants in str(e.value)


def test_transformers_config_asking_ep_over_its_fsdp_ranks_is_ep_over_data_and_other_refusals():
    # transformers' class only builds ep_size > tp_size with fsdp_size covering it: that is ep over its FSDP ranks.
    for dc in (DistributedConfig(tp_size=2, ep_size=4, fsdp_size=2), DistributedConfig(fsdp_size=4, ep_size=2)):
        req = _req(distributed_config=dc)
        assert (req.ep_over, req.ep_data, req.fsdp_size) == ("data", 2, dc.fsdp_size), req
    assert _req(distributed_config=DistributedConfig(tp_size=2, ep_size=2)).ep_over == "stage"
    with pytest.raises(InputError, match="ep_implementation='all_reduce'"):
        ParallelRequest(ep_size=2, ep_over="data", ep_implementation="all_reduce")
    with pytest.raises(InputError, match="must divide the 1 replicas"):  # pp2 at 2 ranks: one replica
        PipelineOptions.resolve(decoder_config("mixtral"), 2, parallel=_req(ep_size=2, ep_over="data"))
    fsdp = _req(ep_size=4, fsdp_size=4, ep_over="data", world_size=8)
    assert PipelineOptions.resolve(decoder_config("mixtral"), 8, num_stages=2, parallel=fsdp).ep_data == 4
    with pytest.raises(InputError, match="its experts span 4 fsdp ranks, which must divide fsdp_size"):  # 4 of fsdp 2
        PipelineOptions.resolve(decoder_config("mixtral"), 8, num_stages=2,
                                parallel=_req(ep_size=4, fsdp_size=2, ep_over="data", world_size=8))
    hsdp = _req(ep_size=2, fsdp_size=2, ep_over="data", world_size=8)  # fsdp2 x 2 replicas: ep within each
    assert PipelineOptions.resolve(decoder_config("mixtral"), 8, num_stages=2, parallel=hsdp).ep_data == 2


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_replicas_in_lock_step_cut_their_shares_into_the_same_microbatch_count(replicas):
    # Experts over replicas: every replica's ring must have the same timetable, so the same microbatch count,
    # whatever the batch and the microbatches asked for; the shares still cover the batch once, in order.
    for units in range(replicas, 3 * replicas + 2):
        for asked in range(1, 5):
            shares = [replica_share(units, replicas, r, asked, same_count=True) for r in range(replicas)]
            assert len({len(bounds) for _, bounds in shares}) == 1, (units, asked, shares)
            assert [lo for (lo, _), _ in shares] == [0] + [hi for (_, hi), _ in shares[:-1]]
            assert shares[-1][0][1] == units
            for (lo, hi), bounds in shares:
                assert bounds[0][0] == 0 and bounds[-1][1] == hi - lo
    # Without lock step a smaller share keeps one microbatch per row (5 rows over 2 replicas, 3 asked: 3 and 2).
    assert [len(replica_share(5, 2, r, 3)[1]) for r in range(2)] == [3, 2]
