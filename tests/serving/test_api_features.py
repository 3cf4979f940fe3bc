"""The OpenAI API features clients need (lm-eval's local-completions, guidellm, the openai client), in one
process on the bundled tiny LLaMA, each against transformers: unknown fields and text content parts in the
protocol; ``ignore_eos``, ``min_tokens`` and the EOS counted in ``usage`` in the continuous engine;
``logprobs`` (chosen tokens, top alternatives) against ``generate(output_scores=True)`` and ``echo``
against a forward pass's ``log_softmax``, through the app."""

from __future__ import annotations

import copy

import pytest
import test_engine
import torch
import transformers

from hf_pipeline.errors import ServingRequestError
from hf_pipeline.serving import CompletionRequest, Engine
from hf_pipeline.serving.protocol import parse_chat, parse_completion
from hf_pipeline.tools.default_model import CHAT_TEMPLATE, default_model_path

PROMPT = "If the file does not exist, the function"
# Log-probabilities: the ring runs the same fp32 ops as transformers on rows padded and batched with
# others, which moves logits by ~1e-6 (values of order 10); 1e-4 allows that. A wrong position, a
# missing processor (temperature) or the raw logits where processed ones belong move them by > 1e-2.
LOGPROB_ATOL = 1e-4
bundled = test_engine.bundled  # the bundled model, its tokenizer and transformers' copy (a module fixture)
_run = test_engine._run  # rounds in this thread until the handles are done


def _greedy(ref, ids: list[int], n: int, **kw) -> list[int]:
    return ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)[0, len(ids) :].tolist()


def _greedy_on(ref, ids: list[int], n: int) -> list[int]:
    """transformers' argmax continuation that no EOS stops (what ``ignore_eos`` generates)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, ref(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids) :].tolist()


def test_unknown_fields_stream_options_and_content_parts(bundled):
    tok = copy.deepcopy(bundled[0])
    tok.chat_template = CHAT_TEMPLATE
    body = {"model": "m", "prompt": "Return the", "max_tokens": 4}
    with pytest.raises(ServingRequestError) as e:
        parse_completion({**body, "zeta": 1, "alpha": 2}, tok, model_name="m")
    assert e.value.param == "alpha" and "alpha, zeta" in str(e.value) and "Unrecognized" in str(e.value)
    with pytest.raises(ServingRequestError) as e:  # a chat field on the completions route
        parse_completion({**body, "messages": []}, tok, model_name="m")
    assert e.value.param == "messages"
    with pytest.raises(ServingRequestError) as e:
        parse_completion({**body, "stream_options": {"include_usage": True}}, tok, model_name="m")
    assert e.value.param == "stream_options"
    assert parse_completion(
        {**body, "stream": True, "stream_options": {"include_usage": True}}, tok, model_name="m"
    ).include_usage
    # Text parts are joined as OpenAI joins them: the same prompt ids as the string.
    chat = {"model": "m", "messages": [{"role": "user", "content": "Return the file"}]}
    parts = [{"type": "text", "text": "Return "}, {"type": "text", "text": "the file"}]
    as_parts = parse_chat({**chat, "messages": [{"role": "user", "content": parts}]}, tok, model_name="m")
    assert as_parts.requests[0].prompt_ids == parse_chat(chat, tok, model_name="m").requests[0].prompt_ids
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(ServingRequestError) as e:
        parse_chat({**chat, "messages": [{"role": "user", "content": [*parts, image]}]}, tok, model_name="m")
    assert e.value.param == "messages" and "'image_url'" in str(e.value)
    req = parse_completion({**body, "logit_bias": {"7": 5}, "presence_penalty": 1}, tok, model_name="m").requests[0]
    assert req.logit_bias == {7: 5.0} and req.presence_penalty == 1.0
    for bad in ({"min_tokens": 9}, {"logprobs": 21}, {"echo": True}, {"ignore_eos": "yes"}, {"presence_penalty": 3},
                {"logit_bias": {"x": 1}}, {"repetition_penalty": 0}):
        with pytest.raises(ServingRequestError) as e:
            parse_completion({**body, **bad}, tok, model_name="m")
        assert e.value.param == next(iter(bad)), bad


@pytest.mark.equiv
def test_ignore_eos_min_tokens_and_the_eos_counted(bundled):
    tok, model, ref = bundled
    ids = tok(PROMPT)["input_ids"]
    full = _greedy_on(ref, ids, 12)
    eos = full[3]  # the model's EOS made the 4th greedy token (its own EOS never comes at this size)
    engine = Engine(model, tok)
    engine.eos = {eos}
    plain = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=12))
    ignored = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=12, ignore_eos=True))
    least = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=12, min_tokens=6))
    _run(engine, [plain, ignored, least])
    got = plain.result()[0]
    assert got.token_ids == full[:3] and got.finish_reason == "stop" and got.completion_tokens == 4
    got = ignored.result()[0]
    assert got.token_ids == full and got.completion_tokens == 12  # the EOS is a token like any other
    assert got.finish_reason == "length"
    # transformers' own min_new_tokens with that EOS.
    expected = _greedy(ref, ids, 12, min_new_tokens=6, eos_token_id=eos)
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    got = least.result()[0]
    assert eos not in expected[:6] and got.completion_tokens == len(expected)
    assert got.token_ids == [t for t in expected if t != eos]
    # A completion ending at once on EOS: no text, one completion token.
    engine = Engine(model, tok)
    engine.eos = {full[0]}
    at_once = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=5))
    _run(engine, [at_once])
    got = at_once.result()[0]
    assert (got.token_ids, got.text, got.completion_tokens, got.finish_reason) == ([], "", 1, "stop")


def test_static_rounds_refuse_what_only_the_ring_serves(bundled):
    tok, model, _ = bundled
    engine = Engine(model, tok, batching="static")
    for kw in ({"ignore_eos": True}, {"min_tokens": 1}, {"logprobs": 0}, {"repetition_penalty": 1.2}):
        with pytest.raises(ServingRequestError) as e:
            engine.submit(CompletionRequest(prompt_ids=[5, 6], max_new_tokens=4, **kw))
        assert e.value.param == next(iter(kw)) and "static" in str(e.value)


def _reference_logprobs(ref, ids: list[int], n: int, k: int, **kw):
    """transformers: the greedy tokens, their log-probabilities and the top-k of each step's processed scores."""
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, output_scores=True, return_dict_in_generate=True, **kw)
    chosen = ref.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    top = [torch.topk(torch.log_softmax(s[0].float(), -1), k) for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), chosen, top


