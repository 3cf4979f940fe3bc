"""LoRA on models loaded with tensor parallelism (``tp_size=2``: transformers' own plan, DTensor shards), against
peft on one process.

One spawned job of 2 ranks runs LLaMA and Qwen3 (whose per-head ``q_norm`` / ``k_norm`` are replicated with their
gradients summed) at tp2, one adapter on the attention's q/k/v (colwise) and o (rowwise) and the MLP's gate/up
(colwise) and down (rowwise) projections; a second job of 4 ranks runs LLaMA at pp2 x tp2 and Qwen3-MoE at
pp2 x tp2 x ep2 (its attention adapted, and its experts' stacked parameters, split over the tp ranks: peft's
``target_parameters``), each rank checking its stage's entries.

Every rank checks: the fresh adapter bitwise, the losses of 2 ``train_step`` calls, every LoRA gradient of both steps
by name, every LoRA parameter after 2 AdamW steps, eval logits with the adapter disabled / unmerged / merged /
unmerged again; and the adapter each mesh saves (whole tensors, written once): one process's keys and values, and
loaded by plain peft on plain transformers, its tensors and its logits. The tp sum is shown to matter: LLaMA at tp2
with ``copy_to_ranks`` made the identity in the LoRA layers (each rank keeping its rows' part of the gradients) must
miss the reference gradients by more than 1e-3. Refused on every rank at injection, naming the field:
``lora_bias=True`` at tp2, GPT-2's packed ``Conv1D`` ``c_attn`` at tp2, and tp2 x fsdp2. The 2-rank job also runs
``PipelineTrainer`` on a LLaMA adapter at tp2: ``test_lora_trainer``'s checks (logs, evaluation, the adapter after
4 steps, a resumed run, the checkpoint's files, the saved adapter loaded by peft) against ``transformers.Trainer``
+ peft on one process, at its tolerance (2e-5).

Tolerances (fp32), as tests/integrations/test_lora_decoders.py: 1e-5 absolute on the losses (~4.6), on every LoRA
gradient (up to ~0.1), on the adapter after 2 AdamW steps of lr 1e-2 (eps 1e-3, see EPS) and on logits (|logits|
~1); measured under 4e-7 on the losses and step-0 gradients, under 2e-6 after the steps. A gradient part not summed
over the tp ranks (lora_B's other rows, lora_A's other columns) moves those gradients by their own size (~1e-2,
asserted > 1e-3 for the mutation) and the adapter after the steps by ~1e-2 (lr-sized AdamW moves); summed twice,
by as much; a merge lost or applied twice moves the logits by what the adapter moves them (asserted > 0.1).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from lora_checks import EXPERTS, check, check_refused, check_saved, reference, refusal, run
from test_lora_decoders import SEED, _checkpoints, _grads
from test_lora_trainer import _check as _check_trainer
from test_lora_trainer import _train_rank

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TP2 = {"tp_size": 2, "n_microbatches": 2}
PP2_TP2 = {"num_stages": 2, "tp_size": 2, "n_microbatches": 2}  # 4 ranks: ranks 0, 1 stage 0; 2, 3 stage 1
# AdamW's eps: the tp ranks' partial sums reorder the gradients' round-off (measured under 4e-7 on step 0's), and
# with eps 1e-5 (the neighbouring tests') a component of a gradient near eps turns it into a 1e-5 move of the
# adapter (measured 2.7e-5 after 2 steps, then 1.3e-5 on Qwen3's step-1 gradients); with 1e-3 under 2e-6.
EPS = 1e-3


def _lora(model_type: str, **extra):
    if model_type == "qwen3_moe":  # the attention (tp) and the experts' stacked parameters (ep over the tp ranks)
        extra = {"target_modules": ATTENTION, "target_parameters": EXPERTS, **extra}
    else:
        extra = {"target_modules": ATTENTION + MLP, **extra}
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM",
                           **extra)


def _paths(tmp_path, model_types) -> dict:
    paths = _checkpoints(tmp_path, [t for t in model_types if t not in ("llama", "gpt2")])
    for arch in {"llama", "gpt2"} & set(model_types):
        paths[arch] = tiny.make_checkpoint(tmp_path / arch, arch, shards=1)
    return {k: str(v) for k, v in paths.items()}


def _adapted(path: str, load: dict, model_type: str):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    torch.manual_seed(SEED)
    return model, peft.get_peft_model(model, _lora(model_type))


def _unsummed_grads(path: str) -> dict:
    """LLaMA at tp2 with the LoRA layers' sums over the tp ranks taken out: the gradients of one step."""
    from hf_pipeline.integrations import peft_tensor_parallel

    summed = peft_tensor_parallel.copy_to_ranks
    peft_tensor_parallel.copy_to_ranks = lambda x, mesh: x
    try:
        model, _ = _adapted(path, TP2, "llama")
        model.train_step(tiny.make_batch("llama", 8, seed=3))
        return _grads(model)
    finally:
        peft_tensor_parallel.copy_to_ranks = summed


