"""What differs per architecture family: recipes, the forward glue, the heads' losses.

Lives here: :mod:`.recipe` (reads and validates ``model_recipes/<family>.toml``, the registry),
:mod:`.glue` (the few lines per family that run HF's own modules for one stage, with shape
comments where hidden states flow) and :mod:`.losses` (each head's loss, equal to transformers').

May import: the base modules and :mod:`hf_pipeline.distributed`. Generic code above reads a family
through its recipe and glue, never by its name.
"""