def test_logprobs_and_echo_equal_transformers(bundled):
    tok, model, ref = bundled
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = CHAT_TEMPLATE
    engine = Engine(model, tok, idle_s=0.05)
    with test_engine.app_client(engine, chat_tok) as client:
        ids = tok(PROMPT)["input_ids"]
        base = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0}
        # Bad bodies first: each a 400, and the engine serves the next request.
        for bad in (
            {"logprobs": True},
            {"echo": True},
            {"frobnicate": 1},
            {"echo": True, "logprobs": 1, "stream": True},
        ):
            r = client.post("/v1/completions", json={**base, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
        tokens, chosen, top = _reference_logprobs(ref, ids, 6, 3, do_sample=False)
        r = client.post("/v1/completions", json={**base, "logprobs": 3})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [tok.decode([t]) for t in tokens]
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"], dtype=torch.float64), chosen.double(), atol=LOGPROB_ATOL, rtol=0
        )
        for got, (values, indices) in zip(lp["top_logprobs"], top):
            assert all(tok.decode([int(i)]) in got for i in indices)
            torch.testing.assert_close(
                torch.tensor(sorted(got.values(), reverse=True)[:3], dtype=torch.float64),
                values.double(),
                atol=LOGPROB_ATOL,
                rtol=0,
            )
        # Sampling: log_softmax of the logits after the temperature, at the tokens drawn.
        sampled = (
            engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=6, temperature=0.7, seed=3, logprobs=0))
            .result(timeout=60)[0]
            .logprobs
        )
        drawn = [e.token for e in sampled]
        with torch.no_grad():
            logits = ref(torch.tensor([ids + drawn])).logits[0, len(ids) - 1 : -1].float()  # (6, V)
        # transformers' sampling processors: the temperature, then its default top_k of 50.
        warped = transformers.TopKLogitsWarper(50)(None, transformers.TemperatureLogitsWarper(0.7)(None, logits))
        warm = torch.log_softmax(warped, -1).gather(1, torch.tensor(drawn)[:, None])[:, 0].double()
        torch.testing.assert_close(
            torch.tensor([e.logprob for e in sampled], dtype=torch.float64), warm, atol=LOGPROB_ATOL, rtol=0
        )
        # Chat: logprobs true with top_logprobs, OpenAI's shape.
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        chat_ids = chat_tok.apply_chat_template(
            chat["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
        _, chosen, _ = _reference_logprobs(ref, list(chat_ids), 4, 2, do_sample=False)
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [len(c["top_logprobs"]) for c in content] == [2] * len(content)
        torch.testing.assert_close(
            torch.tensor([c["logprob"] for c in content], dtype=torch.float64),
            chosen[: len(content)].double(),
            atol=LOGPROB_ATOL,
            rtol=0,
        )
        # echo: what lm-eval's loglikelihood sends (echo, logprobs=1, max_tokens=1): the prompt's tokens'
        # log-probabilities from a forward pass, then the one generated token's.
        with torch.no_grad():
            forward = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)  # (T, V)
        expected = forward[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
        for max_tokens in (1, 0):
            r = client.post("/v1/completions", json={**base, "echo": True, "logprobs": 1, "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
            torch.testing.assert_close(
                torch.tensor(lp["token_logprobs"][1 : len(ids)], dtype=torch.float64),
                expected,
                atol=LOGPROB_ATOL,
                rtol=0,
            )
            assert choice["text"].startswith(tok.decode(ids)) and usage["completion_tokens"] == max_tokens
            # lm-eval's greedy check: each prompt token's logprob against the best of its top_logprobs.
            assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
        assert lp["token_logprobs"][len(ids) - 1] == pytest.approx(float(expected[-1]), abs=LOGPROB_ATOL)


def test_presence_frequency_penalty_is_openais_formula():
    from hf_pipeline.generation.penalties import PresenceFrequencyPenalty

    scores = torch.zeros(1, 6)
    ids = torch.tensor([[4, 4, 1, 2, 2, 2]])  # prompt [4, 4] is not counted; then 1 once and 2 three times
    got = PresenceFrequencyPenalty(prompt_length=2, presence=0.5, frequency=0.25)(ids, scores)
    assert got.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0, 0.0]]


@pytest.mark.equiv
def test_penalties_and_logit_bias_equal_transformers(bundled):
    from hf_pipeline.generation.penalties import PresenceFrequencyPenalty

    tok, model, ref = bundled
    ids = tok(PROMPT)["input_ids"]
    full = _greedy_on(ref, ids, 10)
    cases = [  # (request fields, transformers' generate arguments)
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"logit_bias": {full[1]: -100.0, 7: 5.0}}, {"sequence_bias": [[[full[1]], -100.0], [[7], 5.0]]}),
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
         {"logits_processor": [PresenceFrequencyPenalty(len(ids), presence=1.5, frequency=0.7)]}),
    ]
    engine = Engine(model, tok)
    engine.eos = set()  # every row runs its 10 tokens, as transformers' below with no EOS
    handles = [engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=10, logprobs=0, **kw))
               for kw, _ in cases + [({}, {})]]
    _run(engine, handles)
    plain = [e.logprob for e in handles[-1].result()[0].logprobs]
    for (kw, hf), h in zip(cases, handles):
        # transformers' generate with those processors, stopping on no token (a vocabulary id never chosen);
        # the processed scores' log-probabilities show each penalty even where the argmax stays.
        tokens, chosen, _ = _reference_logprobs(ref, ids, 10, 1, do_sample=False,
                                                eos_token_id=model.config.vocab_size - 1, **hf)
        got = h.result()[0]
        assert got.token_ids == tokens, kw
        lp = torch.tensor([e.logprob for e in got.logprobs], dtype=torch.float64)
        torch.testing.assert_close(lp, chosen.double(), atol=LOGPROB_ATOL, rtol=0)
        assert (lp - torch.tensor(plain, dtype=torch.float64)).abs().max() > 1e-2, kw  # the penalty acted


