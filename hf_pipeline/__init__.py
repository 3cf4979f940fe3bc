"""hf_pipeline: pipeline parallelism for Hugging Face Transformers models.

``AutoModelForCausalLM.from_pretrained(path, pipeline=True)`` in a script started by ``torchrun``
or ``accelerate launch`` gives a model whose stages live on different ranks, each loaded shard by
shard with only its own weights. ``pipeline=False`` (the default) returns exactly what
transformers returns.
"""

from .auto import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)
from .recipe import Recipe, RecipeError, get_recipe, list_recipes, register_recipe

__version__ = "0.1.0"

__all__ = [
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "Recipe",
    "RecipeError",
    "get_recipe",
    "list_recipes",
    "register_recipe",
]
