"""Which families and schedules tensor parallelism goes with, as data, and the recipes' ``[tp]`` plans.

Pure unit tests: the table of families (transformers' ``base_model_tp_plan`` or the recipe's), the
styles a plan may use, the schedules refused under tensor parallelism and their message, the
recipes' plans matched against the modules of meta GPT-2 / BERT / T5 models, the slices a rank
reads of a packed tensor, a malformed ``[tp]`` table refused by name, and plans refused at planning
(parameters left out between sharded projections, a tied embedding sharded, a style refused with its reason).
"""

from __future__ import annotations

import pytest
import tiny
import torch

from hf_pipeline.errors import InputError
from hf_pipeline.families.recipe import RecipeError, get_recipe, load_recipe
from hf_pipeline.loading.tensor_parallel import local_slice, plan_for_stage, shard_parts
from hf_pipeline.planning.mesh_rules import (
    TP_REFUSED_SCHEDULES,
    check_tp_schedule,
    parse_style,
    tp_families,
    tp_plan_source,
)
from hf_pipeline.planning.schedules import SCHEDULES
from hf_pipeline.planning.tp_plan import tp_plan


def test_families_with_a_plan_and_where_it_comes_from():
    from transformers import AutoConfig

    from hf_pipeline.families.recipe import list_recipes

    families = tp_families()
    # the config's plan wherever transformers ships one, else the recipe's [tp] table (GPT-2, BERT, T5)
    shipped = {t for t in list_recipes() if getattr(AutoConfig.for_model(t), "base_model_tp_plan", None)}
    assert families == {"gpt2": "recipe", "bert": "recipe", "t5": "recipe"} | {t: "config" for t in shipped}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss", "deepseek_v3"} <= shipped
    assert "opt" not in families and "bloom" not in families  # no plan anywhere: tp_size > 1 is refused
    assert tp_plan_source(tiny.config_for("gpt2")) == "recipe"
    assert tp_plan_source(tiny.config_for("llama")) == "config"


@pytest.mark.parametrize(
    "style, parsed",
    [("colwise", ("colwise", 1)), ("rowwise", ("rowwise", 1)), ("packed_colwise", ("colwise", 2)),
     ("packed_colwise:3", ("colwise", 3)), ("packed_colwise:1", None), ("sequence_parallel", None), ("local", None),
     ("colwise_gather_output", ("colwise_gather", 1)), ("rowwise_split_input", ("rowwise_split", 1)),
     ("embedding_rowwise", ("rowwise", 1)), ("replicated_with_grad_allreduce", ("replicated", 1)),
     ("mla_kv_a_proj", None)],
)
def test_plan_styles(style, parsed):
    assert parse_style(style) == parsed


def test_schedules_refused_under_tp_are_named_with_the_reason(monkeypatch):
    assert set(TP_REFUSED_SCHEDULES) <= set(SCHEDULES)
    # Every schedule runs tensor-parallel stages today; the refusal is checked with one made up.
    monkeypatch.setitem(TP_REFUSED_SCHEDULES, "dualpipev", "its overlapped halves cannot share a DTensor stage")
    for name in SCHEDULES:
        check_tp_schedule(name, 1)  # without tensor parallelism every schedule goes
        if name not in TP_REFUSED_SCHEDULES:
            check_tp_schedule(name, 2)
            continue
        with pytest.raises(InputError) as e:
            check_tp_schedule(name, 2)
        msg = str(e.value)
        assert f"schedule={name!r} with tp_size=2" in msg and TP_REFUSED_SCHEDULES[name] in msg, msg
        assert "'1f1b'" in msg and "tp_size=1" in msg and "'dualpipev'" not in msg.split("use one of")[1], msg
    with pytest.raises(InputError, match=r"schedule='dualpipev' with tp_size=2: its overlapped"):
        tp_plan(tiny.config_for("llama"), 2, schedule="dualpipev")  # where loading checks it


def _meta(arch):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, tiny.AUTO[arch]).from_config(tiny.config_for(arch))


def test_recipe_plans_name_the_modules_of_gpt2_bert_t5():
    gpt2 = plan_for_stage(_meta("gpt2"), tp_plan(tiny.config_for("gpt2"), 2))
    assert gpt2["transformer.h.3.attn.c_attn"] == "packed_colwise:3"
    assert gpt2["transformer.h.0.mlp.c_proj"] == "rowwise" and len(gpt2) == 4 * 4
    bert = plan_for_stage(_meta("bert"), tp_plan(tiny.config_for("bert"), 2))
    assert bert["bert.encoder.layer.1.attention.output.dense"] == "rowwise"
    assert bert["bert.encoder.layer.1.output.dense"] == "rowwise" and len(bert) == 6 * 4
    assert not any(n.startswith("cls.") for n in bert)  # the head stays whole
    t5 = plan_for_stage(_meta("t5"), tp_plan(tiny.config_for("t5"), 2))
    assert t5["encoder.block.0.layer.0.SelfAttention.relative_attention_bias"] == "colwise"
    assert t5["decoder.block.2.layer.1.EncDecAttention.o"] == "rowwise"
    # encoder: 3 x (q, k, v, o, wi, wo) + its bias; decoder: 3 x (2 x (q, k, v, o) + wi, wo) + its bias
    assert len(t5) == 3 * 6 + 1 + 3 * 10 + 1
    assert tp_plan(tiny.config_for("gpt2"), 2) == tuple(sorted(get_recipe("gpt2").tp_plan))


