"""What several commands read from their arguments: the model's local path, its config and class, the load options."""

from __future__ import annotations

import pathlib
from typing import Any

from ..errors import CheckpointNotFoundError, CLIError, PipelineError

__all__ = [
    "auto_class_for", "flat", "load_config", "load_kwargs", "load_tokenizer", "local_path", "model_path",
    "split_option",
]


def flat(message: object) -> str:
    """``message`` on one line: transformers and tokenizers wrap theirs over several lines mid-sentence."""
    return " ".join(str(message).split())


def _library_errors() -> tuple[type[BaseException], ...]:
    """What transformers / tokenizers / huggingface_hub raise for a file they cannot read as asked: a bad
    JSON file, a field of the wrong type, a missing or broken tokenizer file."""
    from huggingface_hub.errors import StrictDataclassError

    return (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


def split_option(text: str) -> str | list[str]:
    """``--split``: ``auto`` / ``uniform`` as they are, else the comma-separated block names."""
    return text if text in ("auto", "uniform") else [s.strip() for s in text.split(",") if s.strip()]


def auto_class_for(config, given: str | None) -> type:
    """The class to plan/load ``config`` with: ``--auto-class`` if given, else the one the library picks."""
    from ..planning.options import model_class_for

    return model_class_for(config, given)


def local_path(path_or_id: str, download: bool = False) -> str:
    """A checkpoint directory or config.json file as given; a hub id resolved to its local snapshot, cache first.

    transformers then reads the directory, never the id, so a cached id costs no network request
    (and no retries while the hub is unreachable); an id that is not cached is downloaded with
    ``--download`` (``download``), else a one-line error that names the flag.
    """
    if pathlib.Path(path_or_id).expanduser().is_file():
        return str(pathlib.Path(path_or_id).expanduser())
    from ..loading.checkpoint_files import resolve_checkpoint

    try:
        return str(resolve_checkpoint(path_or_id, download=download))
    except CheckpointNotFoundError as e:
        # The library's message names its keyword (download=True); on the command line the flag is what to pass.
        raise CheckpointNotFoundError(f"{e}; on the command line: pass --download") from None


def load_config(path: str, download: bool = False):
    """The transformers config of a checkpoint directory, config.json file or cached hub id.

    Raises:
        CLIError: a config transformers cannot read (malformed JSON, a field of the wrong type), in one line.
    """
    from ..planning.options import load_config as load

    local = local_path(path, download)
    try:
        return load(local)
    except PipelineError:
        raise
    except _library_errors() as e:
        raise CLIError(f"cannot read the config of {path}: {flat(e).rstrip('.')}; fix its config.json") from e


def load_tokenizer(path: str):
    """The tokenizer of the model at ``path`` (``--model``, or the bundled model).

    Raises:
        CLIError: transformers / tokenizers cannot load it, with their whole message on one line.
    """
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except _library_errors() as e:
        raise CLIError(
            f"cannot load the tokenizer of --model {path}: {flat(e).rstrip('.')}; save the model's tokenizer into "
            "that directory"
        ) from e


def model_path(args) -> str:
    """The local directory of ``--model`` (a hub id resolved from the cache), else the bundled default model."""
    if args.model is not None:
        return local_path(args.model, args.download)
    from ..tools.default_model import default_model_path

    return str(default_model_path())


def load_kwargs(args) -> dict[str, Any]:
    """``from_pretrained`` keywords of the ``model`` option group: the load options with a flag
    (:func:`hf_pipeline.load_options.cli_fields`) that were given."""
    from ..load_options import cli_fields

    return {f.name: getattr(args, f.name) for f in cli_fields() if getattr(args, f.name) is not None}
