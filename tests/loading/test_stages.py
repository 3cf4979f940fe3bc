"""Tier 2: in-process equivalence. Stages cut from the meta model, run one after another, equal HF."""

import copy

import pytest
import tiny
import torch
import transformers

from hf_pipeline.families.recipe import get_recipe
from hf_pipeline.loading.stages import build_stage, materialize, meta_model
from hf_pipeline.planning.plan import make_plan
from hf_pipeline.planning.resolve import resolve_recipe

CASES = [
    ("llama", "AutoModelForCausalLM"),
    ("llama-tied", "AutoModelForCausalLM"),
    ("llama", "AutoModel"),
    ("llama", "AutoModelForSequenceClassification"),
    ("mistral", "AutoModelForCausalLM"),
    ("qwen2", "AutoModelForCausalLM"),
    ("gpt2", "AutoModelForCausalLM"),
    ("gpt2", "AutoModel"),
    ("bert", "AutoModelForMaskedLM"),
    ("bert", "AutoModel"),
    ("bert", "AutoModelForSequenceClassification"),
    ("t5", "AutoModelForSeq2SeqLM"),
]


def _stages(arch, auto, num_stages, virtual=1):
    cfg = tiny.config_for(arch)
    torch.manual_seed(0)
    ref = getattr(transformers, auto).from_config(cfg).eval()
    state = ref.state_dict()
    meta = meta_model(cfg, auto)
    resolved = resolve_recipe(meta, get_recipe(cfg.model_type))
    plan = make_plan(meta, resolved, pp_size=num_stages // virtual, virtual_stages=virtual)
    stages = []
    for spec in plan.stages:
        stage = build_stage(meta, resolved, spec)
        groups = {n: g for g in resolved.tied for n in g}
        tensors = {}
        for name in stage.state_dict():
            key = next(k for k in groups.get(name, (name,)) if k in state)
            tensors[name] = state[key]
        materialize(stage, tensors, device=torch.device("cpu"), tied=resolved.tied)
        stages.append(stage.eval())
    return ref, plan, stages


@pytest.mark.parametrize("arch,auto", CASES, ids=[f"{a}-{b.removeprefix('AutoModel') or 'Model'}" for a, b in CASES])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stages_in_sequence_equal_the_hf_model(arch, auto, num_stages):
    ref, plan, stages = _stages(arch, auto, num_stages)
    inputs = tiny.sample_inputs(arch.split("-")[0], batch=3, seq=8)
    with torch.no_grad():
        expected = ref(**inputs)
        x = ()
        for stage in stages:
            x = stage(*x, **inputs)
            x = x if isinstance(x, tuple) else (x,)
    outputs = stages[-1].resolved.head.outputs
    assert len(x) == len(outputs), f"last stage returned {len(x)} tensors for the head's outputs {outputs}"
    for name, got in zip(outputs, x, strict=True):
        want = getattr(expected, name)
        assert got.shape == want.shape, name
        # fp32 outputs: summation order moves them ~1e-6 in the tiny models; a wrong or misnamed weight moves
        # them by 1e-2 or more.
        assert (got - want).abs().max().item() <= 1e-5, name


def test_stage_parameter_names_are_checkpoint_keys():
    ref, plan, stages = _stages("llama", "AutoModelForCausalLM", 2)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in ref.named_parameters())
    assert "model.layers.2.self_attn.q_proj.weight" in dict(stages[1].named_parameters())


def test_tied_weights_on_one_stage_are_one_parameter():
    _, _, stages = _stages("llama-tied", "AutoModelForCausalLM", 1)
    stage = stages[0]
    assert stage.lm_head.weight is stage.model.embed_tokens.weight
    _, _, split = _stages("llama-tied", "AutoModelForCausalLM", 2)
    assert torch.equal(split[0].model.embed_tokens.weight, split[1].lm_head.weight)
    assert split[0].model.embed_tokens.weight is not split[1].lm_head.weight


