"""Generate section, measuring side: pipelined greedy ``generate`` against transformers' and its limits.

Tokens/s of pipelined greedy ``generate`` (``world`` ranks) against transformers' ``generate`` on
one process, against a one-microbatch pipeline, and against the 2-way limit (``world`` independent
processes on their shares of the prompts); then what a decoded token costs, piece by piece: the
stages' steps, the ring's pattern with torch's P2P alone, one message's hop.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.config import Sizes
from benchmarks.timing import hop_seconds, median, prompts, sync
from benchmarks.torch_pipeline import stage_part, torch_ring_step_seconds

__all__ = ["TASKS", "launches"]


def _greedy(model, ids, mask, new_tokens: int, **kwargs):
    """transformers' greedy ``generate`` of exactly ``new_tokens`` tokens."""
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, **kwargs)


def generate_hf(spec: dict, out: dict) -> None:
    """The baseline: transformers' ``generate`` on one process; its tokens, chunked too; one decode step."""
    import torch
    import transformers

    sizes = spec["sizes"]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    ids, mask = prompts(sizes)
    times, result = [], None
    for _ in range(sizes["gen_reps"] + 1):
        t = time.perf_counter()
        result = _greedy(model, ids, mask, sizes["new_tokens"])
        times.append(time.perf_counter() - t)
    new_tokens = int((result.shape[1] - ids.shape[1]) * ids.shape[0])
    out.update(seconds=times[1:], new_tokens=new_tokens, tokens=result.tolist())
    # transformers' own chunked prefill: the tokens the pipelined chunked run must equal
    chunked = _greedy(model, ids, mask, sizes["new_tokens"], prefill_chunk_size=sizes["prefill_chunk"])
    out["chunked_tokens"] = chunked.tolist()
    out["bound"] = _decode_bound(model, sizes)


def _decode_step_seconds(model, rows: int, past: int, reps: int, pause_s: float = 0.0,
                         median_of: bool = False) -> float:
    """Best-of-``reps`` (or median) time of one cached decode step of ``rows`` rows after ``past`` positions.

    ``pause_s``: sleep that long before each step, as a ring's rank waits for its peer's message
    between steps (a core that slept runs the next step slower on some machines).
    """
    import torch

    ids = torch.randint(3, model.config.vocab_size, (rows, past), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = ids[:, -1:]
        times = []
        for _ in range(reps):
            if pause_s:
                time.sleep(pause_s)
            t = time.perf_counter()
            model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            cache.crop(-1)  # back to ``past`` positions: every repetition measures the same step
    return median(times) if median_of else min(times)


def _decode_reps(sizes: dict) -> int:
    return 30 if sizes["new_tokens"] > 8 else 3


def _decode_bound(model, sizes: dict) -> dict:
    """One process's decode step, for the most a ``world``-stage decode ring with ``m = world``
    microbatches can gain on this machine.

    In steady state each rank runs its stage once per microbatch per token, so a token costs the
    slowest stage ``m * T(stage, rows / m)`` against ``T(model, rows)`` for one process. T(model)
    is measured here with transformers itself, at the middle of the run's context length; the
    stages' T, on the pipelined run's ranks with the same layers (:func:`_stage_steps`). On a CPU a
    matmul with fewer rows runs at fewer FLOP/s, so the bound sits below ``world``x.
    """
    world, rows = sizes["world"], sizes["prompts"]
    past = sizes["prompt_len"] + sizes["new_tokens"] // 2
    full_step_s = _decode_step_seconds(model, rows, past, _decode_reps(sizes))
    return {"microbatches": min(world, rows), "full_step_s": full_step_s}


@dataclass
class _Runs:
    """One rank's side of the pipelined job: the pipelined model, transformers' model, the prompts
    and this rank's share of them (the 2-way limit's process)."""

    model: Any
    hf: Any
    ids: Any
    mask: Any
    share: slice
    sizes: dict
    compiled: Any = None  # the same pipeline loaded with compile=True (its blocks compiled, decode steps too)
    v_layout: Any = None  # the same model loaded as zbv-zero-bubble places it: two stages per rank in a V

    def two_way(self, new_tokens: int | None = None) -> float:
        """The 2-way limit: every rank runs transformers' generate on its share of the prompts at once."""
        import torch
        import torch.distributed as dist

        new_tokens = self.sizes["new_tokens"] if new_tokens is None else new_tokens
        sync()
        t = time.perf_counter()
        _greedy(self.hf, self.ids[self.share], self.mask[self.share], new_tokens)
        took = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    def pipelined(self, new_tokens: int, model: Any = None, **kwargs) -> tuple[float, Any, Any]:
        """One pipelined generate of every prompt (by ``model``, default the plain pipeline), ranks starting
        together: the slowest rank's seconds (the call ends with the result's broadcast, so the ranks end
        together), ids, stats."""
        import torch
        import torch.distributed as dist

        sync()
        t = time.perf_counter()
        model = self.model if model is None else model
        tokens, stats = model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=new_tokens,
                                       do_sample=False, pad_token_id=0, return_stats=True, **kwargs)
        took = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took), tokens, stats


