"""``hf-pipeline generate``: pipelined generation; rank 0 prints the continuations (or one JSON line)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from ..errors import CLIError
from .arguments import load_config, load_kwargs, load_tokenizer, model_path

__all__ = ["cmd_generate"]

_EXAMPLE_PROMPTS = ["Return the", "This module provides", "If the file does not exist,"]
_SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "repetition_penalty")


def _prompts_from_file(name: str) -> list[str]:
    """``--prompts-file``: its non-blank lines; a folder, a binary file or a file without a prompt is a mistake."""
    path = pathlib.Path(name)
    if not path.is_file():
        raise CLIError(f"--prompts-file {name} is not a file; pass a text file with one prompt per line")
    text: str | None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = None  # a binary file
    except OSError as e:
        raise CLIError(f"--prompts-file {name} cannot be read ({e.strerror}); pass a readable text file") from e
    if text is None or "\0" in text:
        raise CLIError(f"--prompts-file {name} is not UTF-8 text; pass a text file with one prompt per line")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CLIError(f"--prompts-file {name} has no prompts (it is empty or blank); write one prompt per line")
    return prompts


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        prompts += _prompts_from_file(args.prompts_file)
    return prompts or list(_EXAMPLE_PROMPTS)


def _generate_kwargs(args, tok) -> dict[str, Any]:
    gen: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "pad_token_id": tok.pad_token_id,
    }
    for key in _SAMPLING_OPTIONS:
        if getattr(args, key) is not None:
            gen[key] = getattr(args, key)
    return gen


def _print_results(args, model, path: str, prompts: list[str], texts: list[str], ids, stats, seq2seq: bool) -> None:
    if args.json:
        print(json.dumps({
            "ids": ids.tolist(), "texts": texts, "new_tokens": stats.new_tokens, "seconds": stats.seconds,
            "tokens_per_s": stats.tokens_per_s, "world_size": model.ctx.world_size,
            "num_stages": model.plan.num_stages, "model": args.model or str(path),
        }))
        return
    if not args.quiet:
        print(model.plan)
    for prompt, text in zip(prompts, texts):
        print(f"> {prompt} -> {text}" if seq2seq else f"> {prompt}{text}")
    print(f"{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s "
          f"({model.ctx.world_size} process(es), {model.plan.num_stages} stages)")


def cmd_generate(args) -> int:
    """``hf-pipeline generate``: pipelined generation; rank 0 prints the text (or JSON)."""
    import torch

    import hf_pipeline

    path = model_path(args)
    seq2seq = bool(load_config(path).is_encoder_decoder)
    auto = hf_pipeline.AutoModelForSeq2SeqLM if seq2seq else hf_pipeline.AutoModelForCausalLM
    prompts = _read_prompts(args)
    tok = load_tokenizer(path)
    if not seq2seq:
        tok.padding_side = "left"  # decoder-only prompts are left padded, as transformers' generate expects
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = auto.from_pretrained(path, pipeline=True, progress=False, **load_kwargs(args))
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids, stats = model.generate(**enc, **_generate_kwargs(args, tok), seed=args.seed, return_stats=True)
    if model.ctx.is_main_process:
        new = ids if seq2seq else ids[:, enc["input_ids"].shape[1]:]
        texts = tok.batch_decode(new, skip_special_tokens=True)
        _print_results(args, model, path, prompts, texts, ids, stats, seq2seq)
    return 0