def test_family_fields_tp_must_divide_are_named():
    with pytest.raises(InputError, match=r"tp_size=4 does not divide config.d_ff=66"):
        tp_plan(tiny.config_for("t5", d_ff=66), 4)
    with pytest.raises(InputError, match=r"config.n_inner=30"):
        tp_plan(tiny.config_for("gpt2", n_inner=30), 4)
    with pytest.raises(InputError, match=r"config.num_attention_heads=4"):
        tp_plan(tiny.config_for("bert"), 3)
    with pytest.raises(InputError, match=r"styles \{'h.\*.attn': 'packed_rowwise'\}"):
        tp_plan(tiny.config_for("gpt2"), 2, override=(("h.*.attn", "packed_rowwise"),))


class _Mesh:
    def __init__(self, rank, size):
        self.rank, self._size = rank, size

    def get_local_rank(self):
        return self.rank

    def size(self):
        return self._size


def test_a_rank_reads_its_third_of_each_of_q_k_v():
    model = _meta("gpt2")
    plan = tp_plan(model.config, 2)
    parts = shard_parts([model], plan, _Mesh(1, 2))
    assert parts["transformer.h.0.attn.c_attn.weight"] == (1, 1, 2, 3)  # Conv1D: output features are dim 1
    assert parts["transformer.h.0.attn.c_attn.bias"] == (0, 1, 2, 3)
    assert parts["transformer.h.0.attn.c_proj.weight"] == (0, 1, 2)  # rowwise: input features, dim 0
    assert "transformer.h.0.attn.c_proj.bias" not in parts  # whole on every rank
    whole = torch.arange(4 * 12.0).view(4, 12)  # columns q0..q3 k0..k3 v0..v3
    got = local_slice(whole, parts["transformer.h.0.attn.c_attn.weight"])
    assert got[0].tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    assert local_slice(whole, (0, 1, 2)).tolist() == whole[2:].tolist()


def test_a_malformed_tp_table_is_refused_by_name(tmp_path):
    path = tmp_path / "broken.toml"
    base = 'model_types = ["x"]\nglue = "llama"\nstacks = [{name = "a", blocks = "b"}]\nheads = {}\n'
    path.write_text(base + '[tp]\nplans = {}\n')
    with pytest.raises(RecipeError, match=r"broken.toml: unknown field\(s\) \['plans'\] in tp"):
        load_recipe(path)
    path.write_text(base + '[tp]\nplan = { "a.*.q" = 2 }\n')
    with pytest.raises(RecipeError, match=r"broken.toml: field \"tp.plan.'a.\*.q'\" must be a str"):
        load_recipe(path)


def _meta_decoder(model_type, **overrides):
    from decoders import decoder_config

    from hf_pipeline.loading.stages import meta_model

    return meta_model(decoder_config(model_type, **overrides), "AutoModelForCausalLM")


def test_a_plan_leaving_out_parameters_between_sharded_projections_is_refused_naming_them():
    from hf_pipeline.loading.tensor_parallel import check_plan

    apertus = _meta_decoder("apertus")  # its MLP's XIELU activation has parameters; transformers' plan omits them
    plan = tp_plan(apertus.config, 2)
    with pytest.raises(InputError) as e:
        check_plan(apertus, plan)
    msg = str(e.value)
    assert msg.startswith("ApertusForCausalLM: tp_plan shards the projections of model.layers.0.mlp"), msg
    assert "{'model.layers.0.mlp.act_fn': ['alpha_n', 'alpha_p']}" in msg, msg
    assert "'layers.*.mlp.act_fn': 'replicated_with_grad_allreduce'" in msg, msg
    check_plan(apertus, (*plan, ("layers.*.mlp.act_fn", "replicated_with_grad_allreduce")))  # named: accepted
    qwen3 = _meta_decoder("qwen3")  # its per-head q_norm / k_norm are in transformers' plan
    check_plan(qwen3, tp_plan(qwen3.config, 2))


def test_a_plan_sharding_a_tied_embedding_is_refused():
    from hf_pipeline.loading.tensor_parallel import check_plan

    tied = _meta_decoder("gpt_neox", tie_word_embeddings=True)
    with pytest.raises(InputError, match=r"GPTNeoXForCausalLM: tp_plan shards gpt_neox.embed_in.weight "
                                         r"\('embedding_rowwise'\), which is tied to \['lm_head.weight'\]"):
        check_plan(tied, tp_plan(tied.config, 2))
    untied = _meta_decoder("gpt_neox")
    check_plan(untied, tp_plan(untied.config, 2))


def test_a_refused_style_says_why_and_names_the_model_class():
    deepseek = _meta_decoder("deepseek_v3")
    with pytest.raises(InputError) as e:
        tp_plan(deepseek.config, 2, model_class="DeepseekV3ForCausalLM")
    msg = str(e.value)
    assert msg.startswith("DeepseekV3ForCausalLM: tp_plan styles {'layers.*.self_attn.kv_a_proj_with_mqa': "), msg
    assert "multi-latent attention's shared rotary key" in msg and "'replicated_with_grad_allreduce'" in msg, msg
