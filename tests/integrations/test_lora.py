"""LoRA on a pipelined model equals peft on one process.

One spawned job per world size (2 ranks: interleaved 1F1B, 4 stages, every architecture; 3 ranks:
1F1B, LLaMA; 4 ranks: 2 stages x 2 data-parallel replicas, the fresh adapter and its training), and
the same job in this process (world size 1: LLaMA and GPT-2), run on every rank everything below
against references computed here on one process with plain transformers + peft:

* a fresh adapter from ``peft.get_peft_model`` under one seed: every local ``lora_A`` / ``lora_B``
  bitwise equal to one process's, and the random stream left where one process leaves it;
* three ``model.train_step`` + AdamW steps over the parameters that require grad: the adapter within
  1e-5 of peft's; base weights get no gradient and the step all-reduces no more elements than the
  rank holds adapter entries (no frozen weight crosses the wire);
* ``save_pretrained`` of the trained adapter: the same keys as one process writes, values within 1e-5;
* one-process adapters (non-zero ``lora_B``) loaded with ``PeftModel.from_pretrained`` into LLaMA
  (GQA), GPT-2 (Conv1D, peft's fan_in_fan_out), BERT sequence classification (peft's SEQ_CLS task:
  a trained copy of the classifier in ``modules_to_save``) and T5: logits within
  1e-5, greedy tokens equal (LLaMA, T5); ``merge_and_unload()`` + ``save_pretrained`` gives a
  checkpoint plain transformers loads, equal to peft's merged model;
* refusals, raised on every rank with no communication: ``target_modules`` matching nothing in the
  whole model (and, in this process, what cannot be split by stage); the model works after.

Tolerances (fp32): the pipeline runs the same kernels on microbatches, so only summation order
differs: 1e-5 absolute on logits and on adapter entries after Adam steps (updates of ~lr=1e-2).
"""

from __future__ import annotations

import json

import pytest
import tiny
import torch
from harness import run_distributed

peft = pytest.importorskip("peft")

TOL = 1e-5
LR = 1e-2
EPS = 1e-5  # as in tests/training/test_train.py: round-off-level gradients do not become lr-sized moves
STEPS = 3
M = 4
SEED = 7
NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "t5": {"dropout_rate": 0.0},
}
# (arch, transformers class, peft task type, target modules)
ADAPTED = [
    ("llama", "AutoModelForCausalLM", "CAUSAL_LM", ["q_proj", "v_proj"]),
    ("gpt2", "AutoModelForCausalLM", "CAUSAL_LM", ["c_attn"]),
    ("bert", "AutoModelForSequenceClassification", "SEQ_CLS", ["query", "value"]),  # + classifier in modules_to_save
    ("t5", "AutoModelForSeq2SeqLM", "SEQ_2_SEQ_LM", ["q", "v"]),
]


def _config(targets, task_type=None, **kw):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type=task_type, **kw)


def _adapter_of(model) -> dict[str, torch.Tensor]:
    """Adapter tensors under one-process names (checkpoint key + adapter name), of a pipelined or HF model."""
    stages = getattr(model, "stages", None) or [model]
    return {n: p.detach().clone() for s in stages for n, p in s.named_parameters() if "lora_" in n}


def _inputs(arch):
    return tiny.sample_inputs(arch, batch=M, pad_left=arch != "bert")


def _prompt(arch):
    return {k: v for k, v in _inputs(arch).items() if k in ("input_ids", "attention_mask")}


