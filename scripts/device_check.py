"""Device check: the CUDA path on whatever GPUs this machine has, in one command, under 5 minutes.

    python scripts/device_check.py                                    # one GPU: 2 stages in one process on cuda:0
    torchrun --nproc_per_node $(nvidia-smi -L | wc -l) scripts/device_check.py   # several GPUs: a rank per GPU, NCCL
    python scripts/device_check.py --device cpu --size tiny           # the same code on CPU (what the tests run)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/device_check.py --device cpu --size tiny   # 2 gloo ranks

It builds its own model (nothing is downloaded): a random-weight LLaMA (``--size large``: the
Llama-3.2-1B shape untied, 1.5B parameters, 3 GB in bf16; ``small``: 0.2B; ``tiny``: 3M) saved by
``save_pretrained(max_shard_size=...)`` as a sharded safetensors checkpoint, then runs, section by
section (each one timed, its failure recorded and the next section run anyway):

  env         torch / transformers / CUDA versions, GPUs, world size.
  checkpoint  the random model, written by rank 0 (on the GPU when there is one: init is instant).
  load        ``AutoModelForCausalLM.from_pretrained(path, pipeline=True)`` straight to the device:
              per rank the host peak RSS (VmHWM, reset before the load), the device memory it
              allocated, each stage's parameter bytes and the bytes read, all against the plan's
              stage bytes. On CUDA the host must stay far below the stage bytes (the loader goes
              through a 16 MiB pinned bounce buffer), on CPU it is ~1x (the weights live there).
  reference   transformers ``from_pretrained`` of the same checkpoint on rank 0's device (on
              several GPUs: cuda:0, beside stage 0): the one-GPU baseline.
  forward     pipelined logits against transformers', same inputs (left padded), same device and
              dtype; max |diff| within the tolerance below.
  generate    greedy pipelined ``generate`` against transformers' ``generate(do_sample=False)``:
              tokens equal (see the tolerance), and tokens/s of both.
  train       one ``model.train_step`` against transformers' forward + backward on the same batch:
              loss and gradients (of rank 0's stages) within tolerance, and tokens/s of both; on
              several ranks also each stage's device time per microbatch and the split balanced on
              it (``model.measure_split``), and one profiled step split into the ranks' imbalance,
              the schedule's own bubble (the step replayed with free messages) and the waits
              around the messages.

Tolerances. fp32: the pipeline runs transformers' own modules, so it can differ only by the order
of floating point sums (other batch shapes pick other kernels); fp32 keeps 24 bits, so logits agree
to 1e-4 of the largest logit and greedy tokens must be equal. bf16 keeps 8 bits: a different
summation order alone moves a logit by a few bf16 steps, and a deep residual stream adds these up,
so no fixed number is right for every model. The check measures it instead: transformers in bf16
is compared with the same model in fp32 on the same inputs, and the pipeline in bf16 may differ
from transformers in bf16 by at most twice that rounding error (if both are within it of the fp32
result, they are within twice it of each other), and by at least one bf16 step of the largest
logit (2**-7 of it). Greedy tokens: equal, or a row first differs where transformers' own top two
logits are within that tolerance of each other (a tie that bf16 cannot decide). Loss: 1e-5
relative in fp32, 2**-7 in bf16 (one bf16 step of the loss). Gradients: global relative L2 error
1e-4 in fp32, 2**-4 in bf16; a real bug (a microbatch, stage or tied copy missing) is off by 25% or
more, bf16 rounding by about 1%.

Everything goes to ``--out`` (default ``$OUT/device_check.json`` when ``$OUT`` is set, else
``device_check.json``), rewritten after every section, so a run cut short still leaves its figures.
``--budget-s`` is a hard limit: a section is not started without ``--reserve-s`` left, and at the
budget a watchdog writes the JSON (the running section marked "timed_out") and ends the process.
Exit status 0 when every section ran and passed its checks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

try:
    import hf_pipeline
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import hf_pipeline

import torch
import torch.distributed as dist
import transformers

from hf_pipeline.distributed.context import destroy_distributed, init_distributed
from hf_pipeline.tools.profile import host_peak_rss, host_rss, reset_host_peak, trim_host_heap
from hf_pipeline.training.checkpoint import replace_file

SECTIONS = ("env", "checkpoint", "load", "reference", "forward", "generate", "train")
NEEDS = {"load": ("checkpoint",), "reference": ("checkpoint",), "forward": ("load", "reference"),
         "generate": ("load", "reference"), "train": ("load", "reference")}


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True, kw_only=True)
class Size:
    """Model shape and workload of one ``--size``."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    shard_bytes: int
    batch: int  # rows of the forward, generate and train batches
    seq: int  # forward sequence length
    prompt_len: int
    new_tokens: int
    train_seq: int
    reps: int  # timed repetitions of generate and of the train step


