"""``hf-pipeline env`` and ``hf-pipeline bench``: what a bug report needs, and the benchmarks of a source checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import platform
import sys
from typing import Any, Sequence

from ..errors import CLIError
from .parser import LAUNCH_OPTIONS, PROG, version

__all__ = ["benchmark_script", "cmd_bench", "cmd_env", "env_info"]

# The launcher's variables a bug report shows (set or not).
_LAUNCHER_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def benchmark_script() -> pathlib.Path | None:
    """``scripts/benchmark.py`` of the source checkout this package runs from; None when installed without it."""
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"
    return script if script.is_file() else None


def cmd_bench(argv: Sequence[str]) -> int:
    """``hf-pipeline bench ...``: ``scripts/benchmark.py``'s ``main(argv)`` (it launches its own processes)."""
    script = benchmark_script()
    if script is None:
        if any(a in ("-h", "--help") for a in argv):
            print(f"usage: {PROG} bench [benchmark options]\n\nRuns scripts/benchmark.py of a source checkout "
                  "(git clone, then pip install -e .).")
            return 0
        raise CLIError(
            "`hf-pipeline bench` runs scripts/benchmark.py, which only a source checkout has; clone the repository "
            "and `pip install -e .`"
        )
    if any(a.split("=")[0] in LAUNCH_OPTIONS for a in argv):
        raise CLIError(
            "bench starts its own processes (1, 2 and 4 ranks, as each section needs); drop the launch options"
        )
    spec = importlib.util.spec_from_file_location("hf_pipeline_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv[0] = f"{PROG} bench"
    return int(module.main(list(argv)) or 0)


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


