"""Fine-tune a transformers model with pipeline parallelism on a local text or JSON dataset.

Causal LM (LLaMA, GPT-2, ...), masked LM (BERT) or seq2seq (T5), picked from the checkpoint's
architecture. The data file (.txt/.md one text per line, .json/.jsonl, .csv, .parquet) is read
with ``datasets``, tokenised with the model's tokenizer and cut into fixed-length blocks (one input
shape: the pipeline's communication buffers are sized once; see ``hf_pipeline/training/data.py``, shared
with ``hf-pipeline train``). Every rank reads the same data in the same seeded order and passes
the same global batch; each pipeline replica takes its share.

Run (2 processes, one pipeline of 2 stages; more processes than stages give data parallelism):

    torchrun --nproc_per_node 2 scripts/train.py --model path/to/model --data train.txt \\
        --output-dir out --steps 1000 --batch-size 16 --n-microbatches 8 --schedule interleaved-1f1b

    accelerate launch --multi_gpu --num_processes 2 scripts/train.py --model path/to/model \\
        --data train.txt --output-dir out --steps 1000

    # CPU only (accelerate --multi_gpu on a CPU host starts 2 CPU processes through torchrun):
    accelerate launch --multi_gpu --num_processes 2 scripts/train.py --device cpu ...

    # continue from the latest complete checkpoint in --output-dir:
    torchrun --nproc_per_node 2 scripts/train.py ... --output-dir out --resume

Every ``--save-every`` steps (and at the end) ``<output-dir>/checkpoint-<step>`` gets a normal
transformers checkpoint (plus the tokenizer, optimizer, scheduler and RNG state): load it with
``transformers.AutoModelFor*.from_pretrained`` or resume from it. Rank 0 shows a progress bar (ETA,
loss and lr in its postfix; ``--no-progress`` hides it), prints the loss every ``--log-every`` steps
either way, and appends one JSON line per step (step, loss, lr, grad_norm) to ``--log-file``.
``--model`` may be a hub id in the local cache: it is resolved to the cached snapshot first, so
nothing waits on the network.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors) or cached hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or cached hub id (default: --model)")
    p.add_argument(
        "--data",
        required=True,
        help="training data: a .txt/.md file (one text per line), .json/.jsonl, .csv or .parquet",
    )
    p.add_argument("--text-column", default="text")
    p.add_argument(
        "--target-column", default=None, help="seq2seq: column with the target text (default: the text's continuation)"
    )
    p.add_argument("--task", choices=sorted(TASKS), default=None, help="default: from the checkpoint's architecture")
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--steps", type=int, required=True, help="optimizer steps to train for (in total, counting resumed ones)"
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="global batch (rows) per train_step, all replicas together"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="train_steps per optimizer step")
    p.add_argument("--block-size", type=int, default=128, help="tokens per row")
    p.add_argument("--n-microbatches", type=int, default=None)
    p.add_argument(
        "--schedule",
        default=None,
        help="gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zero-bubble, zbv-zero-bubble, ...",
    )
    p.add_argument("--virtual-stages", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None, help="total stages (default: world size x virtual stages)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mlm-probability", type=float, default=0.15)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    p.add_argument("--device", default=None, help="'cpu' to force CPU (default: cuda:LOCAL_RANK when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-every", type=int, default=0, help="save a checkpoint every K optimizer steps (0: only at the end)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --output-dir")
    p.add_argument("--resume-from", default=None, help="continue from this checkpoint directory")
    p.add_argument("--log-file", default=None, help="JSON lines of per-step metrics (default: <output-dir>/log.jsonl)")
    p.add_argument(
        "--log-every", type=int, default=10, help="print the loss every N steps, with or without the bar (default 10)"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the --log-every loss lines still print)"
    )
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.grad_accum < 1 or args.steps < 1:
        p.error("--batch-size, --grad-accum and --steps must be >= 1")
    return args


# ----------------------------------------------------------------------------- training
def _resume_from(args, out: pathlib.Path) -> str | None:
    """``--resume-from``, else with ``--resume`` the latest complete checkpoint in ``out`` (None: start fresh)."""
    from hf_pipeline.checkpointing.directory import latest_checkpoint

    if args.resume and args.resume_from is None:
        found = latest_checkpoint(out)
        return str(found) if found is not None else None  # nothing saved yet: start fresh
    return args.resume_from


def _load_model(args, model_dir: str, source: str):
    """The pipelined model, and the task its head trains (``causal_lm``, ``masked_lm``, ``seq2seq_lm``).

    As ``hf-pipeline train``: the class is ``--task``'s Auto class, else the one the library picks
    from the config (``model_class_for``: the checkpoint's architecture); the task is its head's loss.
    """
    from hf_pipeline.model import load_pipelined
    from hf_pipeline.planning.options import load_config, model_class_for
    from hf_pipeline.training.data import TASKS as DATA_TASKS

    options = {
        "n_microbatches": args.n_microbatches, "schedule": args.schedule, "virtual_stages": args.virtual_stages,
        "num_stages": args.num_stages, "device": args.device,
    }
    load = {k: v for k, v in options.items() if v is not None}
    cls = TASKS[args.task] if args.task else model_class_for(load_config(model_dir))
    model = load_pipelined(cls, source, dtype="float32", **load)
    task = model.resolved.head.loss
    if task not in DATA_TASKS:
        raise SystemExit(f"{model.plan.model_class} trains with loss {task!r}; pass --task ({', '.join(DATA_TASKS)})")
    return model, task


def _batches(args, tokenizer, task: str):
    from hf_pipeline.training.data import Batches, build_dataset

    dataset = build_dataset(
        args.data, tokenizer, task, block_size=args.block_size, text_column=args.text_column,
        target_column=args.target_column,
    )
    return Batches(
        dataset, batch_size=args.batch_size, seed=args.seed, task=task, tokenizer=tokenizer,
        mlm_probability=args.mlm_probability,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from hf_pipeline.checkpointing.training_state import load_training_state
    from hf_pipeline.loading.checkpoint_files import resolve_checkpoint
    from hf_pipeline.log import StepProgress
    from hf_pipeline.training.loop import run_training

    out = pathlib.Path(args.output_dir)
    resume_from = _resume_from(args, out)
    # Hub ids resolve to their cached snapshot first: transformers then reads directories and never
    # waits on the network.
    model_dir = str(resolve_checkpoint(args.model))
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(resolve_checkpoint(args.tokenizer)) if args.tokenizer else model_dir
    )
    torch.manual_seed(args.seed)
    model, task = _load_model(args, model_dir, resume_from or model_dir)
    model.train()
    ctx = model.ctx
    if ctx.is_main_process:
        print(model.plan, flush=True)

    batches = _batches(args, tokenizer, task)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = transformers.get_linear_schedule_with_warmup(
        opt, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
    )
    start = 0
    if resume_from is not None:
        start = int(load_training_state(model, resume_from, optimizer=opt, scheduler=sched)["step"])
        if ctx.is_main_process:
            print(f"resumed from {resume_from} at step {start}", flush=True)

    log_path = pathlib.Path(args.log_file) if args.log_file else out / "log.jsonl"
    if ctx.is_main_process:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    progress = StepProgress(
        args.steps, initial=start, log_every=args.log_every, enabled=ctx.is_main_process, bar=not args.no_progress
    )

    def save(done: int) -> None:
        path = model.save_pretrained(
            out / f"checkpoint-{done}", optimizer=opt, scheduler=sched, step=done, tokenizer=tokenizer
        )
        if ctx.is_main_process:
            progress.write(f"saved {path}")

    run_training(
        model, batches, opt, sched, steps=args.steps, start_step=start, grad_accum=args.grad_accum,
        max_grad_norm=args.max_grad_norm, autocast=torch.bfloat16 if args.bf16 else None, progress=progress,
        log_file=log_path, warn_non_finite=True, save_every=args.save_every, save=save,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
