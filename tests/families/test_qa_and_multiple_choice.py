"""Question-answering and multiple-choice training, and T5EncoderModel, from the recipes, equal transformers.

Every case loads a real checkpoint with the recipe at world 1 (all stages local), 2 and 3 (one
spawned gloo job per world size runs every case) and is compared with transformers on one
process: the outputs of a 13-row padded forward (fp32, within 1e-5: only summation order
differs), and for the trained heads the loss of those outputs (``losses.output_loss``, what
transformers' forward returns with the targets), the loss of a 15-row training step (three
microbatches whose real positions differ, so a mean of microbatch means would be off), every
gradient by parameter name and every parameter after one SGD step. SGD, not Adam: a loss or
gradient off by any factor moves the parameters by that factor too.

Question answering's targets hold positions past the input (ignored, as transformers clamps them)
in different rows for start and end, so the start and end means run over different counts; and a
negative position (clamped to 0, not ignored).
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

ATOL = 1e-5  # fp32 outputs and losses: summation order only
GRAD_RTOL = 1e-4  # gradients and updates, relative to the largest entry of the tensor (a factor 2 is 1.0)
LR = 0.1
FORWARD_ROWS, TRAIN_ROWS, SEQ, CHOICES = 13, 15, 9, 3
MICROBATCHES = 3
NO_DROPOUT = {
    "llama": {},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0},
    "t5": {"dropout_rate": 0.0},
}
QA = "AutoModelForQuestionAnswering"
MC = "AutoModelForMultipleChoice"
ENCODER = "T5EncoderModel"
CASES = [("bert", QA), ("gpt2", QA), ("llama", QA), ("bert", MC), ("t5", ENCODER)]


def _inputs(arch: str, auto: str, rows: int) -> dict[str, torch.Tensor]:
    if auto != MC:
        return tiny.sample_inputs(arch, batch=rows, seq=SEQ, pad_left=arch not in ("bert", "t5"))
    flat = tiny.sample_inputs(arch, batch=rows * CHOICES, seq=SEQ, pad_left=False)
    out = {k: v.view(rows, CHOICES, SEQ) for k, v in flat.items()}  # (B, C, T)
    out["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(rows, CHOICES, SEQ).contiguous()
    return out


def _targets(auto: str, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    if auto == QA:
        start = torch.randint(0, SEQ, (rows,), generator=g)
        end = torch.randint(0, SEQ, (rows,), generator=g)
        # ignored, clamped to 0 (not ignored), ignored, ignored: one start and two end positions ignored
        start[0], start[4], end[7], end[9] = 50, -3, SEQ, 100
        return {"start_positions": start, "end_positions": end[:, None]}  # (B,) and (B, 1), as transformers takes both
    labels = torch.randint(0, CHOICES, (rows,), generator=g)
    labels[2] = -100
    return {"labels": labels}


def _load(path: str, auto: str, load_kwargs: dict):
    from hf_pipeline.model import load_pipelined

    cls = transformers.T5EncoderModel if auto == ENCODER else auto
    return load_pipelined(cls, path, device="cpu", progress=False, split_method="recipe", **load_kwargs)


def _case(path: str, arch: str, auto: str, load_kwargs: dict) -> dict:
    model = _load(path, auto, {"n_microbatches": MICROBATCHES, **load_kwargs})
    out = model(**_inputs(arch, auto, FORWARD_ROWS))
    result = {"class": type(model).__name__, "outputs": {k: v.clone() for k, v in out.items() if torch.is_tensor(v)}}
    if auto == ENCODER:
        return result
    with_targets = model(**_inputs(arch, auto, FORWARD_ROWS), **_targets(auto, FORWARD_ROWS))
    result["forward_loss"] = float(
        with_targets.loss.detach()
    )  # the pipelined forward's own loss, as transformers' forward
    assert all(torch.equal(with_targets[k], v) for k, v in result["outputs"].items())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result["loss"] = float(model.train_step({**_inputs(arch, auto, TRAIN_ROWS), **_targets(auto, TRAIN_ROWS)}))
    key = model.param_layout.key_of
    named = [(key.get(n, n), p) for s in model.stages for n, p in s.named_parameters()]
    result["grads"] = {n: p.grad.clone() for n, p in named if p.grad is not None}
    opt.step()
    result["params"] = {n: p.detach().clone() for n, p in named}
    return result


def _job(cases):
    return [_case(*case) for case in cases]


def _reference(path: str, arch: str, auto: str) -> dict:
    ref = (transformers.T5EncoderModel.from_pretrained(path).eval() if auto == ENCODER else tiny.reference(path, auto))
    with torch.no_grad():
        out = ref(**_inputs(arch, auto, FORWARD_ROWS))
    result = {"outputs": {k: v for k, v in out.items() if torch.is_tensor(v)}}
    if auto == ENCODER:
        return result
    with torch.no_grad():
        result["forward_loss"] = float(ref(**_inputs(arch, auto, FORWARD_ROWS), **_targets(auto, FORWARD_ROWS)).loss)
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss = ref(**_inputs(arch, auto, TRAIN_ROWS), **_targets(auto, TRAIN_ROWS)).loss
    loss.backward()
    result["loss"] = float(loss.detach())
    result["grads"] = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    opt.step()
    result["params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return result


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    diff = (got - want).abs().max().item()
    return diff <= ATOL + GRAD_RTOL * want.abs().max().item(), diff


def _compare(what: str, per_rank: list[dict], want: dict) -> float:
    """Assert every rank's results equal ``want``; returns the largest difference seen."""
    worst = 0.0
    for rank, got in enumerate(per_rank):
        assert set(got["outputs"]) == set(want["outputs"]), f"{what} rank {rank}: outputs {sorted(got['outputs'])}"
        for name, w in want["outputs"].items():
            g = got["outputs"][name]
            assert g.shape == w.shape, f"{what} rank {rank}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
            diff = (g - w).abs().max().item()
            worst = max(worst, diff)
            assert diff <= ATOL, f"{what} rank {rank}: {name} differs by {diff:.2e}"
        if "loss" not in want:
            continue
        for kind in ("forward_loss", "loss"):
            diff = abs(got[kind] - want[kind])
            worst = max(worst, diff)
            assert diff <= ATOL * max(1.0, abs(want[kind])), f"{what} rank {rank}: {kind} {got[kind]} != {want[kind]}"
        for kind in ("grads", "params"):
            for name, g in got[kind].items():
                ok, diff = _close(g, want[kind][name])
                worst = max(worst, diff)
                assert ok, f"{what} rank {rank}: {kind[:-1]} of {name} differs by {diff:.2e}"
    if "loss" in want:
        # Every parameter with a gradient in transformers got one, on some rank (the stages cover the model).
        seen = {n for got in per_rank for n in got["grads"]}
        assert seen == set(want["grads"]), f"{what}: gradients of {sorted(set(want['grads']) ^ seen)} missing or extra"
    print(f"{what}: largest difference {worst:.1e}")  # shown with pytest -s
    return worst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa_mc")
    out = {}
    for arch, auto in CASES:
        if auto == ENCODER:
            torch.manual_seed(0)
            path = root / "t5-encoder"
            transformers.T5EncoderModel(tiny.config_for("t5", **NO_DROPOUT["t5"])).save_pretrained(
                path, max_shard_size="40KB"
            )
            out[arch, auto] = str(path)
        else:
            out[arch, auto] = str(tiny.make_checkpoint(root / f"{arch}-{auto}", arch, auto=auto, **NO_DROPOUT[arch]))
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    return {case: _reference(path, *case) for case, path in checkpoints.items()}