def _job(dirs, load, archs):
    import hf_pipeline
    from hf_pipeline.errors import InputError

    def pipelined(arch, auto):
        return getattr(hf_pipeline, auto).from_pretrained(dirs[arch], pipeline=True, device="cpu", **load)

    res: dict = {"errors": {}}
    # A fresh adapter, trained, saved.
    model = pipelined("llama", "AutoModelForCausalLM")
    try:
        peft.get_peft_model(model, _config(["no_such_module"], "CAUSAL_LM"))
    except InputError as e:
        res["errors"]["targets"] = str(e)
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(model, _config(["q_proj", "v_proj"], "CAUSAL_LM"))
    res["init"], res["rng_after"] = _adapter_of(model), torch.rand(4)
    res["trainable"] = model.num_parameters(only_trainable=True)  # collective: summed over the pipeline
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    reduced, all_reduce = [], torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        reduced.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        for step in range(STEPS):
            model.train_step(tiny.make_batch("llama", 8, seed=step + 1))
            res.setdefault("frozen_with_grad", [n for s in model.stages for n, p in s.named_parameters()
                                                if not p.requires_grad and p.grad is not None])
            opt.step()
            opt.zero_grad()
    finally:
        torch.distributed.all_reduce = all_reduce
    res["trained"], res["reduced"] = _adapter_of(model), sum(reduced)
    res["optimizer_numel"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    peft_model.save_pretrained(dirs["out"] / "trained")

    # One-process adapters loaded (BERT's with a trained copy of the classifier, on the last stage only).
    for arch, auto, *_ in [a for a in ADAPTED if a[0] in archs]:
        model = pipelined(arch, auto)
        loaded = peft.PeftModel.from_pretrained(model, dirs[f"adapter-{arch}"])
        with torch.no_grad():
            res[f"logits-{arch}"] = loaded(**_inputs(arch)).logits
        if arch in ("llama", "t5"):
            res[f"tokens-{arch}"] = loaded.generate(**_prompt(arch), max_new_tokens=4, do_sample=False)
        if arch == "llama":
            loaded.merge_and_unload().save_pretrained(dirs["out"] / "merged")

    return res


def _references(tmp_path, archs):
    import transformers

    dirs, refs = {"out": tmp_path / "out"}, {}
    for arch, auto, task, targets in [a for a in ADAPTED if a[0] in archs]:
        dirs[arch] = tiny.make_checkpoint(tmp_path / arch, arch, auto=auto, **NO_DROPOUT.get(arch, {}))
        base = getattr(transformers, auto).from_pretrained(dirs[arch], dtype=torch.float32).eval()
        torch.manual_seed(SEED + 1)
        adapted = peft.get_peft_model(base, _config(targets, task))
        with torch.no_grad():
            for n, p in adapted.named_parameters():
                if "lora_B" in n or "modules_to_save" in n:
                    p.normal_(0, 0.5)  # non-zero / changed: the adapter changes the logits
        dirs[f"adapter-{arch}"] = tmp_path / f"adapter-{arch}"
        adapted.save_pretrained(dirs[f"adapter-{arch}"])
        adapted.eval()
        with torch.no_grad():
            refs[f"logits-{arch}"] = adapted(**_inputs(arch)).logits
        if arch in ("llama", "t5"):
            refs[f"tokens-{arch}"] = adapted.generate(**_prompt(arch), max_new_tokens=4, do_sample=False)
        if arch == "llama":
            refs["merged"] = {k: v.clone() for k, v in adapted.merge_and_unload().state_dict().items()}

    # The fresh adapter and its training, on one process.
    dirs.setdefault("llama", tiny.make_checkpoint(tmp_path / "llama", "llama"))
    base = tiny.reference(dirs["llama"], "AutoModelForCausalLM")
    torch.manual_seed(SEED)
    adapted = peft.get_peft_model(base, _config(["q_proj", "v_proj"], "CAUSAL_LM"))
    refs["init"], refs["rng_after"] = _adapter_of(base), torch.rand(4)
    refs["trainable"] = base.num_parameters(only_trainable=True)
    opt = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=LR, eps=EPS)
    adapted.train()
    for step in range(STEPS):
        adapted(**tiny.make_batch("llama", 8, seed=step + 1)).loss.backward()
        opt.step()
        opt.zero_grad()
    refs["trained"] = _adapter_of(base)
    adapted.save_pretrained(tmp_path / "trained-ref")
    refs["trained-file"] = tmp_path / "trained-ref"

    return dirs, refs


def _close(got: dict, want: dict, what: str, exact: bool = False) -> None:
    for key, value in got.items():
        assert key in want, f"{what}: {key} is not an adapter tensor of one process"
        diff = (value - want[key]).abs().max().item()
        assert diff <= (0 if exact else TOL), f"{what}: {key} differs by {diff}"


def _same_files(got, want, what: str) -> None:
    from safetensors.torch import load_file

    a, b = load_file(got / "adapter_model.safetensors"), load_file(want / "adapter_model.safetensors")
    assert sorted(a) == sorted(b), f"{what}: keys {sorted(set(a) ^ set(b))[:4]} differ from one process's"
    _close(a, b, what)
    # peft keeps target_modules as a set: its JSON list's order follows the process's string hashing.
    config, ref = (json.loads((d / "adapter_config.json").read_text()) for d in (got, want))
    config, ref = ({k: sorted(v) if isinstance(v, list) else v for k, v in c.items()} for c in (config, ref))
    differ = {k: (config.get(k), ref.get(k)) for k in set(config) | set(ref) if config.get(k) != ref.get(k)}
    assert not differ, f"{what}: adapter_config.json differs (pipelined, one process): {differ}"


