"""Tier 1: stage plans from the config alone (meta device, nothing read)."""

import pytest
import torch

from hf_pipeline.plan import PlanError, make_plan, resolve_recipe
from hf_pipeline.recipe import get_recipe
from hf_pipeline.stages import meta_model

import tiny


def _plan(arch="llama", auto="AutoModelForCausalLM", **kw):
    cfg = tiny.config_for(arch, **kw.pop("cfg", {}))
    model = meta_model(cfg, auto)
    return model, make_plan(model, get_recipe(cfg.model_type), **kw)


def test_plan_owns_every_block_once_in_order():
    model, plan = _plan(pp_size=3)
    blocks = [b for s in plan.stages for b in s.blocks]
    assert blocks == [f"model.layers.{i}" for i in range(4)]
    assert plan.stages[0].is_first and plan.stages[-1].is_last
    assert "model.embed_tokens" in plan.stages[0].modules
    assert {"model.norm", "lm_head"} <= set(plan.stages[-1].modules)
    assert all("model.rotary_emb" in s.modules for s in plan.stages)
    # every parameter is on exactly one stage (untied model)
    counted = sum(s.params for s in plan.stages)
    assert counted == plan.total_params
    assert all(p.is_meta for p in model.parameters())


def test_auto_split_counts_the_lm_head():
    # A big vocabulary makes the head expensive: the last stage gets fewer blocks than the first.
    _, plan = _plan(pp_size=2, cfg={"vocab_size": 4096, "num_hidden_layers": 8})
    assert len(plan.stages[0].blocks) > len(plan.stages[1].blocks), plan
    costs = [s.flops_per_token for s in plan.stages]
    _, uniform = _plan(pp_size=2, split="uniform", cfg={"vocab_size": 4096, "num_hidden_layers": 8})
    assert max(costs) < max(s.flops_per_token for s in uniform.stages)


def test_explicit_split_points():
    _, plan = _plan(pp_size=2, split=["model.layers.1"])
    assert [len(s.blocks) for s in plan.stages] == [1, 3]
    with pytest.raises(PlanError, match="model.layers.9"):
        _plan(pp_size=2, split=["model.layers.9"])
    with pytest.raises(PlanError, match="need 1"):
        _plan(pp_size=2, split=["model.layers.1", "model.layers.2"])


def test_virtual_stages_loop_and_v_layouts():
    _, loop = _plan(pp_size=2, virtual_stages=2)
    assert [s.rank for s in loop.stages] == [0, 1, 0, 1]
    assert [s.index for s in loop.stages_for_rank(0)] == [0, 2]
    _, v = _plan(pp_size=2, virtual_stages=2, layout="v")
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert v.last_rank == 0


def test_more_stages_than_blocks_is_a_clear_error():
    with pytest.raises(PlanError, match="only 4 blocks"):
        _plan(pp_size=5)
    with pytest.raises(PlanError, match="virtual"):
        _plan(pp_size=3, virtual_stages=2)


def test_t5_plan_runs_encoder_then_decoder_with_bias_replicas():
    _, plan = _plan("t5", "AutoModelForSeq2SeqLM", pp_size=3)
    blocks = [b for s in plan.stages for b in s.blocks]
    assert blocks == [f"encoder.block.{i}" for i in range(3)] + [f"decoder.block.{i}" for i in range(3)]
    for s in plan.stages:
        for stack in s.stacks:
            starts = f"{stack}.block.0" in s.blocks
            has_replica = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias" in s.modules
            assert starts or has_replica, s


def test_plan_prints_a_readable_table_and_dtype_bytes():
    _, plan = _plan(pp_size=2, dtype=torch.bfloat16)
    text = str(plan)
    assert "stage" in text and "rank" in text and "model.layers.0" in text and "lm_head" in text
    assert plan.total_bytes == plan.total_params * 2
    d = plan.to_dict()
    assert [s["rank"] for s in d["stages"]] == [0, 1]
