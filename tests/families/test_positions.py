"""Sequences past ``max_position_embeddings``: rotary models run them as transformers does, learned tables refuse.

transformers runs LLaMA-family models (rotary positions, with or without rope scaling) on inputs
longer than ``config.max_position_embeddings`` — its rope-scaling tests do exactly that — and only
reminds once when ``generate`` goes past it. The pipeline must give the same logits and tokens
there; GPT-2 and BERT (learned position tables) cannot, and are refused (``test_bad_inputs``).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

# fp32 logits: summation order moves them ~1e-6 in the tiny models (hidden 32-64); a wrong weight, mask, cache or
# position moves them by 1e-2 or more.
TOL = 1e-5
LONG = 150  # > max_position_embeddings = 128 of the tiny configs
ROPES = {
    "default": {},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0}},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("positions")
    return {name: str(tiny.make_checkpoint(root / name, "llama", **kw)) for name, kw in ROPES.items()}


def _reference(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs = tiny.sample_inputs("llama", batch=4, seq=LONG)
    prompts = tiny.sample_inputs("llama", batch=4, seq=120, seed=2)
    with torch.no_grad():
        logits = ref(**inputs).logits
        ids = ref.generate(**prompts, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    return logits, ids


def _pipelined(path: str) -> dict:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, n_microbatches=2
    )
    inputs = tiny.sample_inputs("llama", batch=4, seq=LONG)
    prompts = tiny.sample_inputs("llama", batch=4, seq=120, seed=2)
    return {
        "logits": model(**inputs).logits,
        "ids": model.generate(**prompts, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None),
    }


def _job(paths: list[str]) -> list[dict]:
    return [_pipelined(p) for p in paths]


def _check(got: dict, path: str, what: str) -> None:
    logits, ids = _reference(path)
    assert got["logits"].shape == logits.shape, what
    diff = (got["logits"] - logits).abs().max().item()
    assert diff <= TOL, f"{what}: max abs logits diff {diff}"
    assert torch.equal(got["ids"], ids), what


@pytest.mark.equiv  # every rope kind over 150 positions: about 10 s on 2 shared cores
def test_rope_positions_past_max_position_embeddings_equal_transformers_on_one_process(checkpoints):
    for name, path in checkpoints.items():
        _check(_pipelined(path), path, f"{name} rope, 1 process")
    # The rope type matters past the trained length: the two references differ there, so the
    # comparison above would catch a pipeline that ignored the scaling.
    default, _ = _reference(checkpoints["default"])
    dynamic, _ = _reference(checkpoints["dynamic"])
    assert (default[:, -1] - dynamic[:, -1]).abs().max().item() > 10 * TOL


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_rope_positions_past_max_position_embeddings_equal_transformers_across_ranks(checkpoints, world):
    names = list(checkpoints)
    per_rank = run_distributed(_job, world, [checkpoints[n] for n in names], timeout=300)
    for rank, results in enumerate(per_rank):
        for name, got in zip(names, results, strict=True):
            _check(got, checkpoints[name], f"{name} rope, rank {rank} of {world}")
