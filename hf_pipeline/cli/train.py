"""``hf-pipeline train``: fine-tune with the shared training loop and ``save_pretrained`` the result."""

from __future__ import annotations

import pathlib

from ..errors import CLIError
from .options import auto_class_for, load_config, load_kwargs, model_path

__all__ = ["cmd_train"]


def _check_task(model, task: str, tasks) -> None:
    if task not in tasks:
        raise CLIError(
            f"{model.plan.model_class} trains with loss {task!r}; `train` fine-tunes language models "
            f"({', '.join(tasks)}): pass --auto-class AutoModelForCausalLM, AutoModelForMaskedLM or "
            "AutoModelForSeq2SeqLM"
        )


def _check_batch_size(model, batch_size: int) -> None:
    per_step = model.n_microbatches * model.dims.dp_size
    if batch_size % per_step:
        raise CLIError(
            f"--batch-size {batch_size} must be a multiple of n_microbatches x data-parallel replicas = {per_step}"
        )


def cmd_train(args) -> int:
    """``hf-pipeline train``: fine-tune with ``model.train_step`` and ``save_pretrained`` the result.

    The class is the one ``plan`` picks from the config (``--auto-class`` to choose); its head's
    loss is the task (``causal_lm``, ``masked_lm`` or ``seq2seq_lm``), and ``hf_pipeline.training.data``
    makes the rows and batches for it, as for ``scripts/train.py``; both run
    :func:`hf_pipeline.training.loop.run_training`.
    """
    import torch
    import transformers

    from ..log import StepProgress
    from ..model import load_pipelined
    from ..training.data import TASKS, Batches, build_dataset, load_rows
    from ..training.loop import run_training

    path = model_path(args)
    auto = auto_class_for(load_config(path), args.auto_class)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # The file and its columns are checked before the (long) model load; the rows are made after
    # it, once the head says which task they are for.
    columns = (args.text_column,) + ((args.target_column,) if args.target_column else ())
    raw = load_rows(args.data, columns=columns)
    model = load_pipelined(auto, path, progress=False, **load_kwargs(args))
    task = model.resolved.head.loss
    _check_task(model, task, TASKS)
    rows = build_dataset(
        raw, tok, task, block_size=args.block_size, text_column=args.text_column, target_column=args.target_column
    )
    _check_batch_size(model, args.batch_size)
    batches = Batches(
        rows, batch_size=args.batch_size, seed=args.seed, task=task, tokenizer=tok, mlm_probability=args.mlm_probability
    )
    ctx = model.ctx
    if ctx.is_main_process:
        print(model.plan, flush=True)
        print(f"data: {len(raw)} texts, {len(rows)} rows of {args.block_size} tokens ({task})", flush=True)
        if args.log_file:
            pathlib.Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = transformers.get_linear_schedule_with_warmup(
        opt, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
    )
    progress = StepProgress(args.steps, log_every=args.log_every, enabled=ctx.is_main_process, bar=not args.no_progress)
    run_training(
        model, batches, opt, sched, steps=args.steps, max_grad_norm=args.max_grad_norm, progress=progress,
        log_file=args.log_file,
    )
    model.save_pretrained(args.output_dir, max_shard_size=args.max_shard_size, tokenizer=tok)
    if ctx.is_main_process:
        print(f"saved {args.output_dir}")
    return 0
