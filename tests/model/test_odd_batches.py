"""Three ranks against transformers on one process: odd batches, fully padded rows, sliding windows.

One spawned job of 3 gloo ranks loads each tiny fp32 model (no dropout, seeded) with the default
split (one stage per rank, 1F1B) and on every rank compares with transformers:
  * forward logits of a 13-row batch, left padded and right padded, each with two rows that are
    all padding (row 4, inside a microbatch, and row 12, the only real row of the last microbatch),
    in 4 or 5 microbatches: 13 rows do not split evenly, so the runtime pads the batch;
  * one ``train_step`` on such a batch in 13 microbatches of one row (a training step needs equal
    microbatches; the all-padding row's microbatch has no target token in a causal LM): the loss,
    the gradient of every parameter by checkpoint key, and every parameter after an AdamW step;
  * for the sliding-window models, greedy ``generate`` ids for 13 prompts (two of them all
    padding) in 4 or 5 microbatches, decoding past the window.
Models: BERT for sequence classification and GPT-2 / LLaMA causal LMs on 5-token rows; Mistral
(every layer slides) and Qwen2 (layers 0-2 full, 3-5 sliding, so the middle rank holds both kinds)
with a 4-token window on 10-token rows.

transformers gives finite outputs for an all-padding row (torch's SDPA returns zeros for a query
that may attend to no key, so the row keeps its residual path), so those rows are compared like
the others. The ids under the padding are random tokens, not the pad id: a LLaMA-family pad id
embeds to zeros, which would make an all-padding row's outputs zero with or without its mask. For
generation the prompts are padded with the pad id, as a tokenizer pads them, two of them all
padding. Before the run the references show that each input feature matters: the mask changes the
logits of the all-padding rows (BERT's initializer is scaled up so its classifier outputs react by
more than the tolerance), the window changes the
logits and the generated ids of the sliding models, and a causal LM's loss (the mean over the
batch's target tokens) is not the mean of the one-row microbatches' means.

Tolerances as in ``test_train.py`` (fp32, same kernels, only summation order differs): logits 1e-5
absolute, loss 1e-5 relative, gradients 1e-5 of the tensor's largest reference entry, parameters
after AdamW 1e-5 absolute (``EPS`` as there); gradients that are zero in exact arithmetic (BERT's key
biases) get a floor of fp32 epsilon x the model's largest gradient.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import last_run_timing, run_distributed

pytestmark = pytest.mark.dist  # every test here starts other processes

WORLD = 3
ROWS = 13
ZERO_ROWS = (4, 12)
SHORT, LONG, WINDOW = 5, 10, 4  # row lengths: BERT / GPT-2 / LLaMA; sliding models (longer than the window)
PROMPT, NEW = 6, 8  # generation: 6 + 8 tokens pass the 4-token window
TRAIN_M = ROWS
# fp32 logits below 1 (the causal LMs 0.4-0.6; one ulp 6e-8): sums of 32-64 terms over 4-6 layers keep another
# summation order's rounding near 1e-6; a wrong mask, window or position moves them by 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5
LOSS_RTOL = GRAD_RTOL = PARAM_ATOL = 1e-5
LR, EPS = 1e-3, 1e-5
CAUSAL, CLS = "AutoModelForCausalLM", "AutoModelForSequenceClassification"
MIXED = "qwen2"  # full and sliding layers on one rank

# name -> (auto class, config, row length, forward n_microbatches, train padding side, generates)
MODELS = {
    "bert-cls": (
        CLS,
        lambda: tiny.config_for(
            "bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1
        ),
        SHORT, (5,), "right", False,
    ),
    "gpt2": (
        CAUSAL, lambda: tiny.config_for("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), SHORT, (4,), "right",
        False,
    ),
    "llama": (CAUSAL, lambda: tiny.config_for("llama"), SHORT, (4, 5), "left", False),
    "mistral": (CAUSAL, lambda: tiny.sliding_config("mistral", window=WINDOW), LONG, (4,), "left", True),
    "qwen2": (CAUSAL, lambda: tiny.sliding_config("qwen2", window=WINDOW, full_layers=3), LONG, (5,), "right", True),
}


def _forward_inputs(seq: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        side: tiny.padded_rows(ROWS, seq, seed=2, pad_left=side == "left", zero_rows=ZERO_ROWS, pad_id=None)
        for side in ("left", "right")
    }


def _train_batch(name: str) -> dict[str, torch.Tensor]:
    auto, _, seq, _, side, _ = MODELS[name]
    batch = tiny.padded_rows(ROWS, seq, seed=3, pad_left=side == "left", zero_rows=ZERO_ROWS, pad_id=None)
    if auto == CLS:
        batch["labels"] = torch.randint(0, 2, (ROWS,), generator=torch.Generator().manual_seed(4))
    else:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _gen_inputs() -> dict[str, torch.Tensor]:
    return tiny.padded_rows(ROWS, PROMPT, seed=5, pad_left=True, zero_rows=ZERO_ROWS)


GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)


# --------------------------------------------------------------------------- every rank
def _case(name: str, path: str) -> dict:
    import hf_pipeline

    auto, _, seq, forward_m, _, generates = MODELS[name]
    from hf_pipeline.families.glue import attention_kinds

    cls = getattr(hf_pipeline, auto)
    res: dict = {"logits": {}}
    for m in forward_m:
        model = cls.from_pretrained(path, pipeline=True, device="cpu", progress=False, n_microbatches=m)
        for side, inputs in _forward_inputs(seq).items():
            res["logits"][m, side] = model(**inputs).logits
        if generates:
            res["ids"] = model.generate(**_gen_inputs(), **GREEDY, n_microbatches=m)  # (default: one per stage)
    model = cls.from_pretrained(path, pipeline=True, device="cpu", progress=False, n_microbatches=TRAIN_M)
    if generates:  # the attention kinds of this rank's layers
        kinds = attention_kinds(model.config)
        res["kinds"] = {
            kinds[model.resolved.stacks[-1].blocks.index(b)] for st in model.stages for b in st.spec.attention_blocks
        }
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    res["loss"] = float(model.train_step(_train_batch(name)))
    res["grads"] = tiny.tensors_by_key(model, lambda p: p.grad)
    opt.step()
    res["params"] = tiny.tensors_by_key(model, lambda p: p)
    return res


def _job(paths: dict[str, str]) -> dict[str, dict]:
    out = {}
    for name, path in paths.items():
        try:
            out[name] = _case(name, path)
        except Exception:
            print(f"failed case: {name}", flush=True)
            raise
    return out


# --------------------------------------------------------------------------- references (this process)
def _unwindowed(ref):
    """The same weights with every layer full (what ignoring the window would compute)."""
    import copy

    full = copy.deepcopy(ref)
    if getattr(full.config, "layer_types", None) is not None:
        full.config.layer_types = ["full_attention"] * full.config.num_hidden_layers  # Qwen2: each layer's kind
    else:
        full.config.sliding_window = None  # Mistral: one kind for every layer
    return full


def _reference(name: str, path: str) -> dict:
    auto, _, seq, _, _, generates = MODELS[name]
    ref = tiny.reference(path, auto)
    out: dict = {"logits": {}}
    with torch.no_grad():
        for side, inputs in _forward_inputs(seq).items():
            out["logits"][side] = ref(**inputs).logits
            # the mask must matter for these inputs, else a pipeline that dropped it would pass
            effect = (ref(input_ids=inputs["input_ids"]).logits - out["logits"][side]).abs()
            effect = effect.amax(dim=tuple(range(1, effect.dim())))  # per row
            assert effect[list(ZERO_ROWS)].min() > 100 * TOL, (
                f"{name} {side}: the mask does not change the all-padding rows {effect.tolist()}"
            )
        if generates:
            out["ids"] = ref.generate(**_gen_inputs(), **GREEDY)
            full = _unwindowed(ref)
            for side, inputs in _forward_inputs(seq).items():
                assert (full(**inputs).logits - out["logits"][side]).abs().max() > 1e-2, (
                    f"{name} {side}: the window does not change the logits"
                )
            assert not torch.equal(full.generate(**_gen_inputs(), **GREEDY), out["ids"]), (
                f"{name}: the window does not change the ids"
            )
    batch = _train_batch(name)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    loss = ref(**batch).loss
    if auto == CAUSAL:
        # the loss is a mean over the whole batch's target tokens: a mean of the one-row microbatches'
        # means differs (and is NaN for a row without targets)
        with torch.no_grad():
            rows = torch.stack([ref(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(ROWS)])
        assert not abs(rows.nanmean() - loss) <= LOSS_RTOL * abs(loss), f"{name}: the loss is a mean of row means"
    loss.backward()
    out["loss"] = float(loss.detach())
    out["grads"] = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    opt.step()
    out["params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _save(directory, name: str) -> str:
    import transformers

    auto, config, *_ = MODELS[name]
    torch.manual_seed(0)
    getattr(transformers, auto).from_config(config()).save_pretrained(directory, max_shard_size="40KB")
    return str(directory)


def _check(name: str, per_rank: list[dict], ref: dict) -> None:
    for r, res in enumerate(per_rank):
        what = f"{name} rank {r} of {WORLD}"
        for (m, side), logits in res["logits"].items():
            want = ref["logits"][side]
            assert logits.shape == want.shape, (
                f"{what}: logits {tuple(logits.shape)} != transformers {tuple(want.shape)}"
            )
            diff = (logits - want).abs().amax(dim=tuple(range(1, want.dim())))  # per row
            assert diff.max() <= TOL, (
                f"{what} {side} padding, {m} microbatches: logits max abs diff per row {diff.tolist()}"
            )
        if "ids" in ref:
            assert torch.equal(res["ids"], ref["ids"]), (
                f"{what}: generated ids\n{res['ids']}\n!= transformers\n{ref['ids']}"
            )
        assert abs(res["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (
            f"{what}: loss {res['loss']} != transformers {ref['loss']}"
        )
        # A gradient that is zero in exact arithmetic (attention key biases: softmax ignores a constant added
        # to every score) is round-off, as large as fp32 epsilon x the model's gradients, not the tensor's.
        floor = torch.finfo(torch.float32).eps * max(g.abs().max().item() for g in ref["grads"].values())
        for key, copies in res["grads"].items():
            want = ref["grads"][key]
            for got in copies:
                diff = (got - want).abs().max().item()
                assert diff <= GRAD_RTOL * want.abs().max().item() + floor, (
                    f"{what}: gradient of {key}: max abs diff {diff:.3g}"
                )
        for key, copies in res["params"].items():
            for got in copies:
                diff = (got - ref["params"][key]).abs().max().item()
                assert diff <= PARAM_ATOL, f"{what}: parameter {key} after an AdamW step: max abs diff {diff:.3g}"
    if name == MIXED:
        assert {"full_attention", "sliding_attention"} in [res["kinds"] for res in per_rank], (
            f"{name}: no rank holds both kinds of layer"
        )
    covered = {k for res in per_rank for k in res["grads"]}
    assert covered == set(ref["grads"]), (
        f"{name}: no rank returned a gradient for {sorted(set(ref['grads']) - covered)}"
    )


def test_three_ranks_equal_transformers_on_odd_batches_empty_rows_and_sliding_windows(tmp_path):
    torch.set_num_threads(1)
    paths = {name: _save(tmp_path / name, name) for name in MODELS}
    refs = {name: _reference(name, path) for name, path in paths.items()}
    per_rank = run_distributed(_job, WORLD, paths, timeout=300)
    for name in MODELS:
        _check(name, [r[name] for r in per_rank], refs[name])
    timing = last_run_timing()
    print(f"3 ranks: start-up {timing.startup_s:.1f} s, run {timing.run_s:.1f} s")
