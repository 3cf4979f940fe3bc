"""lm-eval's ``local-completions`` model (``LocalCompletionsAPI``, unpatched) against a live ``hf-pipeline serve``
of the bundled tiny LLaMA at 2 ranks, against ``HFLM`` on the transformers model on one process: the same
``loglikelihood``, ``loglikelihood_rolling`` and greedy ``generate_until`` requests as test_lm_eval.py.

lm-eval sends the requests as token ids (``tokenized_requests``, its default) from the model's own tokenizer
folder (``tokenizer_backend="huggingface"``: nothing reaches the hub), several prompts per request
(``batch_size``), log-likelihoods as ``echo=True, logprobs=1, max_tokens=1``, generations with its stop
sequences as ``stop``.
"""

from __future__ import annotations

import pytest
import transformers
from live_server import start_server
from test_lm_eval import LL_ATOL, _evaluate, _requests

from hf_pipeline.tools.default_model import default_model_path

pytest.importorskip("lm_eval")
pytest.importorskip("aiohttp")  # lm-eval[api]

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a server of 2 processes


def _through_the_server(url: str) -> dict:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions", model="tiny", tokenizer=str(default_model_path()),
        tokenizer_backend="huggingface", tokenized_requests=True, batch_size=3, max_retries=1, timeout=120,
    )
    ll, rolling, gen = _requests()
    return {
        "loglikelihood": lm.loglikelihood(ll, disable_tqdm=True),
        "rolling": lm.loglikelihood_rolling(rolling, disable_tqdm=True),
        "generate_until": lm.generate_until(gen, disable_tqdm=True),
    }


def test_local_completions_against_the_server_equals_hflm_on_transformers(tmp_path):
    server = start_server(default_model_path(), tmp_path / "server.log", "--max-batch", "4")
    try:
        server.wait_up()
        got = _through_the_server(server.url)
    finally:
        server.stop()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_path())).eval()
    want = _evaluate(ref)
    assert len(got["loglikelihood"]) == len(want["loglikelihood"])
    for i, ((value, greedy), (ref_value, ref_greedy)) in enumerate(zip(got["loglikelihood"], want["loglikelihood"])):
        assert value == pytest.approx(ref_value, abs=LL_ATOL), f"loglikelihood {i}"
        assert greedy == ref_greedy, f"is_greedy {i}"
    assert got["rolling"] == pytest.approx(want["rolling"], abs=LL_ATOL), "loglikelihood_rolling"
    assert got["generate_until"] == want["generate_until"], "generate_until"
