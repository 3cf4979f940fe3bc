"""Traced and recipe cases that used to crash equal single-process transformers.

  * BERT and RoBERTa masked-LM training through the tracer at 2 and 3 ranks: the MLM decoder's
    weight is the word embedding (stage 0 and the last stage) but its bias lives on the last stage
    only; the gradient sync of every rank must agree on which tensors it reduces (it aborted inside
    gloo with "Received data size doesn't match expected size").
  * OPT through the traced interleaved and ZBV zero-bubble schedules: a bool attention mask (a
    view) crosses stages, and torch's input-gradient pass detaches every stage output in place.
  * GPT-2 with ``token_type_ids``: the traced forward (wte runs twice and is tied to the LM head)
    and the recipe's ``generate`` (each new token takes the prompt's last type, as transformers).
Loss, every gradient by name and every parameter after one SGD step (train); logits (forward);
greedy tokens (generate). One spawned job per world size.
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

TOL = 1e-5  # fp32, the same kernels; only summation order differs
# fp32 loss and gradients (relative to the norm): summation order ~1e-6; a dropped microbatch moves them >= 1e-2,
# a gradient off by 2x 100%.
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-7  # gradients that are zero in exact arithmetic (key biases) carry rounding noise only
SGD_LR = 0.5


def _configs() -> dict[str, tuple[str, transformers.PretrainedConfig]]:
    common = dict(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        vocab_size=tiny.VOCAB,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return {
        "bert": ("AutoModelForMaskedLM", transformers.BertConfig(**common)),
        "roberta": ("AutoModelForMaskedLM", transformers.RobertaConfig(**common)),
        "opt": ("AutoModelForCausalLM", transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, vocab_size=tiny.VOCAB, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )),
        "gpt2": ("AutoModelForCausalLM", tiny.config_for("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("crashes")
    paths = {}
    for arch, (auto, config) in _configs().items():
        torch.manual_seed(0)
        getattr(transformers, auto).from_config(config).save_pretrained(root / arch, max_shard_size="40KB")
        paths[arch] = str(root / arch)
    return paths


def _train_batch() -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs("llama", batch=8, seq=9)
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


def _typed_inputs(batch: int = 4) -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs("gpt2", batch=batch, seq=9)
    types = torch.randint(0, 5, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    return {**inputs, "token_type_ids": types}


def _load(path: str, auto: str, **kwargs):
    import hf_pipeline

    return getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)


# --------------------------------------------------------------------------- run on every rank
def _train(path: str, auto: str, kwargs: dict) -> dict:
    model = _load(path, auto, **kwargs)
    loss = model.train_step(_train_batch())
    grads = {n: p.grad.clone() for n, p in model.checkpoint_named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    return {
        "loss": loss,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()},
    }


def _forward_typed(path: str, kwargs: dict) -> torch.Tensor:
    return _load(path, "AutoModelForCausalLM", **kwargs)(**_typed_inputs()).logits


def _generate_typed(path: str, kwargs: dict) -> torch.Tensor:
    return _load(path, "AutoModelForCausalLM", **kwargs).generate(**_typed_inputs(), max_new_tokens=5, do_sample=False)


def _job(train: list, forward: list, generate: list) -> dict:
    return {
        "train": [_train(*case) for case in train],
        "forward": [_forward_typed(*case) for case in forward],
        "generate": [_generate_typed(*case) for case in generate],
    }


# --------------------------------------------------------------------------- checks
def _check_training(per_rank: list[dict], path: str, auto: str, what: str) -> None:
    ref = tiny.reference(path, auto).train()
    before = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    loss = ref(**_train_batch()).loss
    loss.backward()
    want_grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    torch.optim.SGD(ref.parameters(), lr=SGD_LR).step()
    after = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    seen: set[str] = set()
    for rank, got in enumerate(per_rank):
        assert torch.allclose(got["loss"], loss.detach(), rtol=GRAD_RTOL, atol=0), (what, rank, got["loss"], loss)
        for name, g in got["grads"].items():
            err, norm = (g - want_grads[name]).norm().item(), want_grads[name].norm().item()
            assert err <= GRAD_RTOL * norm + GRAD_ATOL, (
                f"{what} rank {rank} {name}: |diff| {err:.3g}, |want| {norm:.3g}"
            )
        for name, p in got["params"].items():
            update = (after[name] - before[name]).norm().item()
            err = (p - after[name]).norm().item()
            # parameters after one step, relative to the update's norm: noise ~1e-6 of it; a step missed
            # or applied twice is 100% off.
            assert err <= 1e-4 * update + 1e-7, (
                f"{what} rank {rank} {name}: off by {err:.3g} after one step (update {update:.3g})"
            )
        seen |= set(got["grads"])
    # Every tensor got its gradient on some rank, under one of its names.
    aliases: dict[int, set[str]] = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(n)
    missing = [sorted(g) for g in aliases.values() if not g & seen]
    assert not missing, (what, missing)


def _mlm_cases(n_microbatches: int) -> list[tuple[str, str, dict]]:
    return [
        (a, "AutoModelForMaskedLM", {"split_method": "trace", "n_microbatches": n_microbatches})
        for a in ("bert", "roberta")
    ]


@pytest.mark.dist
def test_world_size_2_mlm_zero_bubble_and_token_type_ids_equal_transformers(checkpoints):
    train = _mlm_cases(4) + [
        (
            "opt",
            "AutoModelForCausalLM",
            {"split_method": "trace", "schedule": s, "virtual_stages": 2, "n_microbatches": 4},
        )
        for s in ("interleaved-zero-bubble", "zbv-zero-bubble")
    ]
    forward = [(checkpoints["gpt2"], {"split_method": "trace", "n_microbatches": 2})]
    generate = [(checkpoints["gpt2"], {"split_method": "recipe"})]
    per_rank = run_distributed(
        _job, 2, [(checkpoints[a], auto, kw) for a, auto, kw in train], forward, generate, timeout=600,
    )
    for i, (arch, auto, kw) in enumerate(train):
        _check_training([r["train"][i] for r in per_rank], checkpoints[arch], auto, f"{arch} {kw}")
    ref = tiny.reference(checkpoints["gpt2"], "AutoModelForCausalLM")
    with torch.no_grad():
        want_logits = ref(**_typed_inputs()).logits
    want_ids = ref.generate(**_typed_inputs(), max_new_tokens=5, do_sample=False)
    for rank, r in enumerate(per_rank):
        diff = (r["forward"][0] - want_logits).abs().max().item()
        assert diff <= TOL, f"traced GPT-2 with token_type_ids, rank {rank}: max abs diff {diff}"
        assert torch.equal(r["generate"][0], want_ids), (rank, r["generate"][0], want_ids)


@pytest.mark.dist
def test_world_size_3_mlm_training_equals_transformers(checkpoints):
    train = _mlm_cases(4)
    per_rank = run_distributed(_job, 3, [(checkpoints[a], auto, kw) for a, auto, kw in train], [], [], timeout=600)
    for i, (arch, auto, kw) in enumerate(train):
        _check_training([r["train"][i] for r in per_rank], checkpoints[arch], auto, f"{arch} {kw} at 3 ranks")


def test_generate_token_type_ids_on_one_rank_and_its_refusals(checkpoints):
    model = _load(checkpoints["gpt2"], "AutoModelForCausalLM", num_stages=2, virtual_stages=2)
    want = tiny.reference(checkpoints["gpt2"], "AutoModelForCausalLM").generate(
        **_typed_inputs(), max_new_tokens=5, do_sample=False
    )
    assert torch.equal(model.generate(**_typed_inputs(), max_new_tokens=5, do_sample=False), want)
    bad = _typed_inputs()
    with pytest.raises(ValueError, match="token_type_ids shape"):
        model.generate(**{**bad, "token_type_ids": bad["token_type_ids"][:, :-1]}, max_new_tokens=2)
