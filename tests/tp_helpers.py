"""The run a tensor-parallel test compares: the same forward, greedy generate and AdamW steps on a
pipelined model and on transformers on one process, and the checks between them.

:func:`exercise` runs the sequence on either (``pipelined`` picks ``train_step`` / ``clip_grad_norm_``
or transformers' own loss and ``torch.nn.utils.clip_grad_norm_``); :func:`compare` checks one
pipelined rank's results against the reference's.
"""

from __future__ import annotations

import tiny
import torch

LR, EPS, STEPS, NEW = 1e-3, 1e-5, 2, 5


def gathered(model) -> dict[str, torch.Tensor]:
    """Every local parameter by checkpoint key, whole (collective over the tensor-parallel ranks)."""
    from hf_pipeline.distributed.shards import full_tensor

    out = {}
    for stage in model.stages:
        for name, p in stage.named_parameters():
            out[model.param_layout.key_of.get(name, name)] = full_tensor(p.detach()).clone()
    return out


def _prompt(arch: str) -> dict[str, torch.Tensor]:
    prompt = tiny.sample_inputs(arch, batch=2, seq=6)
    prompt.pop("decoder_input_ids", None)  # a seq2seq prompt is the encoder's
    return prompt


def exercise(model, arch: str, *, pipelined: bool, generate: bool = True, rows: int = 3) -> dict:
    """Logits of a padded batch of ``rows``, greedy tokens (``generate``), then ``STEPS`` AdamW steps with
    the gradients clipped to norm 1: losses, norms and every parameter after them, by checkpoint key."""
    out = {}
    with torch.no_grad():
        out["logits"] = model(**tiny.sample_inputs(arch, batch=rows, seq=9)).logits
    if generate:
        out["tokens"] = model.generate(**_prompt(arch), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out["losses"], out["norms"] = [], []
    for step in range(STEPS):
        batch = tiny.make_batch(arch, 8, seed=step + 1)
        if pipelined:
            out["losses"].append(float(model.train_step(batch)))
            out["norms"].append(float(model.clip_grad_norm_(1.0)))
        else:
            loss = model(**batch).loss
            loss.backward()
            out["losses"].append(float(loss.detach()))
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    model.eval()
    out["params"] = gathered(model) if pipelined else {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def compare(what: str, res: dict, ref: dict, *, logits_tol: float = 1e-5, param_tol: float = 1e-5) -> None:
    """``res`` (one pipelined rank) equals ``ref`` (transformers): logits within ``logits_tol``, the same
    greedy tokens, losses and norms within 1e-5 relative, every parameter within ``param_tol``."""
    diff = (res["logits"] - ref["logits"]).abs().max().item()
    assert diff <= logits_tol, f"{what}: logits max abs diff {diff}"
    if "tokens" in ref:
        assert torch.equal(res["tokens"], ref["tokens"]), f"{what}: greedy tokens {res['tokens']} != {ref['tokens']}"
    for got, want in zip(res["losses"] + res["norms"], ref["losses"] + ref["norms"], strict=True):
        # fp32 losses and grad norms, relative: summation order ~1e-6 (sharded matmuls reorder sums); a wrong
        # shard or dropped microbatch moves them >= 1e-2.
        assert abs(got - want) <= 1e-5 * abs(want), (
            f"{what}: losses/norms {res['losses']} {res['norms']} != {ref['losses']} {ref['norms']}"
        )
    assert res["params"].keys() <= ref["params"].keys(), sorted(res["params"].keys() - ref["params"].keys())
    for key, got in res["params"].items():
        want = ref["params"][key]
        assert got.shape == want.shape, f"{what}: {key} gathered shape {tuple(got.shape)}"
        d = (got - want).abs().max().item()
        assert d <= param_tol, f"{what}: parameter {key} after {STEPS} AdamW steps: max abs diff {d}"
