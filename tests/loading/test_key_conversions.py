"""Mixture-of-experts checkpoints as transformers saves them (one tensor per expert), planned per stage.

Single process, no pipeline run: which checkpoint keys feed which stage tensor (transformers' own
conversion mapping), that a stage reads those keys and no others (bytes counted by the reader), that
transformers' converters merge them into what ``from_pretrained`` loads (bitwise: the same stack and
cat of the same fp32 bytes), that the loader reads each expert tensor straight into its place in the
merged parameter (no source tensor of its own, checked on the reader's calls: all of a stage's sources
alive at once is what made a load peak at 1.1-1.2x of what it keeps), and the refusals for incomplete or
unconvertible checkpoints. The merged models equal transformers end to end in tests/families/test_decoders.py.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import weakref

import pytest
import tiny
import torch
import transformers
from decoders import decoder_config
from safetensors import safe_open

import hf_pipeline
from hf_pipeline.errors import CheckpointError
from hf_pipeline.loading import weights
from hf_pipeline.loading.checkpoint_files import CheckpointIndex
from hf_pipeline.loading.key_conversions import convert_tensors, merge_in_place, narrow_conversion
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


def test_the_loader_reads_each_expert_tensor_into_its_merged_parameter(saved, monkeypatch):
    """Every expert key is read into a view of the loaded parameter it merges into, so no source tensor is
    alive beside the merged ones; the parameters equal transformers' bitwise. Old path (every source read
    into a tensor of its own, then transformers' converter): all of a stage's sources alive at once."""
    _, directory, ref = saved
    read = weights._TensorReader.read
    sources: list = []  # (key, weak reference to the tensor read for it, bytes) of expert keys read on their own
    into: dict[str, int] = {}  # expert key -> the storage it was read into
    peak = [0, 0]  # the most bytes of expert sources alive at once; the largest one

    def tracked(self, f, t, **kw):
        dest = kw.get("into")
        out = read(self, f, t, **kw)
        if ".experts." in t.key:
            if dest is None:
                sources.append((t.key, weakref.ref(out), out.nbytes))
                peak[1] = max(peak[1], out.nbytes)
            else:
                into[t.key] = dest.untyped_storage().data_ptr()
            peak[0] = max(peak[0], sum(n for _, alive, n in sources if alive() is not None))
        return out

    monkeypatch.setattr(weights._TensorReader, "read", tracked)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        directory, pipeline=True, device="cpu", num_stages=2, schedule="interleaved-1f1b", n_microbatches=2,
        progress=False,
    )
    assert peak[0] <= peak[1], f"{peak[0]} bytes of expert tensors alive at once, one is at most {peak[1]}"
    params = dict(model.checkpoint_named_parameters())
    storages = {n: p.untyped_storage().data_ptr() for n, p in params.items() if ".experts." in n}
    plan = key_plan(_maker(directory).skeleton, _maker(directory).resolved, CheckpointIndex.from_directory(directory))
    for name, conv in plan.conversions.items():
        assert all(into.get(k) == storages[name] for k in conv.sources), name  # read in place, every one
    want = ref.state_dict()
    for name, p in params.items():
        assert torch.equal(p.detach(), want[name]), name  # the same bytes as transformers' converters give


def test_an_expert_parallel_part_merged_in_place_equals_transformers_converter(saved):
    """One rank's half of the experts (narrowed as ep_size=2 reads them), cast to bf16 on the way (the
    reader's bounce buffer writes into the views): bitwise the converter's stack and cat of the same reads.
    A converter with an operation merge_in_place does not know is left to transformers'."""
    _, directory, _ = saved
    maker = _maker(directory)
    index = CheckpointIndex.from_directory(directory)
    plan = key_plan(maker.skeleton, maker.resolved, index)
    stages = maker.make_stages(maker.plan.stages)
    wanted, aliases, _, _ = wanted_tensors(maker.skeleton, maker.resolved, stages, index, torch.bfloat16)
    narrowed = {n: narrow_conversion(c, (0, 1, 2)) for n, c in plan.conversions.items()}
    mine = {k for c in narrowed.values() for k in c.sources}
    wanted = {k: v for k, v in wanted.items() if ".experts." not in k or k in mine}
    tensors, _ = load_tensors(index, wanted, aliases=aliases)
    want = convert_tensors(narrowed, tensors, maker.skeleton)
    merges = merge_in_place(narrowed, wanted, device=torch.device("cpu"))
    assert not merges.rest and sorted(merges.views) == sorted(mine)
    load_tensors(index, wanted, aliases=aliases, into=merges.views)
    assert sorted(merges.targets) == sorted(want)
    for name, t in want.items():
        assert t.dtype == torch.bfloat16 and torch.equal(merges.targets[name], t), name

    from transformers.core_model_loading import Transpose

    def transposed(conv):
        converter = copy.deepcopy(conv.converter)
        converter.operations = [*converter.operations, Transpose(1, 2)]
        return dataclasses.replace(conv, converter=converter)

    odd = merge_in_place({n: transposed(c) for n, c in narrowed.items()}, wanted, device=torch.device("cpu"))
    assert not odd.targets and not odd.views and sorted(odd.rest) == sorted(narrowed)
