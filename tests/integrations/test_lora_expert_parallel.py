"""LoRA on mixture-of-experts models loaded with expert parallelism (``ep_size=2``, one stage on 2 ranks, each
keeping half of every layer's experts), against peft on one process.

The adapters go on the attention projections, whole on every expert-parallel rank: the same checks as
tests/integrations/test_lora_decoders.py (fresh adapter bitwise, loss, every LoRA gradient, the adapter after
an AdamW step, logits disabled / unmerged / merged / unmerged again, the saved adapter loaded by peft on one
process), with its tolerances, on every rank. An adapter on the experts' own parameters (peft's
``target_parameters``), which the ranks split, is refused on every rank at injection, naming the field, as is
one on a model whose attention tensor parallelism shards (``tp_size=2``). Mixtral also runs with its experts
over the 2 data-parallel replicas (``ep_over="data"``: each rank half the batch, the adapters' gradients summed
over the replicas): the same checks against the same peft run; and ``PipelineTrainer`` full fine-tuning on that
mesh equals transformers' ``Trainer`` on one process with the replicas' global batch (logs and every parameter,
``test_lora_decoders._check_trainer``'s tolerances).
"""

from __future__ import annotations

import pytest
from harness import run_distributed
from test_lora_decoders import (
    _args,
    _check_saved,
    _check_trainer,
    _checkpoints,
    _close,
    _dataset,
    _job,
    _logs,
    _references,
)

peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FAMILIES = ("mixtral", "qwen3_moe")
LOAD = {"ep_size": 2, "n_microbatches": 2}
# Experts over the 2 data-parallel replicas instead (each rank half the batch, the routed tokens exchanged).
OVER_DATA = {"ep_size": 2, "ep_over": "data", "num_stages": 1, "n_microbatches": 1}


def _refusal(path: str, load: dict, **targets):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    config = peft.LoraConfig(r=4, **targets)
    try:
        peft.get_peft_model(model, config)
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return f"{type(e).__name__}: {e}"
    return None


def _both(paths, out, lora):
    experts = _refusal(paths[lora[0]], LOAD, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    sharded = _refusal(paths[lora[0]], {"tp_size": 2, "n_microbatches": 2}, target_modules=["q_proj"])
    over_data = _job(paths, f"{out}/over-data", OVER_DATA, lora[:1], lora[:1])
    return {"cases": _job(paths, out, LOAD, lora, ()), "refused": (experts, sharded), "over_data": over_data}


def test_lora_on_attention_under_expert_parallelism_equals_peft(tmp_path):
    paths, out = _checkpoints(tmp_path, FAMILIES), tmp_path / "out"
    refs = _references(paths, out, FAMILIES, ())
    results = run_distributed(_both, 2, {k: str(v) for k, v in paths.items()}, str(out), FAMILIES, timeout=600)
    for model_type in FAMILIES:
        ref = refs[model_type]
        over = [(r, res["over_data"][model_type]) for r, res in enumerate(results) if model_type in res["over_data"]]
        assert len(over) == (2 if model_type == FAMILIES[0] else 0), (model_type, len(over))
        moved = (ref["merged"] - ref["base"]).abs().max().item()
        assert moved > 0.1, f"{model_type}: the adapter moves the logits by {moved:.3g} only: the checks are blind"
        cases = [(res["cases"][model_type], f"{model_type} ep2 rank {r}") for r, res in enumerate(results)]
        cases += [(got, f"{model_type} ep2 over dp2 rank {r}") for r, got in over]
        for got, what in cases:
            assert set(got["init"]) == set(ref["init"]), f"{what}: adapter entries differ"  # one stage: all of them
            _close(got["init"], ref["init"], what + " fresh adapter", tol=0)
            assert (got["loss"] - ref["loss"]).abs().item() <= 1e-5, f"{what}: loss {got['loss']} {ref['loss']}"
            assert set(got["grads"]) == set(got["init"]), f"{what}: adapter entries without a gradient"
            _close(got["grads"], ref["grads"], what + " gradient")
            _close(got["trained"], ref["trained"], what + " after an AdamW step")
            for key in ("base", "unmerged", "merged", "unmerged_again"):
                diff = (got[key] - ref[key]).abs().max().item()
                assert diff <= 1e-5, f"{what}: {key} logits differ by {diff:.3g}"
        _check_saved(out / f"adapter-{model_type}", out / f"ref-{model_type}", paths[model_type], ref["trained"],
                     model_type)
    # The Trainer (full fine-tuning) with the experts over the 2 replicas: transformers' Trainer on one process with
    # the replicas' global batch (per-device batch x 2, as with 2 data-parallel processes).
    ref_trainer = {"trainer-mixtral": _trainer_reference(paths["mixtral"], out)}
    _check_trainer([res["over_data"] for res in results], ref_trainer)
    wants = (("['mlp.experts.gate_up_proj']", "ep_size=2"), ("tp_size=2 (tensor parallelism)",))
    for rank, res in enumerate(results):
        for msg, want in zip(res["refused"], wants, strict=True):
            assert msg is not None and msg.startswith("InputError: "), f"rank {rank}: {msg}"
            assert all(w in msg for w in want), f"rank {rank}: {msg}"


def _trainer_reference(path, out) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = _args(str(out / "ref-trainer-over-data"), 8, eval_strategy="no", save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset("llama"))
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logs": _logs(trainer.state.log_history), "params": params}
