"""Fresh processes for the measurements: the launcher (parent side) and the worker (each rank's side).

Every launch is a new set of processes (``torchrun`` for more than one rank), so each task list
starts from a clean heap (peak RSS means something) with 1 thread per rank. The parent writes the
tasks to a JSON file, each rank runs them in order through ``python -m benchmarks --worker FILE``
and writes its results next to it; a task that fails is reported in its result, and the rest run.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

__all__ = ["ROOT", "launch", "machine", "run_worker", "worker_env"]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_worker(spec_path: str, tasks: dict[str, Callable[[dict, dict], None]]) -> int:
    """Run the job in ``spec_path`` on this rank: each task by its name in ``tasks``, its result (or its
    error and traceback) and wall time into ``rank<RANK>.json`` of the job's ``out_dir``."""
    import torch

    torch.set_num_threads(1)
    job = json.loads(pathlib.Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for task in job["tasks"]:
        out: dict[str, Any] = {"task": task["task"], "label": task.get("label")}
        t = time.perf_counter()
        try:
            tasks[task["task"]](task, out)
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
            out.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        out["wall_seconds"] = time.perf_counter() - t
        results.append(out)
        gc.collect()
    pathlib.Path(job["out_dir"], f"rank{rank}.json").write_text(json.dumps(results))
    return 0


def worker_env() -> dict[str, str]:
    """The workers' environment: 1 thread everywhere, offline, gloo on loopback, this checkout importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_PIPELINE_THREADS="1", TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo", TRANSFORMERS_VERBOSITY="error",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def launch(world: int, tasks: list[dict], *, timeout: float, log) -> list[list[dict]]:
    """Run ``tasks`` in order on ``world`` fresh processes (torchrun for world > 1); per-rank results."""
    with tempfile.TemporaryDirectory(prefix="hf_pipeline_bench_") as tmp:
        spec = pathlib.Path(tmp, "job.json")
        spec.write_text(json.dumps({"tasks": tasks, "out_dir": tmp}))
        worker = ["-m", "benchmarks", "--worker", str(spec)]
        if world == 1:
            cmd = [sys.executable, *worker]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *worker]
        log(f"  launching {world} process(es): {', '.join(t.get('label') or t['task'] for t in tasks)}")
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        results = []
        for r in range(world):
            f = pathlib.Path(tmp, f"rank{r}.json")
            if not f.is_file():
                raise RuntimeError(
                    f"rank {r} of {cmd} wrote no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            results.append(json.loads(f.read_text()))
        return results


def _load_average():
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, memory, platform, versions, load average."""
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
        "load_average": _load_average(),
    }