def _timed_runs(runs: _Runs, world: int) -> dict[str, Any]:
    """The timed pipelined calls: default and chunked prefill (each after a 2-way run), one microbatch,
    one microbatch more than ranks."""
    sizes = runs.sizes
    results = {}
    # One more microbatch than ranks: what hiding the message's latency behind another microbatch costs.
    # Chunked prefill: the prompt fed in chunks (transformers' prefill_chunk_size), so the pipeline's
    # prefill fills with chunks x microbatches units instead of microbatches.
    # Compiled: the same calls with every block compiled (inductor), decode steps included; its first call, which
    # compiles, is the warm-up (its seconds kept: what compiling costs once). V layout: the model as the
    # zero-bubble V schedules place it (two stages per rank), what a load that picks one generates with.
    kinds = (("pipelined", None, None), ("chunked_prefill", None, sizes["prefill_chunk"]), ("one_microbatch", 1, None),
             ("more_microbatches", world + 1, None), ("compiled", None, None), ("v_layout", None, None))
    models = {"compiled": runs.compiled, "v_layout": runs.v_layout}
    for label, m, chunk in kinds:
        times, stats, tokens, limit, splits = [], None, None, [], []
        for _ in range(sizes["gen_reps"] + 1):
            if label in ("pipelined", "chunked_prefill", "compiled", "v_layout"):
                limit.append(runs.two_way())
            took, tokens, stats = runs.pipelined(sizes["new_tokens"], model=models.get(label), n_microbatches=m,
                                                 prefill_chunk_size=chunk)
            times.append(took)
            splits.append({k: v / stats.seconds for k, v in stats.time_split.items()})
        results[label] = {"seconds": times[1:], "new_tokens": stats.new_tokens, "n_microbatches": stats.n_microbatches,
                          "tokens": tokens.tolist(), "prefill_steps": stats.prefill_steps,
                          "time_split": _every_rank(splits[1:]), "first_seconds": times[0]}
        if limit:
            results[label]["two_way_seconds"] = limit[1:]
    results["two_way_seconds"] = results["pipelined"]["two_way_seconds"]
    return results


