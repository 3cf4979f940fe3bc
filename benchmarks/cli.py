"""The benchmark's command line: ``python -m benchmarks`` and ``hf-pipeline bench``."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import benchmarks
from benchmarks import checkpointing, generate, load, lora, mesh, serve, serve_capacity, train
from benchmarks.config import SECTIONS
from benchmarks.processes import ROOT, run_worker
from benchmarks.report import to_markdown, update_readme
from benchmarks.run import merge, run_benchmark
from hf_pipeline.checkpointing.durable import replace_file

__all__ = ["main"]

# Every task a launched rank can run, by the name its job file gives.
TASKS = {
    **load.TASKS, **train.TASKS, **generate.TASKS, **checkpointing.TASKS, **lora.TASKS, **serve.TASKS,
    **serve_capacity.TASKS, **mesh.TASKS,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=benchmarks.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, prog="hf-pipeline bench")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition: seconds (CI)")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", default=None, help="directory for results.md, results.json, timelines/ "
                        "(default: bench_results/, or bench_out/quick/ with --quick, so a quick run never overwrites "
                        "the committed results)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the random checkpoints are written once (default ~/.cache/hf_pipeline/bench)")
    parser.add_argument("--load-ranks", default=None, help="world sizes of the load section (default 1,2,4; quick 1,2)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    parser.add_argument("--http-device", default="cpu", choices=("cpu", "cuda"),
                        help="serve-http: the servers' device (cuda: a device per stage of the served pipeline, "
                        "cuda:i for the i-th transformers process)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launched job")
    parser.add_argument("--update-readme", action="store_true",
                        help="rewrite README.md's benchmark tables and bench_results/results.md from "
                        "bench_results/results.json and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def _rewrite_from_committed() -> int:
    """``--update-readme``: README's block and results.md from the committed results.json."""
    res = json.loads((ROOT / "bench_results" / "results.json").read_text())
    update_readme(ROOT / "README.md", res)
    replace_file(ROOT / "bench_results" / "results.md", to_markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one launched rank's job); 1 when any task failed.

    Args:
        argv: the options (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args.worker, TASKS)
    if args.update_readme:
        return _rewrite_from_committed()
    if args.out is None:
        args.out = str(ROOT / ("bench_out/quick" if args.quick else "bench_results"))
    args.argv = argv
    res = run_benchmark(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    if args.sections and json_path.is_file():
        res = merge(json.loads(json_path.read_text()), res, args.sections.split(","))
        res["seconds"] = sum(r.get("seconds", 0) for r in res.get("runs", [])) or res.get("seconds", 0)
    replace_file(json_path, json.dumps(res, indent=2, default=str))
    replace_file(md_path, to_markdown(res))
    print(md_path.read_text())
    return 1 if res.get("errors") else 0
