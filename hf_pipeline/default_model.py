"""The model scripts, notebooks and the CLI use when no model is given: a small trained LLaMA, bundled.

:func:`default_model_path` returns the checkpoint shipped inside the package
(``hf_pipeline/assets/default-model``: sharded safetensors, config, generation config, a byte-level
BPE tokenizer and a model card). It is a ~4M-parameter LLaMA trained on the Python standard
library's docstrings with this package's own pipelined trainer, by
``torchrun --nproc_per_node 2 scripts/make_default_model.py --out hf_pipeline/assets/default-model``;
its README says how, with the final loss. It writes docstring-like English.

If the bundled files are missing (a trimmed install), :func:`default_model_path` falls back to a
model with random weights (same architecture family, gibberish text), built once in
:func:`cache_dir`. Several ranks may build it at once: each builds into its own temporary
directory and renames it into place; the first rename wins and the others discard theirs (the
build is deterministic, so every copy is the same).

Example:
    >>> path = default_model_path()        # .../site-packages/hf_pipeline/assets/default-model
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from .log import get_logger

__all__ = [
    "BUNDLED_MODEL_DIR",
    "DEFAULT_MODEL_NAME",
    "bundled_model_path",
    "byte_level_tokenizer",
    "cache_dir",
    "default_model_path",
    "random_model_path",
]

BUNDLED_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "default-model"
DEFAULT_MODEL_NAME = "default-llama-v1"  # the random fallback's directory in the cache
_REQUIRED = ("config.json", "tokenizer.json", "model.safetensors.index.json")

# Training text for the fallback's tokenizer (a few sentences of plain English and Python).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A pipeline splits a model into stages; each process
holds the weights of its own stages and passes activations to the next one. Generation runs the
stages as a ring: the last stage picks the next token and sends it back to the first.
def generate(model, prompts, max_new_tokens=32):
    \"\"\"Return the prompts followed by the generated text.\"\"\"
    for step in range(max_new_tokens):
        tokens = model(tokens)
    return tokens
If the file does not exist, the function returns None. This module provides helpers for reading
checkpoints, building stage plans and launching jobs with torchrun or accelerate.
"""
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def cache_dir() -> pathlib.Path:
    """``$HF_PIPELINE_CACHE``, else ``~/.cache/hf_pipeline``."""
    env = os.environ.get("HF_PIPELINE_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "hf_pipeline"


def bundled_model_path() -> pathlib.Path | None:
    """The bundled trained checkpoint's directory, or None if its files are not installed.

    Returns:
        ``hf_pipeline/assets/default-model`` when its config, tokenizer, index and every shard the
        index names are present.
    """
    d = BUNDLED_MODEL_DIR
    if not all((d / name).is_file() for name in _REQUIRED):
        return None
    import json

    try:
        shards = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return None
    return d if all((d / s).is_file() for s in shards) else None


def default_model_path() -> pathlib.Path:
    """Directory of the default checkpoint: the bundled trained model, else the random fallback.

    Returns:
        A checkpoint directory with sharded safetensors and a tokenizer.

    Example:
        >>> tok = AutoTokenizer.from_pretrained(default_model_path())
    """
    path = bundled_model_path()
    if path is not None:
        return path
    get_logger(__name__).warning(
        "the bundled default model is missing from %s; using a small model with random weights (its text is "
        "gibberish). Reinstall hf_pipeline, or pass a model path", BUNDLED_MODEL_DIR,
    )
    return random_model_path()


def byte_level_tokenizer(vocab_size: int = 384):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on a short built-in text (every byte encodable).

    Args:
        vocab_size: target size (4 specials + 256 bytes + merges).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tk.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _build_random(directory: pathlib.Path) -> None:
    import torch
    import transformers

    tok = byte_level_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(directory, max_shard_size="200KB")  # several shards, like a real checkpoint
    tok.save_pretrained(directory)


def random_model_path() -> pathlib.Path:
    """Directory of the random-weights fallback model, built in :func:`cache_dir` on first use.

    Returns:
        ``cache_dir() / DEFAULT_MODEL_NAME``: a 4-layer LLaMA (hidden 64) with a 384-token tokenizer.
    """
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _build_random(tmp)
        try:
            os.rename(tmp, target)  # atomic: readers see no directory or a complete one
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
