"""What the LoRA tests on meshes (expert, tensor and fully-sharded data parallelism: test_lora_expert_parallel.py,
test_lora_tensor_parallel.py, test_lora_fsdp.py) run and check, against peft on one process.

:func:`run` makes the same calls on a pipelined model and on one process's: two ``train_step`` calls (rows whose
real-token counts differ), the LoRA gradients of both by name, two AdamW steps, then eval logits with the adapter
disabled / unmerged / merged / unmerged again (``tiny.adapter_logits``), and, when asked, greedy tokens.
:func:`check` compares one rank's results with one process's, :func:`check_saved` the adapter a mesh saves.

Tolerances (fp32, only summation order differing; each test file gives what it measured): ``TOL`` (1e-5 absolute,
test_lora_decoders.py) on the losses (~4.6), on every LoRA gradient (up to ~0.1), on the adapter after 2 AdamW
steps of lr 1e-2 and on logits (|logits| ~1); the fresh adapter bitwise; greedy tokens exactly. A gradient part
lost or counted twice moves the gradients by their own size (~1e-2) and the adapter after the steps by ~lr; a
merge lost or applied twice moves the logits by what the adapter moves them, asserted > 0.1 in :func:`reference`.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from test_lora_decoders import EPS, LR, SEED, TOL, _adapter, _close, _eval_inputs, _grads

peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's target_parameters: stacked experts

def run(model, peft_model, train, eps: float = EPS, tokens: bool = False) -> dict:
    """The same calls on a pipelined or a one-process model; ``train(batch)`` returns the loss, grads set;
    ``tokens``: also 6 greedy tokens from the first 2 eval rows (one each for 2 replicas), with the adapter
    active (unmerged) and disabled."""
    res = {"init": _adapter(model), "losses": [], "grads": []}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR, eps=eps)
    for seed in (3, 4):
        res["losses"].append(train(tiny.make_batch("llama", 8, seed=seed)).detach())
        res["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
    res["trained"] = _adapter(model)
    res.update(tiny.adapter_logits(peft_model, _eval_inputs()))
    if tokens:
        with torch.no_grad():
            prompt = {k: v[:2] for k, v in _eval_inputs().items() if k in ("input_ids", "attention_mask")}
            res["tokens"] = peft_model.generate(**prompt, max_new_tokens=6, do_sample=False)
            with peft_model.disable_adapter():
                res["base_tokens"] = peft_model.generate(**prompt, max_new_tokens=6, do_sample=False)
    return res


def reference(config, path, out, eps: float = EPS, tokens: bool = False) -> dict:
    """:func:`run` on plain transformers + peft on one process (``config`` the ``LoraConfig``); the adapter saved
    to ``out``. Asserts the adapter moves the logits, so a lost or doubled merge cannot pass."""
    base = tiny.reference(path, "AutoModelForCausalLM")
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(base, config)
    peft_model.train()

    def train(batch):
        loss = peft_model(**batch).loss
        loss.backward()
        return loss

    ref = run(base, peft_model, train, eps, tokens)
    peft_model.save_pretrained(out)
    moved = (ref["merged"] - ref["base"]).abs().max().item()
    assert moved > 0.1, f"{path}: the adapter moves the logits by {moved:.3g} only: the checks are blind"
    assert not tokens or not torch.equal(ref["tokens"], ref["base_tokens"]), f"{path}: greedy tokens blind"
    return ref


def check(got: dict, ref: dict, what: str, whole: bool = True, experts: bool = False) -> None:
    """One rank's results against one process's; ``whole``: the rank holds every adapter entry (one stage);
    ``experts``: some entry adapts an expert parameter."""
    held = set(got["init"])
    assert held == set(ref["init"]) if whole else held and held < set(ref["init"]), f"{what}: adapter entries differ"
    assert not experts or any("experts" in n for n in held), f"{what}: no expert adapter"
    _close(got["init"], ref["init"], what + " fresh adapter", tol=0)
    for step, (loss, want) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert (loss - want).abs().item() <= TOL, f"{what}: loss of step {step} {loss.item()} != {want.item()}"
    for step, (grads, want) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert set(grads) == held, f"{what}: adapter entries without a gradient at step {step}"
        _close(grads, want, f"{what} gradient of step {step}")
    _close(got["trained"], ref["trained"], what + " after 2 AdamW steps")
    for key in ("base", "unmerged", "merged", "unmerged_again"):
        diff = (got[key] - ref[key]).abs().max().item()
        assert diff <= TOL, f"{what}: {key} logits differ by {diff:.3g}"
    for key in ("tokens", "base_tokens") if "tokens" in ref else ():
        assert torch.equal(got[key], ref[key]), f"{what}: greedy {key} {got[key]} != {ref[key]}"


def check_saved(path, ref_path, base_path, ref: dict, what: str) -> None:
    """The saved adapter: one process's keys and values; loaded by peft on plain transformers, its tensors and
    its logits (those of the reference's trained adapter)."""
    from safetensors.torch import load_file

    got, want = (load_file(p / "adapter_model.safetensors") for p in (path, ref_path))
    assert sorted(got) == sorted(want), f"{what}: saved keys {sorted(set(got) ^ set(want))[:4]} differ"
    _close(got, want, what + " saved adapter")
    loaded = peft.PeftModel.from_pretrained(tiny.reference(base_path, "AutoModelForCausalLM"), path).eval()
    _close(_adapter(loaded.base_model.model), ref["trained"], what + " loaded by peft")
    with torch.no_grad():
        diff = (loaded(**_eval_inputs()).logits - ref["unmerged"]).abs().max().item()
    assert diff <= TOL, f"{what}: logits of the adapter loaded by peft differ by {diff:.3g}"


def refusal(path: str, load: dict, config=None, **fields) -> str | None:
    """``"Class: message"`` of what ``get_peft_model`` raises on a model loaded with ``load`` (``config``, or a
    ``LoraConfig(r=4, **fields)``); None if it raises nothing."""
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **load)
    try:
        peft.get_peft_model(model, config or peft.LoraConfig(r=4, **fields))
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return f"{type(e).__name__}: {e}"
    return None


def check_refused(results: list[dict], wants: tuple) -> None:
    """Every rank's ``results["refused"]`` (messages of :func:`refusal`): an ``InputError`` naming each of ``wants``'
    strings."""
    for rank, res in enumerate(results):
        for msg, want in zip(res["refused"], wants, strict=True):
            assert msg is not None and msg.startswith("InputError: "), f"rank {rank}: {msg}"
            assert all(w in msg for w in want), f"rank {rank}: {msg}"
