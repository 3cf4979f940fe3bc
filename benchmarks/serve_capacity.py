"""Serve section, capacity: every request of the stream at once, no HTTP, against the 2-way limit.

Per model (the serve section's, and the serve-http section's: the bundled tiny model, the decode-heavy one):

The stream's arrival times make the serve section's throughput arrival-bound (the last request arrives
after most are served). Here the same requests are all queued at once, so each contender runs at its
capacity, and the measurement has no HTTP server, tokenizer or client in it: what is left is the ring
against what the machine's two processes can do. In one launch on ``world`` ranks, ``repeats`` times in
turn (the VM's speed drifts between runs; each ratio is of medians over the same turns):

  * ``served``: hf_pipeline's :class:`~hf_pipeline.serving.Engine` on the pipelined model (its default
    batching), at most ``serve_batch`` rows, the requests submitted by a thread on rank 0;
  * ``replicas``: the same Engine on the model loaded as replicas (``num_stages=1``: a whole model per rank,
    rank 0 sharing the requests out), ``serve_batch / world`` rows each (``max_batch`` counts per replica);
  * ``one_process``: transformers' continuous batching on rank 0 alone (the other ranks wait), at most
    ``serve_batch`` rows;
  * ``limit``: the machine's 2-way limit: every rank runs transformers' continuous batching on its share
    of the requests (``rank::world``) at once, at most ``serve_batch / world`` rows each, so the machine
    holds as many rows as the served pipeline; its time is the slowest rank's.

Every request is greedy and runs to its ``max_new_tokens`` (EOS ignored); every contender's tokens must
equal one process's, request by request. Each contender gets one warm-up request before its timed turn.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

from benchmarks.config import Sizes
from benchmarks.serve import hf_manager, hf_results, request_stream
from benchmarks.tables import Table
from devtools.engine_client import serve_with_client

__all__ = ["CONTENDERS", "TASKS", "label", "launches", "markdown", "summarize"]

CONTENDERS = {
    "served": "hf_pipeline Engine, default batching",
    "replicas": "hf_pipeline Engine, replicas (a whole model per rank)",
    "one_process": "transformers continuous batching, 1 process",
    "limit": "2-way limit: transformers continuous batching on each rank, its share of the requests",
}


def _engine_turn(model, prompts: list[list[int]], new: list[int], max_batch: int) -> dict[str, Any]:
    """Every rank: one Engine serving every request at once until drained; rank 0's seconds and tokens."""
    from hf_pipeline.serving import CompletionRequest, Engine

    engine = Engine(model, None, max_batch=max_batch, max_queue=len(prompts) + 1)
    box: dict[str, Any] = {}

    def feed() -> None:
        try:
            engine.submit(CompletionRequest(prompt_ids=prompts[0], max_new_tokens=2)).result(timeout=600)
            start = time.perf_counter()
            handles = [engine.submit(CompletionRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True))
                       for p, n in zip(prompts, new)]
            box["tokens"] = [h.result(timeout=1800)[0].token_ids for h in handles]
            box["seconds"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - the task reports it, after every rank stopped
            box["error"] = f"{type(e).__name__}: {e}"
        finally:
            engine.drain()

    serve_with_client(engine, feed)
    if "error" in box:
        raise RuntimeError(f"the served pipeline failed: {box['error']}")
    box["times"] = asdict(engine.ring_times)  # every rank: where its time in the ring went
    return box


def _hf_turn(plain, prompts: list[list[int]], new: list[int], max_batch: int, sizes: dict) -> dict[str, Any]:
    """transformers' continuous batching on this process: every request at once; seconds and tokens."""
    manager = hf_manager(plain, sizes, max_batch)
    manager.start()
    try:
        manager.add_request(prompts[0], request_id="warm-up", max_new_tokens=2)
        hf_results(manager, 1)
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, new)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        got = hf_results(manager, len(prompts))
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    return {"seconds": seconds, "tokens": [list(got[f"r{i}"].generated_tokens) for i in range(len(prompts))]}


