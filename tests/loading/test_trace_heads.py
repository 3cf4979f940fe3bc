"""Task heads of families without a recipe train through the tracer: OPT question answering (two
targets) and BLOOM token classification at 2 ranks, loss, every gradient and parameters after an SGD step
equal to transformers on one process."""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

pytestmark = pytest.mark.dist  # every test here starts other processes

ROWS, SEQ, LR = 8, 9, 0.5


_COMMON = dict(vocab_size=tiny.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(auto: str):
    if auto == "AutoModelForQuestionAnswering":
        return transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **_COMMON,
        )
    return transformers.BloomConfig(
        hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, num_labels=3, **_COMMON
    )


def _batch(auto: str) -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs("llama", batch=ROWS, seq=SEQ)
    g = torch.Generator().manual_seed(7)
    if auto == "AutoModelForQuestionAnswering":
        start = torch.randint(0, SEQ, (ROWS,), generator=g)
        end = torch.randint(0, SEQ + 3, (ROWS,), generator=g)  # some past the end: ignored, as transformers clamps them
        return {**inputs, "start_positions": start, "end_positions": end}
    labels = torch.randint(0, 3, (ROWS, SEQ), generator=g).masked_fill(inputs["attention_mask"] == 0, -100)
    return {**inputs, "labels": labels}


def _step(path: str, auto: str) -> dict:
    import hf_pipeline

    model = getattr(hf_pipeline, auto).from_pretrained(
        path, pipeline=True, device="cpu", progress=False, split_method="trace", n_microbatches=4
    )
    loss = float(model.train_step(_batch(auto)))
    grads = {n: p.grad.clone() for n, p in model.checkpoint_named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {
        "loss": loss,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()},
        "class": type(model).__name__,
    }


def _job(cases):
    return [_step(*c) for c in cases]


@pytest.mark.parametrize("world", [2])
def test_traced_qa_and_token_classification_train_as_transformers(tmp_path, world):
    cases, refs = [], []
    for auto in ("AutoModelForQuestionAnswering", "AutoModelForTokenClassification"):
        path = tmp_path / auto
        torch.manual_seed(0)
        getattr(transformers, auto).from_config(_config(auto)).save_pretrained(path, max_shard_size="40KB")
        ref = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32).train()
        loss = ref(**_batch(auto)).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        refs.append((float(loss.detach()), grads, {n: p.detach().clone() for n, p in ref.named_parameters()}))
        cases.append((str(path), auto))
    for per_rank in run_distributed(_job, world, cases, timeout=240):  # each rank: one result per case
        for res, (loss, grads, params), (_, auto) in zip(per_rank, refs, cases, strict=True):
            assert res["class"] == "TracedPipelinedModel"
            # fp32 loss and gradients (relative), params after the step (absolute): summation order ~1e-6;
            # a wrong head, label shift or gradient (2x is 100%) moves them by 1e-2 or more.
            assert res["loss"] == pytest.approx(loss, rel=1e-5), auto
            assert res["grads"], auto
            for n, g in res["grads"].items():
                scale = float(grads[n].abs().max()) or 1.0
                assert float((g - grads[n]).abs().max()) <= 1e-5 * scale + 1e-7, (auto, n)
            for n, p in res["params"].items():
                moved = float((params[n] - p).abs().max())
                assert moved <= 1e-5, (auto, n, moved)
    # the step moved the weights (a test of parameters after a step that did nothing could not fail)
    assert any(float(g.abs().max()) * LR > 1e-3 for g in refs[0][1].values())