def test_the_bundled_model_chats_out_of_the_box():
    # Chat clients (guidellm's default route) need a chat template: the bundled tokenizer carries one.
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    assert tok.chat_template == CHAT_TEMPLATE and text == f"user: {PROMPT}\nassistant:"


def test_metrics_count_what_the_server_answered(bundled):
    from prometheus_client.parser import text_string_to_metric_families

    tok, model, _ = bundled
    engine = Engine(model, tok, idle_s=0.05)
    with test_engine.app_client(engine, tok) as client:
        good = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        r = client.post("/v1/completions", json=good)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert client.post("/v1/completions", json={**good, "zeta": 1}).status_code == 400
        streamed = client.post("/v1/completions", json={**good, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        scraped = client.get("/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped.text) for s in family.samples}
    # two answered (one whole, one streamed: the same greedy tokens), one refused before submission
    assert samples[("hf_pipeline_requests_total", (("status", "200"),))] == 2
    assert samples[("hf_pipeline_requests_total", (("status", "400"),))] == 1
    assert samples[("hf_pipeline_generation_tokens_total", ())] == 2 * usage["completion_tokens"]
    assert samples[("hf_pipeline_prompt_tokens_total", ())] == 2 * usage["prompt_tokens"]
    assert samples[("hf_pipeline_time_to_first_token_seconds_count", ())] == 2
    assert samples[("hf_pipeline_request_seconds_count", ())] == 2
    assert samples[("hf_pipeline_queued_requests", ())] == 0 and samples[("hf_pipeline_running_rows", ())] == 0
    assert samples[("hf_pipeline_kv_pool_rows", ())] == engine.pool
    assert samples[("hf_pipeline_prefix_cache_hits", ())] == engine.prefix_hits  # the engine's totals, exposed