@pytest.mark.dist
def test_qa_mc_and_t5_encoder_at_world_1_2_and_3_equal_transformers(checkpoints, references):
    # World 1: two local stages, run one after another; worlds 2 and 3: one pipeline over the ranks.
    local = [_case(checkpoints[c], *c, {"num_stages": 2, "virtual_stages": 2}) for c in CASES]
    for (arch, auto), got in zip(CASES, local, strict=True):
        assert got["class"] == "PipelinedModel", f"{arch} {auto}: built by the tracer, not the recipe"
        _compare(f"{arch} {auto} world 1", [got], references[arch, auto])
    for world in (2, 3):
        cases = [(checkpoints[c], *c, {}) for c in CASES]
        per_rank = run_distributed(_job, world, cases, timeout=600)
        for i, (arch, auto) in enumerate(CASES):
            _compare(f"{arch} {auto} world {world}", [results[i] for results in per_rank], references[arch, auto])


def test_losses_add_up_to_transformers_loss_function_over_microbatches():
    # Each loss's microbatch shares (divided by the whole batch's count) add up to the full batch's
    # loss as transformers' own loss functions compute it; wrong by a factor 2 if a share were a mean.
    from transformers.loss.loss_utils import LOSS_MAPPING

    from hf_pipeline.families.losses import get_loss

    g = torch.Generator().manual_seed(0)
    cfg = tiny.config_for("llama", num_labels=3)
    logits = torch.randn(6, 5, 7, generator=g)
    tokens = torch.randint(0, 7, (6, 5), generator=g).masked_fill(torch.rand(6, 5, generator=g) < 0.4, -100)
    classes = torch.randint(0, 3, (6, 5), generator=g).masked_fill(tokens == -100, -100)
    start, end = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    sp, ep = torch.tensor([0, 9, 2, 4, 1, -1]), torch.tensor([5, 3, 1, 7, 4, 2])  # 1 and 2 ignored
    cases = {
        "causal_lm": ((logits,), tokens, LOSS_MAPPING["ForCausalLM"](logits, tokens, vocab_size=7)),
        "masked_lm": ((logits,), tokens, LOSS_MAPPING["ForMaskedLM"](logits, tokens, vocab_size=7)),
        "token_classification": (
            (logits[..., :3],),
            classes,
            LOSS_MAPPING["ForTokenClassification"](logits[..., :3], classes, cfg),
        ),
        "question_answering": (
            (start, end),
            get_loss("question_answering").make_targets({"start_positions": sp, "end_positions": ep}, 5),
            LOSS_MAPPING["ForQuestionAnswering"](start, end, sp, ep),
        ),
    }
    for name, (outputs, targets, want) in cases.items():
        fn = get_loss(name)
        denominator = fn.denominator(targets, cfg)
        parts = [
            fn.share(tuple(o[i : i + 2] for o in outputs), targets[i : i + 2], cfg, denominator) for i in range(0, 6, 2)
        ]
        got = torch.stack(parts).sum()
        # fp32 loss shares of three microbatches (sums near 4, where one ulp is 4.8e-7): summation order gives a
        # few ulps, so 1e-5 relative; a wrong denominator moves the sum by >= 30%.
        assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item())), (
            f"{name}: microbatch shares add up to {got.item()} != {want.item()}"
        )
