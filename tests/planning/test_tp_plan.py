"""How tensor parallelism is asked for and planned, on one process (no ranks).

``parallel_request`` maps ``tp_size=`` / transformers' ``DistributedConfig`` / a ``DeviceMesh``-like
object to one request and refuses what this version cannot do, naming the field; ``tp_plan`` takes the
config's ``base_model_tp_plan`` and refuses a family without one or a ``tp_size`` that does not divide
the heads; ``PipelineOptions.resolve`` sizes the pipeline from the world left by ``tp_size``.
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from transformers.distributed import DistributedConfig

from hf_pipeline.errors import InputError
from hf_pipeline.loading.tensor_parallel import plan_for_stage
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.tp_plan import ParallelRequest, parallel_request, tp_plan


def _req(**kw):
    args = {"tp_size": None, "distributed_config": None, "device_mesh": None, "world_size": 4, **kw}
    return parallel_request(**args)


class _Mesh:
    """What parallel_request reads of a torch DeviceMesh: its dim names and rank tensor."""

    def __init__(self, shape, names, ranks=None):
        self.mesh = (torch.arange(int(torch.tensor(shape).prod())) if ranks is None else torch.tensor(ranks))
        self.mesh = self.mesh.reshape(shape)
        self.mesh_dim_names = names


def test_the_three_ways_to_ask_give_one_request():
    assert _req() == ParallelRequest()
    assert _req(tp_size=2) == ParallelRequest(tp_size=2)
    assert _req(distributed_config=DistributedConfig(pp_size=2, tp_size=2)) == ParallelRequest(tp_size=2, pp_size=2)
    plan = {"model.layers.*.mlp.up_proj": "colwise"}
    assert _req(distributed_config=DistributedConfig(tp_size=2, tp_plan=plan)).plan == tuple(plan.items())
    assert _req(device_mesh=_Mesh((2, 2), ("pp", "tp"))) == ParallelRequest(tp_size=2, pp_size=2)
    assert _req(device_mesh=_Mesh((2, 2, 1), ("dp", "pp", "tp"))) == ParallelRequest(tp_size=1, pp_size=2, dp_size=2)
    # FSDP over the tensor-parallel shards
    assert _req(distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)) == ParallelRequest(tp_size=2, fsdp_size=2)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"tp_size": 2, "distributed_config": DistributedConfig(tp_size=2)}, "not tp_size and distributed_config"),
        ({"distributed_config": DistributedConfig(fsdp_size=2, fsdp_cpu_offload=True)}, "fsdp_cpu_offload=True"),
        ({"distributed_config": DistributedConfig(enable_sequence_parallel=True)}, "enable_sequence_parallel"),
        ({"distributed_config": {"tp_size": 2}}, "must be a transformers.distributed.DistributedConfig"),
        ({"device_mesh": _Mesh((2, 2), ("tp", "pp"))}, "order ['pp', 'tp']"),
        ({"device_mesh": _Mesh((2, 2), ("pp", "tp"), ranks=[0, 2, 1, 3])}, "over ranks [0, 2, 1, 3]"),
        ({"device_mesh": _Mesh((2, 2), ("pp", "ep"))}, "named dims among"),
        ({"device_mesh": _Mesh((2, 2), ("pp", "fsdp"))}, "order ['fsdp', 'pp']"),
        ({"device_mesh": _Mesh((2,), ("pp",))}, "has 2 ranks"),
        ({"tp_size": 0}, "tp_size must be a positive integer"),
    ],
)
def test_requests_this_version_cannot_do_are_refused_by_name(kw, needle):
    with pytest.raises(InputError, match=None) as e:
        _req(**kw)
    assert needle in str(e.value), str(e.value)


def test_plan_comes_from_the_config_and_is_checked_against_the_heads():
    llama = tiny.config_for("llama")
    plan = dict(tp_plan(llama, 2))
    assert plan == dict(llama.base_model_tp_plan)
    assert tp_plan(llama, 1) == ()
    with pytest.raises(InputError, match=r"tp_size=4 does not divide config.num_key_value_heads=2"):
        tp_plan(llama, 4)
    with pytest.raises(InputError, match=r"config.num_attention_heads=4"):
        tp_plan(llama, 3)
    with pytest.raises(InputError, match=r"the opt family has no tensor-parallel plan"):
        tp_plan(transformers.OPTConfig(num_attention_heads=4), 2)  # neither transformers nor a recipe has one
    with pytest.raises(InputError, match=r"the llama family has no tensor-parallel plan"):
        tp_plan(llama, 2, traced=True)
    with pytest.raises(InputError, match=r"styles \{'layers.\*.mlp': 'sequence_parallel'\}"):
        tp_plan(llama, 2, override=(("layers.*.mlp", "sequence_parallel"),))


def test_plan_patterns_name_the_stage_modules():
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny.config_for("llama"))
    by_name = plan_for_stage(model, tp_plan(model.config, 2))
    assert by_name["model.layers.3.self_attn.q_proj"] == "colwise"
    assert by_name["model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(by_name) == 7 * 4  # seven projections in each of the 4 blocks, nothing else
    assert "lm_head" not in by_name and "model.embed_tokens" not in by_name


def test_options_size_the_pipeline_from_the_world_left_by_tp():
    cfg = tiny.config_for("llama")
    resolve = PipelineOptions.resolve
    opts = resolve(cfg, 4, auto_class="AutoModelForCausalLM", parallel=ParallelRequest(tp_size=2))
    assert (opts.pp_size, opts.tp_size, opts.dp_size, opts.num_stages) == (2, 2, 1, 2)
    opts = resolve(cfg, 4, auto_class="AutoModelForCausalLM", num_stages=1, parallel=ParallelRequest(tp_size=2))
    assert (opts.pp_size, opts.tp_size, opts.dp_size) == (1, 2, 2)
    assert dict(opts.tp_plan) == dict(cfg.base_model_tp_plan)
    with pytest.raises(InputError, match=r"pp_size=2 conflicts with num_stages=4"):
        resolve(cfg, 4, auto_class="AutoModelForCausalLM", num_stages=4, parallel=ParallelRequest(tp_size=1, pp_size=2))
    with pytest.raises(InputError, match=r"needs a multiple of 4 processes, but the world size is 6"):
        resolve(cfg, 6, auto_class="AutoModelForCausalLM", num_stages=2, parallel=ParallelRequest(tp_size=2))
    with pytest.raises(InputError, match=r"conflicts with world size 4 / \(pp_size 2 x tp_size 2\) = 1"):
        resolve(cfg, 4, auto_class="AutoModelForCausalLM", parallel=ParallelRequest(tp_size=2, pp_size=2, dp_size=2))