HALVED = [c for c in CASES if c[0] != "t5"]  # T5 blocks are never cut


@pytest.mark.parametrize("arch,auto", HALVED, ids=[f"{a}-{b.removeprefix('AutoModel') or 'Model'}" for a, b in HALVED])
def test_block_halves_on_separate_stages_equal_the_hf_model_and_its_gradients(arch, auto):
    # 8 stages over 4 blocks: every stage runs one half of one block (attention or MLP), so both
    # halves of every block run through the glue's block_half and nothing else.
    ref, plan, stages = _stages(arch, auto, 8)
    assert all(len(s.spec.halves) == 1 for s in stages), plan
    inputs = tiny.sample_inputs(arch.split("-")[0], batch=3, seq=8)
    expected = ref(**inputs)
    x = ()
    for stage in stages:
        x = stage(*x, **inputs)
        x = x if isinstance(x, tuple) else (x,)
    outputs = stages[-1].resolved.head.outputs
    assert len(x) == len(outputs), f"last stage returned {len(x)} tensors for the head's outputs {outputs}"
    for name, got in zip(outputs, x, strict=True):
        # fp32 outputs: summation order moves them ~1e-6 in the tiny models; a wrong or misnamed weight moves
        # them by 1e-2 or more.
        assert (got - getattr(expected, name)).abs().max().item() <= 1e-5, name
    sum(t.float().pow(2).sum() for t in x).backward()
    sum(getattr(expected, n).float().pow(2).sum() for n in outputs).backward()
    # A tied embedding and LM head on two stages are two Parameters: their gradients add up to the
    # one tensor's gradient in the HF model (the runtime sums them across ranks).
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    summed: dict[int, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            key = id(ref_params[name])
            summed[key] = p.grad if key not in summed else summed[key] + p.grad
    assert len(summed) == len(list(ref.parameters()))
    for name, want in ref.named_parameters():
        got = summed[id(want)]
        # fp32 gradients, relative to the tensor's largest entry: summation order ~1e-6; a gradient off by 2x
        # is 100% off.
        assert (got - want.grad).abs().max().item() <= 1e-5 * max(1.0, want.grad.abs().max().item()), name


@pytest.mark.parametrize("arch, auto", [("llama-tied", "AutoModelForCausalLM"), ("t5", "AutoModelForSeq2SeqLM")])
def test_a_stage_copies_only_the_modules_it_keeps(arch, auto, monkeypatch):
    # T5's shared embedding is one module under two names; the tied LLaMA shares one weight between
    # the embedding and the head: a stage must keep what it needs under either name, and copy nothing else.
    cfg = tiny.config_for(arch)
    meta = meta_model(cfg, auto)
    resolved = resolve_recipe(meta, get_recipe(cfg.model_type))
    plan = make_plan(meta, resolved, pp_size=2)
    copied: list[str] = []
    names = {id(m): n for n, m in meta.named_modules()}
    originals = {}
    for name, module in meta.named_modules():
        if (
            name.count(".") == 2 and name.split(".")[-1].isdigit()
        ):  # one block of a stack: model.layers.3, encoder.block.1
            cls = type(module)
            if cls not in originals:
                originals[cls] = getattr(cls, "__deepcopy__", None)

                def spy(self, memo, _cls=cls):
                    copied.append(names[id(self)])
                    clone = _cls.__new__(_cls)
                    memo[id(self)] = clone
                    for k, v in self.__dict__.items():
                        clone.__dict__[k] = copy.deepcopy(v, memo)
                    return clone

                monkeypatch.setattr(cls, "__deepcopy__", spy, raising=False)
    for spec in plan.stages:
        copied.clear()
        stage = build_stage(meta, resolved, spec)
        assert sorted(copied) == sorted(spec.blocks), f"stage {spec.index} copied {copied}, keeps {list(spec.blocks)}"
        kept = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
        assert kept and all(any(n == m or n.startswith(m + ".") for m in spec.modules) for n in kept)
