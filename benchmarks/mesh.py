"""Mesh section: per-rank load memory, bytes read and one training step, for several meshes of 4 ranks, of a
dense model and of a mixture of experts (with expert parallelism; its rows also time ``generate``).

For each mesh of :data:`MESHES` (``from_pretrained`` keyword arguments, data: a mesh the package
refuses is recorded as ``refused: <message>``, so a row starts to measure once its feature exists),
every rank:

* loads the load section's checkpoint (>= 1 GB): the peak RSS above the post-import baseline, the
  bytes it read, and the bytes of parameters it keeps (its tensor-parallel slices / fsdp shards);
* loads the train section's model and times ``train_step`` + AdamW (the median of a few steps
  after a warm-up; informational on a 2-core machine, where 4 ranks share 2 cores).

Results side (:func:`summarize`): per mesh, per rank, peak / kept (target <= 1.05x) and bytes read
/ kept (about 1: a tensor-parallel rank reads its slices, not the whole stage).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from benchmarks.config import Sizes
from benchmarks.meters import PeakMeter, kept
from benchmarks.tables import Table, gb
from benchmarks.timing import batch, sync
from devtools.host_memory import trim_host_heap

__all__ = ["MESHES", "MOE_MESHES", "TASKS", "launches", "markdown", "readme", "summarize"]

WORLD = 4
# (name, from_pretrained keyword arguments) on WORLD ranks: the LLaMA checkpoints...
MESHES: list[tuple[str, dict[str, Any]]] = [
    ("pp4", {"num_stages": 4}),
    ("pp2 x tp2", {"num_stages": 2, "tp_size": 2}),
    ("pp2 x fsdp2", {"num_stages": 2, "fsdp_size": 2}),
]
# ... and a mixture of experts (Mixtral-shaped, saved as transformers saves it: experts one tensor each), whose
# rows also time greedy generate.
MOE_MESHES: list[tuple[str, dict[str, Any]]] = [
    ("moe pp4", {"num_stages": 4}),
    ("moe pp2 x ep2", {"num_stages": 2, "ep_size": 2}),
    ("moe pp2 x tp2 x ep2", {"num_stages": 2, "tp_size": 2, "ep_size": 2}),
    ("moe pp1 x fsdp2 x ep2", {"num_stages": 1, "fsdp_size": 2, "ep_size": 2}),
    # experts over the data-parallel ranks (each rank a quarter / half of the experts; rows differ by replica)
    ("moe pp2 x dp2, ep2 over dp", {"num_stages": 2, "ep_size": 2, "ep_over": "data"}),
    ("moe fsdp4, ep4 over fsdp", {"num_stages": 1, "fsdp_size": 4, "ep_size": 4, "ep_over": "data",
                                  "n_microbatches": 1}),  # one stage: a quarter of the batch in one microbatch
]
STEPS = 2  # timed steps after one warm-up


def mesh_rank(task: dict, out: dict) -> None:
    """One mesh on this rank: the load's memory and bytes, then the train step's time (or the refusal)."""
    import torch

    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.errors import PipelineError

    kwargs = task["kwargs"]
    out.update(mesh=task["mesh"], kwargs=kwargs)
    try:  # the warm-up (lazy imports, process groups) on the tiny checkpoint; a refused mesh stops here
        AutoModelForCausalLM.from_pretrained(task["warmup"], pipeline=True, device="cpu", progress=False, **kwargs)
    except PipelineError as e:  # every rank gets it: a feature this version does not have (yet)
        out["refused"] = f"{type(e).__name__}: {e}"
        return
    # The meshes run one after another in one process: what the previous one freed goes back to the OS
    # first, or this load would reuse it unseen (glibc keeps freed heap) and its peak would read low.
    gc.collect()
    trim_host_heap()
    sync()
    with PeakMeter() as meter:
        model = AutoModelForCausalLM.from_pretrained(task["path"], pipeline=True, device="cpu", progress=False,
                                                     **kwargs)
        with torch.no_grad():  # read every weight once, as a first forward would (local parts: no collectives)
            for _, p in model.checkpoint_named_parameters():
                (p.to_local() if hasattr(p, "to_local") else p).sum()
    params, kept_bytes = kept(model)
    dims = model.dims
    out.update(peak_rss=meter.peak, resettable=meter.resettable, kept_params=params, kept_bytes=kept_bytes,
               bytes_read=model.load_report.bytes_read,
               place=[dims.dp_rank // dims.fsdp_size, dims.fsdp_rank, dims.pp_rank, dims.tp_rank])  # mesh coordinates
    del model
    gc.collect()
    sync()

    model = AutoModelForCausalLM.from_pretrained(task["train_path"], pipeline=True, device="cpu", progress=False,
                                                 **{"n_microbatches": task["sizes"]["n_microbatches"], **kwargs})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batch(task["sizes"])
    seconds = []
    for step in range(STEPS + 1):
        sync()
        t = time.perf_counter()
        model.train_step(data)
        opt.step()
        opt.zero_grad()
        if step:
            seconds.append(time.perf_counter() - t)
    out.update(step_seconds=seconds, train_kept_bytes=kept(model)[1])
    if task.get("generate"):
        out["generate_tokens_per_s"] = _generate_rate(model, task["sizes"])
    del model, opt
    gc.collect()
    trim_host_heap()
    sync()


def _generate_rate(model, sizes: dict) -> float:
    """Greedy tokens per second of one ``generate`` call (the generate section's prompts), after a warm-up."""
    import torch

    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, sizes["vocab"], (sizes["prompts"], sizes["prompt_len"]), generator=g)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=2, **kwargs)
    sync()
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=sizes["new_tokens"], **kwargs)
    sync()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t)