SIZES = {
    # Llama-3.2-1B's shape with an untied LM head: 1.50B parameters, 3.0 GB in bf16, 7 shards.
    "large": Size(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, shard_bytes=500_000_000,
                  batch=8, seq=128, prompt_len=32, new_tokens=64, train_seq=512, reps=3),
    "small": Size(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000, shard_bytes=100_000_000,
                  batch=8, seq=128, prompt_len=32, new_tokens=32, train_seq=256, reps=3),
    # 3.4M parameters (13.6 MB in fp32) in 7 shards: big enough that the RSS figures are not noise.
    "tiny": Size(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=2048, shard_bytes=2_000_000,
                 batch=4, seq=32, prompt_len=16, new_tokens=8, train_seq=32, reps=1),
}
_WARMUP = Size(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, shard_bytes=50_000,
               batch=2, seq=8, prompt_len=8, new_tokens=2, train_seq=8, reps=1)

# Tolerances by dtype, explained in the module docstring.
LOGITS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-4, torch.float16: 2.0**-7}
HOST_SLACK_BYTES = 256 << 20  # allocator and CUDA bookkeeping a load straight to the device may add on the host


def _llama_config(size: Size, dtype: torch.dtype) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=size.hidden, intermediate_size=size.intermediate, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
        max_position_embeddings=max(256, size.seq, size.train_seq, size.prompt_len + size.new_tokens),
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        dtype=str(dtype).removeprefix("torch."),
    )


