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

A second job of 4 ranks runs LLaMA at pp2 x fsdp2 (1F1B, 2 microbatches; each rank checks its stage's entries), and
checks an adapter at dp2 x fsdp2 (HSDP) refused on every rank.

Every LoRA rank checks against peft on one process with the whole batch: the fresh adapter bitwise, the losses of 2
``train_step`` calls (rows whose real-token counts differ: a per-rank mean instead of the global item count moves
the loss), every ``lora_A`` / ``lora_B`` gradient of both steps by name, every adapter entry after 2 AdamW steps,
eval logits with the adapter disabled and enabled; and the adapter the mesh saves: one process's keys and values,
and loaded by plain peft on plain transformers, its tensors and its logits.

Tolerances (fp32), as tests/integrations/test_lora_expert_parallel.py, only summation order differing: 1e-5 absolute
on the losses (~4.6; measured under 5e-7), on every LoRA gradient (|g| up to ~0.07; measured under 6e-8), on the
adapter after 2 AdamW steps of lr 1e-2 (measured under 6e-7) and on logits (|logits| ~1; measured under 1.2e-6). A
gradient not summed over the fsdp ranks (each rank stepping with its own rows' gradient) moves the second step's
loss by 1.7e-3 (measured with the sum removed: the LLaMA case fails there) and the adapter by ~lr; the adapter's
effect on the logits is asserted > 0.1, so a lost adapter fails. Trainer: 2e-5 (test_trainer.py).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from test_lora_decoders import EPS, LR, SEED, TOL, _adapter, _checkpoints, _close, _eval_inputs, _grads, _targets
from test_lora_expert_parallel import EXPERTS, _check_saved
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
}
HSDP = {"num_stages": 1, "fsdp_size": 2, "n_microbatches": 2}  # at 4 ranks: 2 replicas of an fsdp2 stage


def _lora(model_type: str):
    experts = {"target_parameters": EXPERTS} if model_type == "qwen3_moe" else {}
    targets = ["q_proj", "v_proj"] if model_type == "llama" else _targets(model_type)
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                           task_type="CAUSAL_LM", **experts)


