"""Tiny models and real sharded checkpoints for tests (no hub: configs are built here).

``make_checkpoint(tmp_path, "llama")`` writes ``save_pretrained(max_shard_size=...)`` output with at
least 3 safetensors shards and an index, and returns the directory; the same seed always gives the
same weights, so a test's reference model is ``AUTO[arch].from_pretrained(path)``.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
import transformers

__all__ = [
    "ARCHS",
    "AUTO",
    "WORDS",
    "config_for",
    "edit_checkpoint",
    "make_batch",
    "make_checkpoint",
    "padded_rows",
    "reference",
    "sample_inputs",
    "save_pytorch_checkpoint",
    "sliding_config",
    "tensors_by_key",
    "text_file",
    "word_tokenizer",
]

ARCHS = ("llama", "gpt2", "bert", "t5")

# Auto class each arch is tested with (others are covered by their own tests).
AUTO = {
    "llama": "AutoModelForCausalLM",
    "gpt2": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "t5": "AutoModelForSeq2SeqLM",
    "mistral": "AutoModelForCausalLM",
}

VOCAB = 96


def config_for(arch: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny config (4 blocks; T5: 3 encoder + 3 decoder blocks) whose tokens ids fit VOCAB."""
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            **common,
        )
    elif arch == "llama-tied":
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            **common,
        )
    elif arch == "mistral":
        cfg = transformers.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            sliding_window=None,
            **common,
        )
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **common,
        )
    elif arch == "qwen3":  # no built-in recipe: tests register one (LLaMA-shaped, q/k norms inside attention)
        cfg = transformers.Qwen3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            **common,
        )
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=128, **common)
    elif arch == "bert":
        cfg = transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
            vocab_size=VOCAB,
            pad_token_id=0,
        )
    elif arch == "t5":
        cfg = transformers.T5Config(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            vocab_size=VOCAB,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        )
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_checkpoint(
    directory: str | pathlib.Path, arch: str, *, auto: str | None = None, seed: int = 0, shards: int = 3, **overrides
) -> pathlib.Path:
    """Save a tiny randomly initialised ``arch`` model in >= ``shards`` safetensors shards."""
    directory = pathlib.Path(directory)
    torch.manual_seed(seed)
    model = getattr(transformers, auto or AUTO.get(arch.split("-")[0], "AutoModelForCausalLM")).from_config(
        config_for(arch, **overrides)
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # Leave room for the largest single tensor: a shard never splits one.
    biggest = max(p.numel() * p.element_size() for p in model.parameters())
    size = max(total // (shards + 1), biggest + 1)
    model.save_pretrained(directory, max_shard_size=f"{max(size // 1000, 1)}KB")
    index = directory / "model.safetensors.index.json"
    if shards > 1:
        n = len(set(json.loads(index.read_text())["weight_map"].values()))
        assert n >= shards, f"expected >= {shards} shards, got {n}"
    return directory


def reference(path, auto: str):
    """The single-process transformers model, fp32, eval mode."""
    return getattr(transformers, auto).from_pretrained(path, dtype=torch.float32).eval()


def sample_inputs(
    arch: str, batch: int = 4, seq: int = 9, *, seed: int = 1, pad_left: bool = True
) -> dict[str, torch.Tensor]:
    """Random ids with an attention mask that pads the first sequences (uneven lengths)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        pad = (b * 2) % max(seq - 2, 1)
        if pad:
            if pad_left:
                mask[b, :pad] = 0
                ids[b, :pad] = 0
            else:
                mask[b, seq - pad :] = 0
                ids[b, seq - pad :] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if arch == "t5":
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (batch, 5), generator=g)
    return inputs


def edit_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path, edit) -> pathlib.Path:
    """Copy a sharded safetensors checkpoint, rewriting each shard's tensors with ``edit(tensors, shard_number)``.

    ``edit`` returns the shard's new key -> tensor dict (keys may be added, dropped or renamed); the
    index follows. Used to imitate checkpoints saved by other transformers versions or classes.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for i, shard in enumerate(sorted(set(index["weight_map"].values()))):
        tensors = edit(load_file(dst / shard), i)
        save_file({k: v.contiguous() for k, v in tensors.items()}, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))
    return dst


def save_pytorch_checkpoint(model, directory: str | pathlib.Path, *, shards: int = 1) -> pathlib.Path:
    """Save ``model`` as an older transformers did: ``pytorch_model.bin`` (or ``shards`` .bin files and their index).

    transformers 5 writes safetensors even with ``safe_serialization=False``, so the state dict is
    written with ``torch.save`` here (tied tensors stay shared, as in old saves).
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return directory
    keys = list(state)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i * per : (i + 1) * per]}
        torch.save(part, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def make_batch(arch: str, rows: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """A padded training batch with labels whose real-token counts differ between microbatches.

    ``arch`` as for :func:`config_for`; a ``-cls`` suffix gives one class id per row (2 labels).
    """
    family = arch.split("-")[0]
    inputs = sample_inputs(family, batch=rows, seq=9, seed=seed, pad_left=family != "bert")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    g = torch.Generator().manual_seed(seed + 100)
    if arch.endswith("-cls"):  # sequence classification: one class id per row (2 labels)
        labels = torch.randint(0, 2, (rows,), generator=g)
    elif family == "bert":
        pick = (torch.rand(ids.shape, generator=g) < 0.3) & mask.bool()
        pick[:, 1] = True  # at least one masked token per row
        labels = ids.masked_fill(~pick, -100)
        inputs["input_ids"] = ids.masked_fill(pick, 4)  # the "[MASK]" id of the tiny vocab
    elif family == "t5":
        labels = inputs.pop("decoder_input_ids")
        for b in range(rows):
            if b % 3:
                labels[b, -(b % 3) :] = -100
    else:
        labels = ids.masked_fill(mask == 0, -100)
    inputs["labels"] = labels
    return inputs


WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree near "
    "the quiet river and children play with a red ball under the warm summer sun"
).split()


def text_file(path: pathlib.Path, lines: int = 60) -> pathlib.Path:
    """Write ``lines`` seeded lines of 6-15 words from :data:`WORDS` to ``path``; return it.

    Written to a file of this process's own and renamed into place: ranks of one test each write the same
    (seeded) text to a shared folder, and a plain ``write_text`` truncates the file under a rank reading it,
    which then trains its tokenizer on part of the text (a batch that differs across ranks).
    """
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(lines):
        n = int(torch.randint(6, 16, (1,), generator=g))
        rows.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)))
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text("\n".join(rows) + "\n")
    os.replace(part, path)
    return path


def word_tokenizer(text: pathlib.Path):
    """A word-level fast tokenizer trained on ``text``.

    At most VOCAB ids; pad/bos/eos are ids 0, 1, 2 as in the configs.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", "[MASK]"]  # ids 0, 1, 2 match tiny's pad/bos/eos
    tok.train([str(text)], trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=specials))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        mask_token="[MASK]",
    )


