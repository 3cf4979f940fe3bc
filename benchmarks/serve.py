"""Serve section, measuring side: one seeded request stream through five servers.

The stream (:func:`request_stream`): prompt lengths, ``max_new_tokens`` and Poisson arrival times drawn
from one seed, the same for every contender. Each contender is fed the stream at its arrival times
after one warm-up request, and records per request: when it was submitted, when its first token and
its last token were ready, and its tokens. The contenders:

  * ``served``: hf_pipeline's serving :class:`~hf_pipeline.serving.Engine` on ``world`` ranks, its
    default batching, fed from a client thread on rank 0;
  * ``static``: the same Engine with ``batching="static"`` (when the Engine has no such option, the
    Engine as it is: its batches are static; the results say which ran);
  * ``served_v``: the same Engine on the model loaded for ``zbv-zero-bubble`` (two stages per rank in a V):
    what a load that picks a V schedule serves with;
  * ``hf_continuous``: transformers' own continuous batching (``init_continuous_batching``) on one process;
  * ``hf_native_pp``: transformers' native pipeline (``DistributedConfig(pp_size=world)``) on ``world``
    ranks, the stream served in static batches through its ``generate``.

Every request is greedy; none stops early (the random checkpoint has no EOS), so each makes exactly its
``max_new_tokens`` tokens and every contender generates the same number of tokens.
"""

from __future__ import annotations

import inspect
import os
import random
import threading
import time
from dataclasses import asdict
from typing import Any

from benchmarks.config import Sizes
from devtools.engine_client import serve_with_client

__all__ = ["CONTENDERS", "STREAM_SEED", "TASKS", "hf_manager", "hf_results", "launches", "request_stream"]

STREAM_SEED = 20
_POLL_S = 0.002  # how often the client looks at its handles: far below a decode step


def request_stream(sizes: dict, seed: int = STREAM_SEED) -> list[dict[str, Any]]:
    """The seeded stream: per request its ``arrival`` (seconds after the first's), ``prompt`` (token ids)
    and ``max_new_tokens``; prompt lengths and output lengths uniform in the sizes' ranges, gaps between
    arrivals exponential at ``serve_rate`` requests per second (Poisson arrivals).

    Returns:
        The requests in arrival order.
    """
    rng = random.Random(seed)  # python's generator: the same stream on every machine and torch version
    stream, t = [], 0.0
    for i in range(sizes["serve_requests"]):
        if i:
            t += rng.expovariate(sizes["serve_rate"])
        n = rng.randint(*sizes["serve_prompt_len"])
        stream.append({"arrival": t, "prompt": [rng.randrange(3, sizes["vocab"]) for _ in range(n)],
                       "max_new_tokens": rng.randint(*sizes["serve_new_tokens"])})
    return stream


def _wait_until(start: float, at: float) -> None:
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _watch(handles: list, records: list[dict], start: float, n: int) -> None:
    """Rank 0's watcher: polls the handles (the feeder still appending to ``handles``) until all ``n`` are
    done, noting when each one's first token and last token were there.

    One polling thread, not a reader thread per handle: those would wake at every token and take the
    GIL from rank 0's main thread, which runs the ring meanwhile."""
    open_: set[int] = set()
    seen = 0
    while seen < n or open_:
        now = time.perf_counter() - start
        open_ |= set(range(seen, len(handles)))
        seen = len(handles)
        for i in list(open_):
            h, rec = handles[i], records[i]
            if rec["first"] is None and h.choices[0].token_ids:
                rec["first"] = now
            if h.done:
                choice = h.result()[0]
                rec.update(done=now, tokens=list(choice.token_ids), finish_reason=choice.finish_reason)
                rec["first"] = now if rec["first"] is None else rec["first"]
                open_.discard(i)
        time.sleep(_POLL_S)


def _feed_engine(engine, stream: list[dict], out: dict) -> None:
    """Rank 0's client: one warm-up request, then the stream at its arrival times; drains the engine."""
    from hf_pipeline.serving import CompletionRequest

    try:
        engine.submit(CompletionRequest(prompt_ids=stream[0]["prompt"], max_new_tokens=2)).result(timeout=600)
        # A request's latency counts from its arrival in the stream (queueing included), not from when
        # the feeder got round to submitting it.
        records = [{"arrival": r["arrival"], "first": None, "done": None} for r in stream]
        handles: list = []
        start = time.perf_counter()
        watcher = threading.Thread(target=_watch, args=(handles, records, start, len(stream)), daemon=True)
        watcher.start()
        for r in stream:
            _wait_until(start, r["arrival"])
            handles.append(engine.submit(CompletionRequest(prompt_ids=r["prompt"],
                                                           max_new_tokens=r["max_new_tokens"])))
        watcher.join()
        out["records"] = records
    finally:
        engine.drain()


