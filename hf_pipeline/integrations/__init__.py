"""Integrations with peft and transformers' Trainer: a pipelined model through their own entry points.

Lives here (flat modules, named by the library they serve):

* :mod:`.peft_host`: :class:`AdapterHost`, what ``PipelinedModel`` adds for peft and for transformers'
  adapter methods (``add_adapter``, ``load_adapter``, ``set_adapter``, ``disable_adapters``, ...), and
  the handlers of peft's calls on a pipelined model.
* :mod:`.peft_inject`: injection on the stages with one-process names and one-process initial values
  (the whole model's random stream replayed on its meta-device copy), and which adapter keys a
  rank loads.
* :mod:`.peft_agree`: adapter steps agreed between ranks: the config and the files (by content) compared,
  a failure on one rank raised on every rank (``AdapterError``), tensor parallelism refused by name.
* :mod:`.peft_save`: an adapter saved as one process saves it: gathered from every rank, written once.
* :mod:`.peft_patches`: the peft methods replaced (named in ``compat.PEFT_PATCHED_METHODS``), in place
  only while a pipelined model is alive, each calling peft's own method for any other model.
* :mod:`.trainer`: ``PipelineTrainer`` and ``PipelineTrainerMixin``, a ``transformers.Trainer`` whose
  step is ``model.train_step`` (or, for a loss of the Trainer's own, its step through the differentiable
  pipelined forward), whose clipping is ``model.clip_grad_norm_`` and whose checkpoints are written by every rank.
* :mod:`.trainer_refusals`: the arguments it cannot honour, refused at construction on every rank.
* :mod:`.one_process`: a Trainer's own step (its ``compute_loss``: TRL's GRPO, RLOO, KTO, reward, a user's) with
  accelerate's state saying one process, and the batches TRL's configs sized by accelerate's process count.
* :mod:`.trainer_dpo`: TRL's DPO loss computed through the pipeline.
* :mod:`.trainer_data`: data loaders giving every rank the same global batch, and a step's item count.
* :mod:`.padding_free`: a padding-free batch (TRL's packing) as the rows a pipelined step splits.
* :mod:`.trainer_checkpoints`: Trainer checkpoints in the package's data-only format, resuming, and
  rotating away only the checkpoints the Trainer wrote (each marked).
* :mod:`.trainer_adapter_checkpoints`: the same for a PEFT model wrapping a pipelined one.

Nothing is imported here: the Trainer modules pull in ``transformers.Trainer`` (import
``hf_pipeline.integrations.trainer``, or ``hf_pipeline.PipelineTrainer``), and peft is imported only
by its users.

May import: the base modules and the rooms below it (``distributed`` up to ``training``), peft,
transformers and accelerate; never ``model``, ``auto`` or anything above (``PipelinedModel`` derives
from :class:`~.peft_host.AdapterHost`, so the model is typed here as ``torch.nn.Module``).
"""