def _run(model, peft_model, train) -> dict:
    """The same calls on a pipelined or a one-process model; ``train(batch)`` returns the loss, grads set.
    (No merge: ``merge_adapter`` on an fsdp model is not done.)"""
    res = {"init": _adapter(model), "losses": [], "grads": []}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    for seed in (3, 4):
        res["losses"].append(train(tiny.make_batch("llama", 8, seed=seed)).detach())
        res["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
    res["trained"] = _adapter(model)
    peft_model.eval()
    with torch.no_grad():
        with peft_model.disable_adapter():
            res["base"] = peft_model(**_eval_inputs()).logits
        res["unmerged"] = peft_model(**_eval_inputs()).logits
    return res


def _adapted(path: str, model_type: str, load: dict):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    torch.manual_seed(SEED)
    return model, peft.get_peft_model(model, _lora(model_type))


def _refused(path: str, load: dict, config) -> str | None:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    try:
        peft.get_peft_model(model, config)
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return f"{type(e).__name__}: {e}"
    return None


def _two_ranks(paths: dict, out: str) -> dict:
    results = {}
    for case, (model_type, load) in CASES.items():
        model, peft_model = _adapted(paths[model_type], model_type, load)
        results[case] = _run(model, peft_model, model.train_step)
        peft_model.save_pretrained(f"{out}/adapter-{case}")
    results["trainer"] = _train_rank(paths["llama"], f"{out}/trainer", 1, {"fsdp_size": 2})
    saved = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    results["refused"] = _refused(paths["llama"], CASES["llama fsdp2"][1], saved)
    return results


def _four_ranks(path: str, out: str) -> dict:
    results = {}
    for case, (load, _) in FOUR_RANKS.items():
        model, peft_model = _adapted(path, "llama", load)
        results[case] = _run(model, peft_model, model.train_step)
        peft_model.save_pretrained(f"{out}/adapter-{case}")  # the first fsdp rank's pipeline's, gathered to rank 0
    results["refused"] = _refused(path, HSDP, _lora("llama"))
    return results


def _reference(model_type: str, path, out) -> dict:
    base = tiny.reference(path, "AutoModelForCausalLM")
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(base, _lora(model_type))
    peft_model.train()

    def train(batch):
        loss = peft_model(**batch).loss
        loss.backward()
        return loss

    ref = _run(base, peft_model, train)
    peft_model.save_pretrained(out)
    moved = (ref["unmerged"] - ref["base"]).abs().max().item()
    assert moved > 0.1, f"{model_type}: the adapter moves the logits by {moved:.3g} only: the checks are blind"
    return ref


def _check(got: dict, ref: dict, what: str, whole: bool = True) -> None:
    """One rank's results against one process's; ``whole``: the rank holds every adapter entry (one stage)."""
    held = set(got["init"])
    assert held == set(ref["init"]) if whole else held and held < set(ref["init"]), f"{what}: adapter entries differ"
    _close(got["init"], ref["init"], what + " fresh adapter", tol=0)
    for step, (loss, want) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert (loss - want).abs().item() <= TOL, f"{what}: loss of step {step} {loss.item()} != {want.item()}"
    for step, (grads, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert set(grads) == held, f"{what}: adapter entries without a gradient at step {step}"
        _close(grads, want, f"{what} gradient of step {step}")
    _close(got["trained"], ref["trained"], what + " after 2 AdamW steps")
    for key in ("base", "unmerged"):
        diff = (got[key] - ref[key]).abs().max().item()
        assert diff <= TOL, f"{what}: {key} logits differ by {diff:.3g}"


def _paths(tmp_path) -> dict:
    paths = _checkpoints(tmp_path, ["qwen3_moe"])
    paths["llama"] = tiny.make_checkpoint(tmp_path / "llama", "llama")
    return paths


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_fsdp_and_fsdp_with_experts_over_data_equals_peft(tmp_path):
    paths, out = _paths(tmp_path), tmp_path / "out"
    refs = {t: _reference(t, paths[t], out / f"ref-{t}") for t in ("llama", "qwen3_moe")}
    results = run_distributed(_two_ranks, 2, {k: str(v) for k, v in paths.items()}, str(out), timeout=600)
    for case, (model_type, _) in CASES.items():
        ref = refs[model_type]
        for rank, res in enumerate(results):
            _check(res[case], ref, f"{case} rank {rank}")
        _check_saved(out / f"adapter-{case}", out / f"ref-{model_type}", paths[model_type], ref, case)
    _check_trainer([res["trainer"] for res in results], str(paths["llama"]), out / "trainer", 2, 1)
    for rank, res in enumerate(results):
        msg = res["refused"]
        assert msg is not None and msg.startswith("InputError: "), f"rank {rank}: {msg}"
        assert "modules_to_save=['lm_head']" in msg and "fsdp_size=2" in msg, f"rank {rank}: {msg}"


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_four_ranks_of_fsdp_meshes_equals_peft(tmp_path):
    """LLaMA at pp2 x fsdp2 (each rank checks its stage's entries; the adapter saved from both stages); an
    adapter at dp2 x fsdp2 (HSDP) refused on every rank, naming the replicas."""
    path, out = tiny.make_checkpoint(tmp_path / "llama", "llama"), tmp_path / "out"
    ref = _reference("llama", path, out / "ref-llama")
    results = run_distributed(_four_ranks, 4, str(path), str(out), timeout=600)
    for case, (_, whole) in FOUR_RANKS.items():
        for rank, got in enumerate(results):
            _check(got[case], ref, f"llama {case} rank {rank}", whole=whole)
        held = set().union(*(got[case]["init"] for got in results))
        assert held == set(ref["init"]), f"{case}: adapter entries no stage holds"
        _check_saved(out / f"adapter-{case}", out / "ref-llama", path, ref, f"llama {case}")
    for rank, res in enumerate(results):
        msg = res["refused"]
        assert msg is not None and msg.startswith("InputError: "), f"rank {rank}: {msg}"
        assert "fsdp_size=2 and 2 replicas" in msg, f"rank {rank}: {msg}"


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
    with pytest.raises(InputError, match=r"fsdp_size=2 and 2 replicas of it \(HSDP\)"):
        refuse_under_fsdp(model(2, replicas=2), _lora("llama"))
    with pytest.raises(InputError, match=r"modules_to_save=\['lm_head'\].*fsdp_size=2"):
        refuse_under_fsdp(model(2), saved)
    with pytest.raises(InputError, match=r"ep_size=2 within each stage and fsdp_size=2.*ep_over='data'"):
        refuse_under_fsdp(model(2, ep=2), experts)
