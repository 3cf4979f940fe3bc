"""What differs per architecture family: recipes, the forward glue, the heads' losses.

Lives here: :mod:`.recipe` (reads and validates ``model_recipes/<family>.toml``, the registry),
:mod:`.roles` (the module roles of a standard transformers decoder, found on a model class, for the
generic ``decoder.toml`` recipe), :mod:`.glue` (the generic decoder's glue, which runs the model
class's own forward over a stage's layers, and the few lines per hand-written family that run HF's
own modules for one stage, with shape comments where hidden states flow) and :mod:`.losses` (each
head's loss, equal to transformers').

May import: the base modules and :mod:`hf_pipeline.distributed`. Generic code above reads a family
through its recipe and glue, never by its name.
"""
