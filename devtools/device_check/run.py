"""One device check: its sections in order under the time budget, the JSON rewritten after each, the watchdog.

:class:`Run` holds the figures and checks of every section and writes them to ``--out``; :func:`main`
parses the options (``python -m devtools.device_check --help``), starts the process group and runs the
sections of :class:`~devtools.device_check.sections.Sections`. The bounds and why each holds are in
:mod:`devtools.device_check`'s docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import pathlib
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import transformers

import devtools.device_check
from devtools.collectives import barrier, gather_objects
from devtools.device_check.sections import Sections
from devtools.device_check.support import SIZES, format_value
from hf_pipeline.checkpointing.durable import replace_file
from hf_pipeline.distributed.context import destroy_distributed, init_distributed

__all__ = ["Run", "main"]

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
    p = argparse.ArgumentParser(prog="python -m devtools.device_check", description=devtools.device_check.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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

