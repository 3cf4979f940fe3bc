"""LoRA and the Trainer on families of the generic decoder recipe (``model_recipes/decoder.toml``) at 2 ranks.

One spawned job (2 ranks, 2 stages, 1F1B, 2 microbatches) runs every case below on the tiny configs of
``tests/decoders.py``; every rank compares with plain transformers + peft on one process, computed here:

* LoRA on Qwen3, Gemma 3, Phi-3, DeepSeek-V3, gpt-oss, OPT and Falcon, with the target modules peft picks
  for the model_type (``target_modules=None``) where peft has a default, else the family's attention
  projections named explicitly; ``init_lora_weights=False`` (random ``lora_B`` too), so every ``lora_A``
  gets a gradient and the adapter changes the logits:
  - the fresh adapter bitwise equal to one process's under one seed;
  - the loss of ``train_step`` and every ``lora_A`` / ``lora_B`` gradient, by name;
  - the adapter after one AdamW step;
  - eval logits with the adapter disabled, unmerged, after ``merge_adapter()`` and after ``unmerge_adapter()``;
  - ``save_pretrained`` of the trained adapter: the same keys and values as one process writes, and the file
    loaded by ``PeftModel.from_pretrained`` on one process gives its tensors.
* ``PipelineTrainer`` (full fine-tuning) on Qwen3 and Gemma 3: the losses, gradient norms and learning rates
  logged at each of 4 steps and every parameter after them, against ``transformers.Trainer`` on one
  process with the same arguments, data and seed.

The LoRA checks also run in this process on DeepSeek-V3 with both stages local (world size 1, fast tier).

Tolerances (fp32): the pipeline runs the same kernels on microbatches, so only summation order differs.
1e-5 absolute on the loss (~4.6; measured under 5e-7), on LoRA gradients (|g| up to ~7 in Falcon, ~0.05
elsewhere; measured under 1.5e-6 and 3e-8), on logits (|logits| ~1; measured under 3e-7) and on the adapter
after an AdamW step of lr 1e-2 (measured under 1e-6); a gradient missing a microbatch, a wrong loss scale or
a mask / position error moves these by 1e-3 or more, and a merge lost or applied twice moves the logits by
what the adapter moves them (asserted > 0.1). Trainer: as tests/integrations/test_trainer.py (2e-5 against
lr-sized moves of 1e-2; measured under 4e-7).
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from decoders import DECODERS, LORA, TRAINER, decoder_config
from harness import run_distributed
from test_trainer import _args, _assert_logs_equal, _dataset, _logs

peft = pytest.importorskip("peft")

TOL = 1e-5
TRAINER_TOL = 2e-5
LR = 1e-2
EPS = 1e-5  # as in tests/integrations/test_lora.py: round-off-level gradients do not become lr-sized moves
SEED = 7
# LORA (model_type -> target_modules) and TRAINER live in tests/decoders.py: README's table is rendered from them
LOAD = {"schedule": "1f1b", "n_microbatches": 2}


def _targets(model_type: str) -> list[str] | None:
    """LORA's targets (None: peft's default for the model_type); for the other families the linear layers of
    the first block's attention (``query_key_value``, ``q_proj`` ...), found on the model (peft 0.21's default
    for Mixtral matches no module of transformers 5's Mixtral)."""
    from hf_pipeline.families.roles import decoder_roles
    from hf_pipeline.loading.stages import meta_model

    if model_type in LORA:
        return LORA[model_type]
    model = meta_model(decoder_config(model_type), "AutoModelForCausalLM")
    block = model.get_submodule(decoder_roles(model).blocks + ".0")
    attention = next(m for n, m in block.named_children() if n.endswith(("attn", "attention")))  # not its norms
    return sorted({n.rpartition(".")[2] for n, m in attention.named_modules() if isinstance(m, torch.nn.Linear)})


def _lora(model_type: str):
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=_targets(model_type),
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )


def _adapter(model) -> dict[str, torch.Tensor]:
    """Adapter entries by one-process name (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""
    stages = getattr(model, "stages", None) or [model]
    return {n: p.detach().clone() for s in stages for n, p in s.named_parameters() if "lora_" in n}


def _grads(model) -> dict[str, torch.Tensor]:
    stages = getattr(model, "stages", None) or [model]
    return {n: p.grad.clone() for s in stages for n, p in s.named_parameters() if "lora_" in n}


def _eval_inputs():
    return tiny.sample_inputs("llama", batch=4)


def _lora_run(model, peft_model, train) -> dict:
    """The same calls on a pipelined or a one-process model; ``train(batch)`` returns the loss, grads set."""
    res = {"init": _adapter(model)}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    res["loss"] = train(tiny.make_batch("llama", 8, seed=3)).detach()
    res["grads"] = _grads(model)
    opt.step()
    opt.zero_grad()
    res["trained"] = _adapter(model)
    return {**res, **tiny.adapter_logits(peft_model, _eval_inputs())}


def _job(paths: dict[str, str], out: str, load: dict, lora: tuple, trained: tuple) -> dict:
    import hf_pipeline
    from hf_pipeline.distributed.shards import full_tensor

    results = {}
    for model_type in lora:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(paths[model_type], pipeline=True, device="cpu", **load)
        torch.manual_seed(SEED)
        peft_model = peft.get_peft_model(model, _lora(model_type))
        results[model_type] = _lora_run(model, peft_model, model.train_step)
        peft_model.save_pretrained(f"{out}/adapter-{model_type}")
    for model_type in trained:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(paths[model_type], pipeline=True, device="cpu", **load)
        trainer = hf_pipeline.PipelineTrainer(
            model=model, args=_trainer_args(f"{out}/trainer-{model_type}"), train_dataset=_dataset("llama")
        )
        trainer.train()
        results[f"trainer-{model_type}"] = {
            "logs": _logs(trainer.state.log_history),  # whole tensors (split experts gathered: every rank calls)
            "params": {n: full_tensor(p.detach()).clone() for n, p in model.checkpoint_named_parameters()},
        }
    return results


def _trainer_args(out: str) -> transformers.TrainingArguments:
    return _args(out, 4, eval_strategy="no", save_strategy="no")


def _references(paths: dict, out, lora: tuple, trained: tuple) -> dict:
    refs = {}
    for model_type in lora:
        base = tiny.reference(paths[model_type], "AutoModelForCausalLM")
        torch.manual_seed(SEED)
        peft_model = peft.get_peft_model(base, _lora(model_type))
        peft_model.train()

        def train(batch, m=peft_model):
            loss = m(**batch).loss
            loss.backward()
            return loss

        refs[model_type] = _lora_run(base, peft_model, train)
        peft_model.save_pretrained(out / f"ref-{model_type}")
    for model_type in trained:
        model = transformers.AutoModelForCausalLM.from_pretrained(paths[model_type], dtype=torch.float32)
        trainer = transformers.Trainer(
            model=model, args=_trainer_args(str(out / f"ref-trainer-{model_type}")), train_dataset=_dataset("llama")
        )
        trainer.train()
        refs[f"trainer-{model_type}"] = {
            "logs": _logs(trainer.state.log_history),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return refs


def _close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    for key, value in got.items():
        assert key in want, f"{what}: {key} is not a tensor of one process"
        diff = (value - want[key]).abs().max().item()
        assert diff <= tol, f"{what}: {key} differs by {diff:.3g}"


def _check_saved(path, ref_path, base_path, want: dict, what: str) -> None:
    from safetensors.torch import load_file

    got, ref = (load_file(p / "adapter_model.safetensors") for p in (path, ref_path))
    assert sorted(got) == sorted(ref), f"{what}: saved keys {sorted(set(got) ^ set(ref))[:4]} differ"
    _close(got, ref, what + " saved adapter")
    # peft on one process loads the file into the unsplit model: the trained tensors
    loaded = peft.PeftModel.from_pretrained(tiny.reference(base_path, "AutoModelForCausalLM"), path)
    _close(_adapter(loaded.base_model.model), want, what + " loaded by peft")


def _check_lora(results: list[dict], refs: dict, paths: dict, out) -> None:
    for model_type in [t for t in refs if t in DECODERS]:
        ref, held = refs[model_type], set()
        moved = (ref["merged"] - ref["base"]).abs().max().item()
        assert moved > 0.1, f"{model_type}: the adapter moves the logits by {moved:.3g} only: the checks are blind"
        for rank, by_case in enumerate(results):
            got, what = by_case[model_type], f"{model_type} rank {rank}"
            assert got["init"], f"{what}: no adapter entry on this rank"
            _close(got["init"], ref["init"], what + " fresh adapter", tol=0)
            diff = (got["loss"] - ref["loss"]).abs().item()
            assert diff <= TOL, f"{what}: loss {got['loss'].item()} != {ref['loss'].item()}"
            assert set(got["grads"]) == set(got["init"]), f"{what}: adapter entries without a gradient"
            _close(got["grads"], ref["grads"], what + " gradient")
            _close(got["trained"], ref["trained"], what + " after an AdamW step")
            for key in ("base", "unmerged", "merged", "unmerged_again"):
                diff = (got[key] - ref[key]).abs().max().item()
                assert diff <= TOL, f"{what}: {key} logits differ by {diff:.3g}"
            held |= set(got["init"])
        assert held == set(ref["init"]), f"{model_type}: adapter entries no rank holds: {set(ref['init']) - held}"
        owned = {frozenset(by_case[model_type]["init"]) for by_case in results}
        assert len(owned) == len(results), f"{model_type}: ranks adapt the same modules"
        _check_saved(
            out / f"adapter-{model_type}", out / f"ref-{model_type}", paths[model_type], ref["trained"], model_type
        )


def _check_trainer(results: list[dict], refs: dict) -> None:
    for model_type in [t for t in TRAINER if f"trainer-{t}" in refs]:
        ref, seen = refs[f"trainer-{model_type}"], set()
        for rank, by_case in enumerate(results):
            got, what = by_case[f"trainer-{model_type}"], f"{model_type} Trainer rank {rank}"
            _assert_logs_equal(got["logs"], ref["logs"], what)
            _close(got["params"], ref["params"], what + " parameters", tol=TRAINER_TOL)
            seen |= set(got["params"])
        assert seen == set(ref["params"]), f"{model_type}: parameters no rank holds: {set(ref['params']) - seen}"


@pytest.mark.slow
def test_lora_on_every_other_decoder_family_on_two_stages_in_one_process_equals_peft(tmp_path):
    """The families the 2-rank job leaves out, both stages in this process, with peft's default targets for
    the model_type or the first block's attention linears: the same checks as at 2 ranks."""
    families = tuple(sorted(set(DECODERS) - set(LORA)))
    paths, out, cases = _checkpoints(tmp_path, families), tmp_path / "out", (families, ())
    load = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2}
    refs = _references(paths, out, *cases)
    _check_lora([_job({k: str(v) for k, v in paths.items()}, str(out), load, *cases)], refs, paths, out)


