"""LoRA on mixture-of-experts models loaded with expert parallelism, on the attention and on the experts' own
parameters, against peft on one process.

One spawned job of 2 ranks runs, for Mixtral and Qwen3-MoE, one adapter on the attention projections and on the
stacked expert parameters (peft's ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``,
each a ``lora.ParamWrapper`` whose ``lora_A`` / ``lora_B`` stay whole on every rank while the rank keeps half of
the experts) on two meshes (and, in this process, on two stages without expert parallelism):

* pp1 x ep2 within the stage (``ep_size=2``: the 2 ranks share one batch, each keeps half of every layer's experts);
* pp1 x ep2 over dp2 (``ep_over="data"``: each rank half the batch, the routed tokens exchanged all-to-all).

A second job of 4 ranks runs Mixtral at pp2 x ep2 (each rank checks its stage's entries; the adapter is
gathered from the two stages' first ep ranks).

Every rank checks: the fresh adapter bitwise, the losses of 2 ``train_step`` calls, every LoRA gradient of both
steps by name, every LoRA parameter after 2 AdamW steps, eval logits with the adapter disabled / unmerged /
merged / unmerged again, 6 greedy tokens of ``generate`` on 2 prompts with the adapter on and off (exactly; the
reference asserts the adapter changes them); and the adapter each mesh saves: the keys and values one process
writes, and loaded by plain peft on plain transformers, its tensors and its logits; and one process's adapter loaded
by ``PeftModel.from_pretrained`` into an ep2 model, its logits. Refused on every rank at injection, naming the
field: one with ``lora_bias`` on a model whose attention tensor parallelism shards (``tp_size=2``;
test_lora_tensor_parallel.py adapts it without). (Experts over FSDP ranks: tests/integrations/test_lora_fsdp.py.)
``PipelineTrainer`` full fine-tuning with the experts over the replicas equals transformers' ``Trainer`` on one
process with the replicas' global batch (logs and every parameter, ``test_lora_decoders._check_trainer``'s
tolerances).

Tolerances (fp32), as tests/integrations/test_lora_decoders.py: 1e-5 absolute on the losses (~4.6; measured under
5e-7), on every LoRA gradient (the experts' up to ~0.03; measured under 1e-8), on the adapter after 2 AdamW steps
of lr 1e-2 (measured under 1e-6) and on logits (|logits| ~1; measured under 7e-7). A lost part of an expert
adapter's gradient (the other experts' rows not gathered within the stage) or one counted twice (gathered as
well as summed over the replicas) moves the experts' LoRA gradients by ~0.03 and the adapter after the steps by
~1e-2; a merge lost or applied twice moves the logits by what the adapter moves them (asserted > 0.1).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from lora_checks import EXPERTS, check, check_refused, check_saved, reference, refusal, run
from test_lora_decoders import (
    SEED,
    TOL,
    _args,
    _check_trainer,
    _checkpoints,
    _dataset,
    _eval_inputs,
    _logs,
    _targets,
    _trainer_args,
)

peft = pytest.importorskip("peft")


FAMILIES = ("mixtral", "qwen3_moe")
MESHES = {
    "ep2": {"ep_size": 2, "n_microbatches": 2},
    # Experts over the 2 data-parallel replicas instead (each rank half the batch, the routed tokens exchanged).
    "ep2 over dp2": {"ep_size": 2, "ep_over": "data", "num_stages": 1, "n_microbatches": 1},
}
PP2_EP2 = {"num_stages": 2, "ep_size": 2, "n_microbatches": 2}  # 4 ranks: ranks 0, 1 stage 0; 2, 3 stage 1


def _lora(model_type: str):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=_targets(model_type),
                           target_parameters=EXPERTS, init_lora_weights=False, task_type="CAUSAL_LM")


def _ranks(paths: dict, out: str) -> dict:
    import hf_pipeline
    from hf_pipeline.distributed.shards import full_tensor

    results = {}
    for model_type in FAMILIES:
        for mesh, load in MESHES.items():
            model = hf_pipeline.AutoModelForCausalLM.from_pretrained(paths[model_type], pipeline=True, device="cpu",
                                                                     **load)
            torch.manual_seed(SEED)
            peft_model = peft.get_peft_model(model, _lora(model_type))
            results[model_type, mesh] = run(model, peft_model, model.train_step, tokens=True)
            peft_model.save_pretrained(f"{out}/adapter-{model_type}-{mesh}")
    mixtral = paths["mixtral"]
    # one process's trained adapter, loaded into an ep2 model: its logits
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(mixtral, pipeline=True, device="cpu", **MESHES["ep2"])
    loaded = peft.PeftModel.from_pretrained(model, f"{out}/ref-mixtral").eval()
    with torch.no_grad():
        results["loaded"] = loaded(**_eval_inputs()).logits
    results["refused"] = (
        refusal(mixtral, {"tp_size": 2, "n_microbatches": 2}, target_modules=["q_proj"], lora_bias=True),
    )
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(mixtral, pipeline=True, device="cpu",
                                                             **MESHES["ep2 over dp2"])
    trainer = hf_pipeline.PipelineTrainer(model=model, args=_trainer_args(f"{out}/trainer-over-data"),
                                          train_dataset=_dataset("llama"))
    trainer.train()
    results["trainer-mixtral"] = {
        "logs": _logs(trainer.state.log_history),  # whole tensors (split experts gathered: every rank calls)
        "params": {n: full_tensor(p.detach()).clone() for n, p in model.checkpoint_named_parameters()},
    }
    return results


@pytest.mark.equiv  # about 10 s on 2 shared cores: the full suite, not the quick tier
def test_lora_on_experts_on_two_stages_in_one_process_equals_peft(tmp_path):
    """Without expert parallelism (world size 1, both stages in this process), Mixtral's experts whole
    on their stage: the same checks and tolerances."""
    paths, out = _checkpoints(tmp_path, ["mixtral"]), tmp_path / "out"
    ref = reference(_lora("mixtral"), paths["mixtral"], out / "ref-mixtral")
    import hf_pipeline

    load = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2}
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(str(paths["mixtral"]), pipeline=True, device="cpu", **load)
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(model, _lora("mixtral"))
    check(run(model, peft_model, model.train_step), ref, "mixtral pp2 in one process", experts=True)
    peft_model.save_pretrained(out / "adapter")
    check_saved(out / "adapter", out / "ref-mixtral", paths["mixtral"], ref, "mixtral pp2 in one process")


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_attention_and_experts_under_expert_parallelism_equals_peft(tmp_path):
    paths, out = _checkpoints(tmp_path, FAMILIES), tmp_path / "out"
    refs = {t: reference(_lora(t), paths[t], out / f"ref-{t}", tokens=True) for t in FAMILIES}
    ref_trainer = {"trainer-mixtral": _trainer_reference(paths["mixtral"], out)}
    results = run_distributed(_ranks, 2, {k: str(v) for k, v in paths.items()}, str(out), timeout=600)
    for model_type in FAMILIES:
        ref = refs[model_type]
        for mesh in MESHES:
            for rank, res in enumerate(results):
                check(res[model_type, mesh], ref, f"{model_type} {mesh} rank {rank}", experts=True)
            check_saved(out / f"adapter-{model_type}-{mesh}", out / f"ref-{model_type}", paths[model_type], ref,
                        f"{model_type} {mesh}")
    _check_trainer(results, ref_trainer)
    for rank, res in enumerate(results):
        diff = (res["loaded"] - refs["mixtral"]["unmerged"]).abs().max().item()
        assert diff <= TOL, f"rank {rank}: one process's adapter loaded at ep2 gives logits off by {diff:.3g}"
    check_refused(results, (("lora_bias=True", "tp_size=2 (tensor parallelism)"),))


def _pipelined(path: str, out: str) -> dict:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **PP2_EP2)
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(model, _lora("mixtral"))
    res = run(model, peft_model, model.train_step)
    peft_model.save_pretrained(f"{out}/adapter")  # each stage's first ep rank's adapter, gathered to rank 0
    return res


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_attention_and_experts_on_two_stages_of_two_expert_parallel_ranks_equals_peft(tmp_path):
    """pp2 x ep2 (4 ranks, Mixtral): each stage's two ranks split its experts; the same checks, each rank on its
    stage's entries, and the adapter saved from both stages."""
    paths, out = _checkpoints(tmp_path, ["mixtral"]), tmp_path / "out"
    ref = reference(_lora("mixtral"), paths["mixtral"], out / "ref-mixtral")
    results = run_distributed(_pipelined, 4, str(paths["mixtral"]), str(out), timeout=600)
    for rank, got in enumerate(results):
        check(got, ref, f"mixtral pp2 x ep2 rank {rank}", whole=False, experts=True)
    assert set(results[0]["init"]) | set(results[2]["init"]) == set(ref["init"]), "adapter entries no stage holds"
    check_saved(out / "adapter", out / "ref-mixtral", paths["mixtral"], ref, "mixtral pp2 x ep2")


def _trainer_reference(path, out) -> dict:
    """transformers' Trainer on one process with the replicas' global batch (per-device batch x 2, as with 2
    data-parallel processes)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = _args(str(out / "ref-trainer-over-data"), 8, eval_strategy="no", save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset("llama"))
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logs": _logs(trainer.state.log_history), "params": params}