# ----------------------------------------------------------------------------- the run
class Run:
    """Sections, their figures and checks, the JSON file and the time budget of one device check."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.rank = int(os.environ.get("RANK", "0"))
        self.lock = threading.Lock()
        self.current: str | None = None
        self.result: dict[str, Any] = {
            "command": [sys.executable, *sys.argv], "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "budget_s": args.budget_s, "ok": False, "config": {}, "sections": {},
        }
        self.state: dict[str, Any] = {}  # objects sections hand on: path, model, reference, tolerance
        self.done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    # -- output
    def log(self, msg: str, *, all_ranks: bool = False) -> None:
        if self.rank == 0 or all_ranks:
            print(f"[device_check {time.monotonic() - self.start:6.1f}s{f' rank {self.rank}' if all_ranks else ''}] {msg}", flush=True)

    def write(self) -> None:
        if self.rank != 0:
            return
        locked = self.lock.acquire(timeout=5)
        try:
            self._write_locked()
        finally:
            if locked:
                self.lock.release()

    def _write_locked(self) -> None:
        # Each writer (the main thread, the watchdog) replaces the JSON whole, under the lock: with one
        # temporary name shared by both, the watchdog once renamed over the output the file the main
        # thread had just truncated, and its exit left the JSON empty (a run at its budget).
        self.result["seconds"] = round(time.monotonic() - self.start, 2)
        out = pathlib.Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            try:
                text = json.dumps(self.result, indent=2, default=str)
                break
            except RuntimeError:  # the other thread changed a dict while it was being read: read again
                if attempt == 2:
                    raise
        replace_file(out, text)

    def _watch(self) -> None:
        # The hard budget: whatever hangs (a collective, a kernel), the figures so far are written.
        if self.done.wait(max(0.0, self.deadline - time.monotonic())):
            return
        if self.rank != 0 and self.done.wait(5):  # rank 0 writes first; torchrun then ends the job when any rank exits
            return
        with contextlib.suppress(Exception):
            self.log(f"time budget of {self.args.budget_s:.0f}s spent in section {self.current!r}; writing what there is", all_ranks=True)
            faulthandler.dump_traceback(all_threads=True)
            # Held until the exit: no write of the main thread replaces these figures or is cut short.
            self.lock.acquire(timeout=5)
            if self.current is not None:
                self.result["sections"].setdefault(self.current, {})["status"] = "timed_out"
            self.result["timed_out"] = True
            if self.rank == 0:
                self._write_locked()
            if self.rank == 0 and self.args.workdir is None and "root" in self.state:
                shutil.rmtree(self.state["root"], ignore_errors=True)  # the temporary checkpoint
        os._exit(3)

    # -- sections
    def section(self, name: str, fn: Callable[[dict, dict], None]) -> None:
        rec: dict[str, Any] = {"status": "skipped", "figures": {}, "checks": {}}
        self.result["sections"][name] = rec
        if name not in self.args.sections:
            rec["reason"] = "not in --sections"
            return
        missing = [n for n in NEEDS.get(name, ()) if self.result["sections"].get(n, {}).get("status") not in ("ok", "check_failed")]
        if missing:
            rec["reason"] = f"needs {', '.join(missing)}"
            self.log(f"{name}: skipped ({rec['reason']})")
            self.write()
            return
        left = self.deadline - time.monotonic()
        if left < self.args.reserve_s:
            rec["reason"] = f"time budget: {left:.0f}s left, a section needs {self.args.reserve_s:.0f}s"
            self.log(f"{name}: skipped ({rec['reason']})")
            self.write()
            return
        self.current = name
        self.log(f"{name} ...")
        t = time.monotonic()
        errors: list[str] = []
        try:
            if name == self.args.fail_in:
                raise RuntimeError(f"failure injected into section {name!r} (--fail-in)")
            fn(rec["figures"], rec["checks"])
        except Exception as e:  # noqa: BLE001 - recorded; the next section runs anyway
            errors.append(f"rank {self.rank}: {type(e).__name__}: {e}")
            rec["traceback"] = traceback.format_exc()[-4000:]
            self.log(f"{name} FAILED: {type(e).__name__}: {e}", all_ranks=True)
        gc.collect()  # a failed section's tensors go too
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
        gathered = _gather((name, errors))
        errors = [e for _, errs in gathered for e in errs]
        if any(n != name for n, _ in gathered):
            # A rank failed between two collectives and the others paired it with a different one.
            errors.append(f"ranks are out of step: sections {[n for n, _ in gathered]}")
        rec["seconds"] = round(time.monotonic() - t, 2)
        if errors:
            rec["status"], rec["errors"] = "failed", errors
        elif all(c["passed"] for c in rec["checks"].values()):
            rec["status"] = "ok"
        else:
            rec["status"] = "check_failed"
        self.current = None
        failed = [k for k, c in rec["checks"].items() if not c["passed"]]
        self.log(f"{name}: {rec['status']} in {rec['seconds']:.1f}s" + (f"; failed checks: {failed}" if failed else ""))
        self.write()

    def finish(self) -> int:
        secs = self.result["sections"]
        ran = [s for s in secs.values() if s["status"] != "skipped" or s.get("reason") != "not in --sections"]
        self.result["ok"] = bool(ran) and all(s["status"] == "ok" for s in ran)
        self.write()
        self.done.set()
        self.log("summary: " + ", ".join(f"{k}={v['status']}" for k, v in secs.items()))
        for name, sec in secs.items():
            for key, c in sec["checks"].items():
                self.log(f"  {'PASS' if c['passed'] else 'FAIL'} {name}.{key} = {_fmt(c['value'])} (bounds {_fmt(c.get('min'))} .. {_fmt(c.get('max'))})")
        self.log(f"figures written to {self.args.out}; {'all ok' if self.result['ok'] else 'NOT ok'}")
        return 0 if self.result["ok"] else 1


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _check(checks: dict, name: str, value: float, *, lo: float | None = None, hi: float | None = None, why: str = "") -> bool:
    value = float(value)
    passed = math.isfinite(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    checks[name] = {"value": value, "min": lo, "max": hi, "passed": bool(passed), "why": why}
    return passed


# ----------------------------------------------------------------------------- collectives
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; a broken group gives this rank's alone."""
    if not _distributed():
        return [obj]
    try:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    except Exception as e:  # noqa: BLE001 - the group is gone (an earlier failure): keep going locally
        print(f"[device_check] gathering from the other ranks failed ({type(e).__name__}: {e}); this rank's figures only", flush=True)
        return [obj]


def _broadcast(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds) with every rank starting together and the device drained at both ends."""
    _sync(device)
    _barrier()
    t = time.perf_counter()
    out = fn()
    _sync(device)
    _barrier()
    return out, time.perf_counter() - t


def _on_rank0(errors: list[str], fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only (reference work); its failure is noted and the ranks meet in a barrier either way."""
    out = None
    if not _distributed() or dist.get_rank() == 0:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - raised after the barrier, so no rank waits for a dead peer
            errors.append(f"{type(e).__name__}: {e}")
    _barrier()
    if errors:
        raise RuntimeError("; ".join(errors))
    return out


# ----------------------------------------------------------------------------- inputs
def _left_padded(rows: int, length: int, vocab: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), row r left-padded by (r % 4) * length / 8 tokens of pad id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = (r % 4) * length // 8
        ids[r, :pad] = 0
        mask[r, :pad] = 0
    return ids, mask


def _param_bytes(params) -> int:
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


