"""LoRA on models loaded with ``fsdp_size`` (FSDP2 shards each stage's base weights) against peft on one process.

The adapter stays whole on every fsdp rank beside FSDP's shards, and ``train_step`` sums its gradients over the
data-parallel ranks (``hf_pipeline/integrations/peft_fsdp.py``). One spawned job of 2 ranks runs:

* LLaMA at fsdp2 (one stage; each rank half of every base weight and half the batch), LoRA on ``q_proj`` /
  ``v_proj``;
* Qwen3-MoE at fsdp2 with ep2 over the fsdp ranks (``ep_over="data"``: each rank 2 of the 4 experts of every
  layer whole, left out of FSDP), LoRA on the attention and on the stacked expert parameters
  (``target_parameters``);
* ``PipelineTrainer`` on the LLaMA adapter at fsdp2: ``test_lora_trainer``'s checks (logs, evaluation, the adapter
  after 4 steps, a resumed run, the checkpoint's files, the saved adapter loaded by peft) against
  ``transformers.Trainer`` + peft on one process with the global batch;
* refused at injection on every rank, naming the field: ``modules_to_save`` under fsdp.

A second job of 4 ranks runs LLaMA at pp2 x fsdp2 (1F1B, 2 microbatches; each rank checks its stage's entries) and
at dp2 x fsdp2 (HSDP: 2 replicas of an fsdp2 stage, the weights on a ``("dp", "fsdp")`` mesh).

Every LoRA rank checks against peft on one process with the whole batch: the fresh adapter bitwise, the losses of 2
``train_step`` calls (rows whose real-token counts differ: a per-rank mean instead of the global item count moves
the loss), every ``lora_A`` / ``lora_B`` gradient of both steps by name, every adapter entry after 2 AdamW steps,
eval logits with the adapter disabled / unmerged / merged into FSDP's shards / unmerged again (``lora_checks.run``);
and the adapter the mesh saves: one process's keys and values, and loaded by plain peft on plain transformers, its
tensors and its logits.

Tolerances (fp32), as tests/integrations/test_lora_expert_parallel.py, only summation order differing: 1e-5 absolute
on the losses (~4.6; measured under 5e-7), on every LoRA gradient (|g| up to ~0.07; measured under 6e-8), on the
adapter after 2 AdamW steps of lr 1e-2 (measured under 6e-7) and on logits (|logits| ~1; measured under 1.4e-6,
merged ones included; HSDP within the same bounds). A
gradient not summed over the fsdp ranks (each rank stepping with its own rows' gradient) moves the second step's
loss by 1.7e-3 (measured with the sum removed: the LLaMA case fails there) and the adapter by ~lr; the adapter's
effect on the logits is asserted > 0.1, so a lost adapter fails. Shown to fail (measured on the 4-rank job): the
merge without the delta laid out as the weight raises peft's "mixed torch.Tensor and DTensor"; every rank given
the first rank's chunk of the delta misses the merged logits by 0.42; HSDP without the whole features at injection
sizes lora_B by the local shard (16 rows of 32) and the forward raises; HSDP's adapter gradients summed over the
fsdp ranks only (not the other replica's) move the second loss by 1.7e-3. Trainer: 2e-5 (test_trainer.py).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from lora_checks import EXPERTS, check, check_refused, check_saved, reference, refusal, run
from test_lora_decoders import SEED, _checkpoints, _targets
from test_lora_trainer import _check as _check_trainer
from test_lora_trainer import _train_rank

peft = pytest.importorskip("peft")

CASES = {  # name -> (model_type, load options), at 2 ranks
    "llama fsdp2": ("llama", {"num_stages": 1, "fsdp_size": 2, "n_microbatches": 2}),
    "qwen3_moe fsdp2 x ep2 over data": ("qwen3_moe", {"num_stages": 1, "fsdp_size": 2, "ep_size": 2,
                                                      "ep_over": "data", "n_microbatches": 1}),
}
FOUR_RANKS = {  # name -> load options of LLaMA at 4 ranks, and whether each rank holds the whole adapter
    "pp2 x fsdp2": ({"num_stages": 2, "fsdp_size": 2, "schedule": "1f1b", "n_microbatches": 2}, False),
    # HSDP: 2 replicas of an fsdp2 stage (the weights on a ("dp", "fsdp") mesh), each replica a quarter of the batch
    "dp2 x fsdp2": ({"num_stages": 1, "fsdp_size": 2, "n_microbatches": 2}, True),
}


def _lora(model_type: str):
    experts = {"target_parameters": EXPERTS} if model_type == "qwen3_moe" else {}
    targets = ["q_proj", "v_proj"] if model_type == "llama" else _targets(model_type)
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                           task_type="CAUSAL_LM", **experts)


def _adapted(path: str, model_type: str, load: dict):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    torch.manual_seed(SEED)
    return model, peft.get_peft_model(model, _lora(model_type))


def _two_ranks(paths: dict, out: str) -> dict:
    results = {}
    for case, (model_type, load) in CASES.items():
        model, peft_model = _adapted(paths[model_type], model_type, load)
        results[case] = run(model, peft_model, model.train_step)
        peft_model.save_pretrained(f"{out}/adapter-{case}")
    results["trainer"] = _train_rank(paths["llama"], f"{out}/trainer", 1, {"fsdp_size": 2})
    results["refused"] = (refusal(paths["llama"], CASES["llama fsdp2"][1], target_modules=["q_proj"],
                                  modules_to_save=["lm_head"]),)
    return results


def _four_ranks(path: str, out: str) -> dict:
    results = {}
    for case, (load, _) in FOUR_RANKS.items():
        model, peft_model = _adapted(path, "llama", load)
        results[case] = run(model, peft_model, model.train_step)
        peft_model.save_pretrained(f"{out}/adapter-{case}")  # the first fsdp rank's pipeline's, gathered to rank 0
    return results


def _paths(tmp_path) -> dict:
    paths = _checkpoints(tmp_path, ["qwen3_moe"])
    paths["llama"] = tiny.make_checkpoint(tmp_path / "llama", "llama")
    return paths


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_fsdp_and_fsdp_with_experts_over_data_equals_peft(tmp_path):
    paths, out = _paths(tmp_path), tmp_path / "out"
    refs = {t: reference(_lora(t), paths[t], out / f"ref-{t}") for t in ("llama", "qwen3_moe")}
    results = run_distributed(_two_ranks, 2, {k: str(v) for k, v in paths.items()}, str(out), timeout=600)
    for case, (model_type, _) in CASES.items():
        ref = refs[model_type]
        for rank, res in enumerate(results):
            check(res[case], ref, f"{case} rank {rank}")
        check_saved(out / f"adapter-{case}", out / f"ref-{model_type}", paths[model_type], ref, case)
    _check_trainer([res["trainer"] for res in results], str(paths["llama"]), out / "trainer", 2, 1)
    check_refused(results, (("modules_to_save=['lm_head']", "fsdp_size=2"),))


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_four_ranks_of_fsdp_meshes_equals_peft(tmp_path):
    """LLaMA at pp2 x fsdp2 (each rank checks its stage's entries; the adapter saved from both stages) and at
    dp2 x fsdp2 (HSDP: every rank the whole adapter, its gradients summed over both replicas' fsdp ranks)."""
    path, out = tiny.make_checkpoint(tmp_path / "llama", "llama"), tmp_path / "out"
    ref = reference(_lora("llama"), path, out / "ref-llama")
    results = run_distributed(_four_ranks, 4, str(path), str(out), timeout=600)
    for case, (_, whole) in FOUR_RANKS.items():
        for rank, got in enumerate(results):
            check(got[case], ref, f"llama {case} rank {rank}", whole=whole)
        held = set().union(*(got[case]["init"] for got in results))
        assert held == set(ref["init"]), f"{case}: adapter entries no stage holds"
        check_saved(out / f"adapter-{case}", out / "ref-llama", path, ref, f"llama {case}")


def test_refusals_under_fsdp_name_the_field():
    """An adapter FSDP cannot hold (a stand-in model with the fields the rules read; no process group)."""
    from types import SimpleNamespace

    from hf_pipeline.errors import InputError
    from hf_pipeline.integrations.peft_fsdp import refuse_under_fsdp

    def model(fsdp: int, ep: int = 1, ep_data: int = 1, replicas: int = 1):
        return SimpleNamespace(dims=SimpleNamespace(fsdp_size=fsdp, ep_data=ep_data, replicas=replicas),
                               options=SimpleNamespace(ep_size=ep))

    experts = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    saved = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    for config in (experts, saved):
        refuse_under_fsdp(model(1, ep=2), config)  # no FSDP: nothing refused here
    refuse_under_fsdp(model(2, ep=2, ep_data=2), experts)  # experts over the fsdp ranks: left out of FSDP
    refuse_under_fsdp(model(2, replicas=2), _lora("llama"))  # HSDP: the adapter whole on every rank too
    with pytest.raises(InputError, match=r"modules_to_save=\['lm_head'\].*fsdp_size=2"):
        refuse_under_fsdp(model(2), saved)
    biased = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True)
    refuse_under_fsdp(model(1), biased)
    with pytest.raises(InputError, match=r"lora_bias=True\) on a model loaded with fsdp_size=2"):
        refuse_under_fsdp(model(2), biased)
    with pytest.raises(InputError, match=r"ep_size=2 within each stage and fsdp_size=2.*ep_over='data'"):
        refuse_under_fsdp(model(2, ep=2), experts)