def sliding_config(
    arch: str, *, window: int = 5, layers: int = 6, full_layers: int = 3, **overrides
) -> transformers.PretrainedConfig:
    """A tiny LLaMA-family config with a ``window``-token sliding window, ``layers`` decoder layers.

    ``"mistral"``: every layer slides (``sliding_window``); ``"qwen2"``: layers ``0 .. full_layers - 1``
    full, the rest sliding (``use_sliding_window``, ``max_window_layers``: ``config.layer_types``).
    """
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        return transformers.MistralConfig(**{"sliding_window": window, **common, **overrides})
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **{
                "use_sliding_window": True,
                "sliding_window": window,
                "max_window_layers": full_layers,
                **common,
                **overrides,
            }
        )
    raise ValueError(f"sliding_config: {arch!r} is not 'mistral' or 'qwen2'")


def padded_rows(
    rows: int,
    seq: int,
    *,
    seed: int = 1,
    pad_left: bool = True,
    zero_rows: tuple[int, ...] = (),
    pad_id: int | None = 0,
) -> dict[str, torch.Tensor]:
    """Random ids and an attention mask: row ``b`` has ``b % seq`` pads, each of ``zero_rows`` is all padding.

    Pads are on the left (``pad_left``) or the right, with id ``pad_id`` (the configs' ``pad_token_id``),
    or, with ``pad_id=None``, the random ids stay under the padding, so only the mask hides them.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for b in range(rows):
        pad = seq if b in zero_rows else b % seq
        if pad and pad_left:
            mask[b, :pad] = 0
        elif pad:
            mask[b, seq - pad :] = 0
    return {"input_ids": ids if pad_id is None else ids.masked_fill(mask == 0, pad_id), "attention_mask": mask}


def tensors_by_key(model, tensors_of) -> dict[str, list[torch.Tensor]]:
    """Checkpoint key -> this rank's copies of ``tensors_of(parameter)`` (a gradient, the parameter), one per
    distinct Parameter object, so a tied tensor held once appears once and one held twice appears twice."""
    out: dict[str, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for stage in model.stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            if id(p) not in seen and tensors_of(p) is not None:
                seen.add(id(p))
                out.setdefault(model.param_layout.key_of.get(name, name), []).append(tensors_of(p).detach().clone())
    return out


def greedy_alone(ref, prompt_ids: list[int], max_new_tokens: int, *, stops=(2,), **generate_kwargs
                 ) -> tuple[list[int], bool]:
    """transformers' greedy tokens for one prompt on its own (no padding), cut as the serving engine cuts them: at
    the first of ``stops`` (the config's EOS 2, and a request's stop ids), which is dropped with what follows.
    An encoder-decoder's prompt is its encoder's input; its tokens follow the decoder's start token.

    Returns:
        (the tokens, whether a stop cut them).
    """
    with torch.no_grad():
        full = ref.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **generate_kwargs)
    full = full[0, 1 if ref.config.is_encoder_decoder else len(prompt_ids):].tolist()
    cut = next((k for k, t in enumerate(full) if t in set(stops)), None)
    return (full, False) if cut is None else (full[:cut], True)


def alone_choice(ref, req: dict) -> tuple[list[int], str]:
    """:func:`greedy_alone` of a serving request's fields (``prompt_ids``, ``max_new_tokens``, ``stop_token_ids``;
    EOS 2) as the engine reports a choice: (tokens, ``"stop"`` or ``"length"``)."""
    tokens, stopped = greedy_alone(ref, req["prompt_ids"], req["max_new_tokens"],
                                   stops={2} | set(req.get("stop_token_ids", ())))
    return tokens, "stop" if stopped else "length"


def serve_staggered(engine, requests: list[dict], first: int = 3) -> list:
    """Rank 0 of a serving test: serve ``requests`` (``CompletionRequest`` fields) from a client thread while this
    thread runs the engine until drained; the first ``first`` requests are submitted at once, the rest once the
    first has tokens (so they join while it decodes). Returns each request's choices."""
    import threading

    from hf_pipeline.serving import CompletionRequest

    out: list = []

    def client():
        reqs = [CompletionRequest(**r) for r in requests]
        handles = [engine.submit(r) for r in reqs[:first]]
        next(iter(handles[0]))  # the first request has tokens: the rest arrive while it decodes
        handles += [engine.submit(r) for r in reqs[first:]]
        out.extend(h.result(timeout=120) for h in handles)
        engine.drain()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    engine.serve_forever()
    thread.join(timeout=60)
    return out


