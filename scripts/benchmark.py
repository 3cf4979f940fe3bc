"""Benchmarks side by side: every figure is a ratio against a baseline measured in the same run.

    python scripts/benchmark.py                      # the full run (several minutes), writes bench_results/
    python scripts/benchmark.py --quick              # tiny sizes, every section, seconds (what CI runs), writes bench_out/quick/
    python scripts/benchmark.py --sections train,generate   # rerun some sections, merged into results.json
    hf-pipeline bench [same options]

Sections (multi-rank parts run under ``torchrun``, 1 thread per rank, OMP_NUM_THREADS=1; each
baseline runs in the same invocation):
  load      a >= 1 GB LLaMA-architecture bf16 checkpoint in >= 4 safetensors shards (random weights,
            written shard by shard and cached): per-rank peak RSS above the post-import baseline
            (the OS's high-water mark, VmHWM, reset before each load) and bytes read, for p = 1, 2, 4,
            against transformers ``from_pretrained`` on every rank (what accelerate's prepare_pippy needs);
            each rank's load wall time against plainly reading the same byte ranges (warm and cold).
  train     tokens/s of ``model.train_step`` per schedule on 2 ranks x 1 thread against one
            transformers process x 1 thread, same global batch (LLaMA hidden 384, 12 layers, GQA,
            vocab 8192, seq 128, batch 16, 8 microbatches); and as fractions of the machine's limit,
            measured in the same run: 2 independent transformers processes on half the batch each,
            paid the cost of small microbatches (perfect overlap).
  generate  tokens/s of pipelined greedy ``generate`` (2 ranks) against transformers' ``generate``
            on one process, against a one-microbatch pipeline, and against the 2-way limit
            (2 independent processes on half the prompts each); 16 prompts x 32 tokens, 64 new tokens.
  bubble    per-rank idle fraction of one profiled training step per schedule (from per-action
            timings, hf_pipeline.tools.profile) beside the schedule's theoretical bubble; Gantt PNGs and
            Chrome traces go to ``<out>/timelines/``.

Writes ``<out>/results.md`` (the tables, the command and the machine) and ``<out>/results.json``.
``--out`` defaults to ``bench_results/`` (committed) for full runs and to ``bench_out/quick/`` (ignored
by git) for ``--quick``, whose tiny sizes make numbers that only show the script works.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # run from a checkout without installing the package
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/_common.py
from _common import host_peak_rss, host_rss, reset_host_peak  # noqa: E402

from hf_pipeline.training.checkpoint import replace_file  # noqa: E402

# (schedule, stages per rank); "auto": schedule="auto", n_microbatches="auto" (the cost model's pick);
# a name ending in MEASURED: that schedule loaded again with the split model.measure_split() advises.
MEASURED = "+measured-split"
SCHEDULES = [
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2), ("zbv-zero-bubble", 2), ("dualpipev", 2),
    ("auto", None), ("zbv-zero-bubble" + MEASURED, 2),
]
SECTIONS = ("load", "train", "generate", "bubble")


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Everything a run's size depends on; ``--quick`` swaps in tiny values."""

    # load: the >= 1 GB checkpoint
    load_hidden: int = 2048
    load_intermediate: int = 5632
    load_layers: int = 12
    load_heads: int = 16
    load_kv_heads: int = 4
    load_vocab: int = 32000
    load_shard_bytes: int = 100_000_000
    load_ranks: tuple[int, ...] = (1, 2, 4)
    # train / generate model: LLaMA-architecture, 12 layers, GQA
    hidden: int = 384
    intermediate: int = 1024  # ~8/3 x hidden, as LLaMA
    layers: int = 12
    heads: int = 6
    kv_heads: int = 2
    vocab: int = 8192
    seq: int = 128
    batch: int = 16
    n_microbatches: int = 8
    train_reps: int = 6
    prompts: int = 16
    prompt_len: int = 32
    prefill_chunk: int = 16  # the chunked-prefill run's prefill_chunk_size: 2 chunks of the prompt
    new_tokens: int = 64
    gen_reps: int = 3
    world: int = 2

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            load_hidden=64, load_intermediate=128, load_layers=4, load_heads=4, load_kv_heads=2, load_vocab=512,
            load_shard_bytes=60_000, load_ranks=(1, 2), hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=256,
            seq=16, batch=8, n_microbatches=4, train_reps=1, prompts=4, prompt_len=8, prefill_chunk=2, new_tokens=8, gen_reps=1,
        )


# ----------------------------------------------------------------------------- checkpoints
def _llama_config(*, hidden, intermediate, layers, heads, kv_heads, vocab, max_pos, dtype):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max_pos, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, dtype=dtype,
    )


def write_random_checkpoint(directory: pathlib.Path, config, *, shard_bytes: int, seed: int = 0) -> pathlib.Path:
    """A sharded safetensors checkpoint of ``config`` with random weights, written tensor by tensor.

    Nothing close to the model's size is ever in memory: parameter names and shapes come from the
    model on the meta device, each shard's tensors are drawn, written and dropped. The layout is
    what ``save_pretrained(max_shard_size=...)`` writes (shards + index + config.json), and a
    ``.complete`` marker makes the directory a cache: an existing complete directory is reused.
    """
    import torch
    from safetensors.torch import save_file

    from hf_pipeline.loading.stages import meta_model

    directory = pathlib.Path(directory)
    if (directory / ".complete").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    meta = meta_model(config, "AutoModelForCausalLM")
    entries = [(name, tuple(t.shape)) for name, t in meta.state_dict().items()]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = itemsize * (1 if not shape else int(torch.Size(shape).numel()))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(directory)
    (directory / ".complete").write_text("ok\n")
    return directory


