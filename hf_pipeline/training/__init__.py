"""Pipelined training: the train step, checkpoints and training data.

Lives here: :mod:`.step` (``model.train_step``: one global batch forward and backward through
torch's schedules, gradients synced), :mod:`.checkpoint` (``save_pretrained`` as a normal HF
checkpoint written by every rank, training state save and resume), :mod:`.data` (fixed-length
rows from a local file, the same batches on every rank) and :mod:`.loop` (the fine-tuning loop of
``hf-pipeline train`` and ``scripts/train.py``: accumulation, clipping, logging, periodic saves).

May import: the base modules and the rooms below it (``distributed`` up to ``generation``).
"""
