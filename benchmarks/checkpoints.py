"""The random checkpoints a run loads, trains and generates from: written once, then reused from a cache."""

from __future__ import annotations

import json
import os
import pathlib
import time

from benchmarks.config import Sizes
from devtools.llama import llama_config
from hf_pipeline.loading.key_conversions import saved_shapes

__all__ = ["cache_dir", "checkpoints", "decode_heavy_checkpoint", "write_random_checkpoint"]


def _shards(entries, itemsize: int, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``entries`` (name, shape) in order, cut into shards of at most ``shard_bytes`` (a bigger tensor: alone)."""
    import torch

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = itemsize * (1 if not shape else int(torch.Size(shape).numel()))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_random_checkpoint(directory: pathlib.Path, config, *, shard_bytes: int, seed: int = 0) -> pathlib.Path:
    """A sharded safetensors checkpoint of ``config`` with random weights, written tensor by tensor.

    Nothing close to the model's size is ever in memory: parameter names and shapes come from the
    model on the meta device, each shard's tensors are drawn, written and dropped. The layout is
    what ``save_pretrained(max_shard_size=...)`` writes (shards + index + config.json), and a
    ``.complete`` marker makes the directory a cache: an existing complete directory is reused.

    Args:
        directory: where to write (created); returned as is when already complete.
        config: a causal-LM config (its ``dtype`` is the weights' dtype).
        shard_bytes: the most bytes of tensors per shard file.
        seed: the weights' random seed.

    Returns:
        ``directory``.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    directory = pathlib.Path(directory)
    if (directory / ".complete").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    with torch.device("meta"):  # names and shapes only: no memory, no initialisation
        meta = transformers.AutoModelForCausalLM.from_config(config)
    # The keys and shapes transformers' save_pretrained writes (a mixture of experts: one tensor per expert).
    entries = list(saved_shapes(meta, list(meta.state_dict()), None).items())
    shards = _shards(entries, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    (directory / ".complete").write_text("ok\n")
    return directory


def cache_dir(args) -> pathlib.Path:
    """``--cache-dir``, else ``$XDG_CACHE_HOME/hf_pipeline/bench`` (``~/.cache`` without it)."""
    if args.cache_dir:
        return pathlib.Path(args.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "hf_pipeline" / "bench"


def _load_config(sizes: Sizes):
    return llama_config(
        hidden=sizes.load_hidden, intermediate=sizes.load_intermediate, layers=sizes.load_layers,
        heads=sizes.load_heads, kv_heads=sizes.load_kv_heads, vocab=sizes.load_vocab, max_pos=256, dtype="bfloat16",
    )


def checkpoints(args, sizes: Sizes) -> dict[str, str]:
    """The run's checkpoints, written where missing: ``load`` (the >= 1 GB one), ``warmup`` (its tiny twin,
    loaded first so lazy imports are not timed), ``train`` (the train/generate model, fp32); and
    ``load_seconds``, the time the load checkpoint took to be ready."""
    root = cache_dir(args)
    quick = Sizes.quick()
    warmup = write_random_checkpoint(root / "warmup", _load_config(quick), shard_bytes=quick.load_shard_bytes)
    tag = f"load-h{sizes.load_hidden}-l{sizes.load_layers}-v{sizes.load_vocab}-s{sizes.load_shard_bytes}"
    t = time.perf_counter()
    load = write_random_checkpoint(root / tag, _load_config(sizes), shard_bytes=sizes.load_shard_bytes)
    created = time.perf_counter() - t
    # Positions for the longest sequence any section runs (the checkpointing section's).
    max_pos = max(256, sizes.seq, sizes.prompt_len + sizes.new_tokens, sizes.ckpt_seq)
    train_cfg = llama_config(
        hidden=sizes.hidden, intermediate=sizes.intermediate, layers=sizes.layers, heads=sizes.heads,
        kv_heads=sizes.kv_heads, vocab=sizes.vocab, max_pos=max_pos, dtype="float32",
    )
    train_tag = f"train-h{sizes.hidden}-l{sizes.layers}-kv{sizes.kv_heads}-v{sizes.vocab}-p{max_pos}"
    train = write_random_checkpoint(root / train_tag, train_cfg, shard_bytes=16_000_000)
    moe_warmup = write_random_checkpoint(root / "moe-warmup", _moe_config(quick, max_pos), shard_bytes=1_000_000)
    moe_tag = f"moe-h{sizes.hidden}-l{sizes.layers}-e{sizes.moe_experts}-i{sizes.moe_intermediate}-p{max_pos}"
    moe = write_random_checkpoint(root / moe_tag, _moe_config(sizes, max_pos), shard_bytes=16_000_000)
    return {"load": str(load), "warmup": str(warmup), "train": str(train), "moe": str(moe),
            "moe_warmup": str(moe_warmup), "load_seconds": f"{created:.1f}"}


def decode_heavy_checkpoint(args, sizes: Sizes) -> pathlib.Path:
    """The serve-http section's decode-heavy model: a random fp32 LLaMA of ``heavy_*`` shape (hidden 1024, 24
    layers: its decode step costs several times a pipeline hop) with the bundled model's tokenizer, vocabulary
    and special tokens, so both servers tokenize the prompts alike; written once into the cache."""
    import shutil

    import transformers

    from hf_pipeline.tools.default_model import default_model_path

    tiny = default_model_path()
    vocab = transformers.AutoConfig.from_pretrained(tiny)
    tag = f"serve-heavy-h{sizes.heavy_hidden}-l{sizes.heavy_layers}-v{vocab.vocab_size}"
    cfg = llama_config(
        hidden=sizes.heavy_hidden, intermediate=sizes.heavy_intermediate, layers=sizes.heavy_layers,
        heads=sizes.heavy_heads, kv_heads=sizes.heavy_kv_heads, vocab=vocab.vocab_size,
        max_pos=vocab.max_position_embeddings, dtype="float32", pad_token_id=vocab.pad_token_id,
        bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id,
    )
    path = write_random_checkpoint(cache_dir(args) / tag, cfg, shard_bytes=200_000_000)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny / name).is_file() and not (path / name).is_file():
            shutil.copyfile(tiny / name, path / name)
    return path


def _moe_config(sizes: Sizes, max_pos: int):
    """A Mixtral of the train model's shape with ``moe_experts`` experts of ``moe_intermediate`` (top 2), fp32."""
    import transformers

    return transformers.MixtralConfig(
        hidden_size=sizes.hidden, intermediate_size=sizes.moe_intermediate, num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads, vocab_size=sizes.vocab,
        num_local_experts=sizes.moe_experts, num_experts_per_tok=2, max_position_embeddings=max_pos,
        dtype="float32", tie_word_embeddings=False,
    )
