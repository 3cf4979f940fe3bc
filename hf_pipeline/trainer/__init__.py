"""Fine-tuning a pipelined model with ``transformers.Trainer``: :class:`PipelineTrainer`.

Lives here:

* :mod:`.trainer`: ``PipelineTrainer``, a ``transformers.Trainer`` with the same constructor whose
  training step is ``model.train_step`` (forward and backward through the pipeline schedule),
  whose clipping is ``model.clip_grad_norm_`` and whose checkpoints are written by every rank.
* :mod:`.refusals`: the arguments it cannot honour, refused at construction on every rank.
* :mod:`.data`: data loaders that give every rank of the job the same global batch (each
  data-parallel replica takes its rows inside ``train_step``), and the item count of a step.
* :mod:`.checkpoints`: Trainer checkpoints in the package's data-only format, and resuming from them.
* :mod:`.adapter_checkpoints`: the same for a PEFT model wrapping a pipelined one (adapter + training state).

May import: every room below it (``errors`` up to ``auto``); transformers' Trainer.
"""

from .trainer import PipelineTrainer, PipelineTrainerMixin

__all__ = ["PipelineTrainer", "PipelineTrainerMixin"]
