"""Continuous batching across 3 ranks (one spawn; 2 ranks run it in ``tests/serving/test_server.py``, one
process in ``tests/serving/test_engine.py``): a stream of requests with different prompts, limits, stop
criteria and arrival times (later ones submitted while earlier ones decode) on LLaMA (GQA) and GPT-2.
Every greedy request against transformers' ``generate`` of it alone; a seeded sampled request alone and
inside the busy stream against the model's own seeded ``generate``; per-request stop strings and stop
ids; a KV pool too small for the stream (requests wait, all are served, never more rows than the pool);
fewer ring steps than static rounds of the same stream need (rows really join as others leave); and a
failure inside the ring fails the requests in flight, naming the stage, and the engine serves the next
one."""

from __future__ import annotations

import threading
import time

import pytest
import tiny
import torch
from harness import run_distributed

pytestmark = pytest.mark.dist

# (prompt length, max_new_tokens, extra request fields); prompts are seeded word ids.
STREAM = [(3, 12, {}), (9, 4, {}), (5, 16, {}), (2, 6, {}), (11, 10, {}), (6, 3, {}),
          (4, 14, {}), (8, 5, {}), (7, 9, {}), (3, 2, {}), (10, 12, {}), (5, 7, {})]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "n": 2}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, tiny.VOCAB, (n,), generator=g).tolist() for n, _, _ in STREAM]


def _serve(path: str, text: str, requests: list[dict], late: int, pool_rows: int | None) -> dict | None:
    """Every rank: one engine; rank 0 submits the first ``late`` requests, the rest once the first has
    tokens (while it decodes), then the same stream to a static engine for its step count."""
    import hf_pipeline
    from hf_pipeline.continuous_batching.kv_budget import row_kv_bytes
    from hf_pipeline.serving import CompletionRequest, Engine

    tok = tiny.word_tokenizer(__import__("pathlib").Path(text))
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    budget = None if pool_rows is None else pool_rows * row_kv_bytes(model, model.config.max_position_embeddings)
    out: dict = {"budget": budget}
    pool = 4 if pool_rows is None else pool_rows
    for batching in ("continuous", "static"):  # static rounds as wide as the continuous pool
        engine = Engine(model, tok, max_batch=4 if batching == "continuous" else pool, batching=batching,
                        kv_cache_bytes=budget if batching == "continuous" else None, idle_s=0.05)
        if model.ctx.rank != 0:
            engine.serve_forever()
            out[batching] = {"peak": engine.peak_cache_bytes}
            continue

        def client(engine=engine, batching=batching):
            reqs = [CompletionRequest(**r) for r in requests]
            alone = engine.submit(CompletionRequest(**requests[-1])) if batching == "continuous" else None
            if alone is not None:
                alone.result(timeout=120)  # the seeded request alone, before the stream
            handles = [engine.submit(r) for r in reqs[:late]]
            next(iter(handles[0]))  # the first request has tokens: the rest arrive while it decodes
            handles += [engine.submit(r) for r in reqs[late:]]
            out[batching] = {"choices": [[(c.token_ids, c.text, c.finish_reason) for c in h.result(timeout=120)]
                                         for h in handles],
                             "alone": [c.token_ids for c in alone.result()] if alone else None}
            engine.drain()

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        start = time.perf_counter()
        engine.serve_forever()
        thread.join(timeout=60)
        out[batching].update(steps=engine.decode_steps, rounds=engine.rounds, mode=engine.batching, pool=engine.pool,
                             seconds=time.perf_counter() - start, peak=engine.peak_cache_bytes,
                             peak_rows=engine.peak_rows)
    return out


def _fail_once(path: str) -> dict:
    """Every rank: the last stage's token choice raises once; the requests in flight fail, the next is served."""
    import hf_pipeline
    from hf_pipeline.continuous_batching.ring_stage import RingStage
    from hf_pipeline.errors import InputError
    from hf_pipeline.serving import CompletionRequest, Engine

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    engine, choose, calls = Engine(model, max_batch=4, idle_s=0.05), RingStage.choose, []

    def broken(stage, *args):
        calls.append(1)
        if len(calls) == 3:
            raise InputError("a logits processor failed")
        return choose(stage, *args)

    RingStage.choose = broken
    out: dict = {}

    def client():
        failed = [engine.submit(CompletionRequest(prompt_ids=[5, 6, 7], max_new_tokens=8)) for _ in range(2)]
        out["failed"] = [(h.result(timeout=60)[0].finish_reason, h.error) for h in failed]
        # Then two together: one plain, one with logprobs and its prompt's (echo): the reply's layout mixed.
        plain = engine.submit(CompletionRequest(prompt_ids=[5, 6, 7], max_new_tokens=8))
        scored = engine.submit(CompletionRequest(prompt_ids=[9, 8, 7, 6], max_new_tokens=5, logprobs=2, echo=True))
        out["after"] = plain.result(timeout=60)
        got = scored.result(timeout=60)[0]
        out["scored"] = (got.token_ids, [(e.token, e.logprob, e.top) for e in got.logprobs],
                         [(e.token, e.logprob) for e in got.prompt_logprobs])
        engine.drain()

    thread = threading.Thread(target=client, daemon=True) if model.ctx.rank == 0 else None
    if thread is not None:
        thread.start()
    try:
        engine.serve_forever()
    finally:
        RingStage.choose = choose
    if thread is not None:
        thread.join(timeout=60)
        out["after"] = [c.token_ids for c in out["after"]]
    return out


def _job(cases):
    return [_serve(*c) for c in cases], _fail_once(cases[0][0])


