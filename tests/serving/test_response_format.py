"""``response_format`` JSON modes (:mod:`hf_pipeline.generation.grammar`, llguidance) on the bundled tiny LLaMA,
in one process: the processor in transformers' own ``generate`` makes text ``json.loads`` takes and the schema
accepts (where the same prompt without it makes no JSON); the serving engine, continuous and static, gives the
same greedy tokens as transformers' ``generate`` with that processor; bad ``response_format`` values are 400s
naming the field, before the queue; through the app, log-probabilities of masked tokens are vLLM's
-9999.0 (JSON has no -inf)."""

from __future__ import annotations

import json

import pytest
import test_engine
import tiny
import torch

from hf_pipeline.errors import InputError, ServingRequestError
from hf_pipeline.serving import CompletionRequest, Engine
from hf_pipeline.serving.protocol import parse_chat, parse_completion

pytest.importorskip("llguidance")
from hf_pipeline.generation.grammar import GrammarProcessor, GrammarTokenizer, json_grammar  # noqa: E402

PROMPT = "If the file does not exist, the function"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0,
                                                                           "maximum": 999}},
    "required": ["name", "count"], "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


def _valid(value) -> bool:
    """SCHEMA, checked by hand: exactly its two keys, a string of at most 12 characters, an int in [0, 999]."""
    return (isinstance(value, dict) and set(value) == {"name", "count"} and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and type(value["count"]) is int and 0 <= value["count"] <= 999)


@pytest.fixture(scope="module")
def bundled():
    tok, model, ref = test_engine.bundled_model()
    return tok, model, ref, GrammarTokenizer(tok, [2], vocab_size=ref.config.vocab_size)


def _reference(ref, grammars, ids: list[int], grammar: str | None, n: int) -> list[int]:
    """transformers' greedy tokens, with the grammar's processor, EOS and what follows dropped."""
    procs = [GrammarProcessor(grammars, grammar, prompt_length=len(ids))] if grammar else []
    return tiny.greedy_alone(ref, ids, n, logits_processor=procs)[0]


@pytest.mark.equiv
def test_the_processor_makes_valid_json_in_transformers_generate(bundled):
    tok, _, ref, grammars = bundled
    ids = tok(PROMPT)["input_ids"]
    plain = tok.decode(_reference(ref, grammars, ids, None, 40), skip_special_tokens=True)
    with pytest.raises(json.JSONDecodeError):  # the check can fail: this prompt alone makes prose
        json.loads(plain)
    got = _reference(ref, grammars, ids, json_grammar(AS_SCHEMA), 40)
    assert len(got) < 40, "the grammar completes (then only EOS is allowed) well within the limit"
    assert _valid(json.loads(tok.decode(got, skip_special_tokens=True)))
    # Several rows (sampled, two per prompt) in one batch: each row follows its own matcher.
    procs = [GrammarProcessor(grammars, json_grammar(AS_SCHEMA), prompt_length=len(ids))]
    torch.manual_seed(0)
    out = ref.generate(torch.tensor([ids, ids]), max_new_tokens=40, do_sample=True, num_return_sequences=2,
                       logits_processor=procs, pad_token_id=0)
    for row in out[:, len(ids):].tolist():
        assert _valid(json.loads(tok.decode(row, skip_special_tokens=True))), row


def test_bad_response_formats_are_refused_naming_the_field(bundled):
    tok, model, _, _ = bundled
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    bad = [{"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}]
    for rf in bad:
        with pytest.raises(ServingRequestError) as e:
            parse_completion({**body, "response_format": rf}, tok, model_name="m")
        assert e.value.param == "response_format", rf
    with pytest.raises(ServingRequestError) as e:  # the grammar decides where the answer ends
        parse_completion({**body, "response_format": {"type": "json_object"}, "min_tokens": 2}, tok, model_name="m")
    assert e.value.param == "min_tokens"
    with pytest.raises(InputError):
        json_grammar({"type": "json_schema", "json_schema": {"name": 5, "schema": {}}})
    assert json_grammar({"type": "text"}) is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    assert parse_chat(chat, tok, model_name="m").requests[0].grammar == json_grammar({"type": "json_object"})
    engine = Engine(model, None)  # no tokenizer: refused at submit, before the queue
    with pytest.raises(ServingRequestError) as e:
        engine.submit(CompletionRequest(prompt_ids=[5, 6], grammar=json_grammar(AS_SCHEMA)))
    assert e.value.param == "response_format" and engine.queued == 0


@pytest.mark.equiv
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_engine_equals_transformers_with_the_processor(bundled, batching):
    tok, model, ref, grammars = bundled
    prompts = [tok(PROMPT)["input_ids"], tok("Return the list of")["input_ids"]]
    formats = [{"type": "json_object"}, AS_SCHEMA]
    engine = Engine(model, tok, max_batch=4, batching=batching)
    cases = [(ids, rf) for ids in prompts for rf in formats] + [(prompts[0], None)]
    handles = [engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=24, grammar=json_grammar(rf)))
               for ids, rf in cases]
    # n > 1 (sampled): every choice is a row of its own, each following the grammar.
    sampled = engine.submit(CompletionRequest(prompt_ids=prompts[0], max_new_tokens=40, n=3, temperature=1.0,
                                              seed=1, grammar=json_grammar(AS_SCHEMA)))
    test_engine._run(engine, handles + [sampled])
    for c in sampled.result():
        assert c.finish_reason == "stop" and _valid(json.loads(c.text)), (batching, c.text)
    for (ids, rf), h in zip(cases, handles):
        got = h.result()[0]
        assert got.token_ids == _reference(ref, grammars, ids, json_grammar(rf), 24), (batching, rf)
        if rf is AS_SCHEMA:
            assert got.finish_reason == "stop" and _valid(json.loads(got.text)), got.text


def test_the_app_answers_logprobs_and_refusals_as_openai(bundled):
    tok, model, _, _ = bundled
    with test_engine.app_client(Engine(model, tok), tok) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]["logprobs"]["content"][0]
        # The grammar allows only "{" first: its log-probability 0, the other alternatives masked (-inf).
        assert first["token"] == "{" and first["logprob"] == 0.0
        assert [t["logprob"] for t in first["top_logprobs"][1:]] == [-9999.0, -9999.0]
        bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}
        r = client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_row_that_left_the_grammar_may_only_end(bundled):
    # A static round's finished rows get padding, which the grammar refuses: such a row is offered EOS alone;
    # rows that share a past and then differ each get their own matcher.
    tok, _, _, grammars = bundled
    proc = GrammarProcessor(grammars, json_grammar({"type": "json_object"}), prompt_length=2)
    brace = tok.convert_tokens_to_ids("{")
    allowed = [(proc(torch.tensor(ids), torch.zeros(len(ids), 2048)) == 0) for ids in
               ([[5, 6]], [[5, 6, 7], [5, 6, brace]])]
    assert allowed[0].nonzero().tolist() == [[0, brace]]
    assert allowed[1][0].nonzero().flatten().tolist() == [2]
    assert allowed[1][1, brace].item() is False and allowed[1][1].sum() > 1  # after "{": a key or "}"
