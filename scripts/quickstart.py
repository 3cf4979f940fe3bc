"""Quick start: the default model pipelined across the launched processes, checked against transformers.

    torchrun --nproc_per_node 2 scripts/quickstart.py
    accelerate launch --multi_gpu --num_processes 2 scripts/quickstart.py      # the same, through accelerate
    python scripts/quickstart.py                                               # one process, all stages local

Every rank loads only its own stages from the sharded safetensors checkpoint, runs a pipelined
forward and a pipelined greedy generate, and compares both with plain transformers on one process.
Rank 0 prints the plan, the comparison and the generated text.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers

import hf_pipeline


def _default_path() -> str:
    from hf_pipeline.tools.default_model import default_model_path

    return str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or cached hub id (default: the bundled model)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    args = parser.parse_args(argv)

    path = args.model or _default_path()
    prompts = args.prompt or ["The function returns", "Return a new list of", "If the file does not exist,",
                              "This module provides"]
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, dtype=torch.float32)
    ctx = model.ctx
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)

    out = model(**enc)
    start = time.perf_counter()
    ids = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - start

    # The reference: plain transformers, whole model, one process.
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(**enc).logits
        want_ids = ref.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                pad_token_id=tok.pad_token_id)
    diff = (out.logits - want).abs().max().item()
    same_tokens = torch.equal(ids, want_ids)
    if ctx.is_main_process:
        print(model.plan)
        print(f"pipelined forward vs transformers on one process: max abs diff {diff:.2e}")
        print(f"pipelined greedy generate equals transformers generate: {same_tokens}")
        new = ids.shape[0] * args.max_new_tokens
        print(f"generated {new} tokens in {seconds:.2f} s ({new / seconds:.1f} tokens/s) on "
              f"{ctx.world_size} process(es)")
        for text in tok.batch_decode(ids, skip_special_tokens=True):
            print("  >", text.replace("\n", " "))
    ok = diff <= 1e-4 and same_tokens
    if not ok and ctx.is_main_process:
        print("MISMATCH between the pipelined model and transformers", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