def serve_capacity(task: dict, out: dict) -> None:
    """Every rank: the three contenders in turn, ``serve_capacity_repeats`` times; rank 0 records them."""
    import torch
    import torch.distributed as dist
    import transformers

    from hf_pipeline import AutoModelForCausalLM

    sizes = task["sizes"]
    model = AutoModelForCausalLM.from_pretrained(task["path"], pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False)
    replicas = AutoModelForCausalLM.from_pretrained(task["path"], pipeline=True, device="cpu", dtype=torch.float32,
                                                    progress=False, num_stages=1)
    plain = transformers.AutoModelForCausalLM.from_pretrained(task["path"], dtype=torch.float32).eval()
    # The stream's seeded lengths; its token ids within this model's vocabulary.
    stream = request_stream(dict(sizes, vocab=min(sizes["vocab"], plain.config.vocab_size)))
    prompts, new = [r["prompt"] for r in stream], [r["max_new_tokens"] for r in stream]
    rank, world = model.ctx.rank, model.ctx.world_size
    batch = sizes["serve_batch"]
    turns: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    tokens: dict[str, list[list[int]]] = {}
    ring_times: list[list[dict]] = []  # per turn, per rank: the served ring's time split
    for _ in range(sizes["serve_capacity_repeats"]):
        dist.barrier()
        served = _engine_turn(model, prompts, new, batch)
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, served["times"])
        ring_times.append(per_rank)
        if rank == 0:
            turns["served"].append(served["seconds"])
            tokens["served"] = served["tokens"]
        dist.barrier()
        dp = _engine_turn(replicas, prompts, new, max(1, batch // replicas.dims.dp_size))
        if rank == 0:
            turns["replicas"].append(dp["seconds"])
            tokens["replicas"] = dp["tokens"]
        dist.barrier()
        share = list(range(rank, len(prompts), world))
        mine = _hf_turn(plain, [prompts[i] for i in share], [new[i] for i in share], max(1, batch // world), sizes)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (share, mine))
        turns["limit"].append(max(m["seconds"] for _, m in gathered))
        limit = [None] * len(prompts)
        for idx, m in gathered:
            for i, t in zip(idx, m["tokens"]):
                limit[i] = t
        tokens["limit"] = limit
        dist.barrier()
        if rank == 0:
            one = _hf_turn(plain, prompts, new, batch, sizes)
            turns["one_process"].append(one["seconds"])
            tokens["one_process"] = one["tokens"]
        dist.barrier()
    if rank == 0:
        out.update(seconds=turns, tokens=tokens, generated=sum(new), ring_times=ring_times)


TASKS = {"serve_capacity": serve_capacity}


def label(model: str) -> str:
    """The task's label for the model named ``model``."""
    return f"serve capacity, {model}"


def launches(sizes: Sizes, models: dict[str, str]) -> dict[int, list[dict]]:
    """One task per model (name -> checkpoint folder) on ``world`` ranks."""
    return {sizes.world: [{"task": "serve_capacity", "label": label(name), "path": path, "sizes": asdict(sizes)}
                          for name, path in models.items()]}


def summarize(sizes: Sizes, find, models: list[str]) -> dict[str, Any]:
    """results.json's ``serve["capacity"]``: per model, per contender the turns' seconds, median tokens/s and the
    ratios; ``mismatches``: contenders whose tokens differ from one process's (all models')."""
    per, mismatches = {}, []
    for name in models:
        per[name], wrong = _summarize_model(sizes, find, name)
        mismatches += wrong
    return {"models": per, "mismatches": mismatches}


def _summarize_model(sizes: Sizes, find, name: str) -> tuple[dict[str, Any], list[str]]:
    """One model's figures, and its contenders' token mismatches."""
    results = find(sizes.world, label(name))
    failed = [r for r in results if not r.get("ok")]
    if not results or failed:
        return {"error": failed[0]["error"] if failed else "did not run"}, []
    main = next(r for r in results if r.get("seconds"))
    rows: dict[str, Any] = {}
    for key in CONTENDERS:
        seconds = main["seconds"][key]
        rows[key] = {"seconds": seconds, "tokens_per_s": main["generated"] / statistics.median(seconds)}
    mismatches = []
    want = main["tokens"]["one_process"]
    for key in ("served", "replicas", "limit"):
        equal = sum(a == b for a, b in zip(main["tokens"][key], want))
        rows[key]["tokens_equal_one_process"] = equal
        if equal != len(want):
            mismatches.append(f"{label(name)}, {CONTENDERS[key]}: greedy tokens differ from one process's in "
                              f"{len(want) - equal} of {len(want)} requests")
    # The served ranks' ring time over all turns (each turn's engine counts from zero), as shares.
    ranks = zip(*main["ring_times"])
    rows["served"]["ring_shares"] = [_sum_times(turns).fractions() for turns in ranks]
    one, limit = rows["one_process"]["tokens_per_s"], rows["limit"]["tokens_per_s"]
    for row in rows.values():
        row["vs_one_process"], row["vs_limit"] = row["tokens_per_s"] / one, row["tokens_per_s"] / limit
    return {"requests": len(want), "generated": main["generated"], "repeats": len(main["seconds"]["served"]),
            "max_batch": sizes.serve_batch, "contenders": rows}, mismatches


def _sum_times(turns) -> Any:
    from hf_pipeline.continuous_batching.ring_times import RingTimes

    total = RingTimes()
    for t in turns:
        total += RingTimes(**t)
    return total


def _shares(row: dict) -> str | None:
    """The served row's ring time per rank: decode / prefill / waiting (the rest: planning, sends, choices)."""
    if "ring_shares" not in row:
        return None
    return "; ".join(f"rank {r}: {100 * f['decode']:.0f} / {100 * f['prefill']:.0f} / {100 * f['wait']:.0f}%"
                     for r, f in enumerate(row["ring_shares"]))


def markdown(sv: dict[str, Any]) -> list:
    """The capacity table of the serve section (``sv``: results.json's ``serve``)."""
    cap = sv.get("capacity")
    if not cap:
        return []
    ran = [r for r in cap["models"].values() if "error" not in r]
    lines = ["### Capacity: every request at once, no HTTP", ""]
    if ran:
        r = ran[0]
        lines += [
            f"The stream's {r['requests']} requests ({r['generated']} tokens to generate; prompt ids within each "
            f"model's vocabulary), all queued at once, so each contender runs at its capacity; no HTTP server, "
            f"tokenizer or client. At most {r['max_batch']} rows on the machine: the served pipeline's ring on "
            f"{sv['world']} ranks, one transformers process, or the 2-way limit's {sv['world']} processes with "
            f"{max(1, r['max_batch'] // sv['world'])} rows each, every rank its share at once (its time the slowest "
            f"rank's); the Engine on the model loaded as {sv['world']} replicas (a whole model per rank, "
            f"{max(1, r['max_batch'] // sv['world'])} rows each, rank 0 planning every replica's op). "
            f"{r['repeats']} turns of the four in order; tokens/s over each contender's median turn. Tokens "
            "equal: requests whose greedy tokens are one process's. Models: the train section's, and the serve-http "
            "section's (the bundled tiny model, the decode-heavy one). Ring time: where each served rank's time in "
            "the ring went, over all turns: its stages' decode forwards / prefill forwards (joining prompts) / "
            "waiting for a message (`Engine.ring_times`); with one group of rows per rank the ring has no slack, so "
            "a long op on one rank is waiting on the other.", "",
        ]
    t = Table(["model", "contender", "processes", "tokens/s", "vs one process", "vs 2-way limit", "turns (s)",
               "tokens equal", "ring time: decode / prefill / waiting"])
    for name, r in cap["models"].items():
        if "error" in r:
            t.add(name, "all", None, f"did not run: {r['error']}", None, None, None, None, None)
            continue
        for key, row in r["contenders"].items():
            t.add(name, CONTENDERS[key], "1" if key == "one_process" else str(sv["world"]),
                  f"{row['tokens_per_s']:.1f}", f"{row['vs_one_process']:.2f}x", f"{row['vs_limit']:.2f}x",
                  ", ".join(f"{s:.2f}" for s in row["seconds"]),
                  f"{row.get('tokens_equal_one_process', r['requests'])} / {r['requests']}", _shares(row))
    return lines + [t, ""]