def _every_rank(splits: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each rank's median share of its call's time per part of ``GenerationStats.time_split`` (compute,
    fill, wait, drain, other), gathered from every rank, in rank order."""
    import torch.distributed as dist

    mine = {k: median([s[k] for s in splits]) for k in splits[0]}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def _prefill_seconds(runs: _Runs) -> dict[str, list[float]]:
    """The prefill alone (calls for one new token; alternating): unchunked, chunked, and the 2-way
    processes'. A pipeline's prefill over p stages with u units in flight idles (p - 1) / (u + p - 1)."""
    prefill: dict[str, list[float]] = {"pipelined": [], "chunked_prefill": [], "two_way": []}
    for _ in range(max(3, runs.sizes["gen_reps"])):
        for label, chunk in (("pipelined", None), ("chunked_prefill", runs.sizes["prefill_chunk"])):
            prefill[label].append(runs.pipelined(1, prefill_chunk_size=chunk)[0])
        prefill["two_way"].append(runs.two_way(1))
    return prefill


def _per_token_seconds(runs: _Runs) -> dict[str, float]:
    """The ring's time per decoded token without the prefill and the call's fixed costs: calls for all
    the new tokens and for half of them, alternating; the difference of their medians per token.
    The same for the 2-way limit's processes (transformers' generate on each rank's share, both at once)."""
    full = runs.sizes["new_tokens"]
    half = full // 2
    calls: dict[int, list[float]] = {full: [], half: []}
    two_way_calls: dict[int, list[float]] = {full: [], half: []}
    # Differences of whole calls are noisy on a shared machine (a call moves by several percent between runs): three
    # times the timed runs' pairs.
    for _ in range(3 * runs.sizes["gen_reps"]):
        for n in calls:
            calls[n].append(runs.pipelined(n)[0])
            two_way_calls[n].append(runs.two_way(n))
    return {
        "decode_token_s": (median(calls[full]) - median(calls[half])) / (full - half),
        "two_way_token_s": (median(two_way_calls[full]) - median(two_way_calls[half])) / (full - half),
    }


def _profiled_idle(runs: _Runs, spec: dict) -> dict:
    """Each rank's idle fraction over one profiled call for the first (up to) 8 tokens; its timeline saved."""
    sizes, model = runs.sizes, runs.model
    with model.profile() as prof:
        model.generate(input_ids=runs.ids, attention_mask=runs.mask, max_new_tokens=min(sizes["new_tokens"], 8),
                       do_sample=False, pad_token_id=0)
    timeline = prof.timeline(title=f"generate: {sizes['prompts']} prompts, {model.plan.pp_size} ranks (first 8 tokens)")
    if model.ctx.is_main_process and spec.get("timeline_dir"):
        d = pathlib.Path(spec["timeline_dir"])
        timeline.save_png(d / "generate.png")
        timeline.save_chrome_trace(d / "generate.trace.json")
    return timeline.idle_fraction()


def _stage_steps(runs: _Runs, part, what: str, rows: int, past: int) -> dict[str, Any]:
    """Each rank's stage rebuilt from transformers' layers by this model's split: its decode step alone
    (ranks in turn) and on every rank at once (the cores share caches and memory bandwidth)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    reps = _decode_reps(runs.sizes)
    alone = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = _decode_step_seconds(part, rows, past, reps)
    dist.barrier()
    concurrent = _decode_step_seconds(part, rows, past, reps)
    steps = torch.zeros(2, world)
    steps[:, rank] = torch.tensor([alone, concurrent])
    dist.all_reduce(steps)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, what)
    return {"stage_parts": parts, "stage_steps_s": steps[0].tolist(), "concurrent_stage_steps_s": steps[1].tolist()}


def _torch_rings(runs: _Runs, part, rows: int, past: int, m: int) -> dict[str, float]:
    """The ring's pattern with these parts and torch's P2P alone (no hf_pipeline), and the same steps
    back to back without messages, alternating: what the pattern itself costs here.
    With them, transformers' whole model on each rank's share of the prompts (the 2-way limit's
    processes' decode steps without their generate loop), both ranks at once: what splitting the
    model into stages costs beside running it whole. Medians of 3, the slowest rank's."""
    import torch
    import torch.distributed as dist

    sizes, world = runs.sizes, dist.get_world_size()
    n = max(sizes["new_tokens"] // 2, 4)
    share = -(-sizes["prompts"] // world)
    trials = [(torch_ring_step_seconds(part, rows, past, m, n, ring=False),
               torch_ring_step_seconds(part, rows, past, m, n, ring=True),
               torch_ring_step_seconds(runs.hf, share, past, 1, n, ring=False)) for _ in range(3)]
    worst = torch.tensor([median([t[i] for t in trials]) for i in range(3)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    back_to_back, torch_ring, two_way_step = worst.tolist()
    return {"back_to_back_token_s": back_to_back, "torch_ring_token_s": torch_ring,
            "two_way_step_token_s": two_way_step}


def generate_pp(spec: dict, out: dict) -> None:
    """The pipelined side: timed calls beside the 2-way limit, the prefill alone, per-token times,
    the profiled idle, the stages' decode steps, the torch-only ring and one message's hop."""
    import torch
    import torch.distributed as dist
    import transformers

    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.generation.microbatches import microbatch_bounds

    sizes = spec["sizes"]
    model = AutoModelForCausalLM.from_pretrained(
        spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False)
    ids, mask = prompts(sizes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = microbatch_bounds(sizes["prompts"], world)[rank]
    compiled = AutoModelForCausalLM.from_pretrained(
        spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, compile=True)
    v_layout = AutoModelForCausalLM.from_pretrained(
        spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, schedule="zbv-zero-bubble")
    runs = _Runs(model=model, hf=hf, ids=ids, mask=mask, share=slice(lo, hi), sizes=sizes, compiled=compiled,
                 v_layout=v_layout)
    results = _timed_runs(runs, world)
    results["prefill_seconds"] = _prefill_seconds(runs)
    results.update(_per_token_seconds(runs))
    results["idle_fraction"] = _profiled_idle(runs, spec)
    part, what = stage_part(hf, model.plan, rank)
    m = min(world, sizes["prompts"])
    rows, past = -(-sizes["prompts"] // m), sizes["prompt_len"] + sizes["new_tokens"] // 2
    results.update(_stage_steps(runs, part, what, rows, past))
    results.update(_torch_rings(runs, part, rows, past, m))
    # One hop of the ring's message with nothing else running (median of 5 runs of 50 rounds).
    rounds = 50 if sizes["new_tokens"] > 8 else 5
    results["hop_s"] = median([hop_seconds((rows, 1, model.config.hidden_size + 1), rounds) for _ in range(5)])
    out.update(results)


TASKS = {"generate_hf": generate_hf, "generate_pp": generate_pp}


def launches(sizes: Sizes, ckpts: dict[str, str], *, timeline_dir: str) -> dict[int, list[dict]]:
    """The generate section's tasks by world size: the baseline and the pipelined job."""
    sz = asdict(sizes)
    return {
        1: [{"task": "generate_hf", "label": "generate transformers", "path": ckpts["train"], "sizes": sz}],
        sizes.world: [{"task": "generate_pp", "label": "generate pipelined", "path": ckpts["train"], "sizes": sz,
                       "timeline_dir": timeline_dir}],
    }