# ----------------------------------------------------------------------------- sections
class Sections:
    """The sections, one method each: ``fn(figures, checks)`` fills the section's record in the JSON.

    Collectives are called by every rank in the same order; work only rank 0 does (the transformers
    reference and the comparisons) runs inside :func:`_on_rank0`, which ends in a barrier even when
    it fails, so a failing reference never leaves the other ranks waiting.
    """

    def __init__(self, run: Run, ctx, args: argparse.Namespace):
        self.run, self.ctx, self.args = run, ctx, args
        self.device = ctx.device
        self.dtype = getattr(torch, args.dtype)
        self.size = SIZES[args.size]
        self.is_main = ctx.rank == 0
        # One process: all stages local (virtual stages); several: one stage per rank unless told.
        self.virtual = args.virtual_stages or (args.stages if ctx.world_size == 1 else 1)
        self.num_stages = args.stages if ctx.world_size == 1 else ctx.world_size * self.virtual
        self.microbatches = args.microbatches or self.num_stages
        self.batch = max(self.size.batch, self.microbatches) // self.microbatches * self.microbatches
        self.model = None
        self.ref = None
        self.tolerance: float | None = None
        run.result["config"] = {
            "size": args.size, "dtype": args.dtype, "device": str(self.device), "world_size": ctx.world_size,
            "backend": ctx.backend, "num_stages": self.num_stages, "virtual_stages": self.virtual,
            "schedule": args.schedule, "n_microbatches": self.microbatches, "batch": self.batch,
            "model": {k: v for k, v in vars(self.size).items()},
        }

    def _load_kwargs(self) -> dict[str, Any]:
        kw = dict(pipeline=True, device=str(self.device), dtype=self.dtype, num_stages=self.num_stages,
                  virtual_stages=self.virtual, n_microbatches=self.microbatches, progress=False)
        if self.args.schedule:
            kw["schedule"] = self.args.schedule
        return kw

    # -- env
    def env(self, fig: dict, checks: dict) -> None:
        fig.update(
            python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
            hf_pipeline=hf_pipeline.__version__, host=platform.node(), cpus=os.cpu_count(),
            world_size=self.ctx.world_size, backend=self.ctx.backend, device=str(self.device),
            cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
        )
        if torch.cuda.is_available():
            fig["gpus"] = [
                {"name": torch.cuda.get_device_name(i), "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())
            ]
            fig["bf16_supported"] = torch.cuda.is_bf16_supported()
            with contextlib.suppress(Exception):
                v = torch.cuda.nccl.version()
                fig["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        self.run.log(f"torch {torch.__version__}, transformers {transformers.__version__}, {self.ctx.world_size} rank(s), "
                     f"device {self.device}, {fig.get('gpus', 'no GPU')}")

    # -- checkpoint
    def checkpoint(self, fig: dict, checks: dict) -> None:
        args = self.args
        root = _broadcast(str(pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="device_check-"))) if self.is_main else None)
        root = pathlib.Path(root)
        self.run.state["root"] = root
        errors: list[str] = []

        def write() -> dict:
            out = {}
            for name, size in (("warmup", _WARMUP), ("model", self.size)):
                t = time.perf_counter()
                config = _llama_config(size, self.dtype)
                torch.manual_seed(args.seed)
                # Built on the device when there is one: random init of 1.5B parameters is instant there.
                with torch.device(self.device):
                    model = transformers.LlamaForCausalLM(config).to(self.dtype)
                model = model.to("cpu")  # saved from host memory, as any checkpoint is
                model.save_pretrained(root / name, max_shard_size=size.shard_bytes)
                n = sum(p.numel() for p in model.parameters())
                del model
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                shards = sorted(p.name for p in (root / name).glob("*.safetensors"))
                out[name] = {"params": n, "bytes": sum((root / name / s).stat().st_size for s in shards),
                             "shards": len(shards), "seconds": round(time.perf_counter() - t, 2)}
            return out

        written = _on_rank0(errors, write)
        if self.is_main:
            fig.update(path=str(root / "model"), **written)
            self.run.log(f"checkpoint: {written['model']['params'] / 1e9:.3f}B params, {written['model']['bytes'] / 2**30:.2f} GiB "
                         f"in {written['model']['shards']} shards, {written['model']['seconds']:.1f}s")
            _check(checks, "shards", written["model"]["shards"], lo=2, why="a sharded checkpoint, as real ones are")

    # -- load
    def load(self, fig: dict, checks: dict) -> None:
        from hf_pipeline import AutoModelForCausalLM

        root = self.run.state["root"]
        dev = self.device
        # Warm-up on a tiny checkpoint of the same architecture: lazy imports, the CUDA context,
        # cuBLAS and the pinned bounce buffer belong to the process, not to loading.
        warm = AutoModelForCausalLM.from_pretrained(root / "warmup", **{**self._load_kwargs(), "n_microbatches": self.num_stages})
        del warm
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            dev_base = torch.cuda.memory_allocated(dev)
        trim_host_heap()
        resettable = reset_host_peak()
        host_base = host_rss()
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(root / "model", **self._load_kwargs())
        _sync(dev)
        seconds = time.perf_counter() - t
        host_peak = host_peak_rss() - host_base
        mine: dict[str, Any] = {"rank": self.ctx.rank, "device": str(model.device), "seconds": round(seconds, 3),
                                "host_peak_bytes": host_peak, "host_peak_resettable": resettable}
        if dev.type == "cuda":
            mine["device_bytes"] = torch.cuda.memory_allocated(dev) - dev_base
            mine["device_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - dev_base
        mine["stages"] = [
            {"index": s.spec.index, "plan_bytes": s.spec.nbytes, "param_bytes": _param_bytes(s.parameters()),
             "on_device": all(p.device == model.device for p in s.parameters())}
            for s in model.stages
        ]
        stage_bytes = sum(s.spec.nbytes for s in model.stages)
        mine.update(stage_bytes=stage_bytes, param_bytes=_param_bytes(p for _, p in model.checkpoint_named_parameters()),
                    bytes_read=model.load_report.bytes_read, files_opened=len(model.load_report.files_opened))
        self.model = model
        ranks = _gather(mine)
        if not self.is_main:
            return
        fig["plan"] = model.plan.to_dict()
        fig["ranks"] = ranks
        self.run.log(f"plan:\n{model.plan}")
        for r in ranks:
            if not isinstance(r, dict):
                continue
            sb = max(1, r["stage_bytes"])
            tag = f"rank{r['rank']}"
            for s in r["stages"]:
                _check(checks, f"{tag}.stage{s['index']}.param_bytes_per_plan_bytes", s["param_bytes"] / max(1, s["plan_bytes"]),
                       lo=0.999, hi=1.001, why="each stage holds exactly the parameters the plan gave it")
                _check(checks, f"{tag}.stage{s['index']}.on_device", float(s["on_device"]), lo=1, why="every parameter on the rank's device")
            _check(checks, f"{tag}.bytes_read_per_stage_bytes", r["bytes_read"] / sb, lo=0.999, hi=1.001,
                   why="reads its own tensors only, each once (stored dtype = load dtype)")
            if "device_bytes" in r:
                _check(checks, f"{tag}.device_bytes_per_stage_bytes", r["device_bytes"] / sb, lo=0.99, hi=1.05,
                       why="the stage's weights are what the load leaves on the GPU")
                _check(checks, f"{tag}.device_peak_per_stage_bytes", r["device_peak_bytes"] / sb, hi=1.05,
                       why="tensors are allocated once at their final place on the GPU: no second copy")
                if r["host_peak_resettable"]:
                    bound = 0.1 + HOST_SLACK_BYTES / sb
                    _check(checks, f"{tag}.host_peak_per_stage_bytes", r["host_peak_bytes"] / sb, hi=bound,
                           why="straight to the GPU through a 16 MiB bounce buffer: host memory never holds the stage")
            elif r["host_peak_resettable"]:
                _check(checks, f"{tag}.host_peak_per_stage_bytes", r["host_peak_bytes"] / sb, lo=0.5, hi=1.25,
                       why="on CPU the weights live in host memory: about 1x, nothing held twice (under 0.5x: the meter missed them)")
            self.run.log(
                f"{tag} on {r['device']}: stages {[s['index'] for s in r['stages']]}, {r['stage_bytes'] / 2**20:.1f} MiB; host peak "
                f"{r['host_peak_bytes'] / 2**20:.1f} MiB" + (f", device {r['device_bytes'] / 2**20:.1f} MiB (peak {r['device_peak_bytes'] / 2**20:.1f})"
                                                           if "device_bytes" in r else "") + f"; {r['seconds']:.2f}s"
            )

    # -- reference
    def reference(self, fig: dict, checks: dict) -> None:
        path = self.run.state["root"] / "model"
        errors: list[str] = []

        def load():
            t = time.perf_counter()
            ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
            _sync(self.device)
            return ref, time.perf_counter() - t

        out = _on_rank0(errors, load)
        if self.is_main:
            self.ref, seconds = out
            fig.update(seconds=round(seconds, 3), params=sum(p.numel() for p in self.ref.parameters()), device=str(self.device))

    # -- forward
    def forward(self, fig: dict, checks: dict) -> None:
        size = self.size
        ids, mask = _left_padded(self.batch, size.seq, size.vocab, seed=self.args.seed + 1)
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.model.eval()
        out, seconds = _timed(lambda: self.model(input_ids=ids, attention_mask=mask), self.device)
        errors: list[str] = []

        def compare() -> None:
            real = mask.bool()  # (B, T): padded positions have no defined output to compare
            with torch.no_grad():
                ref = self.ref(input_ids=ids, attention_mask=mask).logits[real].float()  # (N, V)
            pp = out.logits[real].float()
            diff = (pp - ref).abs()
            scale = ref.abs().max().item()
            fig.update(pipelined_seconds=round(seconds, 4), logits_shape=list(out.logits.shape), max_abs_logit=scale,
                       max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                       argmax_agreement=(pp.argmax(-1) == ref.argmax(-1)).float().mean().item())
            floor = LOGITS_RTOL[self.dtype] * max(1.0, scale)
            if self.dtype == torch.float32:
                tol = floor
                fig["tolerance_rule"] = "fp32: 1e-4 x max(1, largest |logit|); only the order of sums can differ"
            else:
                fig["tolerance_rule"] = (
                    "max(2 x transformers' own bf16 error against fp32 on these inputs, one bf16 step (2**-7) of the "
                    "largest |logit|): two results each within the rounding error of the exact one are within twice it"
                )
                # transformers' own rounding: the same weights in fp32 on the same inputs.
                ref32 = transformers.AutoModelForCausalLM.from_pretrained(self.run.state["root"] / "model", dtype=torch.float32)
                ref32 = ref32.to(self.device).eval()
                with torch.no_grad():
                    exact = ref32(input_ids=ids, attention_mask=mask).logits[real].float()
                del ref32
                rounding = (ref - exact).abs().max().item()
                fig.update(reference_rounding_vs_fp32=rounding, pipelined_rounding_vs_fp32=(pp - exact).abs().max().item())
                tol = max(2 * rounding, floor)
            fig["tolerance"] = tol
            self.tolerance = tol
            _check(checks, "max_abs_logits_diff", fig["max_abs_diff"], hi=tol, why="pipelined logits = transformers' (see the tolerance)")

        _on_rank0(errors, compare)
        if self.is_main:
            self.run.log(f"forward: max |diff| {fig['max_abs_diff']:.3g} (tolerance {fig['tolerance']:.3g}, largest logit "
                         f"{fig['max_abs_logit']:.3g}), argmax agreement {fig['argmax_agreement']:.4f}")
        del out
        _empty(self.device)

    # -- generate
    def generate(self, fig: dict, checks: dict) -> None:
        size = self.size
        ids, mask = _left_padded(self.batch, size.prompt_len, size.vocab, seed=self.args.seed + 2)
        ids, mask = ids.to(self.device), mask.to(self.device)
        gen = dict(do_sample=False, max_new_tokens=size.new_tokens, min_new_tokens=size.new_tokens, pad_token_id=0)
        self.model.eval()
        # Warm-up: kernels and caches of both shapes (prefill, one-token steps).
        self.model.generate(input_ids=ids, attention_mask=mask, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
        times, pp_ids, stats = [], None, None
        for _ in range(size.reps):
            (pp_ids, stats), s = _timed(lambda: self.model.generate(input_ids=ids, attention_mask=mask, return_stats=True, **gen), self.device)
            times.append(s)
        errors: list[str] = []

        def compare() -> None:
            ref = self.ref
            with torch.no_grad():
                ref.generate(input_ids=ids, attention_mask=mask, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
                ref_times = []
                for _ in range(size.reps):
                    _sync(self.device)
                    t = time.perf_counter()
                    ref.generate(input_ids=ids, attention_mask=mask, **gen)
                    _sync(self.device)
                    ref_times.append(time.perf_counter() - t)
                scored = ref.generate(input_ids=ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **gen)
            new = self.batch * size.new_tokens
            tol = self.tolerance
            if tol is None:  # the forward section did not run: one rounding step of the largest logit
                tol = LOGITS_RTOL[self.dtype] * max(1.0, max(l.float().abs().max().item() for l in scored.logits))
            div = first_divergences(pp_ids[:, ids.shape[1]:].cpu(), scored.sequences[:, ids.shape[1]:].cpu(),
                                    [l.float().cpu() for l in scored.logits])
            ties = [d for d in div if d["gap"] <= tol]
            fig.update(
                rows=self.batch, new_tokens_per_row=size.new_tokens, n_microbatches=stats.n_microbatches,
                pipelined_seconds=times, reference_seconds=ref_times,
                pipelined_tokens_per_s=new / statistics.median(times), reference_tokens_per_s=new / statistics.median(ref_times),
                peak_cache_bytes=stats.peak_cache_bytes, rows_equal=self.batch - len(div), divergences=div, tolerance=tol,
                tokens_equal=not div,
            )
            fig["speedup"] = fig["pipelined_tokens_per_s"] / fig["reference_tokens_per_s"]
            allowed = len(div) if self.dtype == torch.float32 else len(div) - len(ties)
            _check(checks, "rows_differing_not_at_a_tie", allowed, hi=0,
                   why="greedy tokens = transformers'; in bf16 a row may part only at a tie within the logits tolerance")
            _check(checks, "pipelined_tokens_per_s", fig["pipelined_tokens_per_s"], lo=0, why="measured")

        _on_rank0(errors, compare)
        if self.is_main:
            self.run.log(f"generate: {fig['rows_equal']}/{self.batch} rows equal ({len(fig['divergences'])} parted, gaps "
                         f"{[round(d['gap'], 4) for d in fig['divergences']]}); {fig['pipelined_tokens_per_s']:.1f} tokens/s pipelined, "
                         f"{fig['reference_tokens_per_s']:.1f} transformers ({fig['speedup']:.2f}x)")
        _empty(self.device)

    # -- train
    def train(self, fig: dict, checks: dict) -> None:
        size = self.size
        g = torch.Generator().manual_seed(self.args.seed + 3)
        ids = torch.randint(3, size.vocab, (self.batch, size.train_seq), generator=g).to(self.device)  # (B, T)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        model = self.model
        model.train()
        params = [p for _, p in model.checkpoint_named_parameters()]

        def clear() -> None:
            for p in params:
                p.grad = None

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        # The first step warms up and is the one compared; its gradients stay until the reference ran.
        loss, first = _timed(lambda: model.train_step(batch), self.device)
        errors: list[str] = []
        mine: dict[str, Any] = {"rank": self.ctx.rank, "loss": float(loss), "first_step_seconds": first,
                                "param_bytes": _param_bytes(params)}
        if self.device.type == "cuda":
            # Gradients (= param_bytes) plus the activations the step kept alive at its peak.
            mine["step_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated(self.device) - before

        def compare() -> None:
            ref = self.ref
            ref.train()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            diff2 = norm2 = 0.0
            for name, p in model.checkpoint_named_parameters():
                r = ref.get_parameter(name).grad
                gp = p.grad if p.grad is not None else torch.zeros_like(p)
                diff2 += (gp.float() - r.float()).pow(2).sum().item()
                norm2 += r.float().pow(2).sum().item()
            fig.update(loss=float(loss), reference_loss=ref_loss.item(), grad_rel_l2=math.sqrt(diff2 / max(norm2, 1e-30)),
                       grad_params_compared=len(params))
            ref.zero_grad(set_to_none=True)
            times = []
            for _ in range(size.reps):
                _sync(self.device)
                t = time.perf_counter()
                ref(**batch).loss.backward()
                _sync(self.device)
                times.append(time.perf_counter() - t)
                ref.zero_grad(set_to_none=True)
            ref.eval()
            fig["reference_seconds"] = times

        failure: Exception | None = None
        try:
            _on_rank0(errors, compare)
        except RuntimeError as e:  # the pipelined timing below is still worth having; raised after it
            failure = e
        clear()
        times = []
        for _ in range(size.reps):
            _, s = _timed(lambda: model.train_step(batch), self.device)
            times.append(s)
            clear()
        advice = breakdown = None
        if failure is None and model.plan.pp_size > 1:
            # Each stage's device time per microbatch (the profiler settles the stream around each
            # action) and the split balanced on it: what the planner's FLOP model misses on this GPU.
            advice = model.measure_split(batch, steps=1)
            # One profiled step: each rank's compute, the step replayed with free messages, the step
            # as run. Their ratios are the schedule's own bubble and the time lost around the
            # messages (NCCL's latency and the hand-offs) on this machine.
            with model.profile() as prof:
                model.train_step(batch)
            clear()
            breakdown = prof.timeline().breakdown()
        model.eval()
        ranks = _gather(mine)
        if failure is not None:
            fig.update(ranks=ranks, pipelined_seconds=times)
            raise failure
        if not self.is_main:
            return
        tokens = ids.numel()
        fig.update(ranks=ranks, pipelined_seconds=times, tokens_per_step=tokens,
                   pipelined_tokens_per_s=tokens / statistics.median(times),
                   reference_tokens_per_s=tokens / statistics.median(fig["reference_seconds"]))
        fig["speedup"] = fig["pipelined_tokens_per_s"] / fig["reference_tokens_per_s"]
        if advice is not None:
            fig["measured_split"] = advice.to_dict()
            self.run.log(str(advice))
        if breakdown is not None:
            fig["step_breakdown"] = breakdown
            self.run.log(f"train step: imbalance {breakdown['imbalance']:.3f}, schedule's bubble {breakdown['schedule']:.3f}, "
                         f"waits around messages {breakdown['waits']:.3f} (profiled step {breakdown['wall_seconds'] * 1e3:.1f} ms)")
        _check(checks, "loss_rel_diff", abs(fig["loss"] - fig["reference_loss"]) / abs(fig["reference_loss"]), hi=LOSS_RTOL[self.dtype],
               why="the pipelined loss = transformers' mean loss of the batch")
        _check(checks, "grad_rel_l2", fig["grad_rel_l2"], hi=GRAD_RTOL[self.dtype],
               why="rank 0's gradients = transformers'; bugs are off by 25%+, rounding by ~1%")
        self.run.log(f"train: loss {fig['loss']:.5f} vs {fig['reference_loss']:.5f}, grad rel L2 {fig['grad_rel_l2']:.3g} over "
                     f"{len(params)} tensors; {fig['pipelined_tokens_per_s']:.0f} tokens/s pipelined, "
                     f"{fig['reference_tokens_per_s']:.0f} transformers ({fig['speedup']:.2f}x)")
        _empty(self.device)


def _empty(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_divergences(pipelined: torch.Tensor, reference: torch.Tensor, logits: list[torch.Tensor]) -> list[dict]:
    """Where each row of two greedy generations first differs, and how close transformers was to a tie there.

    Args:
        pipelined, reference: ``(B, N)`` generated ids (prompts cut off).
        logits: transformers' ``N`` per-step ``(B, V)`` logits of ``reference``.

    Returns:
        One dict per differing row: ``row``, ``step``, both tokens and ``gap`` = transformers' logit of its
        own token minus its logit of the pipeline's token at that step (>= 0; near 0 is a tie).

    Example:
        >>> first_divergences(torch.tensor([[5, 6]]), torch.tensor([[5, 7]]), [torch.zeros(1, 8)] * 2)
        [{'row': 0, 'step': 1, 'reference_token': 7, 'pipelined_token': 6, 'gap': 0.0}]
    """
    out = []
    for row in range(reference.shape[0]):
        differ = (pipelined[row] != reference[row]).nonzero()
        if not len(differ):
            continue
        step = int(differ[0])
        want, got = int(reference[row, step]), int(pipelined[row, step])
        gap = float(logits[step][row, want] - logits[step][row, got])
        out.append({"row": row, "step": step, "reference_token": want, "pipelined_token": got, "gap": gap})
    return out


# ----------------------------------------------------------------------------- entry point
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "device_check.json") if os.environ.get("OUT") else "device_check.json"
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: large on CUDA, tiny on CPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--stages", type=int, default=2, help="stages in a one-process run (more ranks: a stage per rank)")
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (default: all in one process, else 1)")
    p.add_argument("--schedule", default=None, help="training schedule (default: the library's for the stages per rank)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches (default: the number of stages)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--out", default=default_out, help=f"JSON of every figure (default {default_out})")
    p.add_argument("--workdir", default=None, help="where the checkpoint is written (default a temp dir, removed after)")
    p.add_argument("--budget-s", type=float, default=270.0, help="hard time limit of the whole run")
    p.add_argument("--reserve-s", type=float, default=20.0, help="a section starts only with this much budget left")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-in", default=None, help=argparse.SUPPRESS)  # tests: raise inside this section
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    transformers.utils.logging.disable_progress_bar()
    # A collective that waits on a dead peer must end well inside the budget, not after torch's 30 minutes.
    os.environ.setdefault("HF_PIPELINE_TIMEOUT", str(int(max(30.0, args.budget_s / 3))))
    run = Run(args)
    run.log(f"writing to {args.out}; budget {args.budget_s:.0f}s")
    try:
        ctx = init_distributed(device=None if args.device == "auto" else args.device)
    except Exception as e:  # noqa: BLE001 - nothing else can run; say why in the JSON
        run.result["sections"]["env"] = {"status": "failed", "errors": [f"{type(e).__name__}: {e}"], "figures": {}, "checks": {}}
        run.write()
        run.log(f"cannot start: {type(e).__name__}: {e}")
        return 1
    cuda = ctx.device.type == "cuda"
    args.size = args.size or ("large" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    sections = Sections(run, ctx, args)
    for name in SECTIONS:
        run.section(name, getattr(sections, name))
    code = run.finish()
    sections.model = sections.ref = None
    with contextlib.suppress(Exception):  # a group broken by a failed section must not turn into a hang or a traceback here
        _barrier()
        destroy_distributed()
    root = run.state.get("root")
    if root is not None and args.workdir is None and ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
