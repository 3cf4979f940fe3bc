"""Load section, measuring side: per-rank peak RSS, bytes read and load time against a plain read.

A >= 1 GB LLaMA-architecture bf16 checkpoint loaded by hf_pipeline (each rank its stages) and by
transformers' ``from_pretrained`` on every rank (what accelerate's ``prepare_pippy`` needs), for
p = 1, 2, 4 ranks; each rank's load wall time against plainly reading its byte ranges. Then a mixture of
experts saved as transformers saves it (the mesh section's Mixtral, experts one tensor each, which the
loader merges into transformers' stacked tensors) by mesh (:data:`MOE_LOADS`): each rank's peak RSS against
the bytes it keeps, and the bytes it read.
"""

from __future__ import annotations

import gc
import time

from benchmarks.config import Sizes
from benchmarks.meters import PeakMeter, byte_ranges, drop_page_cache, kept, plain_read, touch
from benchmarks.timing import median, sync
from devtools.host_memory import trim_host_heap

__all__ = ["MOE_LOADS", "TASKS", "launches"]

# The mixture of experts' loads: (mesh, ranks, from_pretrained keyword arguments); those whose ranks are among
# ``load_ranks`` run (``--quick``: the first three).
MOE_LOADS: list[tuple[str, int, dict]] = [
    ("pp1", 1, {"num_stages": 1}),
    ("pp2", 2, {"num_stages": 2}),
    ("pp1 x ep2", 2, {"num_stages": 1, "ep_size": 2}),
    ("pp2 x ep2", 4, {"num_stages": 2, "ep_size": 2}),
]


def _load_read_pairs(spec: dict, ranges, n: int, *, cold: bool) -> list[tuple[float, float]]:
    """``n`` (load seconds, plain-read seconds) pairs of the same bytes, every rank at once; ``cold``:
    the page cache dropped right before each (fewer pairs, none, where the machine does not allow it)."""
    import torch
    import torch.distributed as dist

    from hf_pipeline import AutoModelForCausalLM

    rank = dist.get_rank() if dist.is_initialized() else 0

    def timed(fn) -> float | None:  # fn times itself (freeing what it read is not part of it)
        sync()
        if cold:
            flag = torch.tensor([1 if (drop_page_cache() if rank == 0 else True) else 0])
            if dist.is_initialized():
                dist.broadcast(flag, 0)
            if not int(flag):
                return None
            sync()
        return fn()

    def load() -> float:
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", progress=False)
        took = time.perf_counter() - t
        del model
        gc.collect()
        return took

    pairs = []
    for k in range(n):
        # Which goes first alternates: what one leaves behind (freed pages, the allocator's state,
        # the OS reclaiming memory) would otherwise always fall on the same side of the ratio.
        if k % 2 == 0:
            read = timed(lambda: plain_read(spec["path"], ranges))
            took = timed(load) if read is not None else None
        else:
            took = timed(load)
            read = timed(lambda: plain_read(spec["path"], ranges)) if took is not None else None
        if took is None or read is None:
            break
        pairs.append((took, read))
    return pairs


def _pair_medians(pairs: list[tuple[float, float]], prefix: str) -> dict[str, float | None]:
    """Median load and read seconds of ``pairs``, and the median of their ratios (None without pairs)."""
    return {
        f"{prefix}load_seconds": median([p[0] for p in pairs]) if pairs else None,
        f"{prefix}read_seconds": median([p[1] for p in pairs]) if pairs else None,
        f"{prefix}load_over_read": median([p[0] / p[1] for p in pairs]) if pairs else None,
    }