def _tp2(paths: dict, out: str) -> dict:
    results = {}
    for model_type in ("llama", "qwen3"):
        model, peft_model = _adapted(paths[model_type], TP2, model_type)
        results[model_type] = run(model, peft_model, model.train_step, eps=EPS)
        peft_model.save_pretrained(f"{out}/adapter-{model_type}-tp2")
    results["unsummed"] = _unsummed_grads(paths["llama"])
    results["trainer"] = _train_rank(paths["llama"], f"{out}/trainer", 1, {"tp_size": 2})
    results["refused"] = (refusal(paths["llama"], TP2, target_modules=["q_proj"], lora_bias=True),
                          refusal(paths["gpt2"], TP2, target_modules=["c_attn"]))  # packed Conv1D q, k, v
    return results


def _pp2_tp2(paths: dict, out: str) -> dict:
    from transformers.distributed import DistributedConfig

    results = {}
    meshes = {"llama": PP2_TP2, "qwen3_moe": {"distributed_config": DistributedConfig(pp_size=2, tp_size=2, ep_size=2),
                                              "n_microbatches": 2}}
    for model_type, load in meshes.items():
        model, peft_model = _adapted(paths[model_type], load, model_type)
        results[model_type] = run(model, peft_model, model.train_step, eps=EPS)
        peft_model.save_pretrained(f"{out}/adapter-{model_type}-pp2")  # each stage's first tp rank's, gathered
    results["refused"] = (refusal(paths["llama"], {"tp_size": 2, "fsdp_size": 2, "num_stages": 1},
                                   target_modules=["q_proj"]),)
    return results


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_tensor_parallel_llama_and_qwen3_equals_peft(tmp_path):
    families = ("llama", "qwen3")
    paths, out = _paths(tmp_path, (*families, "gpt2")), tmp_path / "out"
    refs = {t: reference(_lora(t), paths[t], out / f"ref-{t}", eps=EPS) for t in families}
    results = run_distributed(_tp2, 2, paths, str(out), timeout=600)
    for model_type in families:
        for rank, res in enumerate(results):
            check(res[model_type], refs[model_type], f"{model_type} tp2 rank {rank}")
        check_saved(out / f"adapter-{model_type}-tp2", out / f"ref-{model_type}", paths[model_type], refs[model_type],
                     f"{model_type} tp2")
    want = refs["llama"]["grads"][0]
    for rank, res in enumerate(results):
        missed = max((g - want[n]).abs().max().item() for n, g in res["unsummed"].items())
        assert missed > 1e-3, f"rank {rank}: LoRA gradients not summed over tp miss by {missed:.3g} only: blind check"
    check_refused(results, (("lora_bias=True", "tp_size=2"), ("transformer.h.0.attn.c_attn", "Conv1D", "tp_size=2")))
    _check_trainer([res["trainer"] for res in results], paths["llama"], out / "trainer", 1, 1)


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_two_stages_of_two_tensor_parallel_ranks_equals_peft(tmp_path):
    """pp2 x tp2 LLaMA and pp2 x tp2 x ep2 Qwen3-MoE (4 ranks): the same checks, each rank on its stage's entries,
    and the adapter saved from both stages."""
    families = ("llama", "qwen3_moe")
    paths, out = _paths(tmp_path, families), tmp_path / "out"
    refs = {t: reference(_lora(t), paths[t], out / f"ref-{t}", eps=EPS) for t in families}
    results = run_distributed(_pp2_tp2, 4, paths, str(out), timeout=600)
    for model_type in families:
        for rank, res in enumerate(results):
            check(res[model_type], refs[model_type], f"{model_type} pp2 x tp2 rank {rank}", whole=False)
        held = set(results[0][model_type]["init"]) | set(results[2][model_type]["init"])
        assert held == set(refs[model_type]["init"]), f"{model_type}: adapter entries no stage holds"
        check_saved(out / f"adapter-{model_type}-pp2", out / f"ref-{model_type}", paths[model_type],
                     refs[model_type], f"{model_type} pp2 x tp2")
    check_refused(results, (("tp_size=2", "fsdp_size=2"),))
