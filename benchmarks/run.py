"""One benchmark run: the sizes and sections from the options, the launches, the results summed up."""

from __future__ import annotations

import datetime
import os
import pathlib
import time
from dataclasses import asdict, replace
from typing import Any

from benchmarks import (
    checkpointing,
    generate,
    generate_results,
    load,
    load_results,
    lora,
    lora_results,
    mesh,
    serve,
    serve_capacity,
    serve_http,
    serve_results,
    train,
    train_results,
)
from benchmarks.checkpoints import cache_dir, checkpoints, decode_heavy_checkpoint
from benchmarks.config import SECTIONS, Sizes
from benchmarks.processes import launch, machine

__all__ = ["merge", "run_benchmark"]


def _sizes(args) -> Sizes:
    """``Sizes`` (``--quick``: tiny), with ``--load-ranks`` and ``--reps`` applied."""
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.load_ranks:
        sizes = replace(sizes, load_ranks=tuple(int(x) for x in args.load_ranks.split(",")))
    if args.reps:
        sizes = replace(sizes, train_reps=args.reps, gen_reps=args.reps)
    return sizes


def _sections(args) -> list[str]:
    sections = [s.strip() for s in args.sections.split(",")] if args.sections else list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return sections


def _http_models(args, sizes: Sizes) -> dict[str, str]:
    """The serve-http section's models by name: the bundled tiny default model, the decode-heavy random one."""
    from hf_pipeline.tools.default_model import default_model_path

    paths = {"tiny": default_model_path, "decode-heavy": lambda: decode_heavy_checkpoint(args, sizes)}
    return {name: str(paths[name]()) for name in sizes.http_models}


def _capacity_models(args, sizes: Sizes, ckpts: dict[str, str]) -> dict[str, str]:
    """The serve section's capacity models by name: its own (the train section's), and the serve-http section's."""
    return {"train model": ckpts["train"], **_http_models(args, sizes)}


def _launches(sections: list[str], sizes: Sizes, ckpts: dict[str, str], *, quick: bool, timeline_dir: str,
              capacity: dict[str, str]) -> dict[int, list[dict]]:
    """Which work runs in which launch: one launch per world size, fresh processes (peak RSS); each
    world's tasks in section order (load, train with the bubble, generate)."""
    per_section = []
    if "load" in sections:
        per_section.append(load.launches(sizes, ckpts, quick=quick))
    if "train" in sections or "bubble" in sections:
        per_section.append(train.launches(sizes, ckpts, timeline_dir=timeline_dir))
    if "generate" in sections:
        per_section.append(generate.launches(sizes, ckpts, timeline_dir=timeline_dir))
    if "checkpointing" in sections:
        per_section.append(checkpointing.launches(sizes, ckpts))
    if "lora" in sections:
        per_section.append(lora.launches(sizes, ckpts))
    if "serve" in sections:
        per_section.append(serve.launches(sizes, ckpts))
        per_section.append(serve_capacity.launches(sizes, capacity))
    if "mesh" in sections:
        per_section.append(mesh.launches(sizes, ckpts))
    launches: dict[int, list[dict]] = {}
    for jobs in per_section:
        for world, tasks in jobs.items():
            launches.setdefault(world, []).extend(tasks)
    return launches


def _errors(rank_results: list[dict]) -> list[str]:
    return [f"{r.get('label') or r['task']}: {r['error']}" for r in rank_results if not r.get("ok")]


def run_benchmark(args, log=print) -> dict[str, Any]:
    """Run the sections ``args`` asks for; returns ``results.json``'s content.

    Args:
        args: the parsed command line (see :func:`benchmarks.cli.main`), with ``argv`` set.
        log: where progress lines go.
    """
    sizes = _sizes(args)
    sections = _sections(args)
    timeline_dir = pathlib.Path(args.out) / "timelines"
    timeline_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log(f"hf_pipeline benchmark ({'quick' if args.quick else 'full'}): sections {', '.join(sections)}")
    ckpts = checkpoints(args, sizes)
    log(f"  checkpoints in {cache_dir(args)} (load checkpoint ready in {ckpts['load_seconds']} s)")
    results: dict[str, Any] = {
        "command": "python -m benchmarks " + " ".join(args.argv), "quick": bool(args.quick),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "sizes": asdict(sizes),
    }
    capacity = _capacity_models(args, sizes, ckpts) if "serve" in sections else {}
    launches = _launches(sections, sizes, ckpts, quick=args.quick, timeline_dir=str(timeline_dir), capacity=capacity)
    raw = {world: launch(world, launches[world], timeout=args.timeout, log=log) for world in sorted(launches)}
    results.update(summarize(raw, sections, sizes, ckpts, capacity=list(capacity)))
    if "serve-http" in sections:  # real servers, each its own processes: no launch of benchmark workers
        results["serve_http"] = serve_http.run(sizes, _http_models(args, sizes), device=args.http_device, log=log)
        results["errors"] += results["serve_http"]["errors"]
    results["seconds"] = time.time() - started
    results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return results


def summarize(raw: dict[int, list[list[dict]]], sections: list[str], sizes: Sizes,
              ckpts: dict[str, str], *, capacity: list[str] = ()) -> dict[str, Any]:
    """``results.json``'s errors and sections from ``raw``: per world size, each rank's task results."""
    def find(world: int, label: str) -> list[dict]:
        return [next(t for t in rr if t["label"] == label) for rr in raw.get(world, [])]

    errors = {e for per_rank in raw.values() for rr in per_rank for e in _errors(rr)}
    summary: dict[str, Any] = {"errors": sorted(errors)}
    if "load" in sections:
        summary["load"] = load_results.summarize(sizes, ckpts, find)
    if "train" in sections or "bubble" in sections:
        summary["train"] = train_results.summarize(sizes, find)
    if "generate" in sections:
        summary["generate"] = generate_results.summarize(sizes, find)
    if "checkpointing" in sections:
        summary["checkpointing"] = checkpointing.summarize(sizes, ckpts, find)
    if "lora" in sections:
        summary["lora"] = lora_results.summarize(sizes, find)
    if "serve" in sections:
        summary["serve"] = serve_results.summarize(sizes, find)
        summary["serve"]["capacity"] = serve_capacity.summarize(sizes, find, list(capacity))
        summary["errors"] += summary["serve"]["mismatches"]  # a speed figure for wrong tokens is an error
        summary["errors"] += summary["serve"]["capacity"]["mismatches"]
    if "mesh" in sections:
        summary["mesh"] = mesh.summarize(sizes, find)
    return summary


def merge(previous: dict[str, Any], new: dict[str, Any], sections: list[str]) -> dict[str, Any]:
    """``previous`` results with a partial rerun's ``new`` ones: only its sections replaced, the run listed."""
    # A partial rerun replaces only its sections (bubble numbers live in the train section).
    merged = dict(previous)
    for key in ("load", "train", "generate", "checkpointing", "lora", "serve", "mesh", "serve_http"):
        if key in new:
            merged[key] = new[key]
    run = {k: new[k] for k in ("command", "date", "seconds") if k in new}
    run |= {"sections": sections, "machine": new["machine"]}
    merged.setdefault("runs", []).append(run)
    for key in ("quick", "sizes", "errors"):
        merged[key] = new[key]
    return merged
