"""The models scripts, notebooks and the CLI use when no model is given: small trained models, bundled.

:func:`default_model_path` returns a checkpoint shipped inside the package (sharded safetensors,
config, tokenizer and a model card), each trained on the Python standard library's docstrings with
this package's own pipelined trainer by :mod:`devtools.make_default_model` (a developer tool of the
source checkout); each README says how, with the final loss:

- ``default_model_path()`` (``"llama"``, ``hf_pipeline/assets/default-model``): a ~4M-parameter
  LLaMA that writes docstring-like English, by
  ``torchrun --nproc_per_node 2 -m devtools.make_default_model --out hf_pipeline/assets/default-model``.
- ``default_model_path("t5")`` (``hf_pipeline/assets/default-t5``): a ~1.2M-parameter T5 that
  summarises a docstring (``"summarize: " + docstring`` -> its first sentence), by ``... --arch t5``.
- ``default_model_path("bert")`` (``hf_pipeline/assets/default-bert``): a ~1.1M-parameter BERT
  masked LM (``[MASK]`` filling in docstring English), by ``... --arch bert``.

If the bundled files are missing (a trimmed install), :func:`default_model_path` falls back to a
model with random weights (same architecture, gibberish output), built once in :func:`cache_dir`.
Several ranks may build it at once: each builds into its own temporary directory and renames it
into place; the first rename wins and the others discard theirs (the build is deterministic, so
every copy is the same).

Example:
    >>> path = default_model_path()        # .../site-packages/hf_pipeline/assets/default-model
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
    >>> t5 = AutoModelForSeq2SeqLM.from_pretrained(default_model_path("t5"), pipeline=True)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from ..errors import InputError
from ..log import get_logger

__all__ = [
    "BUNDLED_ARCHS",
    "CHAT_TEMPLATE",
    "BUNDLED_MODEL_DIR",
    "DEFAULT_MODEL_NAME",
    "bundled_model_path",
    "byte_level_tokenizer",
    "cache_dir",
    "default_model_path",
    "random_model_path",
]

_ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
BUNDLED_MODEL_DIR = _ASSETS / "default-model"  # the default ("llama") model's
DEFAULT_MODEL_NAME = "default-llama-v1"  # the random fallback's directory in the cache
_DEFAULT_ARCH = "llama"
# arch -> (bundled directory under assets/, the random fallback's directory in the cache)
_BUNDLED = {"llama": ("default-model", DEFAULT_MODEL_NAME), "t5": ("default-t5", "default-t5-v1"),
            "bert": ("default-bert", "default-bert-v1")}
BUNDLED_ARCHS = tuple(_BUNDLED)
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


def _check_arch(arch: str) -> None:
    if arch not in _BUNDLED:
        raise InputError(f"no bundled {arch!r} model; pass one of {', '.join(map(repr, BUNDLED_ARCHS))}")


def bundled_model_path(arch: str = _DEFAULT_ARCH) -> pathlib.Path | None:
    """A bundled trained checkpoint's directory, or None if its files are not installed.

    Args:
        arch: ``"llama"`` (the default model), ``"t5"`` or ``"bert"``.

    Returns:
        ``hf_pipeline/assets/default-model`` (``default-t5``, ``default-bert``) when its config,
        tokenizer, index and every shard the index names are present.
    """
    _check_arch(arch)
    # BUNDLED_MODEL_DIR is read here, not copied into _BUNDLED: a test or a repackager may point it elsewhere.
    d = BUNDLED_MODEL_DIR if arch == _DEFAULT_ARCH else _ASSETS / _BUNDLED[arch][0]
    if not all((d / name).is_file() for name in _REQUIRED):
        return None
    import json

    try:
        shards = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return None
    return d if all((d / s).is_file() for s in shards) else None


def default_model_path(arch: str = _DEFAULT_ARCH) -> pathlib.Path:
    """Directory of a bundled checkpoint: the trained model, else its random-weights fallback.

    Args:
        arch: ``"llama"`` (the default model: a causal LM), ``"t5"`` (docstring summaries) or
            ``"bert"`` (a masked LM).

    Returns:
        A checkpoint directory with sharded safetensors and a tokenizer.

    Example:
        >>> tok = AutoTokenizer.from_pretrained(default_model_path())
        >>> fill = transformers.pipeline("fill-mask", model=str(default_model_path("bert")))
    """
    path = bundled_model_path(arch)
    if path is not None:
        return path
    missing = BUNDLED_MODEL_DIR if arch == _DEFAULT_ARCH else _ASSETS / _BUNDLED[arch][0]
    name = "default" if arch == _DEFAULT_ARCH else arch
    get_logger(__name__).warning(
        "the bundled %s model is missing from %s; using a small model with random weights (its output is "
        "gibberish). Reinstall hf_pipeline, or pass a model path", name, missing,
    )
    return random_model_path() if arch == _DEFAULT_ARCH else random_model_path(arch)


# The bundled causal LM's chat template (it writes docstring English and was never tuned for chat):
# each message as "role: content" on its own line, then "assistant:" for the reply, so the server's chat
# route and chat clients (guidellm's default) work out of the box.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


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
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    tk.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _random_model(arch: str, tok):
    """The fallback's (model class, config): small, and the bundled model's architecture."""
    import transformers

    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if arch == "t5":
        return transformers.T5ForConditionalGeneration, transformers.T5Config(
            vocab_size=len(tok), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=tok.pad_token_id, **ids)
    if arch == "bert":
        return transformers.BertForMaskedLM, transformers.BertConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=512, pad_token_id=tok.pad_token_id)
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        **ids)


def _build_random(directory: pathlib.Path, arch: str = _DEFAULT_ARCH) -> None:
    import torch
    import transformers

    tok = byte_level_tokenizer()
    if arch == "bert":
        tok.add_special_tokens({"mask_token": "[MASK]"})  # fill-mask needs one
    cls, config = _random_model(arch, tok)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = cls(config).eval()
    finally:
        torch.random.set_rng_state(state)
    if model.can_generate():
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            decoder_start_token_id=getattr(config, "decoder_start_token_id", None),
        )
    model.save_pretrained(directory, max_shard_size="200KB")  # several shards, like a real checkpoint
    tok.save_pretrained(directory)


def random_model_path(arch: str = _DEFAULT_ARCH) -> pathlib.Path:
    """Directory of a random-weights fallback model, built in :func:`cache_dir` on first use.

    Args:
        arch: ``"llama"``, ``"t5"`` or ``"bert"``, as :func:`default_model_path`.

    Returns:
        ``cache_dir() / DEFAULT_MODEL_NAME`` for ``"llama"``: a 4-layer LLaMA (hidden 64) with a
        384-token tokenizer; ``default-t5-v1`` (2+2 blocks, d_model 64) and ``default-bert-v1``
        (4 layers, hidden 64, a ``[MASK]`` token added) likewise.
    """
    _check_arch(arch)
    name = _BUNDLED[arch][1]
    target = cache_dir() / name
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _build_random(tmp, arch)
        try:
            os.rename(tmp, target)  # atomic: readers see no directory or a complete one
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
