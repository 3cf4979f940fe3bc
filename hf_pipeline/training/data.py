"""Language-model training data from one local file: fixed-length rows and the same batches on every rank.

Used by ``hf-pipeline train`` and ``scripts/train.py``. A file (``.txt`` / ``.md``: one text per
line; ``.json`` / ``.jsonl``, ``.csv``, ``.parquet``: a text column) is tokenised and cut into rows
of one length, so the pipeline's communication buffers are sized once, for one of three tasks
(the recipes' head losses):

* ``causal_lm``: the texts joined with EOS, cut into blocks; labels = input ids (the shift
  happens inside the loss).
* ``masked_lm``: the same blocks; :class:`Batches` masks them with transformers'
  ``DataCollatorForLanguageModeling``, the masks drawn from a generator seeded by the batch number.
* ``seq2seq_lm``: with a target column, source and target texts padded to the block (padding
  labelled -100); without one, blocks of twice the length, the first half the input and the
  second half its continuation as labels.

Every rank reads the file itself and :class:`Batches` gives batch ``b`` by a seeded per-epoch
permutation, so every rank passes the same global batch to ``train_step`` and a resumed run sees
exactly the batches an uninterrupted one would have.

Example:
    >>> rows = build_dataset("train.txt", tokenizer, "causal_lm", block_size=128)
    >>> batches = Batches(rows, batch_size=8, seed=0, task="causal_lm", tokenizer=tokenizer)
    >>> loss = model.train_step(batches(0))   # {"input_ids", "attention_mask", "labels"}: (8, 128) each
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from typing import Any, Iterator

import torch

from ..errors import InputError

__all__ = ["TASKS", "Batches", "build_dataset", "load_rows"]

TASKS = ("causal_lm", "masked_lm", "seq2seq_lm")

# File suffix -> the ``datasets`` builder that reads it.
_BUILDERS = {
    ".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
    ".parquet": "parquet",
}
_NAME_THE_COLUMN = "pass the name of the column holding the text (--text-column) or target (--target-column)"


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    # Every rank reads the file: datasets' per-rank "Generating train split" / "Map" bars would
    # only repeat on stderr what the caller reports once.
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


@contextlib.contextmanager
def _logging_off(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    was = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(was)


def load_rows(path: str | pathlib.Path, *, columns: tuple[str, ...] = ("text",)):
    """The file at ``path`` as an in-memory ``datasets.Dataset`` holding ``columns``.

    Raises:
        InputError: an unknown file type, a folder, an empty or malformed file, or a missing column
            (naming the columns the file has).
    """
    import datasets
    from datasets.exceptions import DatasetsError

    path = pathlib.Path(path)
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise InputError(f"{path}: unknown file type {path.suffix!r}; use one of {', '.join(sorted(_BUILDERS))}")
    if not path.is_file():
        raise InputError(f"{path} is not a file; pass the data file (--data)")
    if path.stat().st_size == 0:
        raise InputError(f"{path} is empty: nothing to train on; pass a file with text in it (--data)")
    try:
        # Its reader also logs the failure below as an ERROR line of its own: the error says it once.
        with _no_progress_bars(), _logging_off("datasets"):
            raw = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except DatasetsError as e:
        # datasets says only "An error occurred while generating the dataset"; the reason is its cause.
        reason = " ".join(str(e.__cause__ or e).split())
        raise InputError(f"{path} cannot be read as a {builder} file ({reason}); fix the file or its suffix") from e
    for column in columns:
        if column not in raw.column_names:
            raise InputError(f"{path} has no column {column!r} (columns: {raw.column_names}); {_NAME_THE_COLUMN}")
    return raw


def build_dataset(
    data: str | pathlib.Path | Any,
    tokenizer,
    task: str,
    *,
    block_size: int,
    text_column: str = "text",
    target_column: str | None = None,
):
    """Fixed-length rows of ``data`` for ``task``: a ``datasets.Dataset`` of ``input_ids`` (and ``labels``, ...).

    Args:
        data: the data file (see the module docstring for the types), or what :func:`load_rows` read from it.
        tokenizer: the model's tokenizer.
        task: one of :data:`TASKS`.
        block_size: tokens per row (per source and per target row for seq2seq).
        text_column: the column holding the text (a ``.txt`` file's lines are ``"text"``).
        target_column: seq2seq only: the column holding each text's target.

    Raises:
        InputError: an unknown task, or fewer tokens than one row.
    """
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    if block_size < 1:
        raise InputError(f"the block size must be >= 1, got {block_size}")
    seq2seq_pairs = task == "seq2seq_lm" and target_column is not None
    columns = (text_column, target_column) if seq2seq_pairs else (text_column,)
    if isinstance(data, (str, pathlib.Path)):
        name, raw = str(data), load_rows(data, columns=columns)
    else:
        name, raw = "the data", data
        missing = [c for c in columns if c not in raw.column_names]
        if missing:
            raise InputError(f"the data has no column {missing[0]!r} (columns: {raw.column_names}); {_NAME_THE_COLUMN}")
    block = block_size
    if seq2seq_pairs:
        def encode_pairs(batch):
            src = tokenizer(batch[text_column], max_length=block, truncation=True, padding="max_length")
            tgt = tokenizer(batch[target_column], max_length=block, truncation=True, padding="max_length")
            pairs = zip(tgt["input_ids"], tgt["attention_mask"])
            labels = [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in pairs]  # no loss on padding
            return {"input_ids": src["input_ids"], "attention_mask": src["attention_mask"], "labels": labels}

        with _no_progress_bars():
            return raw.map(encode_pairs, batched=True, remove_columns=raw.column_names, keep_in_memory=True)

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    span = 2 * block if task == "seq2seq_lm" else block  # seq2seq from plain text: continue the text
    total = [0]

    def group(batch):
        # As transformers' run_clm.py: concatenate the documents, cut into equal blocks, drop the rest.
        texts = [t for t in batch[text_column] if isinstance(t, str) and t.strip()]  # blank lines add no EOS
        ids: list[int] = []
        # verbose=False: texts longer than the model's maximum are expected here, they are cut into blocks.
        for row in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else ():
            ids.extend(row + ([eos] if eos is not None else []))
        total[0] += len(ids)
        n = len(ids) // span * span
        chunks = [ids[i : i + span] for i in range(0, n, span)]
        if task == "seq2seq_lm":
            return {"input_ids": [c[:block] for c in chunks], "labels": [c[block:] for c in chunks]}
        return {"input_ids": chunks}

    with _no_progress_bars():
        ds = raw.map(group, batched=True, batch_size=1000, remove_columns=raw.column_names, keep_in_memory=True)
    if len(ds) == 0:
        rows = f"one row of {span} tokens" + (f" ({block} source + {block} target)" if span != block else "")
        raise InputError(
            f"{name} has {total[0]} tokens, fewer than {rows}: nothing to train on; add text or lower the block size "
            "(--block-size)"
        )
    return ds


class Batches:
    """Global batch number b (0, 1, ...) -> the same batch on every rank, in a seeded per-epoch order.

    A resumed run asks for batch ``k * grad_accum`` onwards and sees exactly what an uninterrupted
    run would have seen; masked-LM masks are drawn from a generator seeded by the batch number.

    Args:
        dataset: rows from :func:`build_dataset`.
        batch_size: rows per batch (the global batch).
        seed: seed of the order (and of the masks).
        task: one of :data:`TASKS`.
        tokenizer: the model's tokenizer (masked LM: it must have a mask token).
        mlm_probability: masked LM: the share of tokens to mask.
    """

    def __init__(self, dataset, *, batch_size: int, seed: int, task: str, tokenizer, mlm_probability: float = 0.15):
        if len(dataset) < batch_size:
            raise InputError(
                f"the dataset has {len(dataset)} rows, fewer than the batch size {batch_size}; use more data or a "
                "smaller batch (--batch-size)"
            )
        self.dataset = dataset.with_format("torch")
        self.batch_size = batch_size
        self.per_epoch = len(dataset) // batch_size
        self.seed = seed
        self.task = task
        self.collator = None
        if task == "masked_lm":
            from transformers import DataCollatorForLanguageModeling

            if tokenizer.mask_token is None:
                raise InputError("masked LM training needs a tokenizer with a mask token")
            self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)

    def __call__(self, b: int) -> dict[str, torch.Tensor]:
        epoch, pos = divmod(b, self.per_epoch)
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))
        rows = self.dataset[order[pos * self.batch_size : (pos + 1) * self.batch_size]]
        ids = rows["input_ids"]  # (B, block)
        if self.collator is not None:
            # The collator draws masks from the global RNG: fork it, seeded by the batch number, so
            # every rank draws the same masks and dropout streams are left alone.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + b)
                return dict(self.collator([{"input_ids": r} for r in ids]))
        batch: dict[str, Any] = {"input_ids": ids}
        batch["attention_mask"] = rows["attention_mask"] if "attention_mask" in rows else torch.ones_like(ids)
        batch["labels"] = rows["labels"] if "labels" in rows else ids.clone()
        return batch