def serve_engine(task: dict, out: dict) -> None:
    """The served pipeline (``task["batching"]`` None: the Engine's default) on every rank."""
    import torch

    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.serving import Engine

    sizes = task["sizes"]
    stream = request_stream(sizes)
    model = AutoModelForCausalLM.from_pretrained(task["path"], pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False, **task.get("load", {}))
    kwargs = {"max_batch": sizes["serve_batch"], "max_queue": len(stream) + 1}
    has_option = "batching" in inspect.signature(Engine).parameters
    if has_option and task["batching"]:
        kwargs["batching"] = task["batching"]
    engine = Engine(model, None, **kwargs)
    # What ran: the Engine's own setting when it has the option (and why it fell back to static, if it
    # did); static batches before it had one.
    ran = getattr(engine, "batching", None) or task["batching"] or "default"
    out["batching"] = str(ran) if has_option else "static"
    if getattr(engine, "static_reason", None):
        out["batching"] += f" ({engine.static_reason})"
    out["engine_has_batching_option"] = has_option
    serve_with_client(engine, lambda: _feed_engine(engine, stream, out))
    out.update(rank=model.ctx.rank, rounds=engine.rounds)


def serve_hf_continuous(task: dict, out: dict) -> None:
    """transformers' continuous batching on one process, fed the stream from this thread."""
    import torch
    import transformers

    sizes = task["sizes"]
    stream = request_stream(sizes)
    model = transformers.AutoModelForCausalLM.from_pretrained(task["path"], dtype=torch.float32).eval()
    manager = hf_manager(model, sizes, sizes["serve_batch"])
    manager.start()
    try:
        manager.add_request(stream[0]["prompt"], request_id="warm-up", max_new_tokens=2)
        hf_results(manager, 1)
        start = time.perf_counter()
        records: list[dict] = [{"arrival": r["arrival"]} for r in stream]
        for i, r in enumerate(stream):
            _wait_until(start, r["arrival"])
            manager.add_request(r["prompt"], request_id=f"r{i}", max_new_tokens=r["max_new_tokens"],
                                record_timestamps=True)
        for res in hf_results(manager, len(stream)).values():
            rec = records[int(res.request_id[1:])]
            rec.update(first=res.timestamps[0] - start, done=res.timestamps[-1] - start,
                       tokens=list(res.generated_tokens), finish_reason="length")
    finally:
        manager.stop(block=True, timeout=30)
    out.update(records=records, batching="continuous")


def hf_manager(model, sizes: dict, max_batch: int):
    """transformers' continuous batching manager of ``model`` (not started): greedy, no EOS, at most
    ``max_batch`` requests per batch, its cache sized for the stream's longest request."""
    import transformers

    if not hasattr(model, "init_continuous_batching"):
        raise RuntimeError(f"transformers {transformers.__version__} has no init_continuous_batching")
    longest = sizes["serve_prompt_len"][1] + sizes["serve_new_tokens"][1]
    page = 32
    # Sized for the stream, as a server would be: its default sizes the cache from free device memory,
    # which on a CPU host means minutes of allocation.
    cb = transformers.ContinuousBatchingConfig(
        page_size=page, num_blocks=max_batch * -(-longest // page) * 2,
        max_batch_tokens=max_batch * sizes["serve_prompt_len"][1], max_requests_per_batch=max_batch)
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=sizes["serve_new_tokens"][1],
                                        eos_token_id=None, pad_token_id=0)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def hf_results(manager, n: int) -> dict[str, Any]:
    """The next ``n`` finished results of transformers' manager, by request id."""
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 1800
    while len(got) < n:
        if time.monotonic() > deadline or not manager.is_running():
            raise RuntimeError(f"transformers' continuous batching stopped after {len(got)} of {n} results")
        res = manager.get_result(timeout=0.5)
        if res is not None and res.is_finished():
            if res.error:
                raise RuntimeError(f"transformers' continuous batching failed a request: {res.error}")
            got[res.request_id] = res
    return got


