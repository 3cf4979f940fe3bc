"""``response_format`` JSON modes through a live ``hf-pipeline serve --num-processes 2`` (continuous batching),
queried with the ``openai`` client, on chat and completions, several requests at once: each greedy answer's
text equals transformers' ``generate`` on one process with the same llguidance processor
(:class:`~hf_pipeline.generation.grammar.GrammarProcessor`); the schema's answers are JSON the schema takes;
bad formats are OpenAI's 400 naming ``response_format``, and the server answers the next request."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from live_server import start_server

from hf_pipeline.tools.default_model import default_model_path

pytest.importorskip("llguidance")
from hf_pipeline.generation.grammar import GrammarProcessor, GrammarTokenizer, json_grammar  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a server of 2 processes

PROMPTS = ["If the file does not exist, the function", "Return the list of"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}
FORMATS = [{"type": "json_object"},
           {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}]
MAX_TOKENS = 24


def _reference(ref, tok, grammars, ids: list[int], response_format) -> str:
    proc = GrammarProcessor(grammars, json_grammar(response_format), prompt_length=len(ids))
    out = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, logits_processor=[proc])
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def _ask(client, route: str, prompt: str, response_format) -> str:
    if route == "chat":
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=MAX_TOKENS, temperature=0, response_format=response_format)
        return r.choices[0].message.content
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"response_format": response_format})
    return r.choices[0].text


def test_response_format_served_equals_transformers_with_the_processor(tmp_path):
    openai = pytest.importorskip("openai")
    model = default_model_path()
    server = start_server(model, tmp_path / "server.log", "--max-batch", "4")
    try:
        server.wait_up()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        cases = [(route, p, rf) for route in ("completions", "chat") for p in PROMPTS for rf in FORMATS]
        with ThreadPoolExecutor(len(cases)) as pool:  # at once: rows join the running ring beside each other
            got = list(pool.map(lambda c: _ask(client, *c), cases))
        for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}):
            with pytest.raises(openai.BadRequestError) as e:
                _ask(client, "chat", PROMPTS[0], bad)
            assert e.value.body["param"] == "response_format", bad
        assert _ask(client, "completions", PROMPTS[0], FORMATS[1]) == got[1]  # served on after the 400s
    finally:
        server.stop()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    grammars = GrammarTokenizer(tok, [ref.generation_config.eos_token_id], vocab_size=ref.config.vocab_size)
    for (route, prompt, rf), text in zip(cases, got):
        if route == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = tok(prompt)["input_ids"]
        assert text == _reference(ref, tok, grammars, list(ids), rf), (route, prompt, rf)
        if rf is FORMATS[1]:
            value = json.loads(text)
            assert set(value) == {"name", "count"} and isinstance(value["count"], int), text
