"""Differential fuzz of continuous batching: seeded random request streams through the serving Engine on every
rank, each request's greedy tokens against transformers' ``generate`` of it alone.

    torchrun --nproc-per-node 2 -m devtools.ring_fuzz CHECKPOINT --seeds 1-40 --layout pp2

Each seed draws a stream (6 to 17 requests: prompts of 1 to 60 tokens, half of them behind one of three shared
heads, so prefix caching has something to reuse; 1 to 23 new tokens each, EOS not ending them) and the Engine's
settings (rows in flight, prompt chunk, prefix caching and its block), then submits the first requests at once and
the rest once the first has a token, so rows join, chunk and leave while others decode. ``--layout`` places the
model: ``pp2`` (a stage per rank), ``v2`` (2 stages per rank), ``dp2`` (a whole model per rank: replicas),
``tp2`` (tensor parallel). Rank 0 prints a line per seed and, at the end, every mismatch; the exit status is 1
when any request differs. The tests run one seed (``tests/continuous_batching/test_ring_fuzz.py``).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

from devtools.engine_client import serve_with_client

__all__ = ["LAYOUTS", "Stream", "fuzz", "main", "stream_for"]

LAYOUTS = {"pp2": {}, "v2": {"virtual_stages": 2}, "dp2": {"num_stages": 1}, "tp2": {"tp_size": 2}}


@dataclass
class Stream:
    """One seed's requests (``CompletionRequest`` fields) and Engine settings; ``first`` requests go at once. Once
    served (rank 0): the requests whose tokens differ from transformers', and the Engine's counters."""

    seed: int
    requests: list[dict]
    engine: dict
    first: int
    mismatches: list[str] = field(default_factory=list)
    counters: dict = field(default_factory=dict)


def stream_for(seed: int, *, vocab: int, positions: int) -> Stream:
    """The seed's stream, the same on every rank (prompt ids in ``[5, vocab)``, prompt and output within
    ``positions``)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(5, vocab) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    requests = []
    for _ in range(rng.randrange(6, 18)):
        head = rng.choice(heads) if rng.random() < 0.5 else []
        new = rng.randrange(1, 24)
        prompt = (head + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 40))])[: positions - new]
        requests.append({"prompt_ids": prompt, "max_new_tokens": new, "ignore_eos": True})
    engine = {"max_batch": rng.choice([2, 3, 4, 6, 8]), "prefill_chunk": rng.choice([None, 4, 7, 16]),
              "prefix_cache": rng.random() < 0.7, "prefix_block": rng.choice([4, 8, 16])}
    return Stream(seed=seed, requests=requests, engine=engine, first=rng.randrange(1, len(requests) + 1))


def _serve(model, stream: Stream) -> tuple[list[list[int]], dict]:
    """Every rank: one Engine serving the stream until drained; rank 0's tokens per request and the Engine's
    counters (prompt chunks run, prefix hits)."""
    from hf_pipeline.serving import CompletionRequest, Engine

    engine = Engine(model, None, idle_s=0.05, max_queue=64, **stream.engine)
    got: list[list[int]] = []
    errors: list[str] = []

    def client() -> None:
        try:
            handles = [engine.submit(CompletionRequest(**r)) for r in stream.requests[: stream.first]]
            next(iter(handles[0]))  # the first request has a token: the rest join while it decodes
            handles += [engine.submit(CompletionRequest(**r)) for r in stream.requests[stream.first:]]
            got.extend(h.result(timeout=600)[0].token_ids for h in handles)
        except Exception as e:  # noqa: BLE001 - reported as the seed's failure, after every rank stopped
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            engine.drain()

    serve_with_client(engine, client)
    if errors:
        raise RuntimeError(f"seed {stream.seed}: {errors[0]}")
    return got, {"chunks": engine.prefill_chunks, "prefix_hits": engine.prefix_hits,
                 "continuous": engine.static_reason is None}


def fuzz(path: str, seeds: list[int], layout: str = "pp2") -> list[Stream] | None:
    """Every rank (collective): each seed's stream served on ``path`` loaded as ``layout``; rank 0 returns the
    streams with their mismatches against transformers (the others None)."""
    import torch
    import transformers

    from hf_pipeline import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False, **LAYOUTS[layout])
    text = model.config.get_text_config(decoder=True)
    positions = int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 128)
    ref = None
    if model.ctx.rank == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    out = []
    for seed in seeds:
        stream = stream_for(seed, vocab=int(text.vocab_size), positions=positions)
        got, stream.counters = _serve(model, stream)
        if ref is None:
            continue
        for k, (request, tokens) in enumerate(zip(stream.requests, got, strict=True)):
            ids = torch.tensor([request["prompt_ids"]])
            with torch.no_grad():
                full = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                                    max_new_tokens=request["max_new_tokens"])
            want = full[0, ids.shape[1]:].tolist()
            if tokens != want:
                stream.mismatches.append(f"seed {seed}, request {k} ({ids.shape[1]} prompt tokens): {tokens} != {want}")
        print(f"seed {seed}: {len(got) - len(stream.mismatches)} / {len(got)} requests equal transformers; "
              f"{stream.engine}, first {stream.first} at once; {stream.counters}", flush=True)
        out.append(stream)
    return out if ref is not None else None


def _seeds(text: str) -> list[int]:
    """``"3"``, ``"1-40"`` or ``"1,5,9"`` as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.ring_fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a causal LM's folder (config and safetensors)")
    parser.add_argument("--seeds", default="1-10", help="'1-40', '3' or '1,5,9' (default 1-10)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2")
    args = parser.parse_args(argv)
    streams = fuzz(args.checkpoint, _seeds(args.seeds), args.layout)
    if streams is None:
        return 0
    bad = [m for s in streams for m in s.mismatches]
    print("\n".join(bad) if bad else f"every request of {len(streams)} seeds equals transformers", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
