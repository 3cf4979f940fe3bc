"""The ``hf-pipeline`` argument parser: one sub-parser per command, the shared option groups, the value checks."""

from __future__ import annotations

import argparse
import math
import pathlib
import re
from typing import Any, Callable

from ..errors import CLIError
from ..load_options import cli_fields

__all__ = ["LAUNCH_OPTIONS", "PROG", "build_parser", "version"]

PROG = "hf-pipeline"
# Launch options: the parent uses them, the processes it starts run the command without them.
LAUNCH_OPTIONS = frozenset({
    "--num-processes", "--num_processes", "--num-machines", "--num_machines", "--machine-rank", "--machine_rank",
    "--main-process-ip", "--main_process_ip", "--main-process-port", "--main_process_port",
    "--num-cpu-threads-per-process", "--num_cpu_threads_per_process",
})
_SPLIT_HELP = (
    "auto, uniform, or comma-separated block names (or block halves, e.g. "
    "model.layers.4.post_attention_layernorm) starting stages 1..S-1"
)
_FORMAT = argparse.RawDescriptionHelpFormatter


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: "--num-proc 2" must not slip past the launcher's option stripping.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    # argparse prints the whole usage block before an error; a one-line error says what to change.
    def error(self, message: str):
        raise CLIError(f"{message} (see `{self.prog} --help`)")


def version() -> str:
    """The installed hf_pipeline version."""
    from .. import __version__

    return __version__


