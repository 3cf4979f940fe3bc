"""TRL's DPOTrainer on a pipelined model through PipelineTrainerMixin, against DPOTrainer on one process.

One spawned 2-rank job (2 stages, 2 microbatches of whole pairs) trains four set-ups, each also trained by
``trl.DPOTrainer`` on one process in this process:

* ``ref``: full fine-tuning, the reference a second pipelined model (another seed, so rewards are not zero
  from the first step), computed by a forward-only pipelined pass every step; ``loss_type="sigmoid"``.
* ``precompute``: ``precompute_ref_log_probs=True`` from that reference (TRL's columns, made by the pipelined
  reference on every rank); ``loss_type="ipo"`` (length-normalised).
* ``peft``: a LoRA adapter, no ``ref_model``: TRL's frozen copy of the adapter as the reference.
* ``peft_config``: the same adapter made by ``DPOTrainer`` itself from its ``peft_config=`` argument.

Compared at every logged step: the loss, the gradient norm, the learning rate and every metric TRL logs
(``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``, ``num_tokens``); after 2
optimizer steps of 2 accumulated batches, every trained parameter by name; then ``evaluate()``'s loss and
metrics (``ref`` case). Tolerance ``TOL`` (2e-5, relative and
absolute, as the Trainer tests): TRL's fused LM head sums log-probabilities computed in tiles, the pipeline's loss
takes torch's ``log_softmax`` of the last stage's output; the sequence log-probabilities differ by ~1e-6
(measured, largest over ranks and steps: losses 4e-6 (ipo's, ~25), metrics 1.4e-6, parameters 4e-6 at lr 1e-3). A
pair split across microbatches, a wrong denominator or a missing reference moves the loss by 1e-3 or more; the LoRA
case failed (gradient norm 0.060 vs 0.072) while a forward-only pass between accumulated steps scaled the gradients.

fp32, no gradient checkpointing (DPOConfig defaults to bf16 autocast, which rounds differently on stages).
"""

from __future__ import annotations

import os
import pathlib
import random
import re

import datasets
import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from test_trainer import TOL

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

CASES = {
    "ref": dict(loss_type="sigmoid"),
    "precompute": dict(loss_type="ipo", precompute_ref_log_probs=True),
    "peft": dict(loss_type="sigmoid"),
    "peft_config": dict(loss_type="sigmoid"),  # the adapter made by DPOTrainer itself from peft_config=
}


def _data(directory: str):
    text = tiny.text_file(pathlib.Path(directory) / "text.txt", lines=32)
    words, rng = text.read_text().split(), random.Random(3)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(16):  # prompts and completions of different lengths: padding inside every microbatch
        rows["prompt"].append(" ".join(rng.choices(words, k=rng.randint(2, 5))))
        for key in ("chosen", "rejected"):
            rows[key].append(" " + " ".join(rng.choices(words, k=rng.randint(1, 5))))
    return datasets.Dataset.from_dict(rows), tiny.word_tokenizer(text)


def _config(out: str, case: str, pairs: int = 4):
    # pairs: per pipeline replica (the global batch is pairs x replicas); 4 on one process.
    return trl.DPOConfig(
        out, per_device_train_batch_size=pairs, gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=0.5,
        logging_steps=1, max_steps=2, seed=7, report_to=[], use_cpu=True, disable_tqdm=True, max_length=16,
        save_strategy="no", gradient_checkpointing=False, bf16=False, **CASES[case],
    )


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
            for e in trainer.state.log_history]


def _eval(trainer, case: str, data) -> dict:
    # evaluate() after training, in the reference-model case: the loss and metrics from the forward's logits.
    if case != "ref":
        return {}
    found = trainer.evaluate(data.select(range(8)))
    return {k: v for k, v in found.items() if "runtime" not in k and "per_second" not in k}


