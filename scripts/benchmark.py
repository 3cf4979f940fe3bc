"""Benchmarks side by side: every figure is a ratio against a baseline measured in the same run.

    python scripts/benchmark.py                      # the full run (several minutes), writes bench_results/
    python scripts/benchmark.py --quick              # tiny sizes, every section, seconds (what CI runs),
                                                     # writes bench_out/quick/
    python scripts/benchmark.py --sections train,generate   # rerun some sections, merged into results.json
    python -m benchmarks [same options]              # the same, from the repository root
    hf-pipeline bench [same options]

The benchmark itself is the ``benchmarks/`` package at the repository root (its docstring lists the
sections and its modules); this file is its entry point from anywhere: it puts the repository root
on ``sys.path`` and runs :func:`benchmarks.cli.main` with the same options.
"""

from __future__ import annotations

import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # run from a checkout without installing: `benchmarks` and `hf_pipeline`

from benchmarks.checkpoints import llama_config, write_random_checkpoint  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from benchmarks.config import MEASURED, SCHEDULES, SECTIONS, Sizes  # noqa: E402
from benchmarks.report import README_END, README_START, readme_tables, to_markdown, update_readme  # noqa: E402
from benchmarks.run import merge, run_benchmark  # noqa: E402

__all__ = [
    "MEASURED", "README_END", "README_START", "SCHEDULES", "SECTIONS", "Sizes", "llama_config", "main", "merge",
    "readme_tables", "run_benchmark", "to_markdown", "update_readme", "write_random_checkpoint",
]

if __name__ == "__main__":
    sys.exit(main())
