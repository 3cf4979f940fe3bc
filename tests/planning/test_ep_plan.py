"""How expert parallelism is asked for and planned, on one process (no ranks).

``ep_size=`` and transformers' ``DistributedConfig(ep_size, ep_plan, ep_implementation)`` map to one
request whose stage has ``ep_size`` ranks (with no tensor-parallel rule when ``ep_size`` is given alone, as
transformers' ``tp_plan={}``); ``ep_plan`` takes the config's ``base_model_ep_plan`` and refuses, naming the
class and the field, what cannot run; the expert rules take precedence over the tensor-parallel ones; and
``narrow_conversion`` makes a rank's merge of the experts stored one tensor each read only its own.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from decoders import decoder_config
from transformers.distributed import DistributedConfig

from hf_pipeline.errors import InputError
from hf_pipeline.loading.key_conversions import (
    checkpoint_conversions,
    convert_tensors,
    narrow_conversion,
    saved_tensors,
)
from hf_pipeline.planning.ep_plan import ep_plan, without_experts
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.tp_plan import ParallelRequest, parallel_request

pytestmark = pytest.mark.unit


def _req(**kw):
    args = {"tp_size": None, "distributed_config": None, "device_mesh": None, "world_size": 4, **kw}
    return parallel_request(**args)


def test_ep_size_alone_or_with_tp_gives_the_stage_ranks_and_their_plans():
    assert _req(ep_size=2) == ParallelRequest(ep_size=2)
    assert _req(ep_size=2).stage_ranks == ParallelRequest(tp_size=2, ep_size=2, plan=())
    dc = DistributedConfig(pp_size=2, tp_size=2, ep_size=2, ep_plan={"layers.*.mlp.experts": "ep_dispatch_experts"},
                           ep_implementation="all_to_all")
    req = _req(distributed_config=dc)
    assert (req.tp_size, req.ep_size, req.pp_size, req.ep_implementation) == (2, 2, 2, "all_to_all")
    assert req.ep_plan == (("layers.*.mlp.experts", "ep_dispatch_experts"),) and req.stage_ranks is req
    with pytest.raises(InputError, match="ep_size must equal tp_size"):
        ParallelRequest(tp_size=2, ep_size=4)
    with pytest.raises(InputError, match="not ep_size and distributed_config"):
        _req(ep_size=2, distributed_config=dc)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_options_split_the_experts_over_the_stage_and_keep_tp_off_them(model_type):
    config = decoder_config(model_type)
    alone = PipelineOptions.resolve(config, 4, parallel=ParallelRequest(ep_size=2))
    assert (alone.pp_size, alone.tp_size, alone.ep_size, alone.tp_plan) == (2, 2, 2, ())
    styles = dict(alone.ep_plan)
    assert styles["layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert styles["layers.*.mlp.experts.gate_up_proj"] == styles["layers.*.mlp.experts.down_proj"] == "grouped_gemm"


def test_expert_rules_take_precedence_over_tensor_parallel_ones():
    tp = (("layers.*.mlp.experts", "colwise"), ("layers.*.mlp.experts.down_proj", "rowwise"),
          ("layers.*.self_attn.q_proj", "colwise"))
    ep = (("layers.*.mlp.experts", "ep_dispatch_experts"),)
    assert without_experts(tp, ep) == (("layers.*.self_attn.q_proj", "colwise"),)
    dc = DistributedConfig(pp_size=2, tp_size=2, ep_size=2)
    both = PipelineOptions.resolve(decoder_config("qwen3_moe"), 4, parallel=_req(distributed_config=dc))
    assert both.tp_plan and not any("experts" in k for k, _ in both.tp_plan)
    assert dict(both.tp_plan)["layers.*.self_attn.q_proj"] == "colwise"


@pytest.mark.parametrize(("model_type", "overrides", "kwargs", "wants"), [
    ("qwen3", {}, {}, "Qwen3ForCausalLM with ep_size=2: expert parallelism needs a mixture of experts"),
    ("mixtral", {"num_local_experts": 3}, {}, "ep_size=2 does not divide the 3 experts of each MoE layer "
                                              "(config.num_local_experts)"),
    ("mixtral", {}, {"implementation": "deepgemm_megamoe"}, "ep_implementation='deepgemm_megamoe' is not one"),
    ("mixtral", {}, {"override": (("layers.*.mlp.experts", "ep_router"),)}, "ep_plan styles {'layers.*.mlp"),
    ("mixtral", {}, {"override": (("layers.*.mlp.experts", "grouped_gemm"),)}, "names no 'ep_dispatch_experts'"),
    ("mixtral", {}, {"traced": True}, "it is split by the tracer"),
])
def test_what_cannot_run_is_refused_naming_the_class_and_field(model_type, overrides, kwargs, wants):
    config = decoder_config(model_type, **overrides)
    name = f"{type(transformers.AutoModelForCausalLM.from_config(config)).__name__}"
    with pytest.raises(InputError) as err:
        ep_plan(config, 2, model_class=name, **kwargs)
    assert wants in str(err.value) and name in str(err.value)


def test_a_rank_merges_only_its_experts_from_a_checkpoint_storing_them_one_by_one():
    config = decoder_config("mixtral")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    saved = saved_tensors(model, dict(model.state_dict()), None)  # what transformers' save_pretrained writes
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in saved
    stored = {n: [n] for n in model.state_dict()}
    conversions = checkpoint_conversions(model, saved.keys(), stored)
    target = "model.layers.0.mlp.experts.gate_up_proj"
    whole = model.state_dict()[target]
    for index in range(2):
        mine = narrow_conversion(conversions[target], (0, index, 2))
        assert len(mine.sources) == len(conversions[target].sources) // 2
        made = convert_tensors({target: mine}, {k: saved[k].clone() for k in mine.sources}, model)[target]
        assert torch.equal(made, whole[2 * index:2 * index + 2])  # experts 2i, 2i + 1, gate and up joined
    # FSDP's chunks of an ep part, cut as torch.chunk cuts: 4 experts over 3 ranks are 2, 2 and none, and
    # expert 1 of ep part 0 of 2 chunked over 2 ranks is expert 1 alone.
    assert [len(narrow_conversion(conversions[target], (0, i, 3)).sources) for i in range(3)] == [4, 4, 0]
    one = narrow_conversion(conversions[target], ((0, 0, 2), (0, 1, 2)))
    made = convert_tensors({target: one}, {k: saved[k].clone() for k in one.sources}, model)[target]
    assert torch.equal(made, whole[1:2])
    assert narrow_conversion(conversions[target], (1, 0, 2)) is None  # a cut along another dim than the experts'