def stopping_stream(ref, stream: list[tuple[int, int]], early: tuple[int, ...], seed: int = 5) -> list[dict]:
    """A serving test's requests (``CompletionRequest`` fields): seeded prompts of ``stream``'s (prompt length,
    max_new_tokens), the ``early`` ones given a stop id of their own greedy continuation under ``ref`` (their third
    token: they end there, or earlier where it came before)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [dict(prompt_ids=torch.randint(5, VOCAB, (n,), generator=g).tolist(), max_new_tokens=m)
            for n, m in stream]
    for k in early:
        full, _ = alone_choice(ref, reqs[k])
        reqs[k]["stop_token_ids"] = [full[2]]
    return reqs


def adapter_logits(peft_model, inputs: dict) -> dict[str, torch.Tensor]:
    """A peft model's logits on ``inputs`` with its adapter disabled (``base``), active (``unmerged``), merged into
    the base weights (``merged``) and unmerged again (``unmerged_again``); the model is left in eval mode."""
    peft_model.eval()
    out = {}
    with torch.no_grad():
        with peft_model.disable_adapter():
            out["base"] = peft_model(**inputs).logits
        out["unmerged"] = peft_model(**inputs).logits
        peft_model.merge_adapter()
        out["merged"] = peft_model(**inputs).logits
        peft_model.unmerge_adapter()
        out["unmerged_again"] = peft_model(**inputs).logits
    return out
