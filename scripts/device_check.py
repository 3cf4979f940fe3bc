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
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _common.py, device_check_*.py
if importlib.util.find_spec("hf_pipeline") is None:  # run from a checkout without installing the package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch
import transformers
from _common import barrier, gather_objects
from device_check_sections import Sections
from device_check_support import SIZES, first_divergences, format_value

from hf_pipeline.checkpointing.durable import replace_file
from hf_pipeline.distributed.context import destroy_distributed, init_distributed

__all__ = ["Run", "first_divergences", "main"]

SECTIONS = ("env", "checkpoint", "load", "reference", "forward", "generate", "train")
NEEDS = {"load": ("checkpoint",), "reference": ("checkpoint",), "forward": ("load", "reference"),
         "generate": ("load", "reference"), "train": ("load", "reference")}


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
            who = f" rank {self.rank}" if all_ranks else ""
            print(f"[device_check {time.monotonic() - self.start:6.1f}s{who}] {msg}", flush=True)

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
            self.log(f"time budget of {self.args.budget_s:.0f}s spent in section {self.current!r}; "
                     "writing what there is", all_ranks=True)
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
        done = ("ok", "check_failed")
        missing = [n for n in NEEDS.get(name, ()) if self.result["sections"].get(n, {}).get("status") not in done]
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
        gathered = gather_objects((name, errors), who="device_check")
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
                bounds = f"{format_value(c.get('min'))} .. {format_value(c.get('max'))}"
                verdict = "PASS" if c["passed"] else "FAIL"
                self.log(f"  {verdict} {name}.{key} = {format_value(c['value'])} (bounds {bounds})")
        self.log(f"figures written to {self.args.out}; {'all ok' if self.result['ok'] else 'NOT ok'}")
        return 0 if self.result["ok"] else 1



# ----------------------------------------------------------------------------- entry point
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "device_check.json") if os.environ.get("OUT") else "device_check.json"
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model size (default: large on CUDA, tiny on CPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--stages", type=int, default=2, help="stages in a one-process run (more ranks: a stage per rank)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per rank (default: all in one process, else 1)")
    p.add_argument("--schedule", default=None,
                   help="training schedule (default: the library's for the stages per rank)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches (default: the number of stages)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--out", default=default_out, help=f"JSON of every figure (default {default_out})")
    p.add_argument("--workdir", default=None,
                   help="where the checkpoint is written (default a temp dir, removed after)")
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
        run.result["sections"]["env"] = {"status": "failed", "errors": [f"{type(e).__name__}: {e}"], "figures": {},
                                         "checks": {}}
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
    # A group broken by a failed section must not turn into a hang or a traceback here.
    with contextlib.suppress(Exception):
        barrier()
        destroy_distributed()
    root = run.state.get("root")
    if root is not None and args.workdir is None and ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
