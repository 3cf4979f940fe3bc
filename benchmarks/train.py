"""Train section, measuring side: pipelined ``train_step`` per schedule against transformers.

Tokens/s of ``model.train_step`` per schedule on ``world`` ranks x 1 thread against one
transformers process x 1 thread, same global batch; beside each step, in the same job, the 2-way
limit (``world`` independent transformers processes on their shares of the batch). Each schedule's
job also profiles steps (the bubble section's figures) and measures one activation's hop; one more
job runs the fixed schedules' steps taking turns, each beside torch's own pipeline on its split.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import asdict
from typing import Any

from benchmarks.config import COMPILED, MEASURED, SCHEDULES, Sizes, is_fixed
from benchmarks.split_backward import split_backward_seconds
from benchmarks.timing import batch as make_batch
from benchmarks.timing import hop_seconds, median, sync
from benchmarks.torch_pipeline import torch_pipeline

__all__ = ["TASKS", "launches"]


def _accumulate(model, batch: dict, bounds: list[tuple[int, int]]) -> None:
    """Forward + backward of ``batch``'s rows ``bounds`` one piece after another, each loss weighted by
    its share of their rows (the gradients of one step on all of them)."""
    rows = bounds[-1][1] - bounds[0][0]
    for lo, hi in bounds:
        (model(**{k: v[lo:hi] for k, v in batch.items()}).loss * ((hi - lo) / rows)).backward()


def _whole_and_microbatched(model, batch: dict, n_microbatches: int,
                            reps: int) -> tuple[list[float], list[float], float]:
    """Seconds of forward + backward of ``batch`` in one piece and as ``n_microbatches`` one after
    another, alternating (each pair sees the machine alike; the first pair warms up); and the loss."""
    from hf_pipeline.generation.microbatches import microbatch_bounds

    rows = next(iter(batch.values())).shape[0]
    bounds = microbatch_bounds(rows, n_microbatches)
    whole, micro = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        whole.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        _accumulate(model, batch, bounds)
        micro.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return whole[1:], micro[1:], float(loss)


def train_hf(spec: dict, out: dict) -> None:
    """The baseline: one transformers process on the whole batch and on one rank's share, whole and microbatched."""
    import torch
    import transformers

    sizes = spec["sizes"]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32)
    model.train()
    batch = make_batch(sizes)
    # The whole batch, and the pipeline's microbatches of it (what perfect overlap spreads over the ranks).
    times, micro, loss = _whole_and_microbatched(model, batch, sizes["n_microbatches"], sizes["train_reps"])
    # The same on one rank's share of the batch, what each process of the 2-way limit trains: in one
    # piece, and as the microbatches a pipeline rank runs it in (the pipeline's microbatch size).
    rows = sizes["batch"] // sizes["world"]
    share = {k: v[:rows] for k, v in batch.items()}
    share_times, share_micro, _ = _whole_and_microbatched(
        model, share, max(1, sizes["n_microbatches"] // sizes["world"]), sizes["train_reps"])
    out.update(step_seconds=times, microbatched_seconds=micro, loss=loss, share_step_seconds=share_times,
               share_microbatched_seconds=share_micro, split_backward=split_backward_seconds(model, sizes))


def _two_way_step(reference, batch: dict, sizes: dict, *, microbatched: bool = False) -> float:
    """One transformers step on this rank's share of the batch, every rank at once: the 2-way
    limit (independent processes, no communication). With ``microbatched`` the share runs as the
    pipeline's microbatches one after another (gradients accumulated): perfect overlap measured
    directly, at the pipeline's microbatch size and with every core busy as in the pipeline.
    Returns the slowest rank's time."""
    import torch
    import torch.distributed as dist

    from hf_pipeline.generation.microbatches import microbatch_bounds

    lo, hi = microbatch_bounds(sizes["batch"], dist.get_world_size())[dist.get_rank()]
    pieces = [(lo, hi)]
    if microbatched:
        per_rank = max(1, sizes["n_microbatches"] // dist.get_world_size())
        pieces = [(lo + a, lo + b) for a, b in microbatch_bounds(hi - lo, per_rank)]
    sync()
    t = time.perf_counter()
    _accumulate(reference, batch, pieces)
    took = torch.tensor([time.perf_counter() - t])
    reference.zero_grad(set_to_none=True)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _timed_train_step(model, batch: dict) -> tuple[float, Any]:
    """Seconds of one pipelined ``train_step`` on this rank (ranks start together), and its loss; gradients cleared."""
    sync()
    t = time.perf_counter()
    loss = model.train_step(batch)
    took = time.perf_counter() - t
    for p in model.parameters():
        p.grad = None
    return took, loss


def _load_pipelined(spec: dict, sizes: dict, batch: dict, out: dict):
    """The schedule's pipelined model; for a MEASURED name, the planned model too (else None) and
    ``out["measured_split"]``: ``model.measure_split``'s advice, the returned model loaded with it."""
    import torch

    from hf_pipeline import AutoModelForCausalLM

    choice = _choice(spec["schedule"], spec["virtual_stages"], sizes)
    options = dict(pipeline=True, device="cpu", dtype=torch.float32, progress=False, **choice)
    model = AutoModelForCausalLM.from_pretrained(spec["path"], **options)
    if not spec["schedule"].endswith(MEASURED):
        return model, None
    # the planner's split measured, then loaded as advised
    advice = model.measure_split(batch)
    out["measured_split"] = {**advice.to_dict(), "text": str(advice)}
    # Both splits stay loaded and take turns: paired in one job, the machine's drifts fall on both.
    return AutoModelForCausalLM.from_pretrained(spec["path"], split=list(advice.split), **options), model


def _choice(name: str, virtual_stages: int | None, sizes: dict) -> dict:
    """``from_pretrained``'s schedule arguments for a row of SCHEDULES."""
    schedule = name.removesuffix(MEASURED).removesuffix(COMPILED)
    if schedule == "auto":
        return dict(schedule="auto", n_microbatches="auto", tune_batch=(sizes["batch"], sizes["seq"]))
    if schedule == "default":  # nothing named: the package's own choice
        return {}
    compiled = {"compile": {"backend": sizes["compile_backend"]}} if name.endswith(COMPILED) else {}
    return dict(schedule=schedule, virtual_stages=virtual_stages, n_microbatches=sizes["n_microbatches"], **compiled)


def _slowest(per_rank: list[float]) -> list[float]:
    """Every rank's step time, the warm-up dropped: the pipeline's step is as slow as its slowest rank."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    return [max(ts[i] for ts in gathered) for i in range(1, len(per_rank))]


def _step_microbatches(model, sizes: dict) -> int:
    """Microbatches a step of the benchmark's batch runs (a count the default chose adapts to each batch's shape, so
    the model's own ``n_microbatches``, planned for its load's batch, may not be it)."""
    return model.microbatches_for(sizes["batch"] // model.dims.dp_size, training=True, seq=sizes["seq"])


def _profiled_step(model, batch: dict, spec: dict, sizes: dict) -> dict[str, Any]:
    """Profiled steps of ``model``: the median one's (by wall time) idle, breakdown with one measured
    activation hop, per-rank busy and wall time, and whether the action order is the schedule's."""
    from hf_pipeline.tools.timeline import expected_vs_recorded

    # Several profiled steps; the figures below are the median one's (by wall time): a single step
    # now and then holds a stall of the machine (a few ms between two actions) that the others do not.
    with model.profile() as prof:
        for _ in range(3 if sizes["train_reps"] > 1 else 1):
            model.train_step(batch)
            for p in model.parameters():
                p.grad = None
    m = _step_microbatches(model, sizes)
    timeline = prof.timeline(title=f"{spec['schedule']}: {m} microbatches, "
                                   f"{model.plan.pp_size} ranks x {model.plan.virtual_stages} stages")
    steps = sorted({x.step for x in timeline.records})
    walls = {st: max(timeline.wall_seconds(r, st) for r in timeline.ranks) for st in steps}
    step = sorted(walls, key=walls.get)[len(walls) // 2]
    order = expected_vs_recorded(timeline, training=True, step=step)
    # One hop of a stage's activation (a microbatch's hidden states) between ranks, nothing else
    # running: the replay with it on every cross-rank dependency is the step with this machine's
    # message latency and no other time between actions.
    rows = max(1, sizes["batch"] // m // model.dims.dp_size)
    rounds = 20 if sizes["train_reps"] > 1 else 3
    hop = median([hop_seconds((rows, sizes["seq"], sizes["hidden"]), rounds) for _ in range(5)])
    if model.ctx.is_main_process and spec.get("timeline_dir"):
        d = pathlib.Path(spec["timeline_dir"])
        timeline.save_png(d / f"train-{spec['schedule']}.png", step=step)
        timeline.save_chrome_trace(d / f"train-{spec['schedule']}.trace.json")
    return dict(
        profiled_steps=len(walls), profiled_step=step, profiled_step_walls=list(walls.values()),
        idle_fraction=timeline.idle_fraction(step), activation_hop_s=hop,
        breakdown=timeline.breakdown(step, latency=hop),
        theoretical_idle_fraction=timeline.theoretical_idle_fraction(),
        order_matches={r: e == got for r, (e, got) in order.items()},
        busy_seconds={r: timeline.busy_seconds(r, step) for r in timeline.ranks},
        profiled_wall_seconds={r: timeline.wall_seconds(r, step) for r in timeline.ranks},
    )


def train_pp(spec: dict, out: dict) -> None:
    """One schedule's pipelined steps, each right after the 2-way limit's steps; then its profiled step."""
    import torch
    import transformers

    sizes = spec["sizes"]
    batch = make_batch(sizes)
    model, planned = _load_pipelined(spec, sizes, batch, out)
    # The 2-way limit runs in this job too, right before each pipelined step: every rank trains a
    # transformers model on its share of the batch at the same time. Both sides of each ratio are
    # measured within seconds of each other, so slow drifts of the machine's speed (other tenants
    # of the host) do not land on one side only.
    reference = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).train()
    times, two_way, two_way_micro, planned_times = [], [], [], []
    for _ in range(sizes["train_reps"] + 1):
        two_way.append(_two_way_step(reference, batch, sizes))
        two_way_micro.append(_two_way_step(reference, batch, sizes, microbatched=True))
        took, loss = _timed_train_step(model, batch)
        times.append(took)
        if planned is not None:
            planned_times.append(_timed_train_step(planned, batch)[0])
    del reference, planned
    step_seconds = _slowest(times)
    if planned_times:
        out["measured_split"]["planned_step_seconds"] = _slowest(planned_times)
    out.update(
        step_seconds=step_seconds, two_way_seconds=two_way[1:], two_way_microbatched_seconds=two_way_micro[1:],
        loss=float(loss), **_profiled_step(model, batch, spec, sizes),
        picked={"schedule": model.schedule.name, "virtual_stages": model.plan.virtual_stages,  # as this batch runs
                "n_microbatches": _step_microbatches(model, sizes)},
        split=list(model.plan.split_points),
    )


def _paired_models(spec: dict, sizes: dict, reference):
    """Every fixed schedule but GPipe loaded, torch's own pipeline of each one's split (where it has
    one), and why the others have none."""
    import torch

    from hf_pipeline import AutoModelForCausalLM

    models = {  # the fixed schedules, the default and the compiled one, in SCHEDULES' order
        name: AutoModelForCausalLM.from_pretrained(
            spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, **_choice(name, v, sizes))
        for name, v in SCHEDULES if name not in ("auto", "gpipe") and not name.endswith(MEASURED)
    }
    torch_only, torch_only_errors = {}, {}
    for name, model in models.items():
        if not is_fixed(name):
            torch_only_errors[name] = "no torch-only twin: not a fixed schedule"
            continue
        try:
            torch_only[name] = torch_pipeline(reference, model.plan, name, sizes["n_microbatches"])
        except ValueError as e:  # a split inside a layer: that schedule has no torch-only twin
            torch_only_errors[name] = str(e)
    return models, torch_only, torch_only_errors


def train_paired(spec: dict, out: dict) -> None:
    """Every fixed schedule loaded in one job, their steps taking turns with the microbatched 2-way
    step (perfect overlap measured): the schedules compared on the same seconds of the machine, where
    each schedule's own job (:func:`train_pp`) sees the machine at another time. Beside each, the
    same split run by torch's own pipeline (:func:`~benchmarks.torch_pipeline.torch_pipeline`), its
    step right after hf_pipeline's. GPipe is left out: it alone keeps every microbatch's activations
    alive at once, and in a process shared with other models its step swung between 1.8 and 5.0 s
    (1.7 s in its own job), which would not compare schedules."""
    import torch
    import torch.distributed as dist
    import transformers

    sizes = spec["sizes"]
    batch = make_batch(sizes)
    reference = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).train()
    models, torch_only, torch_only_errors = _paired_models(spec, sizes, reference)
    times: dict[str, list[float]] = {name: [] for name in models}
    torch_times: dict[str, list[float]] = {name: [] for name in torch_only}
    losses: dict[str, list[float]] = {name: [] for name in torch_only}
    limit = []
    for i in range(sizes["train_reps"] + 1):
        took = [_two_way_step(reference, batch, sizes, microbatched=True)]
        for name, model in models.items():
            seconds, loss = _timed_train_step(model, batch)
            took.append(seconds)
            if name in torch_only:
                seconds, torch_loss = torch_only[name](batch)
                took.append(seconds)
                losses[name].append([float(loss), torch_loss])
        slowest = torch.tensor(took)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a pipeline step is as slow as its slowest rank
        if i:
            steps = iter(slowest.tolist())
            limit.append(next(steps))
            for name in models:
                times[name].append(next(steps))
                if name in torch_only:
                    torch_times[name].append(next(steps))
    out.update(step_seconds=times, two_way_microbatched_seconds=limit, torch_only_step_seconds=torch_times,
               torch_only_losses=losses, torch_only_errors=torch_only_errors)


TASKS = {"train_hf": train_hf, "train_pp": train_pp, "train_paired": train_paired}


def launches(sizes: Sizes, ckpts: dict[str, str], *, timeline_dir: str) -> dict[int, list[dict]]:
    """The train (and bubble) section's tasks by world size: the baseline, each schedule's job, the paired job."""
    sz = asdict(sizes)
    baseline = {"task": "train_hf", "label": "train transformers", "path": ckpts["train"], "sizes": sz}
    jobs: dict[int, list[dict]] = {1: [baseline]}
    pipelined = jobs.setdefault(sizes.world, [])
    for name, v in SCHEDULES:
        pipelined.append({
            "task": "train_pp", "label": f"train {name}", "path": ckpts["train"], "sizes": sz, "schedule": name,
            "virtual_stages": v, "timeline_dir": timeline_dir,
        })
    pipelined.append({"task": "train_paired", "label": "train paired", "path": ckpts["train"], "sizes": sz})
    return jobs