TASKS = {"mesh_rank": mesh_rank}


def launches(sizes: Sizes, ckpts: dict[str, str]) -> dict[int, list[dict]]:
    """The mesh section's tasks: every mesh, in one launch of :data:`WORLD` ranks."""
    from dataclasses import asdict

    sz = asdict(sizes)
    dense = [
        {"task": "mesh_rank", "label": f"mesh {name}", "mesh": name, "kwargs": kwargs, "path": ckpts["load"],
         "warmup": ckpts["warmup"], "train_path": ckpts["train"], "sizes": sz}
        for name, kwargs in MESHES
    ]
    experts = [
        {"task": "mesh_rank", "label": f"mesh {name}", "mesh": name, "kwargs": kwargs, "path": ckpts["moe"],
         "warmup": ckpts["moe_warmup"], "train_path": ckpts["moe"], "sizes": sz, "generate": True}
        for name, kwargs in MOE_MESHES
    ]
    return {WORLD: dense + experts}


# --------------------------------------------------------------------------------------------- results
def summarize(sizes: Sizes, find) -> dict[str, Any]:
    """results.json's ``mesh``: per mesh, per rank figures and the worst ratios, or why it did not run."""
    meshes = []
    for name, kwargs in MESHES + MOE_MESHES:
        ranks = find(WORLD, f"mesh {name}")
        row: dict[str, Any] = {"mesh": name, "kwargs": kwargs}
        failed = [r.get("error", "") for r in ranks if not r.get("ok")]
        refused = {r["refused"] for r in ranks if r.get("ok") and "refused" in r}
        if failed or refused or not ranks:
            row["refused" if refused and not failed else "error"] = "; ".join(sorted(refused) or failed) or "no ranks"
            meshes.append(row)
            continue
        row["ranks"] = [{k: r[k] for k in ("place", "peak_rss", "kept_bytes", "kept_params", "bytes_read",
                                          "step_seconds", "resettable")} for r in ranks]
        row["peak_over_kept"] = max(r["peak_rss"] / r["kept_bytes"] for r in ranks)
        row["read_over_kept"] = max(r["bytes_read"] / r["kept_bytes"] for r in ranks)
        row["step_seconds"] = statistics.median(s for r in ranks for s in r["step_seconds"])
        if all("generate_tokens_per_s" in r for r in ranks):  # every rank returns the call: the slowest is its rate
            row["generate_tokens_per_s"] = min(r["generate_tokens_per_s"] for r in ranks)
        meshes.append(row)
    return {"world": WORLD, "steps": STEPS, "meshes": meshes}


def markdown(res: dict[str, Any]) -> list:
    """The mesh section's block of results.md."""
    mesh = res.get("mesh")
    if not mesh:
        return []
    t = Table(["mesh", "rank (dp, fsdp, pp, tp)", "kept", "bytes read", "read / kept", "peak RSS", "peak / kept",
               "train step (s, median)", "generate (tok/s)"])
    for row in mesh["meshes"]:
        if "ranks" not in row:
            why = f"{'refused' if 'refused' in row else 'error'}: {(row.get('refused') or row.get('error', ''))[:160]}"
            t.add(row["mesh"], *([None] * 7), why)
            continue
        rate = row.get("generate_tokens_per_s")
        for r in row["ranks"]:
            kept = r["kept_bytes"]
            t.add(row["mesh"], str(tuple(r["place"])), gb(kept), gb(r["bytes_read"]), f"{r['bytes_read'] / kept:.2f}x",
                  gb(r["peak_rss"]), f"{r['peak_rss'] / kept:.2f}x", f"{statistics.median(r['step_seconds']):.3f}",
                  None if rate is None else f"{rate:.1f}")
    return [
        "## Meshes: per-rank load memory and a train step on 4 ranks", "",
        f"The load section's checkpoint loaded on {mesh['world']} ranks as each mesh (``from_pretrained`` "
        "keyword arguments in results.json): the parameters each rank keeps (tensor-parallel slices, fsdp "
        "shards), the bytes it read, and its peak RSS above the post-import baseline while loading. Then the "
        f"train section's model on the same mesh: ``train_step`` + AdamW, median of {mesh['steps']} steps after a "
        "warm-up (informational: 4 ranks share the machine's cores). The ``moe`` rows load a Mixtral-shaped "
        "mixture of experts saved as transformers saves it (experts one tensor each) for both, and time greedy "
        "``generate`` of the generate section's prompts (the slowest rank's tokens/s). A mesh this version "
        "refuses says why.", "",
        t, "",
    ]


def readme(res: dict[str, Any]) -> list:
    """README's mesh table: per mesh, its worst rank's figures."""
    mesh = res.get("mesh")
    if not mesh:
        return []
    t = Table(["mesh", "kept per rank (largest)", "bytes read / kept", "peak RSS / kept", "train step (s)",
               "generate (tok/s)"])
    for row in mesh["meshes"]:
        if "ranks" not in row:
            t.add(row["mesh"], None, None, None, None, ("refused" if "refused" in row else "error"))
            continue
        rate = row.get("generate_tokens_per_s")
        t.add(row["mesh"], gb(max(r["kept_bytes"] for r in row["ranks"])), f"{row['read_over_kept']:.2f}x",
              f"{row['peak_over_kept']:.2f}x", f"{row['step_seconds']:.3f}", None if rate is None else f"{rate:.1f}")
    return [f"Meshes on {mesh['world']} ranks (the load checkpoint, and the train model's shape as a dense LLaMA and "
            "as a Mixtral of 8 experts saved one tensor per expert; 4 ranks share the 2 cores, so step times and "
            "tokens/s are informational):", "", t, ""]
