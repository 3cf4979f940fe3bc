"""Pipelined text generation: prompts from the command line or a file, text and tokens/s on rank 0.

    torchrun --nproc_per_node 2 scripts/generate.py --prompt "The pipeline" --max-new-tokens 32
    accelerate launch --multi_gpu --num_processes 2 scripts/generate.py --prompts-file prompts.txt
    torchrun --nproc_per_node 2 scripts/generate.py --model /path/to/llama --do-sample --top-p 0.9 --seed 0
    python scripts/generate.py --prompt "Hello"          # one process: every stage local

Without ``--model`` it uses the default model (``hf_pipeline.tools.default_model.default_model_path()``: the
small LLaMA bundled with the package, trained on the Python standard library's docstrings; a
random-weights stand-in is built in the cache only if the bundled files are missing). Every
rank loads only its stages; ``model.generate`` is collective and returns the same ids everywhere;
rank 0 prints each prompt's continuation and the throughput. ``--stream`` (one prompt) prints
tokens as they come, from the last stage's rank, which picks them. ``--json`` prints one JSON
line (ids, texts, tokens/s) instead, for tools and tests.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import transformers

import hf_pipeline

DEFAULT_PROMPTS = ["The pipeline", "A model is split into stages", "def generate(model, prompts"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or cached hub id (default: the built-in small LLaMA)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same tokens at every world size)")
    p.add_argument("--n-microbatches", type=int, default=None,
                   help="microbatches in flight (default: number of stages)")
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per rank")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the checkpoint's)")
    p.add_argument("--device", default=None, help="force a device type, e.g. cpu")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated (one prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON line on rank 0 instead of text")
    return p.parse_args(argv)


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        lines = pathlib.Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    return prompts or list(DEFAULT_PROMPTS)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.model is None:
        from hf_pipeline.tools.default_model import default_model_path

        path = str(default_model_path())
    else:
        from hf_pipeline.loading.checkpoint_files import resolve_checkpoint

        # A hub id from the local cache, no network; transformers reads the directory.
        path = str(resolve_checkpoint(args.model))
    prompts = _prompts(args)
    if args.stream and len(prompts) != 1:
        raise SystemExit("--stream prints one sequence: pass exactly one prompt")

    load = {"dtype": args.dtype}
    if args.virtual_stages is not None:
        load["virtual_stages"] = args.virtual_stages
    if args.device is not None:
        load["device"] = args.device
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **load)
    ctx = model.ctx
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # decoder-only batches are left padded, as transformers' generate expects
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)

    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "pad_token_id": tok.pad_token_id}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if getattr(args, key) is not None:
            gen[key] = getattr(args, key)
    streamer = transformers.TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    ids, stats = model.generate(
        **enc, **gen, seed=args.seed, n_microbatches=args.n_microbatches, streamer=streamer, return_stats=True
    )
    if ctx.is_main_process:
        start = enc["input_ids"].shape[1]
        texts = tok.batch_decode(ids[:, start:], skip_special_tokens=True)
        if args.json:
            print(json.dumps({
                "ids": ids.tolist(), "texts": texts, "new_tokens": stats.new_tokens, "seconds": stats.seconds,
                "tokens_per_s": stats.tokens_per_s, "world_size": ctx.world_size, "num_stages": model.plan.num_stages,
                "n_microbatches": stats.n_microbatches,
            }))
        else:
            print(model.plan)
            for prompt, text in zip(prompts, texts):
                print(f"> {prompt!r} -> {text!r}")
            print(
                f"{stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s "
                f"({ctx.world_size} process(es), {model.plan.num_stages} stages, {stats.n_microbatches} microbatches)"
            )
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        from hf_pipeline.distributed.context import destroy_distributed

        destroy_distributed()  # leave no process group behind for the interpreter's exit to trip over
    sys.exit(code)
