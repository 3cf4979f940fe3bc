"""``hf-pipeline``: plan, generate, train, bench, convert and env from the command line.

    hf-pipeline plan PATH --stages 4 --dtype bf16 --batch 8 --seq 2048
    hf-pipeline generate --num-processes 2 "The function returns"
    hf-pipeline train --num-processes 2 --data notes.txt --output-dir my-model --steps 200
    hf-pipeline convert PATH OUT --stages 4          # one safetensors file per stage
    hf-pipeline convert OUT BACK --merge            # standard shards again
    hf-pipeline bench --quick
    hf-pipeline env

``generate`` and ``train`` are collective programs: with ``--num-processes N`` (and, for several
hosts, ``--num-machines`` / ``--machine-rank`` / ``--main-process-ip`` / ``--main-process-port``, as
``accelerate launch``) the command starts N processes itself with torch's elastic launcher (as torchrun), each
running ``python -m hf_pipeline.cli <command> ...``; run under ``torchrun`` / ``accelerate launch``
yourself, it joins the job it is in. Without either it runs in one process, every stage local.

User mistakes (a missing path, a bad number, an impossible split) end with one line on stderr and
exit code 2, no traceback; ``HF_PIPELINE_TRACEBACK=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import re
import sys
from typing import Any, Sequence

from .errors import CLIError, PipelineBroken, PipelineError, RankError

__all__ = ["CLIError", "build_parser", "main"]

PROG = "hf-pipeline"
# Launch options: the parent uses them, the processes it starts run the command without them.
_LAUNCH_OPTS = frozenset({
    "--num-processes", "--num_processes", "--num-machines", "--num_machines", "--machine-rank", "--machine_rank",
    "--main-process-ip", "--main_process_ip", "--main-process-port", "--main_process_port",
    "--num-cpu-threads-per-process", "--num_cpu_threads_per_process",
})


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: "--num-proc 2" must not slip past the launcher's option stripping.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    # argparse prints the whole usage block before an error; a one-line error says what to change.
    def error(self, message: str):
        raise CLIError(f"{message} (see `{self.prog} --help`)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _existing_path(text: str) -> str:
    if pathlib.Path(text).expanduser().exists():
        return str(pathlib.Path(text).expanduser())
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        return text  # a hub id ("org/name"): looked up in the local cache when loading
    raise argparse.ArgumentTypeError(f"{text} does not exist")


# ------------------------------------------------------------------------------------ parsers
def _add_launch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launching (as accelerate launch)")
    g.add_argument("--num-processes", "--num_processes", type=_positive, default=None, metavar="N",
                   help="start N processes (in total, over all machines) through torch.distributed.run")
    g.add_argument("--num-machines", "--num_machines", type=_positive, default=1, metavar="M", help="hosts taking part (default 1)")
    g.add_argument("--machine-rank", "--machine_rank", type=int, default=0, metavar="R", help="this host's rank, 0..M-1")
    g.add_argument("--main-process-ip", "--main_process_ip", default=None, metavar="IP", help="address of machine 0 (default 127.0.0.1)")
    g.add_argument("--main-process-port", "--main_process_port", type=int, default=None, metavar="PORT", help="a free port on machine 0 (default: any free port, one machine only)")
    g.add_argument("--num-cpu-threads-per-process", "--num_cpu_threads_per_process", type=_positive, default=None, metavar="T",
                   help="torch threads per process (default: CPU cores / local processes)")


def _add_download(p) -> None:
    p.add_argument("--download", action="store_true",
                   help="download a hub id that is not in the local Hugging Face cache (default: cache only, nothing downloaded)")


def _add_load(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", type=_existing_path, default=None, help="checkpoint directory or cached hub id (default: the bundled model)")
    _add_download(g)
    g.add_argument("--schedule", default=None, help="pipeline schedule (default 1f1b; interleaved-1f1b with --virtual-stages > 1)")
    g.add_argument("--virtual-stages", type=_positive, default=None, help="stages per process")
    g.add_argument("--n-microbatches", type=_positive, default=None, help="microbatches per pipelined call (default: number of stages)")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the checkpoint's)")
    g.add_argument("--device", default=None, help="force a device type, e.g. cpu")


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-pipeline`` argument parser (one sub-command per task)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog=PROG, usage=f"{PROG} <command> [<args>]", description="Pipeline parallelism for Hugging Face Transformers models: plan, generate, train, bench, convert, env.",
                     epilog=f"Run `{PROG} <command> --help` for a command's options.", formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{plan,generate,train,bench,convert,env}", parser_class=_Parser)

    p = sub.add_parser("plan", prog=f"{PROG} plan", help="show the stage plan and predicted memory of a checkpoint or config (no weights read)",
                       description="Split a model into pipeline stages from its config alone and predict every rank's memory.", formatter_class=fmt)
    p.add_argument("path", type=_existing_path, help="checkpoint directory, config.json file or cached hub id")
    _add_download(p)
    p.add_argument("--stages", "--num-stages", dest="stages", type=_positive, default=2, help="total pipeline stages (default 2)")
    p.add_argument("--virtual-stages", type=_positive, default=None, help="stages per rank (default 1, or 2 for interleaved schedules)")
    p.add_argument("--schedule", default=None, help="schedule name (default 1f1b, or interleaved-1f1b with virtual stages)")
    p.add_argument("--dtype", default=None, help="weights dtype: bf16, fp16, fp32 (default: the config's)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=_positive, default=None, help="tokens per sequence (default min(max positions, 2048))")
    p.add_argument("--n-microbatches", type=_positive, default=None, help="microbatches per step (default: number of stages)")
    p.add_argument("--split", default="auto", help="auto, uniform, or comma-separated block names (or block halves, e.g. model.layers.4.post_attention_layernorm) starting stages 1..S-1")
    p.add_argument("--auto-class", default=None, help="transformers class to load as (default: from the config)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = sub.add_parser("generate", prog=f"{PROG} generate", help="pipelined text generation with the bundled model or yours",
                       description="Generate text with a pipelined model; rank 0 prints the continuations and tokens/s.", formatter_class=fmt)
    p.add_argument("prompts", nargs="*", help="prompts (default: a few examples)")
    p.add_argument("--prompts-file", type=_existing_path, default=None, help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=_positive_float, default=None, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-k", type=_positive, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=_positive_float, default=None, help="nucleus sampling: the smallest set with this probability")
    p.add_argument("--repetition-penalty", type=_positive_float, default=None, help="> 1 discourages repeating tokens")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same tokens at every world size)")
    p.add_argument("--json", action="store_true", help="print one JSON line (ids, texts, tokens/s) on rank 0")
    p.add_argument("--quiet", action="store_true", help="do not print the plan")
    _add_load(p)
    _add_launch(p)

    p = sub.add_parser("train", prog=f"{PROG} train", help="fine-tune a causal LM, masked LM or seq2seq model on a text / JSON / CSV file",
                       description="Fine-tune a causal LM (GPT-2, LLaMA, ...), masked LM (BERT) or seq2seq model (T5), the "
                                   "task chosen from the config, with model.train_step (any torch schedule) and save a "
                                   "transformers checkpoint into --output-dir. Options are named as scripts/train.py's, which "
                                   "adds gradient accumulation, periodic checkpoints and resuming.", formatter_class=fmt)
    p.add_argument("--data", type=_existing_path, required=True, help=".txt/.md (one text per line), .json/.jsonl, .csv or .parquet file")
    p.add_argument("--text-column", default="text", help="column holding the text (JSON / CSV / parquet; default 'text')")
    p.add_argument("--target-column", default=None, help="seq2seq: column holding each text's target (default: the text's continuation)")
    p.add_argument("--mlm-probability", type=_positive_float, default=0.15, help="masked LM: share of tokens masked (default 0.15)")
    p.add_argument("--auto-class", default=None, help="transformers class to train (default: from the config, as plan)")
    p.add_argument("--output-dir", required=True, help="directory for the trained checkpoint and its tokenizer")
    p.add_argument("--steps", type=_positive, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch-size", type=_positive, default=8, help="rows per step, the global batch (default 8)")
    p.add_argument("--block-size", type=_positive, default=128, help="tokens per row (default 128)")
    p.add_argument("--lr", type=_positive_float, default=3e-4, help="peak learning rate of AdamW (default 3e-4)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps, then linear decay (default 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--max-grad-norm", type=_positive_float, default=1.0, help="clip gradients to this global norm (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch order (default 0)")
    p.add_argument("--log-every", type=_positive, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--log-file", default=None, help="also append one JSON line per step (step, loss, lr, grad_norm) to this file")
    p.add_argument("--max-shard-size", default="2GB", help="shard size of the saved checkpoint (default 2GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the --log-every loss lines still print)")
    _add_load(p)
    _add_launch(p)

    sub.add_parser("bench", prog=f"{PROG} bench", help="run the benchmarks (scripts/benchmark.py; a source checkout is needed)", add_help=False,
                   description="Pass every argument to scripts/benchmark.py (try `hf-pipeline bench --help`).")

    p = sub.add_parser("convert", prog=f"{PROG} convert", help="re-shard a checkpoint into one file per pipeline stage, or back (--merge)",
                       description="Rewrite a checkpoint so each stage's tensors are in their own file (loading then opens only a "
                                   "rank's own files), or merge it back into standard size-based shards. The source is never modified; "
                                   "the output appears atomically.", formatter_class=fmt)
    p.add_argument("path", type=_existing_path, help="source checkpoint directory")
    p.add_argument("output", help="new directory to write")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stages", "--num-stages", dest="stages", type=_positive, help="write one file per stage of this many stages")
    mode.add_argument("--merge", action="store_true", help="write standard shards (from a per-stage or any other layout)")
    p.add_argument("--virtual-stages", type=_positive, default=None, help="stages per rank (use the values you will load with)")
    p.add_argument("--schedule", default=None, help="schedule the model will run (fixes where virtual stages go)")
    p.add_argument("--split", default="auto", help="auto, uniform, or comma-separated block names (or block halves, e.g. model.layers.4.post_attention_layernorm) starting stages 1..S-1")
    p.add_argument("--auto-class", default=None, help="transformers class to plan for (default: from the config)")
    p.add_argument("--max-shard-size", default="5GB", help="with --merge: bytes per shard, e.g. 2GB (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace the output directory if it exists")

    p = sub.add_parser("env", prog=f"{PROG} env", help="versions, devices, default backend and the launcher environment",
                       description="Print what a bug report needs: versions, devices, backend, world size.", formatter_class=fmt)
    p.add_argument("--json", action="store_true")
    return parser


def _version() -> str:
    from . import __version__

    return __version__


# ------------------------------------------------------------------------------------ helpers
def _split(text: str) -> str | list[str]:
    return text if text in ("auto", "uniform") else [s.strip() for s in text.split(",") if s.strip()]


def _auto_class_for(config, given: str | None) -> type:
    """The class to plan/load ``config`` with: ``--auto-class`` if given, else the one the library picks."""
    from .planning.options import model_class_for

    return model_class_for(config, given)


def _local(path_or_id: str, download: bool = False) -> str:
    """A checkpoint directory or config.json file as given; a hub id resolved to its local snapshot, cache first.

    transformers then reads the directory, never the id, so a cached id costs no network request
    (and no retries while the hub is unreachable); an id that is not cached is downloaded with
    ``--download`` (``download``), else a one-line error that names the flag.
    """
    if pathlib.Path(path_or_id).expanduser().is_file():
        return str(pathlib.Path(path_or_id).expanduser())
    from .loading.weights import CheckpointNotFoundError, resolve_checkpoint

    try:
        return str(resolve_checkpoint(path_or_id, download=download))
    except CheckpointNotFoundError as e:
        # The library's message names its keyword; on the command line the flag is what to pass.
        raise CheckpointNotFoundError(str(e).replace("(download=True)", "(pass --download)")) from None


def _load_config(path: str, download: bool = False):
    from .planning.options import load_config

    return load_config(_local(path, download))


def _model_path(args) -> str:
    """The local directory of ``--model`` (a hub id resolved from the cache), else the bundled default model."""
    if args.model is not None:
        return _local(args.model, args.download)
    from .tools.default_model import default_model_path

    return str(default_model_path())


def _load_kwargs(args) -> dict[str, Any]:
    kw: dict[str, Any] = {"dtype": args.dtype}
    for key in ("schedule", "virtual_stages", "n_microbatches", "device"):
        if getattr(args, key) is not None:
            kw[key] = getattr(args, key)
    return kw


def _strip_launch_args(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in _LAUNCH_OPTS:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def _launch(args, argv: Sequence[str]) -> int:
    """Start ``args.num_processes`` processes running this command (torch's elastic launcher, as torchrun).

    Returns:
        0 when every process succeeded; 2 when they all stopped on a user mistake (already printed
        by rank 0 as one line); otherwise the first failing process's exit code.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.utils.distributed import get_free_port
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n, machines = args.num_processes, args.num_machines
    if os.environ.get("WORLD_SIZE") not in (None, "", "1"):
        raise CLIError("this process already runs under a launcher (WORLD_SIZE is set); drop --num-processes")
    if n % machines:
        raise CLIError(f"--num-processes {n} is the total over all machines; it must be a multiple of --num-machines {machines}")
    if not 0 <= args.machine_rank < machines:
        raise CLIError(f"--machine-rank must be in 0..{machines - 1}, got {args.machine_rank}")
    if machines > 1 and (args.main_process_ip is None or args.main_process_port is None):
        raise CLIError("with --num-machines > 1 pass --main-process-ip and --main-process-port (machine 0's address and a free port)")
    if getattr(args, "model", None) is not None:
        # A missing model fails here, once, not in every process; a download also happens once, here,
        # and the processes then find it in the cache.
        _local(args.model, args.download)
    local = n // machines
    port = args.main_process_port or get_free_port()
    # The processes inherit this environment: they import this very package, installed or from a checkout.
    here = str(pathlib.Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = here + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    threads = args.num_cpu_threads_per_process or max(1, (os.cpu_count() or 1) // local)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("HF_PIPELINE_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=machines, max_nodes=machines, nproc_per_node=local, run_id="hf-pipeline", rdzv_backend="static",
        rdzv_endpoint=f"{args.main_process_ip or '127.0.0.1'}:{port}", rdzv_configs={"rank": args.machine_rank},
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    # The agent logs every failure with a traceback of its own; the processes already said what went wrong.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "hf_pipeline.cli", *_strip_launch_args(argv))
    except ChildFailedError as e:
        # The first process to fail decides; the agent then stops the others (SIGTERM: negative codes).
        rank, failure = e.get_first_failure()
        if failure.exitcode == 2:
            return 2  # a user mistake, already said in one line
        print(f"{PROG}: error: process {rank} exited with code {failure.exitcode} (its output is above)", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


# ------------------------------------------------------------------------------------ commands
def cmd_plan(args) -> int:
    """``hf-pipeline plan``: the stage table and per-rank memory, from the config alone."""
    config = _load_config(args.path, args.download)
    auto = _auto_class_for(config, args.auto_class)
    from .tools.memory import plan_report

    report = plan_report(
        config, stages=args.stages, virtual_stages=args.virtual_stages, schedule=args.schedule, dtype=args.dtype,
        batch=args.batch, seq=args.seq, n_microbatches=args.n_microbatches, auto_class=auto, split=_split(args.split),
    )
    print(report.to_json() if args.json else report)
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        prompts += [line for line in pathlib.Path(args.prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts or ["Return the", "This module provides", "If the file does not exist,"]


def cmd_generate(args) -> int:
    """``hf-pipeline generate``: pipelined generation; rank 0 prints the text (or JSON)."""
    import torch
    import transformers

    import hf_pipeline

    path = _model_path(args)
    config = transformers.AutoConfig.from_pretrained(path)
    seq2seq = bool(config.is_encoder_decoder)
    auto = hf_pipeline.AutoModelForSeq2SeqLM if seq2seq else hf_pipeline.AutoModelForCausalLM
    prompts = _read_prompts(args)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not seq2seq:
        tok.padding_side = "left"  # decoder-only prompts are left padded, as transformers' generate expects
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = auto.from_pretrained(path, pipeline=True, progress=False, **_load_kwargs(args))
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "pad_token_id": tok.pad_token_id}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if getattr(args, key) is not None:
            gen[key] = getattr(args, key)
    with torch.no_grad():
        ids, stats = model.generate(**enc, **gen, seed=args.seed, return_stats=True)
    if model.ctx.is_main_process:
        new = ids if seq2seq else ids[:, enc["input_ids"].shape[1]:]
        texts = tok.batch_decode(new, skip_special_tokens=True)
        if args.json:
            print(json.dumps({
                "ids": ids.tolist(), "texts": texts, "new_tokens": stats.new_tokens, "seconds": stats.seconds,
                "tokens_per_s": stats.tokens_per_s, "world_size": model.ctx.world_size, "num_stages": model.plan.num_stages,
                "model": args.model or str(path),
            }))
        else:
            if not args.quiet:
                print(model.plan)
            for prompt, text in zip(prompts, texts):
                print(f"> {prompt} -> {text}" if seq2seq else f"> {prompt}{text}")
            print(f"{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s "
                  f"({model.ctx.world_size} process(es), {model.plan.num_stages} stages)")
    return 0


def cmd_train(args) -> int:
    """``hf-pipeline train``: fine-tune with ``model.train_step`` and ``save_pretrained`` the result.

    The class is the one ``plan`` picks from the config (``--auto-class`` to choose); its head's
    loss is the task (``causal_lm``, ``masked_lm`` or ``seq2seq_lm``), and ``hf_pipeline.training.data``
    makes the rows and batches for it, as for ``scripts/train.py``.
    """
    import torch
    import transformers

    from .log import StepProgress
    from .model import load_pipelined
    from .training.data import TASKS, Batches, build_dataset, load_rows

    path = _model_path(args)
    auto = _auto_class_for(_load_config(path), args.auto_class)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # The file and its columns are checked before the (long) model load; the rows are made after
    # it, once the head says which task they are for.
    columns = (args.text_column,) + ((args.target_column,) if args.target_column else ())
    raw = load_rows(args.data, columns=columns)
    model = load_pipelined(auto, path, progress=False, **_load_kwargs(args))
    task = model.resolved.head.loss
    if task not in TASKS:
        raise CLIError(
            f"{model.plan.model_class} trains with loss {task!r}; `train` fine-tunes language models ({', '.join(TASKS)}): "
            f"pass --auto-class AutoModelForCausalLM, AutoModelForMaskedLM or AutoModelForSeq2SeqLM"
        )
    rows = build_dataset(raw, tok, task, block_size=args.block_size, text_column=args.text_column, target_column=args.target_column)
    per_step = model.n_microbatches * model.dims.dp_size
    if args.batch_size % per_step:
        raise CLIError(f"--batch-size {args.batch_size} must be a multiple of n_microbatches x data-parallel replicas = {per_step}")
    batches = Batches(rows, batch_size=args.batch_size, seed=args.seed, task=task, tokenizer=tok, mlm_probability=args.mlm_probability)
    ctx = model.ctx
    if ctx.is_main_process:
        print(model.plan, flush=True)
        print(f"data: {len(raw)} texts, {len(rows)} rows of {args.block_size} tokens ({task})", flush=True)
        if args.log_file:
            pathlib.Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps)
    progress = StepProgress(args.steps, log_every=args.log_every, enabled=ctx.is_main_process, bar=not args.no_progress)
    with progress:
        for step in range(args.steps):
            loss = float(model.train_step(batches(step)))  # the same batch on every rank
            norm = float(model.clip_grad_norm_(args.max_grad_norm))
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            progress.step(step + 1, loss=loss, lr=lr)
            if ctx.is_main_process and args.log_file:
                with open(args.log_file, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm}) + "\n")
    model.save_pretrained(args.output_dir, max_shard_size=args.max_shard_size, tokenizer=tok)
    if ctx.is_main_process:
        print(f"saved {args.output_dir}")
    return 0


def _benchmark_script() -> pathlib.Path | None:
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
    return script if script.is_file() else None


def cmd_bench(argv: Sequence[str]) -> int:
    """``hf-pipeline bench ...``: ``scripts/benchmark.py``'s ``main(argv)`` (it launches its own processes)."""
    script = _benchmark_script()
    if script is None:
        if any(a in ("-h", "--help") for a in argv):
            print(f"usage: {PROG} bench [benchmark options]\n\nRuns scripts/benchmark.py of a source checkout "
                  "(git clone, then pip install -e .).")
            return 0
        raise CLIError("`hf-pipeline bench` runs scripts/benchmark.py, which only a source checkout has; clone the repository and `pip install -e .`")
    if any(a.split("=")[0] in _LAUNCH_OPTS for a in argv):
        raise CLIError("bench starts its own processes (1, 2 and 4 ranks, as each section needs); drop the launch options")
    spec = importlib.util.spec_from_file_location("hf_pipeline_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv[0] = f"{PROG} bench"
    return int(module.main(list(argv)) or 0)


def cmd_convert(args) -> int:
    """``hf-pipeline convert``: per-stage files (``--stages N``) or standard shards (``--merge``)."""
    from .tools.convert import convert_to_stages, merge_shards

    if args.merge:
        report = merge_shards(args.path, args.output, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    else:
        report = convert_to_stages(
            args.path, args.output, num_stages=args.stages, virtual_stages=args.virtual_stages, schedule=args.schedule,
            split=_split(args.split), auto_class=args.auto_class, overwrite=args.overwrite,
        )
    for name, keys in report.files.items():
        print(f"  {name}: {len(keys)} tensors")
    for stage, files in report.stage_files.items():
        print(f"  stage {stage} opens {', '.join(files)}")
    print(f"wrote {report.output} ({len(report.files)} files, {report.bytes_written / 1e6:.1f} MB)")
    return 0


def env_info() -> dict[str, Any]:
    """What ``hf-pipeline env`` prints: versions, devices, default backend, launcher variables."""
    import accelerate
    import safetensors
    import torch
    import transformers

    from .families.recipe import list_recipes

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "hf_pipeline version": _version(),
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
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"):
        info[name] = os.environ.get(name, "not set")
    from .tools.default_model import bundled_model_path

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


# ------------------------------------------------------------------------------------ main
# Builtin errors that mean a user mistake here: a path that does not exist or is taken, a plain
# ValueError from an argument check (its subclasses, e.g. a JSON decoding error, are not).
_USER_EXACT = (ValueError, FileExistsError)
_USER_ANY = (FileNotFoundError, NotADirectoryError)


def _named_type(name: str) -> type | None:
    """The exception class a RankError names for another rank: the library's own (``hf_pipeline.errors``) or a builtin."""
    import builtins

    from . import errors

    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def _is_user_error_type(cls: type) -> bool:
    """Every :class:`~hf_pipeline.errors.PipelineError` but the two that report a failure while running
    (``RankError`` of a real fault, ``PipelineBroken``), and the builtins above."""
    if issubclass(cls, (RankError, PipelineBroken)):
        return False
    return issubclass(cls, (PipelineError, *_USER_ANY)) or cls in _USER_EXACT


def _is_user_error(e: BaseException) -> bool:
    """Errors the library raises for bad input (also when another rank raised one: a RankError naming it).

    Decided by the library's exception types; a RankError carries each failing rank's type by
    name, looked up as a class first (an unknown name is not a user mistake).
    """
    if isinstance(e, RankError):
        kinds = [_named_type(kind) for kind, _, _ in e.failures.values()]
        return all(cls is not None and _is_user_error_type(cls) for cls in kinds)
    return _is_user_error_type(type(e))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-pipeline`` console script. Returns the exit code.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Example:
        >>> main(["plan", "path/to/llama", "--stages", "4"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if getattr(args, "num_processes", None) and args.num_processes > 1:
            return _launch(args, argv)
        return {"plan": cmd_plan, "generate": cmd_generate, "train": cmd_train, "convert": cmd_convert, "env": cmd_env}[args.command](args)
    except Exception as e:
        if not _is_user_error(e) or os.environ.get("HF_PIPELINE_TRACEBACK") == "1":
            raise
        # In a launched job every process gets the error (the failing one its own, the others a
        # RankError naming it); rank 0 says it once.
        if int(os.environ.get("RANK", "0") or 0) == 0:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if os.environ.get("WORLD_SIZE"):
            from .distributed.context import destroy_distributed

            destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
