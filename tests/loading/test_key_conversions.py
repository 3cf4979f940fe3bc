"""Mixture-of-experts checkpoints as transformers saves them (one tensor per expert), planned per stage.

Single process, no pipeline run: which checkpoint keys feed which stage tensor (transformers' own
conversion mapping), that a stage reads those keys and no others (bytes counted by the reader), that
transformers' converters merge them into what ``from_pretrained`` loads (bitwise: the same stack and
cat of the same fp32 bytes), and the refusals for incomplete or unconvertible checkpoints. The merged
models equal transformers end to end in tests/families/test_decoders.py.
"""

from __future__ import annotations

import re

import pytest
import tiny
import torch
import transformers
from decoders import decoder_config
from safetensors import safe_open

from hf_pipeline.errors import CheckpointError
from hf_pipeline.loading.checkpoint_files import CheckpointIndex
from hf_pipeline.loading.key_conversions import convert_tensors
from hf_pipeline.loading.key_plan import key_plan, wanted_tensors
from hf_pipeline.loading.stages import recipe_front_end
from hf_pipeline.loading.weights import load_tensors, resolve_keys
from hf_pipeline.planning.options import PipelineOptions

# model_type -> how transformers names expert e's first weight of layer i in the checkpoint
EXPERT_KEY = {
    "mixtral": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "qwen3_moe": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
}


@pytest.fixture(scope="module", params=sorted(EXPERT_KEY))
def saved(request, tmp_path_factory):
    """(model_type, checkpoint directory, transformers' model loaded from it)."""
    model_type = request.param
    directory = tmp_path_factory.mktemp(model_type)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type)).save_pretrained(
        directory, max_shard_size="40KB"
    )
    return model_type, directory, transformers.AutoModelForCausalLM.from_pretrained(directory)


def _maker(directory):
    config = transformers.AutoConfig.from_pretrained(directory)
    options = PipelineOptions.resolve(config, auto_class="AutoModelForCausalLM", num_stages=2)
    return recipe_front_end(config, options)


def _stored_bytes(index: CheckpointIndex, keys) -> int:
    total = 0
    for key in keys:
        with safe_open(index.directory / index.weight_map[key], "pt") as f:
            t = f.get_tensor(key)
            total += t.numel() * t.element_size()
    return total


def test_each_stage_reads_only_its_layers_experts_and_merges_them_as_transformers(saved):
    model_type, directory, ref = saved
    maker = _maker(directory)
    index = CheckpointIndex.from_directory(directory)
    plan = key_plan(maker.skeleton, maker.resolved, index)
    # Every layer's two merged tensors, each fed by its own layer's experts and nothing else.
    assert sorted(plan.conversions) == sorted(
        f"model.layers.{i}.mlp.experts.{kind}" for i in range(4) for kind in ("down_proj", "gate_up_proj")
    )
    gate_up = plan.conversions["model.layers.2.mlp.experts.gate_up_proj"]
    assert len(gate_up.sources) == 8  # 4 experts x (gate, up)
    assert EXPERT_KEY[model_type].format(i=2, e=3) in gate_up.sources
    assert all(".layers.2." in k for k in gate_up.sources)

    want = ref.state_dict()
    for spec in maker.plan.stages:
        stages = maker.make_stages([spec])
        layers = {int(m) for s in stages for n in s.state_dict() for m in re.findall(r"layers\.(\d+)\.", n)}
        wanted, aliases, expected, _ = wanted_tensors(maker.skeleton, maker.resolved, stages, index, torch.float32)
        experts = {k for k in wanted if ".experts." in k}
        assert experts == {k for c in plan.conversions.values() for k in c.sources
                           if int(re.search(r"layers\.(\d+)\.", k)[1]) in layers}, spec.index
        tensors, report = load_tensors(index, wanted, aliases=aliases, expected_keys=expected)
        # What was read is this stage's keys, each once, and their stored bytes only.
        assert sorted(report.keys_read) == sorted(set(resolve_keys(index, wanted, aliases).values()))
        assert report.bytes_read == _stored_bytes(index, report.keys_read)
        merged = convert_tensors(plan.conversions, tensors, maker.skeleton)
        assert sorted(merged) == sorted(n for n in plan.conversions
                                        if int(re.search(r"layers\.(\d+)\.", n)[1]) in layers)
        assert not any(".experts." in k for k in tensors if k not in want)  # the sources were taken out
        for name, t in merged.items():
            assert torch.equal(t, want[name]), name  # the same bytes stacked and concatenated as transformers


def test_a_missing_expert_is_refused_naming_the_class_and_the_key(saved, tmp_path):
    model_type, directory, _ = saved
    gone = EXPERT_KEY[model_type].format(i=1, e=2)
    broken = tiny.edit_checkpoint(
        directory, tmp_path / "broken", lambda t, _: {k: v for k, v in t.items() if k != gone}
    )
    maker = _maker(broken)
    with pytest.raises(CheckpointError) as caught:
        key_plan(maker.skeleton, maker.resolved, CheckpointIndex.from_directory(broken))
    message = str(caught.value)
    assert type(maker.skeleton).__name__ in message and gone in message
    assert "model.layers.1.mlp.experts.gate_up_proj" in message


def test_experts_in_a_layout_the_class_has_no_conversion_for_are_refused(saved, tmp_path):
    """Experts under names transformers' mapping for the class does not match (w1 / w3 for Qwen3-MoE, gate_proj /
    up_proj for Mixtral): the merged tensors are named missing, with the keys the checkpoint has instead."""
    model_type, directory, _ = saved
    names = [(".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")]
    swaps = names if model_type == "mixtral" else [(new, old) for old, new in names]

    def other_layout(key: str) -> str:
        for old, new in swaps:
            key = key.replace(old, new)
        return key

    broken = tiny.edit_checkpoint(
        directory, tmp_path / "other", lambda t, _: {other_layout(k): v for k, v in t.items()}
    )
    maker = _maker(broken)
    with pytest.raises(CheckpointError) as caught:
        key_plan(maker.skeleton, maker.resolved, CheckpointIndex.from_directory(broken))
    message = str(caught.value)
    assert type(maker.skeleton).__name__ in message and "builds none of them" in message
    assert "model.layers.0.mlp.experts.gate_up_proj" in message


def test_a_checkpoint_holding_the_merged_tensors_is_read_as_it_is(saved, tmp_path):
    """A checkpoint of the model's own names (merged experts) has nothing to convert."""
    _, directory, ref = saved
    from safetensors.torch import save_file

    ref.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    maker = _maker(tmp_path)
    plan = key_plan(maker.skeleton, maker.resolved, CheckpointIndex.from_directory(tmp_path))
    assert plan.conversions == {}