def _check(results, dirs, refs, world_size, archs, replicas=1):
    import transformers

    held: dict[str, int] = {}
    for rank, res in enumerate(results):
        assert "no_such_module" in res["errors"].get("targets", ""), f"rank {rank}: {res['errors']}"
        _close(res["init"], refs["init"], f"rank {rank} fresh adapter", exact=True)
        assert torch.equal(res["rng_after"], refs["rng_after"]), f"rank {rank}: random stream differs after injection"
        _close(res["trained"], refs["trained"], f"rank {rank} after {STEPS} AdamW steps")
        assert res["trainable"] == refs["trainable"], f"rank {rank}: num_parameters(only_trainable=True)"
        assert not res["frozen_with_grad"], f"rank {rank}: frozen weights got gradients: {res['frozen_with_grad'][:3]}"
        local = sum(v.numel() for v in res["trained"].values())
        assert res["optimizer_numel"] == local, f"rank {rank}: optimizer holds {res['optimizer_numel']} != {local}"
        # The step's all_reduces: each local adapter entry at most once per step, plus a few scalars.
        assert res["reduced"] <= STEPS * (local + 8), f"rank {rank}: all-reduced {res['reduced']} elements"
        for key in res["trained"]:
            held[key] = held.get(key, 0) + 1
        for arch in archs:
            diff = (res[f"logits-{arch}"] - refs[f"logits-{arch}"]).abs().max().item()
            assert diff <= TOL, f"rank {rank} {arch}: logits with the loaded adapter differ by {diff}"
        for arch in {"llama", "t5"} & set(archs):
            same = torch.equal(res[f"tokens-{arch}"], refs[f"tokens-{arch}"])
            assert same, f"rank {rank} {arch}: greedy tokens differ"
    assert held == {k: replicas for k in refs["trained"]}, "every adapter tensor is held by one rank per replica"
    pipelines = len({tuple(sorted(r["trained"])) for r in results})
    assert pipelines == world_size // replicas, "each pipeline rank adapts its own modules"
    _same_files(dirs["out"] / "trained", refs["trained-file"], "saved adapter")
    if "llama" in archs:
        merged = transformers.AutoModelForCausalLM.from_pretrained(dirs["out"] / "merged", dtype=torch.float32)
        _close(dict(merged.state_dict()), refs["merged"], "merged checkpoint")
        assert set(merged.state_dict()) == set(refs["merged"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, load, archs",
    [
        (2, {"schedule": "interleaved-1f1b", "n_microbatches": M}, [a[0] for a in ADAPTED]),
        (3, {"schedule": "1f1b", "n_microbatches": M}, ["llama"]),
        (4, {"schedule": "1f1b", "n_microbatches": M, "num_stages": 2}, []),  # 2 stages x 2 replicas
    ],
)
def test_lora_equals_peft_on_one_process(tmp_path, world_size, load, archs):
    dirs, refs = _references(tmp_path, archs)
    results = run_distributed(_job, world_size, dirs, load, archs, timeout=300)
    _check(results, dirs, refs, world_size, archs, replicas=world_size // load.get("num_stages", world_size))


def test_lora_on_one_process_equals_peft(tmp_path):
    """World size 1 (every stage local, no process group): the same checks, in this process."""
    archs = ["llama", "gpt2"]
    dirs, refs = _references(tmp_path, archs)
    _check([_job(dirs, {}, archs)], dirs, refs, 1, archs)


def test_what_cannot_be_split_by_stage_is_refused_by_name(tmp_path):
    """Each refused option raises an InputError naming it before any stage changes; the model works after."""
    import hf_pipeline
    from hf_pipeline.errors import InputError

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu")
    before = model(**_inputs("llama")).logits
    refused = {
        "use_dora": _config(["q_proj"], use_dora=True),
        "init_lora_weights": _config(["q_proj"], init_lora_weights="pissa"),
        "modules_to_save": _config(["q_proj"], modules_to_save=["embed_tokens"]),
        "outside the model's repeated blocks": _config(["lm_head", "q_proj"]),
        "peft_type": peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]),
    }
    for name, config in refused.items():
        with pytest.raises(InputError, match=name):
            peft.get_peft_model(model, config)
        assert not any("lora_" in n or "ia3_" in n for n, _ in model.named_parameters()), f"{name}: model changed"
    assert torch.equal(model(**_inputs("llama")).logits, before)


@pytest.mark.dist
@pytest.mark.slow
def test_peft_imported_after_the_model_is_loaded_still_adapts_the_stages(tmp_path):
    """The hooks are installed right after peft's import when the model was built first (a fresh process)."""
    import subprocess
    import sys

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    code = (
        "import sys, torch, hf_pipeline\n"
        f"model = hf_pipeline.AutoModelForCausalLM.from_pretrained({str(path)!r}, pipeline=True, device='cpu')\n"
        "assert 'peft' not in sys.modules\n"
        "import peft\n"
        "peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=['q_proj']))\n"
        "print(model.adapter_state is not None, sum('lora_A' in n for n, _ in model.stages[0].named_parameters()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # adapter_state: set by this package's injection (peft's own would adapt by the stages.N. names)
    assert proc.stdout.strip().splitlines()[-1] == "True 4", proc.stdout  # one q_proj per layer
