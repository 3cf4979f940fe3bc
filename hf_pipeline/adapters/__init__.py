"""PEFT adapters (LoRA) on a pipelined model: each rank adapts only the modules of its own stages.

Lives here:

* :mod:`.host`: :class:`AdapterHost`, what ``PipelinedModel`` adds for peft and for transformers'
  adapter methods (``add_adapter``, ``load_adapter``, ``set_adapter``, ``disable_adapters``, ...).
* :mod:`.inject`: injection on the stages with one-process names and one-process initial values
  (the whole model's random stream replayed on its meta-device copy), and which adapter keys a
  rank loads.
* :mod:`.save`: an adapter saved as one process saves it: gathered from every rank, written once.
* :mod:`.peft_hooks`: where peft's own entry points (``get_peft_model``, ``PeftModel.from_pretrained``,
  ``save_pretrained``) hand a pipelined model to the two modules above.

May import: the base modules and the rooms below it (``distributed`` up to ``training``).
"""