def _cache_dir(args) -> pathlib.Path:
    if args.cache_dir:
        return pathlib.Path(args.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hf_pipeline" / "bench"


def _checkpoints(args, sizes: Sizes) -> dict[str, str]:
    import torch

    root = _cache_dir(args)
    s = sizes
    load_cfg = _llama_config(
        hidden=s.load_hidden, intermediate=s.load_intermediate, layers=s.load_layers, heads=s.load_heads,
        kv_heads=s.load_kv_heads, vocab=s.load_vocab, max_pos=256, dtype="bfloat16",
    )
    q = Sizes.quick()
    warm_cfg = _llama_config(
        hidden=q.load_hidden, intermediate=q.load_intermediate, layers=q.load_layers, heads=q.load_heads,
        kv_heads=q.load_kv_heads, vocab=q.load_vocab, max_pos=256, dtype="bfloat16",
    )
    warmup = write_random_checkpoint(root / "warmup", warm_cfg, shard_bytes=q.load_shard_bytes)
    tag = f"load-h{s.load_hidden}-l{s.load_layers}-v{s.load_vocab}-s{s.load_shard_bytes}"
    t = time.perf_counter()
    load = write_random_checkpoint(root / tag, load_cfg, shard_bytes=s.load_shard_bytes)
    created = time.perf_counter() - t
    train_cfg = _llama_config(
        hidden=s.hidden, intermediate=s.intermediate, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, vocab=s.vocab,
        max_pos=max(256, s.seq, s.prompt_len + s.new_tokens), dtype="float32",
    )
    train = write_random_checkpoint(root / f"train-h{s.hidden}-l{s.layers}-kv{s.kv_heads}-v{s.vocab}", train_cfg, shard_bytes=16_000_000)
    del torch
    return {"load": str(load), "warmup": str(warmup), "train": str(train), "load_seconds": f"{created:.1f}"}


# ----------------------------------------------------------------------------- memory readings
def _touch(params) -> None:
    # transformers maps same-dtype safetensors weights lazily (views of the file mapping): their pages
    # are read, and count as resident, only when first used. Reading every weight once, as the first
    # forward would, makes both loaders' numbers mean "the weights are in memory".
    import torch

    with torch.no_grad():
        for p in params:
            p.sum()


class _PeakMeter:
    """Peak RSS above the RSS at entry, as the OS counts it (mapped file pages included)."""

    def __enter__(self):
        gc.collect()
        self.resettable = reset_host_peak()
        self.base = host_rss()
        return self

    def __exit__(self, *exc):
        self.peak = host_peak_rss() - self.base


# ----------------------------------------------------------------------------- worker side
def _sync(model=None):
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _byte_ranges(directory: str, keys: list[str]) -> dict[str, list[tuple[int, int]]]:
    """file -> sorted (offset, length) of ``keys``' stored bytes, from the safetensors headers."""
    index = json.loads(pathlib.Path(directory, "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(index["weight_map"][key], []).append(key)
    ranges = {}
    for fname, names in by_file.items():
        with open(pathlib.Path(directory, fname), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        ranges[fname] = sorted((8 + n + header[k]["data_offsets"][0], header[k]["data_offsets"][1] - header[k]["data_offsets"][0]) for k in names)
    return ranges


def _plain_read(directory: str, ranges: dict[str, list[tuple[int, int]]]) -> float:
    """Seconds to read these byte ranges into fresh memory, one file after another: the least any
    loader of the same tensors does (open, read into memory it allocates), nothing parsed or built.

    Fresh means never touched: anonymous mappings, so every page is faulted in and zeroed by the OS
    as a loader's new tensors are. (Buffers from the allocator would reuse the pages the model just
    freed, already mapped, and read several times faster than any first load can.)"""
    import mmap

    t = time.perf_counter()
    kept = []
    for fname, spans in ranges.items():
        with open(pathlib.Path(directory, fname), "rb", buffering=0) as f:
            for offset, length in spans:
                buf = mmap.mmap(-1, length)
                f.seek(offset)
                view, done = memoryview(buf), 0
                while done < length:
                    done += f.readinto(view[done:])
                view.release()
                kept.append(buf)  # held until the end, as a loader holds its tensors
    took = time.perf_counter() - t
    for buf in kept:
        buf.close()
    return took


def _drop_page_cache() -> bool:
    """Empty the OS page cache (needs root; False where the machine does not allow it)."""
    try:
        os.sync()
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def _load_read_pairs(spec: dict, ranges, n: int, *, cold: bool) -> list[tuple[float, float]]:
    """``n`` (load seconds, plain-read seconds) pairs of the same bytes, every rank at once; ``cold``:
    the page cache dropped right before each (fewer pairs, none, where the machine does not allow it)."""
    import torch
    import torch.distributed as dist

    from hf_pipeline import AutoModelForCausalLM

    rank = dist.get_rank() if dist.is_initialized() else 0

    def timed(fn) -> float | None:  # fn times itself (freeing what it read is not part of it)
        _sync()
        if cold:
            flag = torch.tensor([1 if (_drop_page_cache() if rank == 0 else True) else 0])
            if dist.is_initialized():
                dist.broadcast(flag, 0)
            if not int(flag):
                return None
            _sync()
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
            read = timed(lambda: _plain_read(spec["path"], ranges))
            took = timed(load) if read is not None else None
        else:
            took = timed(load)
            read = timed(lambda: _plain_read(spec["path"], ranges)) if took is not None else None
        if took is None or read is None:
            break
        pairs.append((took, read))
    return pairs


def _pair_medians(pairs: list[tuple[float, float]], prefix: str) -> dict[str, float | None]:
    """Median load and read seconds of ``pairs``, and the median of their ratios (None without pairs)."""
    return {
        f"{prefix}load_seconds": _median([p[0] for p in pairs]) if pairs else None,
        f"{prefix}read_seconds": _median([p[1] for p in pairs]) if pairs else None,
        f"{prefix}load_over_read": _median([p[0] / p[1] for p in pairs]) if pairs else None,
    }


def _task_load_ours(spec: dict, out: dict) -> None:
    from hf_pipeline import AutoModelForCausalLM

    # Warm-up on a tiny checkpoint of the same architecture: lazy imports and the process group
    # belong to the baseline, not to loading.
    AutoModelForCausalLM.from_pretrained(spec["warmup"], pipeline=True, device="cpu", progress=False)
    _sync()
    with _PeakMeter() as meter:
        model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", progress=False)
        _touch(model.parameters())
    out.update(
        peak_rss=meter.peak, resettable=meter.resettable, base_rss=meter.base,
        stage_bytes=sum(p.numel() * p.element_size() for _, p in model.checkpoint_named_parameters()),
        bytes_read=model.load_report.bytes_read, files_opened=len(model.load_report.files_opened),
        stages=[s.spec.index for s in model.stages], pp_rank=model.dims.pp_rank,
    )
    # Load time against the read limit, in this process: the same byte ranges of the same files read
    # plainly (every rank reads at once, as they load at once).
    phases = dict(model.load_report.seconds)
    ranges = _byte_ranges(spec["path"], model.load_report.keys_read)
    del model
    gc.collect()
    _sync()
    # Pairs of (load, plain read), interleaved, every rank at once; medians, and the median of the
    # per-pair ratios (4 processes on 2 cores make single runs vary by 2x). Warm: pages cached (the
    # load above just read them). Cold: the page cache dropped before each read and each load (a
    # cold read is the disk's and the kernel's readahead's: one pair varied 1.0-1.4x between runs).
    warm = _load_read_pairs(spec, ranges, spec.get("warm_pairs", 7), cold=False)
    cold = _load_read_pairs(spec, ranges, spec.get("cold_pairs", 5), cold=True) if spec.get("cold") else []
    out.update(phases=phases, **_pair_medians(warm, ""), **_pair_medians(cold, "cold_"))
    _sync()


def _task_load_hf(spec: dict, out: dict) -> None:
    import torch
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(spec["warmup"], dtype=torch.bfloat16)
    with _PeakMeter() as meter:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.bfloat16)
        _touch(model.parameters())
    out.update(
        peak_rss=meter.peak, resettable=meter.resettable, base_rss=meter.base,
        model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    del model
    gc.collect()
    _sync()


def _batch(sizes: dict, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _prompts(sizes: dict, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sizes["vocab"], (sizes["prompts"], sizes["prompt_len"]), generator=g)
    return ids, torch.ones_like(ids)


def _accumulate(model, batch: dict, bounds: list[tuple[int, int]]) -> None:
    """Forward + backward of ``batch``'s rows ``bounds`` one piece after another, each loss weighted by
    its share of their rows (the gradients of one step on all of them)."""
    rows = bounds[-1][1] - bounds[0][0]
    for lo, hi in bounds:
        (model(**{k: v[lo:hi] for k, v in batch.items()}).loss * ((hi - lo) / rows)).backward()


def _whole_and_microbatched(model, batch: dict, n_microbatches: int, reps: int) -> tuple[list[float], list[float], float]:
    """Seconds of forward + backward of ``batch`` in one piece and as ``n_microbatches`` one after
    another, alternating (each pair sees the machine alike; the first pair warms up); and the loss."""
    from hf_pipeline.generation.sampling import microbatch_bounds

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


def _split_backward_seconds(model, sizes: dict) -> dict[str, float]:
    """One rank's share of the decoder layers (transformers' own) on one pipeline microbatch: the
    seconds of its forward, its full backward, and a zero-bubble schedule's split backward, input
    pass (I) then weight pass (W), two ways: hf_pipeline's (``weight_pass.py``: I is the full
    backward with the linears' weight matmuls left out, W those matmuls) and torch's generic one
    (``stage_backward_input`` / ``stage_backward_weight``). Alternating, medians. What the split
    costs on this machine, apart from any pipeline."""
    import torch
    from torch.distributed.pipelining import _backward as torch_backward

    from hf_pipeline.runtime import weight_pass

    layers = model.model.layers[: max(1, sizes["layers"] // sizes["world"])]
    weight_pass.install(layers)
    params = [p for layer in layers for p in layer.parameters()]
    rows = max(1, sizes["batch"] // sizes["n_microbatches"])
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(rows, sizes["seq"], sizes["hidden"], generator=gen)
    grad = torch.randn(rows, sizes["seq"], sizes["hidden"], generator=gen)
    positions = torch.arange(sizes["seq"])[None].expand(rows, -1)
    rope = tuple(t.detach() for t in model.model.rotary_emb(x0, positions))

    def forward():
        x = x0.clone().requires_grad_()
        h = x
        for layer in layers:
            h = layer(h, position_embeddings=rope, attention_mask=None, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
        return x, h

    times: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "input", "weight", "torch_input", "torch_weight")}
    for _ in range(6 if sizes["train_reps"] > 1 else 2):
        t = time.perf_counter()
        x, h = forward()
        times["forward"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.autograd.backward(h, grad, inputs=[x, *params])
        times["backward"].append(time.perf_counter() - t)
        with weight_pass.deferring():
            x, h = forward()
            t = time.perf_counter()
            with weight_pass.capturing():
                torch.autograd.backward(h, grad, inputs=[x, *params])
            w = weight_pass.take()
            t1 = time.perf_counter()
            w()
            times["input"].append(t1 - t)
            times["weight"].append(time.perf_counter() - t1)
        x, h = forward()
        t = time.perf_counter()
        _, groups = torch_backward.stage_backward_input([h], [grad], [x], iter(params))
        t1 = time.perf_counter()
        torch_backward.stage_backward_weight(iter(params), groups)
        times["torch_input"].append(t1 - t)
        times["torch_weight"].append(time.perf_counter() - t1)
        for p in params:
            p.grad = None
    got = {k: _median(v[1:]) for k, v in times.items()}
    got["layers"], got["rows"] = len(layers), rows
    return got


def _task_train_hf(spec: dict, out: dict) -> None:
    import torch
    import transformers

    sizes = spec["sizes"]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32)
    model.train()
    batch = _batch(sizes)
    # The whole batch, and the pipeline's microbatches of it (what perfect overlap spreads over the ranks).
    times, micro, loss = _whole_and_microbatched(model, batch, sizes["n_microbatches"], sizes["train_reps"])
    # The same on one rank's share of the batch, what each process of the 2-way limit trains: in one
    # piece, and as the microbatches a pipeline rank runs it in (the pipeline's microbatch size).
    rows = sizes["batch"] // sizes["world"]
    share = {k: v[:rows] for k, v in batch.items()}
    share_times, share_micro, _ = _whole_and_microbatched(model, share, max(1, sizes["n_microbatches"] // sizes["world"]), sizes["train_reps"])
    out.update(step_seconds=times, microbatched_seconds=micro, loss=loss, share_step_seconds=share_times, share_microbatched_seconds=share_micro,
               split_backward=_split_backward_seconds(model, sizes))


def _two_way_step(reference, batch: dict, sizes: dict, *, microbatched: bool = False) -> float:
    """One transformers step on this rank's share of the batch, every rank at once: the 2-way
    limit (independent processes, no communication). With ``microbatched`` the share runs as the
    pipeline's microbatches one after another (gradients accumulated): perfect overlap measured
    directly, at the pipeline's microbatch size and with every core busy as in the pipeline.
    Returns the slowest rank's time."""
    import torch
    import torch.distributed as dist

    from hf_pipeline.generation.sampling import microbatch_bounds

    lo, hi = microbatch_bounds(sizes["batch"], dist.get_world_size())[dist.get_rank()]
    pieces = [(lo, hi)]
    if microbatched:
        pieces = [(lo + a, lo + b) for a, b in microbatch_bounds(hi - lo, max(1, sizes["n_microbatches"] // dist.get_world_size()))]
    _sync()
    t = time.perf_counter()
    _accumulate(reference, batch, pieces)
    took = torch.tensor([time.perf_counter() - t])
    reference.zero_grad(set_to_none=True)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _timed_train_step(model, batch: dict) -> tuple[float, Any]:
    """Seconds of one pipelined ``train_step`` on this rank (ranks start together), and its loss; gradients cleared."""
    _sync()
    t = time.perf_counter()
    loss = model.train_step(batch)
    took = time.perf_counter() - t
    for p in model.parameters():
        p.grad = None
    return took, loss


def _task_train_pp(spec: dict, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.tools.profile import expected_vs_recorded

    sizes = spec["sizes"]
    schedule = spec["schedule"].removesuffix(MEASURED)
    if schedule == "auto":
        choice = dict(schedule="auto", n_microbatches="auto", tune_batch=(sizes["batch"], sizes["seq"]))
    else:
        choice = dict(schedule=schedule, virtual_stages=spec["virtual_stages"], n_microbatches=sizes["n_microbatches"])
    model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, **choice)
    batch = _batch(sizes)
    if spec["schedule"].endswith(MEASURED):  # the planner's split measured, then loaded as advised
        advice = model.measure_split(batch)
        out["measured_split"] = {**advice.to_dict(), "text": str(advice)}
        # Both splits stay loaded and take turns below: paired in one job, the machine's drifts fall on both.
        planned = model
        model = AutoModelForCausalLM.from_pretrained(
            spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, split=list(advice.split), **choice)
    else:
        planned = None
    # The 2-way limit runs in this job too, right before each pipelined step: every rank trains a
    # transformers model on its share of the batch at the same time. Both sides of each ratio are
    # measured within seconds of each other, so slow drifts of the machine's speed (other tenants
    # of the host) do not land on one side only.
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).train()
    times, two_way, two_way_micro, planned_times = [], [], [], []
    for i in range(sizes["train_reps"] + 1):
        two_way.append(_two_way_step(reference, batch, sizes))
        two_way_micro.append(_two_way_step(reference, batch, sizes, microbatched=True))
        took, loss = _timed_train_step(model, batch)
        times.append(took)
        if planned is not None:
            planned_times.append(_timed_train_step(planned, batch)[0])
    del reference, planned

    # Every rank's step time: the pipeline's step is as slow as its slowest rank.
    def slowest(per_rank: list[float]) -> list[float]:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, per_rank)
        return [max(ts[i] for ts in gathered) for i in range(1, len(per_rank))]

    step_seconds = slowest(times)
    if planned_times:
        out["measured_split"]["planned_step_seconds"] = slowest(planned_times)
    # Several profiled steps; the figures below are the median one's (by wall time): a single step
    # now and then holds a stall of the machine (a few ms between two actions) that the others do not.
    with model.profile() as prof:
        for _ in range(3 if sizes["train_reps"] > 1 else 1):
            model.train_step(batch)
            for p in model.parameters():
                p.grad = None
    timeline = prof.timeline(title=f"{spec['schedule']}: {model.n_microbatches} microbatches, {model.plan.pp_size} ranks x {model.plan.virtual_stages} stages")
    walls = {st: max(timeline.wall_seconds(r, st) for r in timeline.ranks) for st in sorted({x.step for x in timeline.records})}
    step = sorted(walls, key=walls.get)[len(walls) // 2]
    order = expected_vs_recorded(timeline, training=True, step=step)
    # One hop of a stage's activation (a microbatch's hidden states) between ranks, nothing else
    # running: the replay with it on every cross-rank dependency is the step with this machine's
    # message latency and no other time between actions.
    rows = max(1, sizes["batch"] // model.n_microbatches // model.dims.dp_size)
    hop = _median([_hop_seconds((rows, sizes["seq"], sizes["hidden"]), 20 if sizes["train_reps"] > 1 else 3) for _ in range(5)])
    if model.ctx.is_main_process and spec.get("timeline_dir"):
        d = pathlib.Path(spec["timeline_dir"])
        timeline.save_png(d / f"train-{spec['schedule']}.png", step=step)
        timeline.save_chrome_trace(d / f"train-{spec['schedule']}.trace.json")
    out.update(
        step_seconds=step_seconds, two_way_seconds=two_way[1:], two_way_microbatched_seconds=two_way_micro[1:], loss=float(loss),
        profiled_steps=len(walls), profiled_step=step, profiled_step_walls=list(walls.values()),
        idle_fraction=timeline.idle_fraction(step), activation_hop_s=hop, breakdown=timeline.breakdown(step, latency=hop),
        theoretical_idle_fraction=timeline.theoretical_idle_fraction(),
        order_matches={r: e == got for r, (e, got) in order.items()},
        busy_seconds={r: timeline.busy_seconds(r, step) for r in timeline.ranks},
        profiled_wall_seconds={r: timeline.wall_seconds(r, step) for r in timeline.ranks},
        picked={"schedule": model.schedule.name, "virtual_stages": model.plan.virtual_stages, "n_microbatches": model.n_microbatches},
        split=list(model.plan.split_points),
    )


def _layer_indices(modules) -> list[int]:
    """The LLaMA decoder layers (``model.layers.<i>`` or a module inside one) among a stage's module names, ascending."""
    return sorted({int(x.group(1)) for x in (re.fullmatch(r"model\.layers\.(\d+)(\..*)?", m) for m in modules) if x})


def _torch_pipeline(reference, plan, schedule: str, n_microbatches: int):
    """The pipeline of ``plan`` built from transformers' layers and torch's pipelining alone, no
    hf_pipeline: each of this rank's stages is a plain module over copies of ``reference``'s
    embedding, decoder layers, rotary embedding, final norm and LM head; torch's ``PipelineStage``;
    the schedule's torch class, as torch's documentation shows it (for the zero-bubble schedules its
    generic split backward). Returns ``step(batch) -> (seconds, loss)``: one forward + backward of the
    batch, timed on this rank (ranks start together), gradients cleared; the loss (the microbatches'
    mean token cross-entropy) on every rank.

    hf_pipeline's step against this one, on the same split and the same seconds of the machine, is
    what hf_pipeline adds (or saves) over torch's own runtime: its stage modules, its zero-bubble
    weight pass, the step's own work (the ranks' agreement on the batch, the loss's reduction)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from hf_pipeline.planning.schedules import get_schedule

    class Stage(nn.Module):
        def __init__(self, spec):
            super().__init__()
            if spec.halves:
                raise ValueError(f"stage {spec.index} splits a layer ({dict(spec.halves)}): the torch-only pipeline takes whole layers")
            base = reference.model
            layers = _layer_indices(spec.modules)
            self.embed = copy.deepcopy(base.embed_tokens) if spec.is_first else None
            self.layers = nn.ModuleList(copy.deepcopy(base.layers[i]) for i in layers)
            self.rotary = copy.deepcopy(base.rotary_emb)
            self.norm = copy.deepcopy(base.norm) if spec.is_last else None
            self.head = copy.deepcopy(reference.lm_head) if spec.is_last else None

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            rotary = self.rotary(h, positions)
            for layer in self.layers:  # no mask: transformers' SDPA attention is causal without one
                h = layer(h, position_ids=positions, position_embeddings=rotary)
            return self.head(self.norm(h)) if self.head is not None else h

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())

    rank = dist.get_rank()
    mine = [s for s in plan.stages if s.rank == rank]
    stages = [PipelineStage(Stage(s), s.index, plan.num_stages, torch.device("cpu")) for s in mine]
    spec = get_schedule(schedule)
    runner = spec.cls(stages if spec.multi else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    first, last = any(s.is_first for s in mine), any(s.is_last for s in mine)

    def step(batch: dict) -> tuple[float, float]:
        losses: list = []
        _sync()
        t = time.perf_counter()
        runner.step(*((batch["input_ids"],) if first else ()), **({"target": batch["labels"], "losses": losses} if last else {}))
        took = time.perf_counter() - t
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        loss = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0])
        dist.all_reduce(loss)  # one rank holds the last stage
        return took, float(loss)

    return step


def _task_train_paired(spec: dict, out: dict) -> None:
    """Every fixed schedule loaded in one job, their steps taking turns with the microbatched 2-way
    step (perfect overlap measured): the schedules compared on the same seconds of the machine, where
    each schedule's own job (``_task_train_pp``) sees the machine at another time. Beside each, the
    same split run by torch's own pipeline (:func:`_torch_pipeline`), its step right after
    hf_pipeline's. GPipe is left out: it alone keeps every microbatch's activations alive at once,
    and in a process shared with other models its step swung between 1.8 and 5.0 s (1.7 s in its
    own job), which would not compare schedules."""
    import torch
    import torch.distributed as dist
    import transformers

    from hf_pipeline import AutoModelForCausalLM

    sizes = spec["sizes"]
    batch = _batch(sizes)
    models = {
        name: AutoModelForCausalLM.from_pretrained(
            spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, schedule=name, virtual_stages=v,
            n_microbatches=sizes["n_microbatches"])
        for name, v in SCHEDULES if v is not None and not name.endswith(MEASURED) and name != "gpipe"
    }
    reference = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).train()
    torch_only, torch_only_errors = {}, {}
    for name, model in models.items():
        try:
            torch_only[name] = _torch_pipeline(reference, model.plan, name, sizes["n_microbatches"])
        except ValueError as e:  # a split inside a layer: that schedule has no torch-only twin
            torch_only_errors[name] = str(e)
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


def _task_generate_hf(spec: dict, out: dict) -> None:
    import torch
    import transformers

    sizes = spec["sizes"]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    ids, mask = _prompts(sizes)
    times, result = [], None
    for i in range(sizes["gen_reps"] + 1):
        t = time.perf_counter()
        result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sizes["new_tokens"], min_new_tokens=sizes["new_tokens"], do_sample=False, pad_token_id=0)
        times.append(time.perf_counter() - t)
    out.update(seconds=times[1:], new_tokens=int((result.shape[1] - ids.shape[1]) * ids.shape[0]), tokens=result.tolist())
    # transformers' own chunked prefill: the tokens the pipelined chunked run must equal
    chunked = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sizes["new_tokens"], min_new_tokens=sizes["new_tokens"],
                             do_sample=False, pad_token_id=0, prefill_chunk_size=sizes["prefill_chunk"])
    out["chunked_tokens"] = chunked.tolist()
    out["bound"] = _decode_bound(model, sizes)


def _decode_step_seconds(model, rows: int, past: int, reps: int, pause_s: float = 0.0, median: bool = False) -> float:
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
    return _median(times) if median else min(times)


def _torch_ring_step_seconds(model, rows: int, past: int, m: int, steps: int, *, ring: bool) -> float:
    """Seconds per token of a decode ring built from transformers' layers and torch's P2P alone.

    Every rank runs ``model`` (its share of the layers) on ``m`` microbatches of ``rows`` rows per
    token. ``ring=True``: as hf_pipeline's ring, rank k waits for microbatch i from rank k-1 (rank 0:
    from the last rank, a step later), runs it, and sends it on with ``isend``; receives are posted
    ahead. ``ring=False``: the same steps back to back, no messages.
    """
    import torch
    import torch.distributed as dist

    r, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (r + 1) % world, (r - 1) % world
    ids = torch.randint(3, model.config.vocab_size, (rows, past), generator=torch.Generator().manual_seed(3))
    hidden = model.config.hidden_size
    with torch.no_grad():
        caches = [model(input_ids=ids, use_cache=True).past_key_values for _ in range(m)]
        token = ids[:, -1:]
        sbuf = [torch.zeros(rows, 1, hidden + 1) for _ in range(m)]
        rbuf = [torch.zeros(rows, 1, hidden + 1) for _ in range(m)]
        recvs = [dist.irecv(rbuf[i], prev) if ring and r > 0 else None for i in range(m)]
        sends = []
        dist.barrier()
        start = time.perf_counter()
        for t in range(steps):
            for i in range(m):
                if ring and (r > 0 or t > 0):
                    recvs[i].wait()
                model(input_ids=token, cache=caches[i], use_cache=True)
                caches[i].crop(-1)
                if not ring:
                    continue
                last_send = r == world - 1 and t == steps - 1  # the last token goes nowhere
                if not last_send:
                    sends.append(dist.isend(sbuf[i], nxt))
                if t < steps - 1:  # the next message for microbatch i: step t + 1's
                    recvs[i] = dist.irecv(rbuf[i], prev)
        for w in sends:
            w.wait()
        took = time.perf_counter() - start
    return took / steps


def _hop_seconds(shape: tuple[int, ...], rounds: int) -> float:
    """Seconds of one hop of a message with no compute: a float32 tensor of ``shape`` passed around
    every rank ``rounds`` times with the pipeline's own calls (``isend``, ``irecv`` waited on), per
    round over the ranks. What a dependency between two ranks costs beyond the compute on either
    side, on this machine and backend."""
    import torch
    import torch.distributed as dist

    r, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (r + 1) % world, (r - 1) % world
    buf = torch.zeros(shape)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if r == 0:
            dist.isend(buf, nxt).wait()
            dist.irecv(buf, prev).wait()
        else:
            dist.irecv(buf, prev).wait()
            dist.isend(buf, nxt).wait()
    return (time.perf_counter() - start) / (rounds * world)


def _decode_bound(model, sizes: dict) -> dict:
    """One process's decode step, for the most a ``world``-stage decode ring with ``m = world``
    microbatches can gain on this machine.

    In steady state each rank runs its stage once per microbatch per token, so a token costs the
    slowest stage ``m * T(stage, rows / m)`` against ``T(model, rows)`` for one process. T(model)
    is measured here with transformers itself, at the middle of the run's context length; the
    stages' T, on the pipelined run's ranks with the same layers (:func:`_stage_part`). On a CPU a
    matmul with fewer rows runs at fewer FLOP/s, so the bound sits below ``world``x.
    """
    world, rows = sizes["world"], sizes["prompts"]
    past = sizes["prompt_len"] + sizes["new_tokens"] // 2
    return {"microbatches": min(world, rows), "full_step_s": _decode_step_seconds(model, rows, past, _decode_reps(sizes))}


def _decode_reps(sizes: dict) -> int:
    return 30 if sizes["new_tokens"] > 8 else 3


def _stage_part(model, plan, rank: int):
    """This rank's share of the pipelined model's split, built from transformers' own ``model``: its
    layers (renumbered, as a transformers cache counts them) under the LM head when the rank holds
    it, else under the base model (the embedding lookup and final norm it adds cost next to nothing).
    Returns the part and what it holds, in words."""
    import copy

    mods = [m for st in plan.stages if st.rank == rank for m in st.modules]
    layers = _layer_indices(mods)
    head = "lm_head" in mods
    part = copy.deepcopy(model)
    part.model.layers = part.model.layers[layers[0]: layers[-1] + 1]
    part.config.num_hidden_layers = len(part.model.layers)
    for i, layer in enumerate(part.model.layers):
        layer.self_attn.layer_idx = i
    what = f"layers {layers[0]}-{layers[-1]}" + (" + LM head" if head else "")
    return (part if head else part.model), what


def _task_generate_pp(spec: dict, out: dict) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.generation.sampling import microbatch_bounds

    sizes = spec["sizes"]
    model = AutoModelForCausalLM.from_pretrained(spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False)
    ids, mask = _prompts(sizes)
    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    lo, hi = microbatch_bounds(sizes["prompts"], dist.get_world_size())[dist.get_rank()]

    def two_way(new_tokens: int = sizes["new_tokens"]) -> float:
        # The 2-way limit: every rank runs transformers' generate on its share of the prompts at once.
        _sync()
        t = time.perf_counter()
        hf.generate(input_ids=ids[lo:hi], attention_mask=mask[lo:hi], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        took = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    def pipelined(new_tokens: int, **kwargs) -> tuple[float, Any, Any]:
        # One pipelined generate of every prompt, ranks starting together: the slowest rank's
        # seconds (the call ends with the result's broadcast, so the ranks end together), ids, stats.
        _sync()
        t = time.perf_counter()
        tokens, stats = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                       return_stats=True, **kwargs)
        took = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took), tokens, stats

    results = {}
    # One more microbatch than ranks: what hiding the message's latency behind another microbatch costs.
    # Chunked prefill: the prompt fed in chunks (transformers' prefill_chunk_size), so the pipeline's
    # prefill fills with chunks x microbatches units instead of microbatches.
    runs = (("pipelined", None, None), ("chunked_prefill", None, sizes["prefill_chunk"]), ("one_microbatch", 1, None),
            ("more_microbatches", dist.get_world_size() + 1, None))
    for label, m, chunk in runs:
        times, stats, tokens, limit = [], None, None, []
        for i in range(sizes["gen_reps"] + 1):
            if label in ("pipelined", "chunked_prefill"):
                limit.append(two_way())
            took, tokens, stats = pipelined(sizes["new_tokens"], n_microbatches=m, prefill_chunk_size=chunk)
            times.append(took)
        results[label] = {"seconds": times[1:], "new_tokens": stats.new_tokens, "n_microbatches": stats.n_microbatches, "tokens": tokens.tolist(),
                          "prefill_steps": stats.prefill_steps}
        if limit:
            results[label]["two_way_seconds"] = limit[1:]
    results["two_way_seconds"] = results["pipelined"]["two_way_seconds"]
    # The prefill alone (calls for one new token, medians; alternating): unchunked, chunked, and the
    # 2-way processes'. A pipeline's prefill over p stages with u units in flight idles (p - 1) / (u + p - 1).
    prefill: dict[str, list[float]] = {"pipelined": [], "chunked_prefill": [], "two_way": []}
    for _ in range(max(3, sizes["gen_reps"])):
        for label, chunk in (("pipelined", None), ("chunked_prefill", sizes["prefill_chunk"])):
            prefill[label].append(pipelined(1, prefill_chunk_size=chunk)[0])
        prefill["two_way"].append(two_way(1))
    results["prefill_seconds"] = prefill
    # The ring's time per decoded token without the prefill and the call's fixed costs: calls for all
    # the new tokens and for half of them, alternating; the difference of their medians per token.
    # The same for the 2-way limit's processes (transformers' generate on each rank's share, both at once).
    half = sizes["new_tokens"] // 2
    calls: dict[int, list[float]] = {sizes["new_tokens"]: [], half: []}
    two_way_calls: dict[int, list[float]] = {sizes["new_tokens"]: [], half: []}
    for _ in range(sizes["gen_reps"]):
        for n in calls:
            calls[n].append(pipelined(n)[0])
            two_way_calls[n].append(two_way(n))
    results["decode_token_s"] = (_median(calls[sizes["new_tokens"]]) - _median(calls[half])) / (sizes["new_tokens"] - half)
    results["two_way_token_s"] = (_median(two_way_calls[sizes["new_tokens"]]) - _median(two_way_calls[half])) / (sizes["new_tokens"] - half)
    with model.profile() as prof:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=min(sizes["new_tokens"], 8), do_sample=False, pad_token_id=0)
    timeline = prof.timeline(title=f"generate: {sizes['prompts']} prompts, {model.plan.pp_size} ranks (first 8 tokens)")
    if model.ctx.is_main_process and spec.get("timeline_dir"):
        d = pathlib.Path(spec["timeline_dir"])
        timeline.save_png(d / "generate.png")
        timeline.save_chrome_trace(d / "generate.trace.json")
    results["idle_fraction"] = timeline.idle_fraction()
    # Each rank's stage rebuilt from transformers' layers by this model's split: its decode step alone
    # (ranks in turn) and on every rank at once (the cores share caches and memory bandwidth).
    rank, world = dist.get_rank(), dist.get_world_size()
    part, what = _stage_part(hf, model.plan, rank)
    m = min(world, sizes["prompts"])
    rows, past = -(-sizes["prompts"] // m), sizes["prompt_len"] + sizes["new_tokens"] // 2
    alone = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = _decode_step_seconds(part, rows, past, _decode_reps(sizes))
    dist.barrier()
    concurrent = _decode_step_seconds(part, rows, past, _decode_reps(sizes))
    steps = torch.zeros(2, world)
    steps[:, rank] = torch.tensor([alone, concurrent])
    dist.all_reduce(steps)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, what)
    results["stage_parts"], results["stage_steps_s"], results["concurrent_stage_steps_s"] = parts, steps[0].tolist(), steps[1].tolist()
    # The ring's pattern with these parts and torch's P2P alone (no hf_pipeline), and the same steps
    # back to back without messages, alternating: what the pattern itself costs here.
    # With them, transformers' whole model on each rank's share of the prompts (the 2-way limit's
    # processes' decode steps without their generate loop), both ranks at once: what splitting the
    # model into stages costs beside running it whole.
    n = max(sizes["new_tokens"] // 2, 4)
    share = -(-sizes["prompts"] // world)
    runs = [(_torch_ring_step_seconds(part, rows, past, m, n, ring=False), _torch_ring_step_seconds(part, rows, past, m, n, ring=True),
             _torch_ring_step_seconds(hf, share, past, 1, n, ring=False)) for _ in range(3)]
    worst = torch.tensor([_median([r[i] for r in runs]) for i in range(3)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    results["back_to_back_token_s"], results["torch_ring_token_s"], results["two_way_step_token_s"] = worst.tolist()
    # One hop of the ring's message with nothing else running (median of 5 runs of 50 rounds).
    results["hop_s"] = _median([_hop_seconds((rows, 1, model.config.hidden_size + 1), 50 if sizes["new_tokens"] > 8 else 5) for _ in range(5)])
    out.update(results)


_TASKS = {
    "load_ours": _task_load_ours, "load_hf": _task_load_hf, "train_hf": _task_train_hf, "train_pp": _task_train_pp, "train_paired": _task_train_paired,
    "generate_hf": _task_generate_hf, "generate_pp": _task_generate_pp,
}


def _worker(spec_path: str) -> int:
    import torch

    torch.set_num_threads(1)
    job = json.loads(pathlib.Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for task in job["tasks"]:
        out: dict[str, Any] = {"task": task["task"], "label": task.get("label")}
        t = time.perf_counter()
        try:
            _TASKS[task["task"]](task, out)
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
            out.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        out["wall_seconds"] = time.perf_counter() - t
        results.append(out)
        gc.collect()
    pathlib.Path(job["out_dir"], f"rank{rank}.json").write_text(json.dumps(results))
    return 0


# ----------------------------------------------------------------------------- parent side
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_PIPELINE_THREADS="1", TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo", TRANSFORMERS_VERBOSITY="error",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _launch(world: int, tasks: list[dict], *, timeout: float, log) -> list[list[dict]]:
    """Run ``tasks`` in order on ``world`` fresh processes (torchrun for world > 1); per-rank results."""
    with tempfile.TemporaryDirectory(prefix="hf_pipeline_bench_") as tmp:
        spec = pathlib.Path(tmp, "job.json")
        spec.write_text(json.dumps({"tasks": tasks, "out_dir": tmp}))
        script = str(pathlib.Path(__file__).resolve())
        if world == 1:
            cmd = [sys.executable, script, "--worker", str(spec)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", script, "--worker", str(spec)]
        log(f"  launching {world} process(es): {', '.join(t.get('label') or t['task'] for t in tasks)}")
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=str(_ROOT))
        results = []
        for r in range(world):
            f = pathlib.Path(tmp, f"rank{r}.json")
            if not f.is_file():
                raise RuntimeError(f"rank {r} of {cmd} wrote no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            results.append(json.loads(f.read_text()))
        return results


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _machine() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", pathlib.Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except ImportError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _errors(rank_results: list[dict]) -> list[str]:
    return [f"{r.get('label') or r['task']}: {r['error']}" for r in rank_results if not r.get("ok")]


def _share(part: float, whole: float) -> float | None:
    """``part / whole`` for a positive ``whole`` (a cost and what it is a part of); None otherwise."""
    return part / whole if whole > 0 else None


def _gap(r0: dict, world: int) -> dict[str, float]:
    """Where a schedule's step goes against the 2-way limit, as factors whose product is the median
    step over the median 2-way step: the ranks' compute over the 2-way processes' compute (``compute``:
    small microbatches, per-stage work, the split backward), the busiest rank over the mean
    (``imbalance``), the profiled step over the busiest rank's compute (``bubble``: its idle), and the
    timed step over the profiled one (``rest``: messages and the step's own work, and noise).

    Two factors are split further (their products are the factors above): ``compute`` into
    ``microbatches`` (the 2-way processes running their shares as the pipeline's microbatches, over
    in one piece, both measured in the job: small matmuls with every core busy) and ``stages`` (the
    rest: the stages' own work, the split backward); ``bubble`` into ``schedule`` (the profiled
    step replayed with free messages over the busiest rank's compute: the idle the schedule's order
    leaves with these action times, :meth:`~hf_pipeline.tools.profile.Timeline.replayed_seconds`) and
    ``waits`` (the profiled step over its replay: P2P latency and the runtime between actions)."""
    bd = r0["breakdown"]  # Timeline.breakdown of the profiled step
    two_way, step = _median(r0["two_way_seconds"]), _median(r0["step_seconds"])
    gap = {"compute": sum(bd["busy_seconds"]) / (world * two_way), "rest": step / bd["wall_seconds"]}
    gap.update({k: bd[k] for k in ("imbalance", "bubble", "schedule", "waits", "messages", "runtime")})
    gap["microbatches"] = _median(r0["two_way_microbatched_seconds"]) / two_way
    gap["stages"] = gap["compute"] / gap["microbatches"]
    return gap


def run_benchmark(args, log=print) -> dict[str, Any]:
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.load_ranks:
        sizes = Sizes(**{**asdict(sizes), "load_ranks": tuple(int(x) for x in args.load_ranks.split(","))})
    if args.reps:
        sizes = Sizes(**{**asdict(sizes), "train_reps": args.reps, "gen_reps": args.reps})
    sections = [s.strip() for s in args.sections.split(",")] if args.sections else list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    out_dir = pathlib.Path(args.out)
    timeline_dir = out_dir / "timelines"
    timeline_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log(f"hf_pipeline benchmark ({'quick' if args.quick else 'full'}): sections {', '.join(sections)}")
    ckpts = _checkpoints(args, sizes)
    log(f"  checkpoints in {_cache_dir(args)} (load checkpoint ready in {ckpts['load_seconds']} s)")
    sz = asdict(sizes)
    results: dict[str, Any] = {
        "command": "python scripts/benchmark.py " + " ".join(args.argv), "quick": bool(args.quick),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": _machine(), "sizes": sz,
    }
    timeout = args.timeout

    # Which work runs in which launch: one launch per world size, fresh processes (peak RSS).
    launches: dict[int, list[dict]] = {}
    if "load" in sections:
        for p in sizes.load_ranks:
            launches.setdefault(p, []).extend([
                # cold reads only in full runs: dropping the page cache slows whatever else the machine runs
                {"task": "load_ours", "label": f"load hf_pipeline p={p}", "path": ckpts["load"], "warmup": ckpts["warmup"], "cold": not args.quick},
                {"task": "load_hf", "label": f"load transformers p={p}", "path": ckpts["load"], "warmup": ckpts["warmup"]},
            ])
    if "train" in sections or "bubble" in sections:
        launches.setdefault(1, []).append({"task": "train_hf", "label": "train transformers", "path": ckpts["train"], "sizes": sz})
        for name, v in SCHEDULES:
            launches.setdefault(sizes.world, []).append({
                "task": "train_pp", "label": f"train {name}", "path": ckpts["train"], "sizes": sz, "schedule": name,
                "virtual_stages": v, "timeline_dir": str(timeline_dir),
            })
        launches[sizes.world].append({"task": "train_paired", "label": "train paired", "path": ckpts["train"], "sizes": sz})
    if "generate" in sections:
        launches.setdefault(1, []).append({"task": "generate_hf", "label": "generate transformers", "path": ckpts["train"], "sizes": sz})
        launches.setdefault(sizes.world, []).append({"task": "generate_pp", "label": "generate pipelined", "path": ckpts["train"], "sizes": sz, "timeline_dir": str(timeline_dir)})

    raw: dict[int, list[list[dict]]] = {}
    for world in sorted(launches):
        raw[world] = _launch(world, launches[world], timeout=timeout, log=log)
    results["errors"] = sorted({e for per_rank in raw.values() for rr in per_rank for e in _errors(rr)})

    def find(world: int, label: str) -> list[dict]:
        return [next(t for t in rr if t["label"] == label) for rr in raw.get(world, [])]

    from hf_pipeline.loading.weights import CheckpointIndex, checkpoint_nbytes

    if "load" in sections:
        ckpt_bytes = checkpoint_nbytes(CheckpointIndex.from_directory(ckpts["load"]))
        index = json.loads(pathlib.Path(ckpts["load"], "model.safetensors.index.json").read_text())
        load = {"checkpoint_bytes": ckpt_bytes, "tensor_bytes": index["metadata"]["total_size"], "shards": len(set(index["weight_map"].values())), "by_world": {}}
        for p in sizes.load_ranks:
            ours, hf = find(p, f"load hf_pipeline p={p}"), find(p, f"load transformers p={p}")
            if not all(t.get("ok") for t in ours + hf):
                load["by_world"][str(p)] = {"error": "; ".join(t.get("error", "") for t in ours + hf if not t.get("ok"))}
                continue
            load["by_world"][str(p)] = {
                "ours_peak_rss": [t["peak_rss"] for t in ours], "ours_stage_bytes": [t["stage_bytes"] for t in ours],
                "ours_bytes_read": [t["bytes_read"] for t in ours], "ours_files_opened": [t["files_opened"] for t in ours],
                "hf_peak_rss": [t["peak_rss"] for t in hf], "hf_model_bytes": [t["model_bytes"] for t in hf],
                "peak_over_stage": max(t["peak_rss"] / t["stage_bytes"] for t in ours),
                "bytes_read_over_checkpoint": sum(t["bytes_read"] for t in ours) / index["metadata"]["total_size"],
                "hf_bytes_read_over_checkpoint": sum(t["model_bytes"] for t in hf) / index["metadata"]["total_size"],
                "hf_peak_over_ours": max(t["peak_rss"] for t in hf) / max(t["peak_rss"] for t in ours),
                "peak_resettable": all(t["resettable"] for t in ours + hf),
                # wall time of each rank's load against plainly reading its byte ranges (max over ranks)
                "load_seconds": [t["load_seconds"] for t in ours], "read_seconds": [t["read_seconds"] for t in ours],
                "load_over_read_per_rank": [t["load_over_read"] for t in ours],  # median of that rank's pair ratios
                "load_over_read": max(t["load_over_read"] for t in ours),
                "cold_load_seconds": [t["cold_load_seconds"] for t in ours], "cold_read_seconds": [t["cold_read_seconds"] for t in ours],
                "cold_load_over_read": max(t["cold_load_over_read"] for t in ours) if all(t["cold_load_over_read"] for t in ours) else None,
                "phases": [t["phases"] for t in ours],  # each rank's first load, by phase (LoadReport.seconds)
            }
        results["load"] = load

    if "train" in sections or "bubble" in sections:
        base = find(1, "train transformers")[0]
        tokens = sizes.batch * sizes.seq
        train = {"tokens_per_step": tokens, "baseline": None, "schedules": {}}
        micro_cost = None
        if base.get("ok"):
            # The cost of small microbatches on one process, median over back-to-back pairs: on one
            # rank's share of the batch, the size each 2-way process trains in one piece (what perfect
            # overlap pays), and on the whole batch (for reference: on a machine where a batch of the
            # share's size runs faster per row than the whole one, it understates the cost).
            micro_cost = _median([mb / full for mb, full in zip(base["share_microbatched_seconds"], base["share_step_seconds"])])
            train["baseline"] = {
                "step_seconds": base["step_seconds"], "tokens_per_s": tokens / _median(base["step_seconds"]),
                "share_step_seconds": base["share_step_seconds"], "share_microbatched_seconds": base["share_microbatched_seconds"],
                "microbatch_cost": micro_cost,
                "microbatched_seconds": base["microbatched_seconds"],
                "whole_batch_microbatch_cost": _median([mb / full for mb, full in zip(base["microbatched_seconds"], base["step_seconds"])]),
                "split_backward": {**base["split_backward"],
                                   "split_over_full": (base["split_backward"]["input"] + base["split_backward"]["weight"]) / base["split_backward"]["backward"],
                                   "torch_split_over_full": (base["split_backward"]["torch_input"] + base["split_backward"]["torch_weight"])
                                   / base["split_backward"]["backward"]},
            }
        limits, micro_limits = [], []
        for name, v in SCHEDULES:
            per_rank = find(sizes.world, f"train {name}")
            r0 = per_rank[0]
            if not r0.get("ok"):
                train["schedules"][name] = {"virtual_stages": v, "error": r0["error"]}
                continue
            tps = tokens / _median(r0["step_seconds"])
            two_way = r0["two_way_seconds"]
            limits.extend(two_way)
            # median over steps of (2-way step / pipelined step), each pair run back to back
            of_two_way = _median([w / p for w, p in zip(two_way, r0["step_seconds"])])
            micro_way = r0.get("two_way_microbatched_seconds") or []
            micro_limits.extend(micro_way)
            train["schedules"][name] = {
                "virtual_stages": v, "step_seconds": r0["step_seconds"], "tokens_per_s": tps, "two_way_seconds": two_way,
                "speedup_vs_separate_baseline": tps / train["baseline"]["tokens_per_s"] if train["baseline"] else None,
                "fraction_of_two_way": of_two_way,
                # perfect overlap = the 2-way limit paid the microbatch cost: 2-way time x cost
                "fraction_of_perfect_overlap": of_two_way * micro_cost if micro_cost else None,
                # perfect overlap measured: the 2-way processes running the pipeline's microbatches
                "two_way_microbatched_seconds": micro_way,
                "fraction_of_microbatched_two_way": _median([w / p for w, p in zip(micro_way, r0["step_seconds"])]) if micro_way else None,
                "breakdown": r0["breakdown"], "activation_hop_s": r0["activation_hop_s"],
                "idle_fraction": r0["idle_fraction"], "theoretical_idle_fraction": r0["theoretical_idle_fraction"],
                "order_matches_schedule": r0["order_matches"], "busy_seconds": r0["busy_seconds"],
                "profiled_steps": r0["profiled_steps"], "profiled_step": r0["profiled_step"], "profiled_step_walls": r0["profiled_step_walls"],
                "profiled_wall_seconds": r0["profiled_wall_seconds"], "picked": r0["picked"],
                "gap": _gap(r0, sizes.world), "split": r0["split"],
            }
            if "measured_split" in r0:
                train["schedules"][name]["measured_split"] = r0["measured_split"]
        fixed = [row for name, row in train["schedules"].items() if name != "auto" and not name.endswith(MEASURED) and "error" not in row]
        if "auto" in train["schedules"] and "error" not in train["schedules"]["auto"] and fixed:
            # auto against the best fixed choice of the same run (tokens/s)
            train["auto_vs_best_fixed"] = train["schedules"]["auto"]["tokens_per_s"] / max(row["tokens_per_s"] for row in fixed)
        for row in train["schedules"].values():  # a measured split against the planned one: steps paired in its job
            if "measured_split" in row:
                row["vs_planned_split"] = _median([p / m for p, m in zip(row["measured_split"]["planned_step_seconds"], row["step_seconds"])])
        paired = find(sizes.world, "train paired")[0]
        if paired.get("ok"):
            ref = paired["step_seconds"]["1f1b"]
            train["paired"] = {
                "two_way_microbatched_seconds": paired["two_way_microbatched_seconds"],
                "schedules": {
                    name: {
                        "step_seconds": ts,
                        "vs_1f1b": _median([r / t for r, t in zip(ref, ts)]),  # tokens/s over 1F1B's, per round
                        "fraction_of_microbatched_two_way": _median([w / t for w, t in zip(paired["two_way_microbatched_seconds"], ts)]),
                    }
                    for name, ts in paired["step_seconds"].items()
                },
            }
            for name, row in train["paired"]["schedules"].items():
                if name in paired["torch_only_step_seconds"]:
                    theirs = paired["torch_only_step_seconds"][name]
                    row["torch_only"] = {
                        "step_seconds": theirs,
                        "vs_torch_only": _median([o / t for o, t in zip(theirs, row["step_seconds"])]),  # our tokens/s over theirs, per round
                        "losses": paired["torch_only_losses"][name],  # (ours, torch-only) per step, the same weights and batch
                    }
                else:
                    row["torch_only"] = {"error": paired["torch_only_errors"].get(name, "not run")}
        else:
            train["paired"] = {"error": paired.get("error", "not run")}
        if train["baseline"] and limits:
            # Over every schedule's job: the 2-way limit and perfect overlap against the separate process.
            train["two_way_speedup"] = _median(base["step_seconds"]) / _median(limits)
            train["perfect_overlap_speedup"] = train["two_way_speedup"] / micro_cost
            if micro_limits:
                train["microbatched_two_way_speedup"] = _median(base["step_seconds"]) / _median(micro_limits)
        results["train"] = train

    if "generate" in sections:
        base, pp = find(1, "generate transformers")[0], find(sizes.world, "generate pipelined")[0]
        gen: dict[str, Any] = {}
        if base.get("ok"):
            gen["baseline"] = {"seconds": base["seconds"], "tokens_per_s": base["new_tokens"] / _median(base["seconds"])}
            gen["bound"] = dict(base["bound"])
            if pp.get("ok"):
                bd = gen["bound"]
                bd["stage_parts"], bd["stage_steps_s"] = pp["stage_parts"], pp["stage_steps_s"]
                bd["stage_step_s"] = max(pp["stage_steps_s"])
                bd["ring_step_s"] = bd["microbatches"] * bd["stage_step_s"]
                bd["speedup_bound"] = bd["full_step_s"] / bd["ring_step_s"]
                bd["concurrent_stage_step_s"] = max(pp["concurrent_stage_steps_s"])
                bd["concurrent_speedup_bound"] = bd["full_step_s"] / (bd["microbatches"] * bd["concurrent_stage_step_s"])
                bd["back_to_back_token_s"] = pp["back_to_back_token_s"]
                bd["torch_ring_token_s"] = pp["torch_ring_token_s"]
                bd["hop_s"] = pp["hop_s"]
                # A token's cycle runs every stage once and crosses every link once: with balanced stages
                # the ring pays world hops per token beyond the same steps back to back.
                bd["predicted_ring_token_s"] = bd["back_to_back_token_s"] + sizes.world * pp["hop_s"]
                bd["decode_token_s"] = pp["decode_token_s"]
                # Per decoded token (prefill excluded), the ring against the 2-way limit's processes,
                # as factors whose product is the ring's token time over theirs: the model's steps
                # split into stages (``stages``: 2 stage steps per rank back to back over the whole
                # model's step on a rank's share, both ranks at once), the ring's pattern with torch's
                # P2P alone (``pattern``), hf_pipeline's ring over that torch-only ring (``ours``),
                # and transformers' generate loop's own work per token beyond its model step
                # (``generate_loop``, divided out: the 2-way processes pay it, the ring its own, in ``ours``).
                bd["two_way_token_s"], bd["two_way_step_token_s"] = pp["two_way_token_s"], pp["two_way_step_token_s"]
                bd["token_factors"] = {
                    "stages": pp["back_to_back_token_s"] / pp["two_way_step_token_s"],
                    "pattern": pp["torch_ring_token_s"] / pp["back_to_back_token_s"],
                    "ours": pp["decode_token_s"] / pp["torch_ring_token_s"],
                    "generate_loop": pp["two_way_token_s"] / pp["two_way_step_token_s"],
                    "ring_over_two_way": pp["decode_token_s"] / pp["two_way_token_s"],
                }
        else:
            gen["baseline"] = {"error": base["error"]}
        if pp.get("ok"):
            for label in ("pipelined", "chunked_prefill", "one_microbatch", "more_microbatches"):
                r = pp[label]
                # the chunked run against transformers' own chunked prefill, the others against its default
                want = base.get("chunked_tokens" if label == "chunked_prefill" else "tokens")
                gen[label] = {
                    "seconds": r["seconds"], "tokens_per_s": r["new_tokens"] / _median(r["seconds"]), "n_microbatches": r["n_microbatches"],
                    "tokens_equal_transformers": bool(base.get("ok")) and r["tokens"] == want, "prefill_steps": r["prefill_steps"],
                }
                if "two_way_seconds" in r:
                    gen[label]["two_way_seconds"] = r["two_way_seconds"]
                    gen[label]["fraction_of_two_way"] = _median([w / t for w, t in zip(r["two_way_seconds"], r["seconds"])])
            ps = pp["prefill_seconds"]
            units = {"pipelined": gen["pipelined"]["n_microbatches"],
                     "chunked_prefill": gen["chunked_prefill"]["n_microbatches"] * gen["chunked_prefill"]["prefill_steps"]}
            gen["prefill"] = {
                "seconds": ps,
                # each pipelined prefill over the 2-way processes' (same pairs), and the fill's theory:
                # units of work per stage u, p stages: (u + p - 1) / u of the work spread evenly
                **{f"{label}_over_two_way": _median([a / b for a, b in zip(ps[label], ps["two_way"])]) for label in units},
                **{f"{label}_fill_theory": (u + sizes.world - 1) / u for label, u in units.items()},
            }
            gen["idle_fraction"] = pp["idle_fraction"]
            gen["two_way_seconds"] = pp["two_way_seconds"]
            # median over runs of (2-way time / pipelined time), each pair run back to back
            gen["fraction_of_two_way"] = _median([w / p for w, p in zip(pp["two_way_seconds"], pp["pipelined"]["seconds"])])
            if base.get("ok"):
                gen["two_way_speedup"] = _median(base["seconds"]) / _median(pp["two_way_seconds"])
                gen["speedup_vs_transformers"] = gen["pipelined"]["tokens_per_s"] / gen["baseline"]["tokens_per_s"]
                gen["one_microbatch_vs_transformers"] = gen["one_microbatch"]["tokens_per_s"] / gen["baseline"]["tokens_per_s"]
            gen["speedup_vs_one_microbatch"] = gen["pipelined"]["tokens_per_s"] / gen["one_microbatch"]["tokens_per_s"]
        else:
            gen["error"] = pp["error"]
        results["generate"] = gen

    results["seconds"] = time.time() - started
    results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return results


# ----------------------------------------------------------------------------- report
def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def to_markdown(res: dict[str, Any]) -> str:
    m, s = res["machine"], res["sizes"]
    lines = [
        "# hf_pipeline benchmark" + (" (quick mode: tiny sizes, numbers mean nothing)" if res.get("quick") else ""),
        "",
        f"Command: `{res['command'].strip()}` — {res['date']}, {res['seconds']:.0f} s.",
        f"Machine: {m['cpu']}, {m['cores']} cores, {(m['memory_bytes'] or 0) / 2**30:.0f} GiB; {m['platform']}; "
        f"python {m['python']}, torch {m['torch']}, transformers {m['transformers']}. "
        f"Load average at start {tuple(round(x, 2) for x in m['load_average'] or ())}, at end "
        f"{tuple(round(x, 2) for x in m.get('load_average_end') or ())} (other work on the machine disturbs timings).",
        "Every rank runs 1 thread (OMP_NUM_THREADS=1); every ratio is against a baseline measured in the same run.",
        "",
    ]
    if "load" in res:
        ld = res["load"]
        lines += [
            "## Load: per-rank memory and bytes read",
            "",
            f"LLaMA-architecture checkpoint, random bf16 weights: hidden {s['load_hidden']}, {s['load_layers']} layers, vocab "
            f"{s['load_vocab']}; {_gb(ld['checkpoint_bytes'])} in {ld['shards']} safetensors shards. Peak RSS = the OS's "
            "high-water mark (VmHWM, reset before each load) minus the RSS just before loading; it includes the pages of "
            "the shard being read. Baseline: `transformers.AutoModelForCausalLM.from_pretrained` on every rank (what "
            "accelerate's `prepare_pippy` needs).",
            "",
            "| ranks | hf_pipeline peak RSS per rank | stage bytes per rank | peak / stage bytes (max) | bytes read, all ranks / checkpoint | transformers peak RSS per rank | transformers bytes, all ranks / checkpoint |",
            "|---|---|---|---|---|---|---|",
        ]
        for p, row in ld["by_world"].items():
            if "error" in row:
                lines.append(f"| {p} | error: {row['error']} | | | | | |")
                continue
            lines.append(
                f"| {p} | {', '.join(_gb(x) for x in row['ours_peak_rss'])} | {', '.join(_gb(x) for x in row['ours_stage_bytes'])} | "
                f"{row['peak_over_stage']:.2f}x (target <= 1.25x) | {row['bytes_read_over_checkpoint']:.2f}x (target <= 1.1x) | "
                f"{', '.join(_gb(x) for x in row['hf_peak_rss'])} | {row['hf_bytes_read_over_checkpoint']:.2f}x |"
            )
        lines += [
            "",
            "Load wall time per rank against plainly reading the same byte ranges of the same files into fresh memory "
            "(anonymous mappings, faulted in by the read as new tensors are), in the same process, every rank at once: "
            "warm = pages in the OS cache (medians of 7 interleaved read/load pairs, which of the two goes first alternating; the ratio is the median of the pairs' "
            "ratios, the worst rank's shown), cold = page cache dropped just before each read and each load (where the machine allows it; medians of 5 pairs, likewise). "
            "Target <= 1.2x.",
            "",
            "| ranks | load (s) | plain read (s) | load / read, warm (max) | cold load (s) | cold read (s) | load / read, cold (max) |",
            "|---|---|---|---|---|---|---|",
        ]

        def secs(xs):
            return ", ".join("-" if x is None else f"{x:.2f}" for x in xs)

        for p, row in ld["by_world"].items():
            if "error" in row or "load_seconds" not in row:
                continue
            cold = f"{row['cold_load_over_read']:.2f}x" if row.get("cold_load_over_read") else "not measured"
            lines.append(
                f"| {p} | {secs(row['load_seconds'])} | {secs(row['read_seconds'])} | {row['load_over_read']:.2f}x | "
                f"{secs(row['cold_load_seconds'])} | {secs(row['cold_read_seconds'])} | {cold} |"
            )
        timed = [(p, row) for p, row in ld["by_world"].items() if "error" not in row and row.get("phases")]
        if timed:
            lines += ["", "Where a load's time goes (rank 0's first load, seconds): " + "; ".join(
                f"{p} ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in row["phases"][0].items()) for p, row in timed) + "."]
        worlds = [(p, row) for p, row in ld["by_world"].items() if "error" not in row and int(p) > 1]
        if worlds:
            lines += ["", f"Whole checkpoint: {_gb(ld['checkpoint_bytes'])}. Largest per-rank peak RSS: " + "; ".join(
                f"{p} ranks {_gb(max(row['ours_peak_rss']))} (transformers {_gb(max(row['hf_peak_rss']))})" for p, row in worlds) + "."]
        lines.append("")
    if "train" in res:
        tr = res["train"]
        base = tr.get("baseline")
        lines += [
            "## Train: tokens/s against one transformers process, and against the machine's limit",
            "",
            f"LLaMA hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads ({s.get('kv_heads', s['heads'])} key/value), vocab "
            f"{s['vocab']}, seq {s['seq']}, global batch {s['batch']}, {s['n_microbatches']} microbatches; forward + backward of "
            f"the whole batch per step (medians of {s['train_reps']} steps after a warm-up). Pipelined: {s['world']} ranks x 1 "
            "thread. **vs transformers**: one transformers process (1 thread, the whole batch), run on its own. References "
            f"measured in the same run: the **2-way limit** ({s['world']} independent transformers processes at once, each "
            "training on its share of the batch, run right before each pipelined step in the same job), the **microbatch "
            "cost** (one process running one rank's share of the batch, what each 2-way process trains in one piece, as the "
            "pipeline's microbatches one after another, over that share in one piece, alternating), and **perfect overlap** = "
            "2-way limit / microbatch cost: what a pipeline with no bubble and free communication reaches at this microbatch "
            "size. Fractions are medians over back-to-back pairs.",
            "",
        ]
        if base and tr.get("two_way_speedup"):
            lines += [
                f"2-way limit: **{tr['two_way_speedup']:.2f}x**; microbatch cost: {base['microbatch_cost']:.2f}x"
                + (f" (on the whole batch, against the whole batch in one piece: {base['whole_batch_microbatch_cost']:.2f}x)"
                   if "whole_batch_microbatch_cost" in base else "")
                + f"; perfect overlap: **{tr['perfect_overlap_speedup']:.2f}x**"
                + (f"; perfect overlap measured ({s['world']} processes at once, each running its share as the pipeline's "
                   f"microbatches): **{tr['microbatched_two_way_speedup']:.2f}x**" if tr.get("microbatched_two_way_speedup") else "")
                + ".",
                "",
            ]
        lines += [
            "| schedule | stages per rank | step (s) | vs transformers | fraction of perfect overlap | fraction of perfect overlap, measured | fraction of the 2-way limit |",
            "|---|---|---|---|---|---|---|",
        ]
        if base:
            lines.append(f"| transformers, one process | - | {_median(base['step_seconds']):.3f} | 1.00x | - | - | - |")
        for name, row in tr["schedules"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['virtual_stages']} | error: {row['error'][:200]} | | | | |")
                continue
            sep = f"**{row['speedup_vs_separate_baseline']:.2f}x**" if row.get("speedup_vs_separate_baseline") else "-"
            label = name
            if name == "auto" and row.get("picked"):
                pk = row["picked"]
                label = f"auto: {pk['schedule']}, m={pk['n_microbatches']}"
            lines.append(
                f"| {label} | {row['picked']['virtual_stages'] if row.get('picked') else row['virtual_stages']} | "
                f"{_median(row['step_seconds']):.3f} | {sep} | "
                f"{_pct(row.get('fraction_of_perfect_overlap'))} | {_pct(row.get('fraction_of_microbatched_two_way'))} | "
                f"{_pct(row.get('fraction_of_two_way'))} |"
            )
        pr = tr.get("paired", {})
        if "schedules" in pr:
            lines += [
                "", "The fixed schedules again, all loaded in one job and their steps taking turns (each round: the "
                "microbatched 2-way step, then one step of each schedule; medians over the rounds of the per-round ratios): "
                "here each comparison is on the same seconds of the machine, where the rows above come from a job each. "
                "GPipe is left out: it alone keeps every microbatch's activations alive at once, and in a process shared "
                "with other models its step time swings by 2-3x. **torch's own pipeline**: the same split run without "
                "hf_pipeline (each stage a plain module over transformers' embedding, layers, norm and LM head, torch's "
                "`PipelineStage` and the schedule's torch class, for the zero-bubble schedules with torch's generic split "
                "backward), its step right after hf_pipeline's in each round; the loss columns are both pipelines' losses "
                "on the same weights and batch (the largest difference over the rounds).",
                "", "| schedule | step (s) | tokens/s vs 1F1B, paired | fraction of perfect overlap, measured, paired "
                "| torch's own pipeline: step (s) | hf_pipeline's tokens/s over torch's own, paired | loss: hf_pipeline, torch's own |",
                "|---|---|---|---|---|---|---|",
            ]
            for name, row in pr["schedules"].items():
                to = row.get("torch_only", {})
                if "step_seconds" in to:
                    worst = max(to["losses"], key=lambda pair: abs(pair[0] - pair[1]))
                    theirs = f"{_median(to['step_seconds']):.3f} | **{_pct(to['vs_torch_only'])}** | {worst[0]:.6f}, {worst[1]:.6f}"
                else:
                    theirs = f"- | {to.get('error', 'not run')[:120]} | -"
                lines.append(f"| {name} | {_median(row['step_seconds']):.3f} | {_pct(row['vs_1f1b'])} | "
                             f"{_pct(row['fraction_of_microbatched_two_way'])} | {theirs} |")
        elif "error" in pr:
            lines += ["", f"Schedules paired in one job: error: {pr['error'][:200]}"]
        if tr.get("auto_vs_best_fixed"):
            lines += ["", f"`schedule=\"auto\", n_microbatches=\"auto\"` (the cost model's pick at load) reaches "
                      f"**{_pct(tr['auto_vs_best_fixed'])}** of the best fixed choice's tokens/s."]
        for name, row in tr["schedules"].items():
            ms = row.get("measured_split")
            if ms and row.get("vs_planned_split"):
                heads = "; ".join(f"{m} {b:.2f} blocks measured, {ms['head_blocks_by_flops'][m]:.2f} by FLOPs" for m, b in ms["head_blocks"].items())
                lines += ["", f"`{name}`: `model.measure_split(batch)` on the planned split {ms['planned']} measured the head and loss apart "
                          f"from the blocks ({heads}) and advised {ms['split']}"
                          + (" (the same split)" if ms["split"] == ms["planned"] else "")
                          + f"; loaded so, its tokens/s are **{_pct(row['vs_planned_split'])}** of the planned split's "
                          "(both loaded in one job, their steps taking turns; median of the pairs' ratios)."]
        gaps = {name: row["gap"] for name, row in tr["schedules"].items() if "gap" in row}
        if gaps:
            share = f"{base['microbatch_cost']:.2f}x" if base else "-"
            lines += [
                "",
                "Where each step goes against the 2-way limit (factors; their product is the step over the 2-way step): "
                "**compute** = all ranks' compute (forward, backward, weight-gradient and loss actions of the profiled step: "
                "the median by wall time of the schedule's 3 profiled steps) "
                f"over {s['world']} x the 2-way step (each 2-way process trains its share of the batch in one piece): what "
                f"running the model in small microbatches and stages costs more. Of it, one process running a rank's share of the batch as the pipeline's microbatches, against that "
                f"share in one piece, takes **{share}** (this machine's matmuls on smaller microbatches); the rest is the "
                "stages' own work (zero-bubble: the split backward). **imbalance** = the busiest rank's compute over the mean; "
                "**bubble** = the profiled step over the busiest rank's compute (its idle time); **rest** = the timed step over "
                "the profiled one (messages, the step's own work, noise). Two factors split further: compute = "
                "**microbatches** (the 2-way processes running their shares as the pipeline's microbatches over in one piece, "
                "both measured in the schedule's job: small matmuls with every core busy) x **stages** (the rest: the stages' "
                "own work, the split backward); bubble = **schedule** (the profiled step replayed with every action at its "
                "recorded time and free messages, over the busiest rank's compute: the idle the schedule's order leaves with "
                "these action times, `Timeline.replayed_seconds()`) x **waits** (the profiled step over its replay: P2P "
                "latency and the runtime between actions), and waits = **messages** (the replay with one measured hop of a "
                "microbatch's activations, nothing else running, on every dependency between ranks, over the replay without: "
                "this machine's message latency) x **runtime** (the profiled step over that replay: the time between actions "
                "that is not the message's flight).",
                "",
                "| schedule | compute | = microbatches | x stages | imbalance | bubble | = schedule | x waits | = messages | x runtime | rest | step / 2-way step |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]

            def f(gp, key):
                return f"{gp[key]:.3f}" if key in gp else "-"

            for name, gp in gaps.items():
                total = gp["compute"] * gp["imbalance"] * gp["bubble"] * gp["rest"]
                lines.append(f"| {name} | {f(gp, 'compute')} | {f(gp, 'microbatches')} | {f(gp, 'stages')} | {f(gp, 'imbalance')} | "
                             f"{f(gp, 'bubble')} | {f(gp, 'schedule')} | {f(gp, 'waits')} | {f(gp, 'messages')} | {f(gp, 'runtime')} | "
                             f"{f(gp, 'rest')} | {total:.3f} |")
            hops = [row["activation_hop_s"] for row in tr["schedules"].values() if row.get("activation_hop_s")]
            if hops:
                lines += ["", f"One hop of a microbatch's activations between ranks (measured in each schedule's job, nothing else "
                          f"running): {min(hops) * 1e3:.2f}-{max(hops) * 1e3:.2f} ms."]
            sb = (base or {}).get("split_backward")
            if sb:
                lines += [
                    "",
                    f"The zero-bubble schedules' split backward on this machine, apart from any pipeline (transformers' own "
                    f"{sb['layers']} layers, one microbatch of {sb['rows']} rows, in the baseline's process; medians): forward "
                    f"{sb['forward'] * 1e3:.1f} ms, full backward {sb['backward'] * 1e3:.1f} ms; hf_pipeline's split "
                    f"(`weight_pass.py`: the linears' weight matmuls deferred to W) input pass {sb['input'] * 1e3:.1f} ms + weight "
                    f"pass {sb['weight'] * 1e3:.1f} ms = **{sb['split_over_full']:.2f}x** the full backward; torch's generic split "
                    f"(`stage_backward_input` / `stage_backward_weight`) {sb['torch_input'] * 1e3:.1f} + {sb['torch_weight'] * 1e3:.1f} "
                    f"ms = {sb['torch_split_over_full']:.2f}x. Part of the zero-bubble schedules' **stages** factor above is this "
                    "price, paid for their smaller **schedule** bubble.",
                ]
        lines.append("")
    if "generate" in res:
        g = res["generate"]
        lines += [
            "## Generate: tokens/s against transformers and a one-microbatch pipeline",
            "",
            f"{s['prompts']} prompts x {s['prompt_len']} tokens, {s['new_tokens']} new tokens, greedy (median of {s['gen_reps']} "
            f"runs after a warm-up); pipelined on {s['world']} ranks x 1 thread.",
            "",
            "| run | microbatches | seconds | new tokens/s | vs transformers | tokens equal transformers |",
            "|---|---|---|---|---|---|",
        ]
        b = g.get("baseline", {})
        if "tokens_per_s" in b:
            lines.append(f"| transformers generate, 1 process | - | {_median(b['seconds']):.2f} | {b['tokens_per_s']:.0f} | 1.00x | - |")
        for label, name in (("pipelined", "pipelined generate"),
                            ("chunked_prefill", f"pipelined, prefill_chunk_size={s.get('prefill_chunk')} (tokens against transformers' chunked prefill)"),
                            ("one_microbatch", "pipelined, n_microbatches=1"),
                            ("more_microbatches", f"pipelined, n_microbatches={s['world'] + 1}")):
            if label in g:
                r = g[label]
                vs = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if "tokens_per_s" in b else "-"
                lines.append(f"| {name} | {r['n_microbatches']} | {_median(r['seconds']):.2f} | {r['tokens_per_s']:.0f} | {vs} | {'yes' if r['tokens_equal_transformers'] else 'no'} |")
        if "error" in g:
            lines.append(f"| pipelined generate | error: {g['error'][:200]} | | | | |")
        if "speedup_vs_one_microbatch" in g:
            lines += ["", f"Pipelined vs one microbatch: {g['speedup_vs_one_microbatch']:.2f}x."]
        if "speedup_vs_transformers" in g:
            lines += ["", f"Pipelined vs transformers: **{g['speedup_vs_transformers']:.2f}x**."]
        if "two_way_speedup" in g:
            lines += [
                "",
                f"2-way limit ({s['world']} independent transformers processes at once, each generating for its share of the "
                f"prompts, run right before each pipelined run): **{g['two_way_speedup']:.2f}x**; pipelined generate reaches "
                f"**{_pct(g['fraction_of_two_way'])}** of it (median over back-to-back pairs).",
            ]
        if "prefill" in g and "fraction_of_two_way" in g.get("chunked_prefill", {}):
            pf, ch = g["prefill"], g["chunked_prefill"]
            med = {k: _median(v) * 1e3 for k, v in pf["seconds"].items()}
            lines += [
                "",
                f"With `prefill_chunk_size={s['prefill_chunk']}` (transformers' chunked prefill: the {s['prompt_len']}-token prompts in "
                f"{ch['prefill_steps']} chunks, each microbatch's chunks following each other down the pipeline) pipelined generate "
                f"reaches **{_pct(ch['fraction_of_two_way'])}** of the 2-way limit (its own back-to-back pairs). The prefill alone "
                f"(calls for one new token, medians): {med['pipelined']:.1f} ms pipelined, {med['chunked_prefill']:.1f} ms chunked, "
                f"{med['two_way']:.1f} ms for the 2-way processes; over theirs {pf['pipelined_over_two_way']:.2f}x and "
                f"{pf['chunked_prefill_over_two_way']:.2f}x, where a {s['world']}-stage pipeline's fill alone costs "
                f"{pf['pipelined_fill_theory']:.2f}x with {g['pipelined']['n_microbatches']} units of work per stage and "
                f"{pf['chunked_prefill_fill_theory']:.2f}x with {ch['n_microbatches'] * ch['prefill_steps']}.",
            ]
        if "speedup_bound" in g.get("bound", {}):
            bd = g["bound"]
            stages = ", ".join(f"rank {r}: {what} {t * 1e3:.1f} ms" for r, (what, t) in enumerate(zip(bd["stage_parts"], bd["stage_steps_s"])))
            lines += [
                "",
                f"Bound on this machine, measured in the same run with transformers: one decode step of all {s['layers']} layers on "
                f"{s['prompts']} rows takes {bd['full_step_s'] * 1e3:.1f} ms; the pipelined model's stages, rebuilt from "
                f"transformers' layers with its split, on {-(-s['prompts'] // bd['microbatches'])} rows ({stages}; ranks in turn): "
                f"the slowest, run {bd['microbatches']}x per token = {bd['ring_step_s'] * 1e3:.1f} ms. No {s['world']}-stage ring with "
                f"{bd['microbatches']} microbatches can beat **{bd['speedup_bound']:.2f}x** here.",
            ]
            if "concurrent_stage_step_s" in bd:
                lines += [
                    "",
                    f"With every rank running its stage step at the same time (the cores share caches and memory bandwidth), the "
                    f"slowest stage step takes {bd['concurrent_stage_step_s'] * 1e3:.1f} ms: bound **{bd['concurrent_speedup_bound']:.2f}x**"
                    + (f"; the measured ring reaches {g['speedup_vs_transformers'] / bd['concurrent_speedup_bound']:.0%} of it."
                       if "speedup_vs_transformers" in g else "."),
                ]
            if "torch_ring_token_s" in bd:
                per_token = bd.get("decode_token_s") if bd.get("decode_token_s", 0) > 0 else None  # tiny runs: noise
                lines += [
                    "",
                    f"The ring's pattern built from transformers' own model and torch's P2P alone (no hf_pipeline: each rank runs "
                    f"its stage's transformers layers as above on {bd['microbatches']} microbatches per token, waits for each "
                    f"microbatch from the previous rank, sends it on with `isend`, receives posted ahead): "
                    f"{bd['torch_ring_token_s'] * 1e3:.1f} ms per token, against {bd['back_to_back_token_s'] * 1e3:.1f} ms for the "
                    f"same steps back to back without messages ({bd['back_to_back_token_s'] / bd['torch_ring_token_s']:.0%}): "
                    f"the part of the gap that is the pattern on this machine, not hf_pipeline"
                    + (f"; hf_pipeline's ring takes {per_token * 1e3:.1f} ms per token (the difference between calls for "
                       f"{s['new_tokens']} and {s['new_tokens'] // 2} new tokens, per token: prefill excluded), "
                       f"{bd['torch_ring_token_s'] / per_token:.0%} of that torch-only ring's speed." if per_token else "."),
                ]
            if "hop_s" in bd:
                lines += [
                    "",
                    f"One hop of the ring's message between ranks with nothing else running (`isend`, the receiver's posted "
                    f"receive waited on; gloo here): **{bd['hop_s'] * 1e3:.2f} ms**. A token's cycle runs every stage once and "
                    f"crosses all {s['world']} links, so with balanced stages the messages' flight adds {s['world']} hops per token to "
                    f"the steps back to back: {bd['back_to_back_token_s'] * 1e3:.1f} + {s['world']} x {bd['hop_s'] * 1e3:.2f} = "
                    f"{bd['predicted_ring_token_s'] * 1e3:.1f} ms per token, against {bd['torch_ring_token_s'] * 1e3:.1f} ms measured "
                    f"for the torch-only ring: the flight is "
                    f"{_pct(_share(bd['predicted_ring_token_s'] - bd['back_to_back_token_s'], bd['torch_ring_token_s'] - bd['back_to_back_token_s']))} "
                    "of what the ring's pattern adds; the rest is lost around the hand-offs while both ranks compute, which "
                    "this measurement does not split further.",
                ]
            if "token_factors" in bd and bd.get("decode_token_s", 0) > 0 and bd.get("two_way_token_s", 0) > 0:
                f = bd["token_factors"]
                lines += [
                    "",
                    f"Per decoded token against the 2-way limit (prefill excluded: calls for {s['new_tokens']} and "
                    f"{s['new_tokens'] // 2} new tokens, per token, on both sides): hf_pipeline's ring "
                    f"{bd['decode_token_s'] * 1e3:.1f} ms, the 2-way processes' generate {bd['two_way_token_s'] * 1e3:.1f} ms "
                    f"(the ring reaches **{_pct(1 / f['ring_over_two_way'])}** of the 2-way limit per token). As factors of "
                    f"the ring's token time over theirs: "
                    f"**stages** {f['stages']:.3f} (each rank's {bd['microbatches']} stage steps back to back, "
                    f"{bd['back_to_back_token_s'] * 1e3:.1f} ms, over transformers' whole model on a rank's share of the prompts, "
                    f"{bd['two_way_step_token_s'] * 1e3:.1f} ms, both ranks at once: the split's imbalance and each stage's own "
                    f"work) x **pattern** {f['pattern']:.3f} (the torch-only ring over the same steps back to back: torch's P2P "
                    f"and this machine) x **hf_pipeline** {f['ours']:.3f} (its ring over the torch-only ring: its stage modules, "
                    f"caches, sampling and loop) / **generate loop** {f['generate_loop']:.3f} (transformers' generate per token "
                    f"over its model's step alone: the 2-way processes' own loop, logits processing and cache work) = "
                    f"{f['ring_over_two_way']:.3f}.",
                ]
        lines.append("")
    if "train" in res:
        lines += [
            "## Bubble: measured idle fraction per rank vs theory",
            "",
            "Three profiled training steps per schedule (`model.profile()`), the median one by wall time shown: idle = 1 - busy / step wall time on that rank, "
            "busy = forward, backward, weight-gradient and loss actions. Theory: GPipe/1F1B (p-1)/(m+p-1), interleaved "
            "(p-1)/(v*m+p-1), ZB-H1 about a third of 1F1B's, ZBV about 0. The recorded action order is compared with the "
            "schedule's action list. Timelines: `timelines/train-<schedule>.png` and `.trace.json` (Perfetto / chrome://tracing).",
            "",
            "| schedule | idle per rank (measured) | theoretical bubble | action order = schedule |",
            "|---|---|---|---|",
        ]
        for name, row in res["train"]["schedules"].items():
            if "error" in row:
                lines.append(f"| {name} | error | | |")
                continue
            idle = ", ".join(f"rank {k}: {_pct(v)}" for k, v in sorted(row["idle_fraction"].items()))
            match = "yes" if all(row["order_matches_schedule"].values()) else "no"
            lines.append(f"| {name} | {idle} | {_pct(row['theoretical_idle_fraction'])} | {match} |")
        lines.append("")
    if res.get("runs"):
        lines += ["## Partial reruns", ""] + [
            f"- `{r['command'].strip()}` ({', '.join(r['sections'])}) — {r['date']}, load average at start "
            f"{tuple(round(x, 2) for x in r['machine'].get('load_average') or ())}" for r in res["runs"]
        ] + [""]
    if res.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in res["errors"]] + [""]
    return "\n".join(lines)


def _merge(previous: dict[str, Any], new: dict[str, Any], sections: list[str]) -> dict[str, Any]:
    # A partial rerun replaces only its sections (bubble numbers live in the train section).
    merged = dict(previous)
    for key in ("load", "train", "generate"):
        if key in new:
            merged[key] = new[key]
    merged.setdefault("runs", []).append({k: new[k] for k in ("command", "date", "seconds") if k in new} | {"sections": sections, "machine": new["machine"]})
    for key in ("quick", "sizes", "errors"):
        merged[key] = new[key]
    return merged


README_START = "<!-- benchmark tables: generated by `python scripts/benchmark.py --update-readme` from bench_results/results.json -->"
README_END = "<!-- end of benchmark tables -->"


def readme_tables(res: dict[str, Any]) -> str:
    """The README's benchmark tables: the headline figures of ``results.json``, one table per section."""
    m, s = res["machine"], res["sizes"]
    lines = [
        README_START,
        f"From `{res['command'].strip()}` ({res['date'][:10]}; {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"transformers {m['transformers']}, 1 thread per rank). Full tables: `bench_results/results.md`.",
        "",
    ]
    if "load" in res:
        ld = res["load"]
        lines += [
            f"Load ({_gb(ld['checkpoint_bytes'])} bf16 LLaMA in {ld['shards']} shards):",
            "",
            "| ranks | peak RSS / stage bytes | bytes read / checkpoint | transformers on every rank: bytes read | load time / plain read, warm | cold |",
            "|---|---|---|---|---|---|",
        ]
        for p, row in ld["by_world"].items():
            if "error" in row:
                continue
            cold = f"{row['cold_load_over_read']:.2f}x" if row.get("cold_load_over_read") else "-"
            warm = f"{row['load_over_read']:.2f}x" if "load_over_read" in row else "-"
            lines.append(f"| {p} | {row['peak_over_stage']:.2f}x | {row['bytes_read_over_checkpoint']:.2f}x | "
                         f"{row['hf_bytes_read_over_checkpoint']:.2f}x | {warm} | {cold} |")
        lines.append("")
    if "train" in res:
        tr = res["train"]
        head = (f"Train (LLaMA hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, seq {s['seq']}, batch {s['batch']}, "
                f"{s['n_microbatches']} microbatches, {s['world']} ranks)")
        if tr.get("two_way_speedup"):
            head += (f"; this machine's 2-way limit {tr['two_way_speedup']:.2f}x, microbatch cost "
                     f"{tr['baseline']['microbatch_cost']:.2f}x, perfect overlap {tr['perfect_overlap_speedup']:.2f}x")
        if tr.get("microbatched_two_way_speedup"):
            head += f", perfect overlap measured {tr['microbatched_two_way_speedup']:.2f}x"
        lines += [head + ":", "", "| schedule | vs transformers (own process) | fraction of perfect overlap | fraction of perfect overlap, measured |",
                  "|---|---|---|---|"]
        for name, row in tr["schedules"].items():
            if "error" in row:
                continue
            label = name if name != "auto" else f"auto ({row['picked']['schedule']}, m={row['picked']['n_microbatches']})"
            lines.append(f"| {label} | {row['speedup_vs_separate_baseline']:.2f}x | {_pct(row.get('fraction_of_perfect_overlap'))} | "
                         f"{_pct(row.get('fraction_of_microbatched_two_way'))} |")
        if "schedules" in tr.get("paired", {}):
            vs = ", ".join(f"{name} {_pct(row['vs_1f1b'])}" for name, row in tr["paired"]["schedules"].items() if name != "1f1b")
            lines += ["", f"The fixed schedules loaded in one job, their steps taking turns: tokens/s against 1F1B's {vs}."]
            theirs = ", ".join(f"{name} {_pct(row['torch_only']['vs_torch_only'])}" for name, row in tr["paired"]["schedules"].items()
                               if "vs_torch_only" in row.get("torch_only", {}))
            if theirs:
                lines[-1] += (f" hf_pipeline's tokens/s over torch's own pipeline on the same split (transformers' layers, "
                              f"torch's stages and schedule, no hf_pipeline), paired: {theirs}.")
        lines.append("")
    if "generate" in res and "pipelined" in res["generate"]:
        g = res["generate"]
        text = f"Generate ({s['prompts']} prompts x {s['prompt_len']} tokens, {s['new_tokens']} new, greedy, tokens equal transformers'): "
        text += f"{g['speedup_vs_transformers']:.2f}x of one transformers process"
        if "two_way_speedup" in g:
            text += f"; 2-way limit {g['two_way_speedup']:.2f}x, of which the ring reaches {_pct(g['fraction_of_two_way'])}"
            if "fraction_of_two_way" in g.get("chunked_prefill", {}):
                text += f" ({_pct(g['chunked_prefill']['fraction_of_two_way'])} with `prefill_chunk_size={s['prefill_chunk']}`)"
        bd = g.get("bound", {})
        if "torch_ring_token_s" in bd and bd.get("decode_token_s", 0) > 0:
            per_token = bd["decode_token_s"]
            text += (f". The same ring built from transformers' model and torch's P2P alone loses "
                     f"{1 - bd['back_to_back_token_s'] / bd['torch_ring_token_s']:.0%} against its steps back to back; "
                     f"hf_pipeline's ring runs at {bd['torch_ring_token_s'] / per_token:.0%} of that ring's speed")
        lines += [text + ".", ""]
    lines.append(README_END)
    return "\n".join(lines)


def update_readme(readme: pathlib.Path, res: dict[str, Any]) -> None:
    text = readme.read_text()
    a, b = text.find(README_START), text.find(README_END)
    if a < 0 or b < a:
        raise SystemExit(f"{readme} has no benchmark block ({README_START!r} ... {README_END!r})")
    replace_file(readme, text[:a] + readme_tables(res) + text[b + len(README_END):])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, prog="hf-pipeline bench")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition: seconds (CI)")
    parser.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", default=None, help="directory for results.md, results.json, timelines/ "
                        "(default: bench_results/, or bench_out/quick/ with --quick, so a quick run never overwrites the committed results)")
    parser.add_argument("--cache-dir", default=None, help="where the random checkpoints are written once (default ~/.cache/hf_pipeline/bench)")
    parser.add_argument("--load-ranks", default=None, help="world sizes of the load section (default 1,2,4; quick 1,2)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launched job")
    parser.add_argument("--update-readme", action="store_true",
                        help="rewrite README.md's benchmark tables and bench_results/results.md from bench_results/results.json and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    if args.update_readme:
        res = json.loads((_ROOT / "bench_results" / "results.json").read_text())
        update_readme(_ROOT / "README.md", res)
        replace_file(_ROOT / "bench_results" / "results.md", to_markdown(res))
        return 0
    if args.out is None:
        args.out = str(_ROOT / ("bench_out/quick" if args.quick else "bench_results"))
    args.argv = argv
    res = run_benchmark(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    if args.sections and json_path.is_file():
        res = _merge(json.loads(json_path.read_text()), res, args.sections.split(","))
        res["seconds"] = sum(r.get("seconds", 0) for r in res.get("runs", [])) or res.get("seconds", 0)
    replace_file(json_path, json.dumps(res, indent=2, default=str))
    replace_file(md_path, to_markdown(res))
    print(md_path.read_text())
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
