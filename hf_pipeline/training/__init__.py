"""Pipelined training: the train step, the fine-tuning loop and training data.

Lives here:

* :mod:`.step`: ``model.train_step`` (one global batch forward and backward through torch's
  schedules, gradients synced; the head's loss or one given); :mod:`.clipping`: ``clip_grad_norm_``;
  :mod:`.flat_reduce` (gradients summed in flat buckets).
* :mod:`.inference_loss`: what a pipelined ``forward()`` returns (outputs, and the loss whose backward points
  at ``train_step`` where no graph is kept); :mod:`.differentiable`: the forward's outputs under grad mode,
  whose backward runs the pipeline's step with the caller's output gradients; :mod:`.fused_head`: TRL's fused
  LM head's per-token fields computed from the forward's logits.
* :mod:`.data`: fixed-length rows from a local file, the same batches on every rank.
* :mod:`.loop`: the fine-tuning loop of ``hf-pipeline train`` and ``scripts/train.py`` (accumulation,
  clipping, logging, periodic saves through a ``save`` callback, resume from a start step).

Saving and resuming (``save_pretrained``, ``load_training_state``) are :mod:`hf_pipeline.checkpointing`,
activation recomputation is :mod:`hf_pipeline.recompute`; both sit above this room.

May import: the base modules and the rooms below it (``distributed`` up to ``generation``).
"""