def _trained(model) -> dict[str, torch.Tensor]:
    """Trained parameters by one-process name (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""
    return {re.sub(r"^(base_model\.model\.)?(stages\.\d+\.)?", "", n): p.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _dpo_rank(path: str, ref_path: str, directory: str, load: dict | None = None, pairs: int = 4) -> dict:
    """Every case trained through the mixin, the models loaded with ``load`` (default: one stage per rank and 2
    microbatches), ``pairs`` per replica."""
    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineDPOTrainer(PipelineTrainerMixin, trl.DPOTrainer):
        pass

    load = load or {"n_microbatches": 2}
    data, tokenizer = _data(directory)
    results = {}
    for case in CASES:
        model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, **load)
        results["dims"] = (model.dims.dp_size, model.dims.pp_size)
        ref, extra = None, {}
        if case == "peft":
            torch.manual_seed(0)
            model = peft.get_peft_model(model, _lora())
        elif case == "peft_config":
            torch.manual_seed(0)
            extra["peft_config"] = _lora()
        else:
            ref = AutoModelForCausalLM.from_pretrained(ref_path, pipeline=True, progress=False, **load)
        out = os.path.join(directory, f"{case}-rank{os.environ['RANK']}")
        trainer = PipelineDPOTrainer(model=model, ref_model=ref, args=_config(out, case, pairs), train_dataset=data,
                                     processing_class=tokenizer, **extra)
        trainer.train()
        results[case] = {"logs": _logs(trainer), "params": _trained(trainer.model), "eval": _eval(trainer, case, data)}
    return results


def _reference(path: str, ref_path: str, directory: str, case: str) -> dict:
    data, tokenizer = _data(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref, extra = None, {}
    if case == "peft":
        torch.manual_seed(0)
        model = peft.get_peft_model(model, _lora())
    elif case == "peft_config":
        torch.manual_seed(0)
        extra["peft_config"] = _lora()
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=_config(os.path.join(directory, f"trl-{case}"), case),
                             train_dataset=data, processing_class=tokenizer, **extra)
    trainer.train()
    return {"logs": _logs(trainer), "params": _trained(trainer.model), "eval": _eval(trainer, case, data)}


@pytest.mark.dist
@pytest.mark.slow
def test_dpo_trainer_through_the_mixin_equals_dpo_trainer(tmp_path):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    ref_path = str(tiny.make_checkpoint(tmp_path / "llama-ref", "llama", seed=5))
    results = run_distributed(_dpo_rank, 2, path, ref_path, str(tmp_path), timeout=300)
    assert [r["dims"] for r in results] == [(1, 2)] * 2
    assert_equal_to_trl(results, path, ref_path, str(tmp_path), "pp2")


def assert_equal_to_trl(results: list[dict], path: str, ref_path: str, directory: str, mesh: str) -> None:
    """Every case of every rank's ``results`` against ``trl.DPOTrainer`` on one process with the global batch
    (4 pairs): logged steps, ``evaluate()`` and the trained parameters, each within ``TOL``."""
    for case in CASES:
        want = _reference(path, ref_path, directory, case)
        held = set().union(*(by_case[case]["params"] for by_case in results))
        assert held == set(want["params"]), f"{case}: trained parameters {sorted(held ^ set(want['params']))[:3]}"
        assert len(want["logs"]) == 3  # 2 steps and the summary
        assert abs(want["logs"][0]["rewards/margins"]) > 1e-4 or case.startswith("peft")  # the reference counts
        for rank, by_case in enumerate(results):
            got, what = by_case[case], f"{mesh} {case} rank {rank}"
            assert [sorted(e) for e in got["logs"]] == [sorted(e) for e in want["logs"]], what
            for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
                for key, value in w.items():
                    assert g[key] == pytest.approx(value, rel=TOL, abs=TOL), f"{what} step {step} {key}"
            assert got["eval"].keys() == want["eval"].keys(), what
            for key, value in want["eval"].items():
                assert got["eval"][key] == pytest.approx(value, rel=TOL, abs=TOL), f"{what} evaluate {key}"
            assert got["params"], what  # each rank holds its stage's
            for name, p in got["params"].items():
                torch.testing.assert_close(p, want["params"][name], atol=TOL, rtol=TOL,
                                           msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
