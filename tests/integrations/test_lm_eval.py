"""lm-eval's ``HFLM`` on a pipelined model, unpatched, at 2 ranks, against ``HFLM`` on the transformers model
on one process: ``loglikelihood``, ``loglikelihood_rolling`` and greedy ``generate_until`` on the bundled
tiny LLaMA and its tokenizer (a local folder: nothing reaches the hub).

Every rank builds its own ``HFLM(pretrained=<pipelined model>)`` and runs the same requests: lm-eval then
sees one process (it does no data-parallel split for a model object), which is what the pipelined model
needs (every call is collective). batch_size=3 with n_microbatches=2 gives batches that do not split
evenly and a last batch of one row, which the pipeline pads.
"""

from __future__ import annotations

import math

import pytest
import transformers
from harness import run_distributed

from hf_pipeline.tools.default_model import default_model_path

pytest.importorskip("lm_eval")

CONTEXTS = ["Return the", "This module provides a way to", "If the file does not exist, the function", "def"]
CONTINUATIONS = [" value", " read the file", " returns None", " main():"]
TEXTS = ["The function returns the value of the file.", "import os\nimport sys", "Return the path of the file", "def"]
# Log-likelihoods are sums of log_softmax over a few tokens of fp32 logits; the pipeline runs the same ops in
# a different batch split (padded rows, microbatches), which moves each logit by ~1e-6 and a sum by ~1e-5.
# 1e-4 allows that; a shifted position or a wrong row moves a sum by > 0.1.
LL_ATOL = 1e-4


def _requests():
    from lm_eval.api.instance import Instance

    def make(kind, args):
        return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]

    until = {"until": ["\n\n", "def "], "max_gen_toks": 12, "do_sample": False}
    # The last pair is the model's greedy continuation (is_greedy True); the others are not.
    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS[:2]] + list(zip(CONTEXTS, CONTINUATIONS))
    pairs.append(("Return the", " same."))
    return (
        make("loglikelihood", pairs),
        make("loglikelihood_rolling", [(t,) for t in TEXTS]),
        make("generate_until", [(c, dict(until)) for c in CONTEXTS] + [("Return the", {"max_gen_toks": 5})]),
    )


def _evaluate(model) -> dict:
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=str(default_model_path()), batch_size=3)
    ll, rolling, gen = _requests()
    return {
        "loglikelihood": lm.loglikelihood(ll, disable_tqdm=True),
        "rolling": lm.loglikelihood_rolling(rolling, disable_tqdm=True),
        "generate_until": lm.generate_until(gen, disable_tqdm=True),
    }


def _pipelined_rank():
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        str(default_model_path()), pipeline=True, n_microbatches=2, progress=False
    )
    rows: list[int] = []  # the batch of every forward lm-eval makes, to show a batch of fewer rows than microbatches
    model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    return {**_evaluate(model), "forward_rows": rows}


@pytest.mark.dist
@pytest.mark.slow
def test_hflm_on_a_pipelined_model_equals_hflm_on_transformers():
    results = run_distributed(_pipelined_rank, 2, timeout=300)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_path())).eval()
    want = _evaluate(ref)
    assert all(math.isfinite(v) and v < 0 for v, _ in want["loglikelihood"])
    assert [greedy for _, greedy in want["loglikelihood"]] == [False] * 12 + [True]
    assert any(want["generate_until"]), "the reference generated nothing: the comparison would be empty"
    for rank, got in enumerate(results):
        assert 1 in got["forward_rows"] and 3 in got["forward_rows"], f"rank {rank}: batches {got['forward_rows']}"
        for (value, greedy), (ref_value, ref_greedy) in zip(got["loglikelihood"], want["loglikelihood"]):
            assert value == pytest.approx(ref_value, abs=LL_ATOL), f"rank {rank} loglikelihood"
            assert greedy == ref_greedy, f"rank {rank} is_greedy"
        assert got["rolling"] == pytest.approx(want["rolling"], abs=LL_ATOL), f"rank {rank} loglikelihood_rolling"
        assert got["generate_until"] == want["generate_until"], f"rank {rank} generate_until"
