"""``hf-pipeline train``: fine-tune with the shared training loop and ``save_pretrained`` the result."""

from __future__ import annotations

import os
import pathlib
import tempfile
import time

from ..errors import CLIError
from .arguments import auto_class_for, flat, load_config, load_kwargs, load_tokenizer, model_path

__all__ = ["cmd_train"]


# ------------------------------------------------------------------------------------ checks before the first step
def _writable_place(path: pathlib.Path, flag: str, kind: str) -> None:
    """``path`` (a folder for ``kind == "folder"``, else a file) can be made or written by this process."""
    if path.exists():
        if (kind == "folder") != path.is_dir():
            raise CLIError(
                f"{flag} {path} is {'a folder' if path.is_dir() else 'a file'}; pass a {kind} path "
                f"(it is created if missing)"
            )
        if not os.access(path, os.W_OK | (os.X_OK if kind == "folder" else 0)):
            raise CLIError(f"{flag} {path} is not writable by this user; pass a {kind} you can write")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CLIError(f"{flag} {path} cannot be made: {parent} is a file, not a folder; pass another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path} cannot be made: {parent} is not writable; pass a {kind} you can write")


def _check_outputs(args) -> None:
    """Where the run writes, checked before the model loads: a typo there must not cost the training."""
    _writable_place(pathlib.Path(args.output_dir), "--output-dir", "folder")
    if args.log_file:
        _writable_place(pathlib.Path(args.log_file), "--log-file", "file")


def _check_task(model, task: str, tasks) -> None:
    if task not in tasks:
        raise CLIError(
            f"{model.plan.model_class} trains with loss {task!r}; `train` fine-tunes language models "
            f"({', '.join(tasks)}): pass --auto-class AutoModelForCausalLM, AutoModelForMaskedLM or "
            "AutoModelForSeq2SeqLM"
        )


def _check_batch_size(model, batch_size: int) -> None:
    # A replica's rows split into the microbatches a step of them runs (the default adapts its chosen count).
    replica = batch_size // model.dims.dp_size if batch_size % model.dims.dp_size == 0 else batch_size
    per_step = model.microbatches_for(replica, training=True) * model.dims.dp_size
    if batch_size % per_step:
        raise CLIError(
            f"--batch-size {batch_size} must be a multiple of n_microbatches x data-parallel replicas = {per_step}"
        )


# ------------------------------------------------------------------------------------ saving
def _agreed(model, value: str) -> str:
    """Rank 0's ``value`` on every rank (a folder name with the time in it)."""
    if not model.ctx.is_distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=model.ctx.group)
    return box[0]


def _save(model, args, tok) -> None:
    """``save_pretrained`` into ``--output-dir``; if that fails, into a sibling or the temp folder, and say where.

    Collective: a failed save fails on every rank, so every rank tries the same places in turn.
    """
    from ..distributed.agreement import is_lost_peer_error
    from ..errors import PipelineBroken

    try:
        model.save_pretrained(args.output_dir, max_shard_size=args.max_shard_size, tokenizer=tok)
        return
    except Exception as e:
        if isinstance(e, PipelineBroken) or is_lost_peer_error(e):
            raise  # the group is gone: no collective save can run
        error = e
    stamp = _agreed(model, time.strftime("%Y%m%d-%H%M%S"))
    out = pathlib.Path(args.output_dir).absolute()
    name = f"{out.name}.unsaved-{stamp}"
    places = [out.with_name(name), pathlib.Path(tempfile.gettempdir(), name)]  # beside it, else the temp folder
    for place in places:
        try:
            model.save_pretrained(place, max_shard_size=args.max_shard_size, tokenizer=tok)
        except Exception as e:
            error.add_note(f"saving into {place} failed too: {e}")
            continue
        raise CLIError(
            f"could not save into --output-dir {args.output_dir} ({flat(error).rstrip('.')}); the trained model is "
            f"in {place} instead: move it where you want it"
        ) from error
    raise error


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

    _check_outputs(args)
    path = model_path(args)
    auto = auto_class_for(load_config(path), args.auto_class)
    tok = load_tokenizer(path)
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
    _save(model, args, tok)
    if ctx.is_main_process:
        print(f"saved {args.output_dir}")
    return 0
