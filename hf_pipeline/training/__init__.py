"""Pipelined training: the train step, checkpoints and training data.

Lives here:

* :mod:`.step`: ``model.train_step`` (one global batch forward and backward through torch's
  schedules, gradients synced) and ``clip_grad_norm_``; :mod:`.flat_reduce` (gradients summed in flat
  buckets).
* :mod:`.inference_loss`: the loss a pipelined ``forward()`` returns, whose backward points at
  ``train_step``.
* :mod:`.checkpoint`: ``save_pretrained`` as a normal HF checkpoint written by every rank, in
  named steps; :mod:`.checkpoint_format` (the file names, when a directory is a complete
  checkpoint, ``latest_checkpoint``); :mod:`.staging` (crash-safe publication, index last);
  :mod:`.durable` (flushed writes, a full disk named); :mod:`.training_state` (optimizer,
  scheduler and RNG state beside the weights, ``load_training_state``); :mod:`.state_shards` (a sharded
  parameter's optimizer state gathered whole to save, cut to the rank's shard to load).
* :mod:`.data`: fixed-length rows from a local file, the same batches on every rank.
* :mod:`.activation_checkpointing`: transformers' ``activation_checkpointing_enable`` / ``_disable`` on
  the stages (non-reentrant, ``every_n_layers`` over the whole model's layers).
* :mod:`.loop`: the fine-tuning loop of ``hf-pipeline train`` and ``scripts/train.py`` (accumulation,
  clipping, logging, periodic saves, resume).

May import: the base modules and the rooms below it (``distributed`` up to ``generation``).
"""
