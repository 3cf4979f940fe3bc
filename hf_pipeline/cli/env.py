"""``hf-pipeline env`` and ``hf-pipeline bench``: what a bug report needs, and the benchmarks of a source checkout."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
from typing import Any, Sequence

from ..errors import CLIError
from .parser import LAUNCH_OPTIONS, PROG, version

__all__ = ["benchmarks_checkout", "cmd_bench", "cmd_env", "env_info"]

# The launcher's variables a bug report shows (set or not).
_LAUNCHER_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def benchmarks_checkout() -> pathlib.Path | None:
    """The source checkout this package runs from, when it holds the ``benchmarks`` package; None when
    installed without it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks" / "__main__.py").is_file() else None


def cmd_bench(argv: Sequence[str]) -> int:
    """``hf-pipeline bench ...``: ``python -m benchmarks ...`` of the source checkout (it launches its own
    processes), its output passed on line by line.

    Raises:
        SystemExit: with the benchmark's exit status, as if it had run in this process (its ``--help``
            and its usage errors end the command as every other command's do).
    """
    root = benchmarks_checkout()
    if root is None:
        if any(a in ("-h", "--help") for a in argv):
            print(f"usage: {PROG} bench [benchmark options]\n\nRuns the benchmarks (python -m benchmarks) of a "
                  "source checkout (git clone, then pip install -e .).")
            return 0
        raise CLIError(
            "`hf-pipeline bench` runs the benchmarks package, which only a source checkout has; clone the "
            "repository and `pip install -e .`"
        )
    if any(a.split("=")[0] in LAUNCH_OPTIONS for a in argv):
        raise CLIError(
            "bench starts its own processes (1, 2 and 4 ranks, as each section needs); drop the launch options"
        )
    # The checkout's root is where `benchmarks` (and the `devtools` it uses) import from, as for the
    # benchmark's own ranks; the working directory stays the caller's, so relative paths mean what they did.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with subprocess.Popen([sys.executable, "-m", "benchmarks", *argv], env=env, stdout=subprocess.PIPE,
                          text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
    sys.exit(proc.returncode)  # exit, not an error: the benchmark has said what went wrong


def env_info() -> dict[str, Any]:
    """What ``hf-pipeline env`` prints: versions, devices, default backend, launcher variables."""
    import accelerate
    import safetensors
    import torch
    import transformers

    from ..families.recipe import list_recipes

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "hf_pipeline version": version(),
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "PyTorch version": torch.__version__,
        "Transformers version": transformers.__version__,
        "Accelerate version": accelerate.__version__,
        "safetensors version": safetensors.__version__,
        "CPU cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "CUDA available": cuda,
        "CUDA devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "default device": "cuda:LOCAL_RANK" if cuda else "cpu",
        "default backend": "nccl" if cuda else "gloo",
        "gloo available": torch.distributed.is_gloo_available(),
        "nccl available": torch.distributed.is_nccl_available(),
        "recipes": sorted(list_recipes()),
    }
    for name in _LAUNCHER_VARIABLES:
        info[name] = os.environ.get(name, "not set")
    from ..tools.default_model import bundled_model_path

    bundled = bundled_model_path()
    info["default model"] = str(bundled) if bundled else "missing (a random-weights model is built in the cache)"
    return info


def cmd_env(args) -> int:
    """``hf-pipeline env``: print :func:`env_info` as a list (or JSON)."""
    info = env_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("Copy-and-paste the text below in your GitHub issue\n")
        print("\n".join(f"- {k}: {', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in info.items()))
    return 0