def load_ours(spec: dict, out: dict) -> None:
    """hf_pipeline's load on this rank: peak RSS, bytes read, then load time against a plain read."""
    from hf_pipeline import AutoModelForCausalLM

    # Warm-up on a tiny checkpoint of the same architecture: lazy imports and the process group
    # belong to the baseline, not to loading.
    AutoModelForCausalLM.from_pretrained(spec["warmup"], pipeline=True, device="cpu", progress=False)
    sync()
    with PeakMeter() as meter:
        model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", progress=False)
        touch(model.parameters())
    out.update(
        peak_rss=meter.peak, resettable=meter.resettable, base_rss=meter.base,
        stage_bytes=sum(p.numel() * p.element_size() for _, p in model.checkpoint_named_parameters()),
        bytes_read=model.load_report.bytes_read, files_opened=len(model.load_report.files_opened),
        stages=[s.spec.index for s in model.stages], pp_rank=model.dims.pp_rank,
    )
    # Load time against the read limit, in this process: the same byte ranges of the same files read
    # plainly (every rank reads at once, as they load at once).
    phases = dict(model.load_report.seconds)
    ranges = byte_ranges(spec["path"], model.load_report.keys_read)
    del model
    gc.collect()
    sync()
    # Pairs of (load, plain read), interleaved, every rank at once; medians, and the median of the
    # per-pair ratios (4 processes on 2 cores make single runs vary by 2x). Warm: pages cached (the
    # load above just read them). Cold: the page cache dropped before each read and each load (a
    # cold read is the disk's and the kernel's readahead's: one pair varied 1.0-1.4x between runs).
    warm = _load_read_pairs(spec, ranges, spec.get("warm_pairs", 7), cold=False)
    cold = _load_read_pairs(spec, ranges, spec.get("cold_pairs", 5), cold=True) if spec.get("cold") else []
    out.update(phases=phases, **_pair_medians(warm, ""), **_pair_medians(cold, "cold_"))
    sync()


def load_hf(spec: dict, out: dict) -> None:
    """transformers' ``from_pretrained`` of the whole model on this rank: peak RSS and the model's bytes."""
    import torch
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(spec["warmup"], dtype=torch.bfloat16)
    with PeakMeter() as meter:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.bfloat16)
        touch(model.parameters())
    out.update(
        peak_rss=meter.peak, resettable=meter.resettable, base_rss=meter.base,
        model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    del model
    gc.collect()
    sync()


def load_moe(spec: dict, out: dict) -> None:
    """hf_pipeline's load of the mixture of experts as ``spec["kwargs"]`` asks: peak RSS, bytes kept and read."""
    from hf_pipeline import AutoModelForCausalLM

    kwargs = spec["kwargs"]
    AutoModelForCausalLM.from_pretrained(spec["warmup"], pipeline=True, device="cpu", progress=False, **kwargs)
    # What this process freed before (the dense loads) goes back to the OS first, or this load would reuse it
    # unseen (glibc keeps freed heap) and its peak would read low.
    gc.collect()
    trim_host_heap()
    sync()
    with PeakMeter() as meter:
        model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", progress=False,
                                                     **kwargs)
        # local parts: an expert-parallel rank's DTensors read without collectives
        touch(p.to_local() if hasattr(p, "to_local") else p for _, p in model.checkpoint_named_parameters())
    out.update(peak_rss=meter.peak, resettable=meter.resettable, kept_bytes=kept(model)[1],
               bytes_read=model.load_report.bytes_read, stages=[s.spec.index for s in model.stages])
    del model
    gc.collect()
    trim_host_heap()
    sync()


TASKS = {"load_ours": load_ours, "load_hf": load_hf, "load_moe": load_moe}


def launches(sizes: Sizes, ckpts: dict[str, str], *, quick: bool) -> dict[int, list[dict]]:
    """The load section's tasks by world size: both loaders for every ``load_ranks``, then the mixture of
    experts' loads (:data:`MOE_LOADS`) on those ranks."""
    jobs: dict[int, list[dict]] = {}
    for p in sizes.load_ranks:
        jobs.setdefault(p, []).extend([
            # cold reads only in full runs: dropping the page cache slows whatever else the machine runs
            {"task": "load_ours", "label": f"load hf_pipeline p={p}", "path": ckpts["load"], "warmup": ckpts["warmup"],
             "cold": not quick},
            {"task": "load_hf", "label": f"load transformers p={p}", "path": ckpts["load"], "warmup": ckpts["warmup"]},
        ])
    for name, p, kwargs in MOE_LOADS:
        if p in sizes.load_ranks:
            jobs.setdefault(p, []).append({"task": "load_moe", "label": f"load moe {name}", "path": ckpts["moe"],
                                           "warmup": ckpts["moe_warmup"], "kwargs": kwargs})
    return jobs