# ------------------------------------------------------------------------------------ value checks
# Every numeric flag of every command has one of these as its type: a bad value is one line from the
# parser, before anything loads (a negative weight decay found by the optimizer after the model loaded
# would be a traceback, and a seed or port out of range fails only where it is used).
def _bounded(kind: type, low: float, high: float | None = None, *, above: bool = False) -> Callable[[str], Any]:
    """A flag type: a whole number (``kind`` int) or a finite number (float) >= ``low`` (> with ``above``),
    and <= ``high`` when given."""
    noun = "a whole number" if kind is int else "a number"
    if high is None:
        allowed = f"{'>' if above else '>='} {low}"
    else:
        allowed = f"in {low}..{high}" if kind is int else f"in {'(' if above else '['}{low}, {high}]"

    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (value <= low if above else value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return check


_positive = _bounded(int, 1)
_non_negative = _bounded(int, 0)
_positive_float = _bounded(float, 0, above=True)
_non_negative_float = _bounded(float, 0)
_probability = _bounded(float, 0, 1, above=True)  # top-p, the masked share: 0 would keep nothing
_port = _bounded(int, 1, 65535)
_seed = _bounded(int, 0, 2**32 - 1)  # as NumPy and transformers' set_seed take it; train derives seeds from it


def _size(text: str) -> str:
    """A shard size as transformers writes them (``2GB``, ``500MB``, bytes), checked now, not after training."""
    from ..errors import InputError
    from ..planning.options import parse_size

    try:
        parse_size(text, what="--max-shard-size")
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _device(text: str) -> str:
    """A torch device string (``cpu``, ``cuda``, ``cuda:1``, ...), read by torch itself."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch device type; use e.g. cpu, cuda, cuda:1, mps or xpu"
        ) from None
    return text


def _existing_path(text: str) -> str:
    if pathlib.Path(text).expanduser().exists():
        return str(pathlib.Path(text).expanduser())
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        return text  # a hub id ("org/name"): looked up in the local cache when loading
    raise argparse.ArgumentTypeError(f"{text} does not exist")


# ------------------------------------------------------------------------------------ shared groups
def _add_launch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launching (as accelerate launch)")
    g.add_argument("--num-processes", "--num_processes", type=_positive, default=None, metavar="N",
                   help="start N processes (in total, over all machines) through torch.distributed.run")
    g.add_argument("--num-machines", "--num_machines", type=_positive, default=1, metavar="M",
                   help="hosts taking part (default 1)")
    g.add_argument("--machine-rank", "--machine_rank", type=_non_negative, default=0, metavar="R",
                   help="this host's rank, 0..M-1")
    g.add_argument("--main-process-ip", "--main_process_ip", default=None, metavar="IP",
                   help="address of machine 0 (default 127.0.0.1)")
    g.add_argument("--main-process-port", "--main_process_port", type=_port, default=None, metavar="PORT",
                   help="a free port on machine 0 (default: any free port, one machine only)")
    g.add_argument("--num-cpu-threads-per-process", "--num_cpu_threads_per_process", type=_positive, default=None,
                   metavar="T", help="torch threads per process (default: CPU cores / local processes)")


def _add_download(p) -> None:
    p.add_argument("--download", action="store_true",
                   help="download a hub id that is not in the local Hugging Face cache "
                        "(default: cache only, nothing downloaded)")


def _add_load(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", type=_existing_path, default=None,
                   help="checkpoint directory or cached hub id (default: the bundled model)")
    _add_download(g)
    # The load options with a flag, each defined once (hf_pipeline.load_options); a flag not given leaves the
    # option at its default (cli.arguments.load_kwargs reads them back).
    types = {"positive": _positive, "device": _device, "text": None}
    for f in cli_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.metadata["cli_type"] == "flag":
            g.add_argument(flag, action="store_const", const=True, default=None, help=f.metadata["cli"])
        else:
            g.add_argument(flag, type=types[f.metadata["cli_type"]], default=None, help=f.metadata["cli"])


# ------------------------------------------------------------------------------------ one per command
def _add_plan(sub) -> None:
    p = sub.add_parser("plan", prog=f"{PROG} plan",
                       help="show the stage plan and predicted memory of a checkpoint or config (no weights read)",
                       description="Split a model into pipeline stages from its config alone and predict every "
                                   "rank's memory.", formatter_class=_FORMAT)
    p.add_argument("path", type=_existing_path, help="checkpoint directory, config.json file or cached hub id")
    _add_download(p)
    p.add_argument("--stages", "--num-stages", dest="stages", type=_positive, default=None,
                   help="total pipeline stages (default 2; with --num-processes, what --tp-size x --fsdp-size leave)")
    # Its own dest: a "num_processes" attribute makes the CLI launch that many processes.
    p.add_argument("--num-processes", dest="mesh_processes", type=_positive, default=None,
                   help="ranks of the job: plan the mesh they form (replicas are what pp x tp x fsdp leave)")
    p.add_argument("--tp-size", type=_positive, default=1, help="tensor-parallel ranks per stage (default 1)")
    p.add_argument("--fsdp-size", type=_positive, default=1,
                   help="ranks each stage's parameters, gradients and optimizer states are sharded over (FSDP2; "
                        "default 1)")
    p.add_argument("--ep-size", type=_positive, default=1,
                   help="expert-parallel ranks per stage of a mixture of experts, each keeping 1/ep of a layer's "
                        "experts: --tp-size's ranks (equal to it), or alone (default 1)")
    p.add_argument("--ep-over", choices=("stage", "data"), default="stage",
                   help="the ranks --ep-size spans: stage (a stage's own ranks, default) or data (--tp-size's ranks in "
                        "ep / tp consecutive replicas or fsdp ranks, whose rows differ: transformers' ep_size > "
                        "tp_size)")
    p.add_argument("--moe-routing", choices=("worst", "balanced"), default="worst",
                   help="token-expert pairs a rank's experts are priced at: worst (an upper bound: every token's "
                        "top_k experts on the rank) or balanced (tokens x top_k / ep)")
    p.add_argument("--virtual-stages", type=_positive, default=None,
                   help="stages per rank (default 1, or 2 for interleaved schedules)")
    p.add_argument("--schedule", default=None,
                   help="schedule name (default 1f1b, or interleaved-1f1b with virtual stages)")
    p.add_argument("--dtype", default=None, help="weights dtype: bf16, fp16, fp32 (default: the config's)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=_positive, default=None,
                   help="tokens per sequence (default min(max positions, 2048))")
    p.add_argument("--n-microbatches", type=_positive, default=None,
                   help="microbatches per step (default: number of stages)")
    p.add_argument("--split", default="auto", help=_SPLIT_HELP)
    p.add_argument("--auto-class", default=None, help="transformers class to load as (default: from the config)")
    p.add_argument("--checkpoint-every-n-layers", type=_positive, default=1,
                   help="the activation checkpointing (every_n_layers) the 'ckpt' columns assume (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        prog=f"{PROG} generate",
        help="pipelined text generation with the bundled model or yours",
        description="Generate text with a pipelined model; rank 0 prints the continuations and tokens/s.",
        formatter_class=_FORMAT,
    )
    p.add_argument("prompts", nargs="*", help="prompts (default: a few examples)")
    p.add_argument("--prompts-file", type=_existing_path, default=None, help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=_positive_float, default=None, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-k", type=_positive, default=None, help="sample from the k most likely tokens")
    p.add_argument(
        "--top-p", type=_probability, default=None,
        help="nucleus sampling: the smallest set with this probability, in (0, 1]"
    )
    p.add_argument("--repetition-penalty", type=_positive_float, default=None, help="> 1 discourages repeating tokens")
    p.add_argument("--seed", type=_seed, default=None, help="sampling seed (same tokens at every world size)")
    p.add_argument("--json", action="store_true", help="print one JSON line (ids, texts, tokens/s) on rank 0")
    p.add_argument("--quiet", action="store_true", help="do not print the plan")
    _add_load(p)
    _add_launch(p)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        prog=f"{PROG} serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over a pipelined model",
        description="Serve a pipelined causal LM over HTTP on rank 0 (OpenAI's API; continuous batching in the "
        "decode ring, or static batches per round). "
        "SIGTERM drains the queue and stops every process.",
        formatter_class=_FORMAT,
    )
    p.add_argument("path", nargs="?", type=_existing_path, default=None,
                   help="checkpoint directory or cached hub id (default: --model, else the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model name clients pass (default: the folder name)")
    p.add_argument("--max-batch", type=_positive, default=8,
                   help="rows in flight (continuous: per data-parallel replica) or per generate round (static) at most "
                   "(default 8)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join the running decode ring as others finish; static: rounds of "
                   "one generate call, each as long as its longest row (default continuous; models the ring "
                   "does not serve, such as chunked-attention caches, run static rounds)")
    p.add_argument("--kv-cache-mb", type=_positive, default=None,
                   help="continuous: KV-cache memory per rank for the rows in flight; requests that do not fit "
                   "wait in the queue (default: --max-batch rows); what they leave holds the prefix cache")
    p.add_argument("--prefill-chunk", type=_non_negative, default=512,
                   help="continuous: prompt tokens a decode step runs at most beside the decoding rows (chunked "
                   "prefill: a longer prompt joins over several steps); 0: whole prompts at once (default 512)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="continuous: compute every prompt in full (default: prompt heads shared with earlier "
                   "requests, in blocks of 16 tokens, are reused from each stage's prefix cache)")
    p.add_argument("--max-queue", type=_positive, default=64,
                   help="queued rows at most, a request with n choices counting n; more are answered 429 (default 64)")
    p.add_argument("--max-n", type=_positive, default=16,
                   help="choices per request (OpenAI's n) at most; more are answered 400 (default 16)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds before a request is cancelled and answered 504 (default 600)")
    g = p.add_argument_group("access")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="answer only requests sending `Authorization: Bearer KEY` (every route but /health; others "
                   "get 401). Default: $HF_PIPELINE_API_KEY, which keeps the key off the process list; unset: no key")
    g.add_argument("--max-body-mb", type=_positive, default=4,
                   help="request bodies over this many MiB are answered 413 before they are read (default 4)")
    g.add_argument("--max-prompt-chars", type=_positive, default=None,
                   help="prompts (or chat messages together) over this many characters are answered 400 before "
                   "they are tokenized (default: the context times the longest vocabulary entry, the most that "
                   "can fit the context)")
    _add_load(p)
    _add_launch(p)


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        prog=f"{PROG} train",
        help="fine-tune a causal LM, masked LM or seq2seq model on a text / JSON / CSV file",
        description="Fine-tune a causal LM (GPT-2, LLaMA, ...), masked LM (BERT) or seq2seq model (T5), "
        "the task chosen from the config, with model.train_step (any torch schedule) and "
        "save a transformers checkpoint into --output-dir. Options are named as "
        "scripts/train.py's, which adds gradient accumulation, periodic checkpoints and "
        "resuming.",
        formatter_class=_FORMAT,
    )
    p.add_argument(
        "--data",
        type=_existing_path,
        required=True,
        help=".txt/.md (one text per line), .json/.jsonl, .csv or .parquet file",
    )
    p.add_argument(
        "--text-column", default="text", help="column holding the text (JSON / CSV / parquet; default 'text')"
    )
    p.add_argument(
        "--target-column",
        default=None,
        help="seq2seq: column holding each text's target (default: the text's continuation)",
    )
    p.add_argument(
        "--mlm-probability", type=_probability, default=0.15,
        help="masked LM: share of tokens masked, in (0, 1] (default 0.15)"
    )
    p.add_argument("--auto-class", default=None, help="transformers class to train (default: from the config, as plan)")
    p.add_argument("--output-dir", required=True, help="directory for the trained checkpoint and its tokenizer")
    p.add_argument("--steps", type=_positive, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch-size", type=_positive, default=8, help="rows per step, the global batch (default 8)")
    p.add_argument("--block-size", type=_positive, default=128, help="tokens per row (default 128)")
    p.add_argument("--lr", type=_positive_float, default=3e-4, help="peak learning rate of AdamW (default 3e-4)")
    p.add_argument(
        "--warmup-steps", type=_non_negative, default=0, help="linear warmup steps, then linear decay (default 0)"
    )
    p.add_argument("--weight-decay", type=_non_negative_float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument(
        "--max-grad-norm", type=_positive_float, default=1.0, help="clip gradients to this global norm (default 1)"
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the batch order (default 0)")
    p.add_argument("--log-every", type=_positive, default=10, help="print the loss every N steps (default 10)")
    p.add_argument(
        "--log-file", default=None, help="also append one JSON line per step (step, loss, lr, grad_norm) to this file"
    )
    p.add_argument(
        "--max-shard-size", type=_size, default="2GB", help="shard size of the saved checkpoint (default 2GB)"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the --log-every loss lines still print)"
    )
    _add_load(p)
    _add_launch(p)


def _add_bench(sub) -> None:
    sub.add_parser(
        "bench",
        prog=f"{PROG} bench",
        help="run the benchmarks (python -m benchmarks; a source checkout is needed)",
        add_help=False,
        description="Pass every argument to python -m benchmarks (try `hf-pipeline bench --help`).",
    )


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        prog=f"{PROG} convert",
        help="re-shard a checkpoint into one file per pipeline stage, or back (--merge)",
        description="Rewrite a checkpoint so each stage's tensors are in their own file (loading then "
        "opens only a rank's own files), or merge it back into standard size-based shards. "
        "The source is never modified; the output appears atomically.",
        formatter_class=_FORMAT,
    )
    p.add_argument("path", type=_existing_path, help="source checkpoint directory")
    p.add_argument("output", help="new directory to write")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--stages", "--num-stages", dest="stages", type=_positive, help="write one file per stage of this many stages"
    )
    mode.add_argument(
        "--merge", action="store_true", help="write standard shards (from a per-stage or any other layout)"
    )
    p.add_argument(
        "--virtual-stages", type=_positive, default=None, help="stages per rank (use the values you will load with)"
    )
    p.add_argument("--schedule", default=None, help="schedule the model will run (fixes where virtual stages go)")
    p.add_argument("--split", default="auto", help=_SPLIT_HELP)
    p.add_argument("--auto-class", default=None, help="transformers class to plan for (default: from the config)")
    p.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="with --merge: bytes per shard, e.g. 2GB (default 5GB)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the output directory if it exists")


def _add_env(sub) -> None:
    p = sub.add_parser(
        "env",
        prog=f"{PROG} env",
        help="versions, devices, default backend and the launcher environment",
        description="Print what a bug report needs: versions, devices, backend, world size.",
        formatter_class=_FORMAT,
    )
    p.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-pipeline`` argument parser (one sub-command per task)."""
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} <command> [<args>]",
        description="Pipeline parallelism for Hugging Face Transformers models: plan, generate, train, "
        "bench, convert, env.",
        epilog=f"Run `{PROG} <command> --help` for a command's options.",
        formatter_class=_FORMAT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="{plan,generate,serve,train,bench,convert,env}",
                                parser_class=_Parser)
    for add in (_add_plan, _add_generate, _add_serve, _add_train, _add_bench, _add_convert, _add_env):
        add(sub)
    return parser