def _expected(ref, tok, req: dict) -> tuple[list[int], str, str]:
    """transformers' greedy generate of the request alone, cut as the engine cuts it."""
    ids = req["prompt_ids"]
    full = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=req["max_new_tokens"], do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    stops = {2} | set(req.get("stop_token_ids", ()))
    cut = next((k for k, t in enumerate(full) if t in stops), None)
    tokens = full if cut is None else full[:cut]
    text = tok.decode(tokens, skip_special_tokens=True)
    for s in req.get("stop", ()):
        if s in text:
            text = text[: text.index(s)]
            return tokens, text, "stop"
    return tokens, text, "length" if cut is None else "stop"


def _check_logprobs(ref, tokens, chosen, prompt) -> None:
    """Across 3 stages: the chosen tokens' log-probabilities (top 2) against transformers' ``generate(output_scores)``
    and the prompt's against a forward pass. Tolerance 1e-4: fp32 logits of order 1 batched with another row
    move by ~1e-6; a wrong position or row moves them by > 1e-2."""
    ids = [9, 8, 7, 6]
    out = ref.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)
    want = ref.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0].double()
    assert [t for t, _, _ in chosen] == out.sequences[0, 4: 4 + len(chosen)].tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp, _ in chosen], dtype=torch.float64), want[: len(chosen)],
                               atol=1e-4, rtol=0)
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for _, _, top in chosen)
    with torch.no_grad():
        forward = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1].float(), -1)
    expected = forward.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
    assert [t for t, _ in prompt] == ids[1:]
    torch.testing.assert_close(torch.tensor([lp for _, lp in prompt], dtype=torch.float64), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_continuous_stream_equals_each_request_alone_at_3_ranks(tmp_path):
    import hf_pipeline

    text = tiny.text_file(tmp_path / "words.txt")
    tok = tiny.word_tokenizer(text)
    archs = ["llama", "gpt2"]
    cases, refs = [], {}
    for arch in archs:
        path = tiny.make_checkpoint(tmp_path / arch, arch, shards=1)
        ref = tiny.reference(path, "AutoModelForCausalLM")
        requests = [dict(prompt_ids=p, max_new_tokens=m, **x) for p, (_, m, x) in zip(_prompts(), STREAM)]
        # Per-request stop criteria, taken from each request's own greedy continuation.
        full, _, _ = _expected(ref, tok, requests[2])
        requests[2]["stop_token_ids"] = [full[4]]
        _, words, _ = _expected(ref, tok, requests[6])
        requests[6]["stop"] = [words.split()[3]] if len(words.split()) > 3 else []
        requests.append(dict(prompt_ids=requests[0]["prompt_ids"], max_new_tokens=8, **SAMPLED))
        refs[arch] = (ref, requests)
        # GPT-2: a pool of 3 full-context rows (fewer than max_batch=4): requests wait for room.
        cases.append((str(path), str(text), requests, 6, 3 if arch == "gpt2" else None))
    per_rank = run_distributed(_job, 3, cases, timeout=300)
    failure = per_rank[0][1]
    assert [r for r, _ in failure["failed"]] == ["error", "error"], failure
    assert all("stage 2" in e and "a logits processor failed" in e for _, e in failure["failed"]), failure
    ids = [5, 6, 7]
    full = refs["llama"][0].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert failure["after"] == [full[: full.index(2)] if 2 in full else full]
    _check_logprobs(refs["llama"][0], *failure["scored"])
    per_rank = [r[0] for r in per_rank]
    for arch, *ranks in zip(archs, *per_rank):
        # Every rank held a cache, within the pool where it is bounded (3 full-context rows).
        assert all(r["continuous"]["peak"] > 0 for r in ranks), arch
        if ranks[0]["budget"] is not None:
            assert all(r["continuous"]["peak"] <= r["budget"] for r in ranks), arch
    for arch, got in zip(archs, per_rank[0]):
        ref, requests = refs[arch]
        cont, static = got["continuous"], got["static"]
        assert cont["mode"] == "continuous" and static["mode"] == "static"
        # The pool's rows were all used, never more: the rest waited in the queue.
        assert cont["pool"] == cont["peak_rows"] == (3 if arch == "gpt2" else 4)
        for k, req in enumerate(requests[:-1]):
            tokens, text_, reason = _expected(ref, tok, req)
            (got_tokens, got_text, got_reason), = cont["choices"][k]
            assert got_text == text_ and got_reason == reason, (arch, k)
            if not req.get("stop"):
                assert got_tokens == tokens, (arch, k)
            assert cont["choices"][k] == static["choices"][k], (arch, k)  # static rounds agree
        assert len(cont["choices"][2][0][0]) <= 4 and cont["choices"][2][0][2] == "stop"  # its own stop id
        # The seeded request: alone, inside the stream and the model's own seeded generate agree.
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(refs[arch][0].name_or_path, pipeline=True,
                                                                 device="cpu", progress=False)
        ids = requests[-1]["prompt_ids"]
        rows = model.generate(torch.tensor([ids, ids]), max_new_tokens=8, do_sample=True, temperature=0.9,
                              top_p=0.95, seed=7, pad_token_id=0)[:, len(ids):].tolist()
        want = [r[: r.index(2)] if 2 in r else r for r in rows]
        assert cont["alone"] == want and [c[0] for c in cont["choices"][-1]] == want, arch
        assert want[0] != want[1]
        # Rows joined as others left: fewer ring steps than static rounds, each as long as its longest row.
        assert cont["steps"] < static["steps"], (cont["steps"], static["steps"])
        assert cont["steps"] >= max(m for _, m, _ in STREAM)
