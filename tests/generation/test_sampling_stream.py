"""Sampling without a seed is transformers' sampling: the same tokens after the same ``torch.manual_seed``.

transformers' ``generate(do_sample=True)`` draws every step's tokens with one ``torch.multinomial`` over the whole
batch from torch's global stream. The pipelined ``generate`` without ``seed`` draws the same numbers on its last
stage, a step's block at a time (``sampling.step_noise``), and leaves every rank's stream where one process's ends.

Checked against transformers on one process after the same ``manual_seed``: two calls in a row (the second starts
from the stream the first left, on every rank), each a batch with left padding whose rows end at different steps
(several EOS ids drawn at a high temperature; top-k, top-p and a repetition penalty), and ``num_return_sequences``
copies; then the stream itself (a draw after the calls is one process's). Layouts: pp=2 with 1 and 3 microbatches, 2
stages per rank (V layout) with chunked prefill, pp=3, pp=2 x dp=2 (each replica draws the whole batch's block and
keeps its rows), pp=2 x tp=2, a Mixtral's replicas in lock step (experts over them), and T5 at pp=2. A stream off by
one row, one step, a step drawn for no row or a rank left on its own stream changes tokens at once (the calls' rows
are sampled at temperature 1.5 over a vocabulary of 96).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

pytestmark = pytest.mark.dist

SAMPLING = dict(do_sample=True, temperature=1.5, top_k=60, top_p=0.95, repetition_penalty=1.1, max_new_tokens=10,
                pad_token_id=0, eos_token_id=[2, 5, 7, 11, 13, 17])
LAYOUTS = {  # name -> (checkpoint, world size, load options, generate options)
    "pp2": ("llama", 2, {}, {}),
    "pp2, 3 microbatches": ("llama", 2, {}, {"n_microbatches": 3}),
    "v2, chunked prefill": ("llama", 2, {"num_stages": 4, "virtual_stages": 2}, {"prefill_chunk_size": 3}),
    "pp3": ("llama", 3, {}, {}),
    "pp2 x dp2": ("llama", 4, {"num_stages": 2}, {}),
    "pp2 x tp2": ("llama", 4, {"num_stages": 2, "tp_size": 2}, {}),
    # experts over the replicas: their rings step together, finished rows padded until every replica's are done
    "dp2 lock step": ("mixtral", 2, {"num_stages": 1, "ep_size": 2, "ep_over": "data"}, {}),
    "t5 pp2": ("t5", 2, {}, {}),  # an encoder-decoder: the decoder's last stage draws
}
_NEW = {"llama": 7, "mixtral": 7, "t5": 1}  # where the generated part starts (T5: after the decoder start token)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, tiny.VOCAB, (6, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[3, :1] = 0  # left padding
    return ids, mask


def _calls(model, extra: dict) -> dict:
    ids, mask = _inputs()
    torch.manual_seed(21)
    first = model.generate(input_ids=ids, attention_mask=mask, **SAMPLING, **extra)
    second = model.generate(input_ids=ids[:4], attention_mask=mask[:4], num_return_sequences=2, **SAMPLING, **extra)
    return {"first": first, "second": second, "after": torch.rand(4)}


def _rank(path: str, auto: str, options: dict, extra: dict) -> dict:
    import hf_pipeline

    model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, progress=False, **options)
    return _calls(model, extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    import transformers
    from decoders import decoder_config

    root = tmp_path_factory.mktemp("stream")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config("mixtral")).save_pretrained(root / "mixtral")
    return {"llama": tiny.make_checkpoint(root / "llama", "llama"), "mixtral": root / "mixtral",
            "t5": tiny.make_checkpoint(root / "t5", "t5")}


def _auto(kind: str) -> str:
    return "AutoModelForSeq2SeqLM" if kind == "t5" else "AutoModelForCausalLM"


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    out = {kind: _calls(tiny.reference(path, _auto(kind)), {}) for kind, path in checkpoints.items()}
    for kind, calls in out.items():
        lengths = (calls["first"][:, _NEW[kind]:] != 0).sum(1)
        assert len(set(lengths.tolist())) > 1, "rows should end at different steps"  # EOS drawn, then pad
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sampling_without_a_seed_equals_transformers(checkpoints, references, layout):
    kind, world, options, extra = LAYOUTS[layout]
    reference = references[kind]
    for rank, got in enumerate(run_distributed(_rank, world, str(checkpoints[kind]), _auto(kind), options, extra)):
        for key in ("first", "second"):
            assert torch.equal(got[key], reference[key]), f"{layout} rank {rank}: {key} call"
        assert torch.equal(got["after"], reference["after"]), f"{layout} rank {rank}: the stream after the calls"


def test_a_seed_still_gives_its_own_stream(checkpoints):
    """``seed=`` samples the per-row streams (the same at every layout): not the global stream's tokens, and the
    global stream left untouched."""
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(checkpoints["llama"], pipeline=True, progress=False,
                                                             num_stages=2, virtual_stages=2)
    ids, mask = _inputs()
    torch.manual_seed(21)
    seeded = model.generate(input_ids=ids, attention_mask=mask, seed=5, **SAMPLING)
    after = torch.rand(4)
    torch.manual_seed(21)
    assert torch.equal(after, torch.rand(4))
    torch.manual_seed(21)
    drawn = model.generate(input_ids=ids, attention_mask=mask, **SAMPLING)
    assert not torch.equal(seeded, drawn)
