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
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from .checkpointing.directory import latest_checkpoint
from .checkpointing.training_state import load_training_state
from .distributed.context import init_distributed
from .errors import NoSuchAttribute, PipelineError
from .families.recipe import Recipe, RecipeError, get_recipe, list_recipes, register_recipe
from .memory.planner import plan_report
from .model import PipelinedModel

__version__ = "0.1.0"

# What users import. Everything else is reached through its module (hf_pipeline.planning.schedules,
# hf_pipeline.errors, ...), whose own __all__ lists what other modules use.
__all__ = [
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForMultipleChoice",
    "AutoModelForQuestionAnswering",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "PipelineError",
    "PipelineTrainer",
    "PipelinedModel",
    "Recipe",
    "RecipeError",
    "get_recipe",
    "init_distributed",
    "latest_checkpoint",
    "list_recipes",
    "load_training_state",
    "plan_report",
    "register_recipe",
]


def __getattr__(name: str):
    # PipelineTrainer is imported when first asked for: transformers.Trainer pulls in much (peft,
    # accelerate's state, datasets), which loading and running a model never needs.
    if name == "PipelineTrainer":
        from .integrations.trainer import PipelineTrainer

        return PipelineTrainer
    raise NoSuchAttribute(f"module 'hf_pipeline' has no attribute {name!r}")