def test_peft_defaults_are_what_the_cases_say():
    """target_modules=None exactly where peft has a default for the model_type (else the case names them)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    assert {t for t in LORA if LORA[t] is None} == {t for t in LORA if t in defaults}


def _checkpoints(root, model_types) -> dict:
    paths = {}
    for model_type in model_types:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(decoder_config(model_type))
        paths[model_type] = root / model_type
        model.save_pretrained(paths[model_type])
    return paths


@pytest.mark.dist
@pytest.mark.slow
def test_lora_and_trainer_on_decoder_families_equal_one_process(tmp_path):
    paths, out, cases = _checkpoints(tmp_path, sorted(set(LORA) | set(TRAINER))), tmp_path / "out", (LORA, TRAINER)
    refs = _references(paths, out, *cases)
    results = run_distributed(_job, 2, {k: str(v) for k, v in paths.items()}, str(out), LOAD, *cases, timeout=600)
    _check_lora(results, refs, paths, out)
    _check_trainer(results, refs)


def test_lora_on_two_stages_in_one_process_equals_peft(tmp_path):
    """World size 1, both stages in this process (the fast tier): DeepSeek-V3, whose nested base model makes peft
    read transformers' weight-conversion mapping on each stage."""
    paths, out, cases = _checkpoints(tmp_path, ["deepseek_v3"]), tmp_path / "out", (("deepseek_v3",), ())
    load = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2}
    refs = _references(paths, out, *cases)
    _check_lora([_job({k: str(v) for k, v in paths.items()}, str(out), load, *cases)], refs, paths, out)
