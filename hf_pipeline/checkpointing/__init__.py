"""Saving and resuming: a pipelined model's checkpoint written by every rank, its training state restored.

Lives here:

* :mod:`.save`: ``model.save_pretrained`` as a normal HF checkpoint written by every rank, in named
  steps (weights, config, and training state when asked for).
* :mod:`.directory`: what a checkpoint directory holds (the training state's file names), when it is a
  complete checkpoint, and ``latest_checkpoint``; the weight files' names are the reader's
  (:mod:`hf_pipeline.loading.checkpoint_files`).
* :mod:`.staging`: crash-safe publication (files staged in a hidden directory, the index moved in
  last); :mod:`.lock`: one save at a time into a directory, and only inside it; :mod:`.durable`:
  flushed writes, a full disk named, ``replace_file``.
* :mod:`.training_state`: optimizer, scheduler and RNG state beside the weights, and
  ``load_training_state``; :mod:`.state_files`: that state in files that cannot carry code;
  :mod:`.state_shards`: a sharded parameter's optimizer state gathered whole to save, cut to the
  rank's shard to load.

Why here: saving reads what the loader reads (``loading``'s file names) and writes a model's stages,
so it sits above ``training``; the fine-tuning loop (``training/loop.py``) takes its saves as a
callback, so the training room never imports this one and the loop stays beside the train step.

May import: the base modules and the rooms below it (``distributed`` up to ``recompute``).
"""