class _StepTimes:
    """A streamer recording when each decode step's tokens were ready (rank 0 of the native pipeline)."""

    def __init__(self, start: float):
        self.start, self.times, self.prompt_seen = start, [], False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True  # generate puts the prompt first
            return
        self.times.append(time.perf_counter() - self.start)

    def end(self) -> None:
        pass


def _native_generate(model, prompts: list[list[int]], new_tokens: int, streamer=None) -> list[list[int]]:
    """transformers' greedy ``generate`` of ``prompts`` left padded; each row's new tokens."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, streamer=streamer)
    return out[:, width:].tolist()


def _next_batch(stream: list[dict], served: int, start: float, max_batch: int) -> list[int]:
    """Rank 0: wait for the oldest unserved request, then take every one arrived by now (FIFO, at most
    ``max_batch``): the static batcher's policy for greedy requests."""
    _wait_until(start, stream[served]["arrival"])
    now = time.perf_counter() - start
    return [i for i in range(served, min(len(stream), served + max_batch)) if stream[i]["arrival"] <= now]


def serve_hf_native_pp(task: dict, out: dict) -> None:
    """transformers' native pipeline on every rank: the stream in static batches through its ``generate``;
    rank 0 picks each batch and broadcasts it."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    sizes = task["sizes"]
    stream = request_stream(sizes)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        task["path"], dtype=torch.float32, distributed_config=DistributedConfig(pp_size=world)).eval()
    rank, max_batch = dist.get_rank(), sizes["serve_batch"]
    _native_generate(model, [stream[0]["prompt"]], 2)  # warm-up
    records: list[dict] = [{"arrival": r["arrival"]} for r in stream]
    ctrl = torch.zeros(max_batch + 1, dtype=torch.long)  # [k, the batch's k request indices, ...]; k = 0: stop
    served = 0
    dist.barrier()
    start = time.perf_counter()
    while True:
        if rank == 0:
            batch = _next_batch(stream, served, start, max_batch) if served < len(stream) else []
            ctrl.zero_()
            ctrl[0] = len(batch)
            ctrl[1:1 + len(batch)] = torch.tensor(batch, dtype=torch.long)
        dist.broadcast(ctrl, src=0)
        batch = ctrl[1:1 + int(ctrl[0])].tolist()
        if not batch:
            break
        steps = _StepTimes(start) if rank == 0 else None
        rows = _native_generate(model, [stream[i]["prompt"] for i in batch],
                                max(stream[i]["max_new_tokens"] for i in batch), steps)
        if steps is not None:
            for i, row in zip(batch, rows):
                n = stream[i]["max_new_tokens"]
                records[i].update(first=steps.times[0], done=steps.times[n - 1], tokens=row[:n],
                                  finish_reason="length")
        served += len(batch)
    out.update(rank=rank, records=records if rank == 0 else None, batching="static")


TASKS = {"serve_engine": serve_engine, "serve_hf_continuous": serve_hf_continuous,
         "serve_hf_native_pp": serve_hf_native_pp}
CONTENDERS = {"served": "serve served", "static": "serve static", "served_v": "serve served V layout",
              "hf_continuous": "serve transformers continuous", "hf_native_pp": "serve transformers native pp"}


def launches(sizes: Sizes, ckpts: dict[str, str]) -> dict[int, list[dict]]:
    """The serve section's tasks by world size: the Engine twice and transformers' native pipeline on
    ``world`` ranks, transformers' continuous batching on one process."""
    sz = asdict(sizes)
    common = {"path": ckpts["train"], "sizes": sz}
    return {
        1: [{"task": "serve_hf_continuous", "label": CONTENDERS["hf_continuous"], **common}],
        sizes.world: [
            {"task": "serve_engine", "label": CONTENDERS["served"], "batching": None, **common},
            {"task": "serve_engine", "label": CONTENDERS["static"], "batching": "static", **common},
            {"task": "serve_engine", "label": CONTENDERS["served_v"], "batching": None,
             "load": {"schedule": "zbv-zero-bubble"}, **common},
            {"task": "serve_hf_native_pp", "label": CONTENDERS["hf_native_pp"], **common},
        ],
    }
