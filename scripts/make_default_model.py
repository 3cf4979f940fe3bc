"""Train the bundled default model: a small LLaMA on the Python standard library's docstrings.

    torchrun --nproc_per_node 2 scripts/make_default_model.py --out hf_pipeline/default_model

Everything it needs ships with Python and this package: the text is every module, class and function
docstring of the standard library's ``.py`` files (read with ``ast``, nothing imported), the
tokenizer is a byte-level BPE trained on that text with ``tokenizers``, and the model is trained
with this package's own pipelined trainer (``model.train_step``, interleaved 1F1B over the launched
ranks, 2 stages per rank) and written with ``model.save_pretrained`` as sharded safetensors. Rank 0
then writes the tokenizer and a model card (``README.md``) with the command, the data, the
configuration and the measured losses, so anyone can reproduce it. The output directory is
replaced atomically; nothing else is touched.

Run with ``--steps 3 --tiny`` for a smoke test (seconds).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
import tempfile
import time

try:
    import hf_pipeline
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import hf_pipeline

import torch
import transformers

from hf_pipeline.dist import destroy_distributed, init_distributed

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# Tests, demos and vendored tools are code-heavy or duplicated; the rest of the stdlib is the corpus.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}
SAMPLE_PROMPTS = ["Return the", "This module provides", "If the file does not exist,", "The default value is"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (global batch)")
    p.add_argument("--n-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="interleaved-1f1b")
    p.add_argument("--virtual-stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="4MB", help="shard size of the saved checkpoint")
    p.add_argument("--tiny", action="store_true", help="tiny model and corpus, for smoke tests")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- data
def stdlib_docstrings(limit: int | None = None) -> list[str]:
    """Every module, class and function docstring (> 40 characters) of the stdlib's ``.py`` files.

    Files are read in sorted path order and parsed with ``ast`` (nothing is imported), so the
    result depends only on the Python version.

    Args:
        limit: stop after this many files (for smoke tests).

    Returns:
        The docstrings, cleaned by ``ast.get_docstring`` (indentation removed).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    docs: list[str] = []
    for path in files[:limit]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are deliberately invalid (bad encodings, py2 syntax)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte encodable, so no unknown tokens) trained on ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tk.train_from_iterator(docs, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=512, clean_up_tokenization_spaces=False,
    )


def pack(docs: list[str], tok, seq: int) -> torch.Tensor:
    """Tokenize ``docs``, join them with EOS and cut the stream into rows of ``seq`` tokens. (N, seq)"""
    ids: list[int] = []
    # The backend tokenizer directly: documents longer than model_max_length are fine here.
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [tok.eos_token_id]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq], dtype=torch.long).view(n, seq)  # (N, seq)


def _config(args: argparse.Namespace, tok) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-5, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, dtype="float32",
    )


def _prepare(args: argparse.Namespace, work: pathlib.Path) -> dict:
    """Rank 0: corpus, tokenizer, packed data and the randomly initialised checkpoint in ``work``."""
    start = time.perf_counter()
    docs = stdlib_docstrings(limit=40 if args.tiny else None)
    tok = train_tokenizer(docs, args.vocab_size)
    data = pack(docs, tok, args.seq)
    g = torch.Generator().manual_seed(args.seed)
    data = data[torch.randperm(len(data), generator=g)]
    n_eval = max(args.batch, len(data) // 50)  # 2% held out, at least one batch
    torch.save({"train": data[n_eval:], "eval": data[:n_eval]}, work / "data.pt")
    tok.save_pretrained(work / "tokenizer")
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(_config(args, tok))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(work / "init")
    return {
        "docs": len(docs), "chars": sum(len(d) for d in docs), "tokens": int(data.numel()), "train_rows": len(data) - n_eval,
        "eval_rows": n_eval, "prepare_s": time.perf_counter() - start,
    }


def _lr(step: int, args: argparse.Namespace) -> float:
    # Linear warmup, then cosine decay to a tenth of the peak.
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def _eval_loss(model, rows: torch.Tensor, batch: int) -> float:
    """Mean token loss over ``rows`` (pipelined forward with labels), same value on every rank."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows) - batch + 1, batch):
        x = rows[i : i + batch]
        out = model(input_ids=x, labels=x)
        total += float(out.loss) * x.shape[0]
        count += x.shape[0]
    model.train()
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    """Train and write the default model; see the module docstring."""
    args = _parse(argv)
    if args.tiny:
        args.vocab_size, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads = 320, 32, 4, 64, 4, 2
        args.seq, args.batch = 32, 8
    ctx = init_distributed(device="cpu")
    out = pathlib.Path(args.out).resolve()
    # One work directory for every rank: rank 0 makes it and tells the others where it is.
    work_box = [tempfile.mkdtemp(prefix=".make-default-", dir=out.parent) if ctx.is_main_process else None]
    if ctx.is_distributed:
        torch.distributed.broadcast_object_list(work_box, src=0)
    work = pathlib.Path(work_box[0])
    try:
        info = [_prepare(args, work) if ctx.is_main_process else None]
        if ctx.is_distributed:
            torch.distributed.broadcast_object_list(info, src=0)
        info = info[0]
        data = torch.load(work / "data.pt")
        tok = transformers.AutoTokenizer.from_pretrained(work / "tokenizer")

        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
            work / "init", pipeline=True, schedule=args.schedule, virtual_stages=args.virtual_stages,
            n_microbatches=args.n_microbatches, device="cpu", dtype=torch.float32, progress=False,
        )
        model.train()
        if ctx.is_main_process:
            print(model.plan, flush=True)
            print(f"corpus: {info['docs']} docstrings, {info['chars']} characters, {info['tokens']} tokens", flush=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        g = torch.Generator().manual_seed(args.seed + 1)  # same batches on every rank
        train = data["train"]
        start = time.perf_counter()
        load_start = os.getloadavg()  # the machine may be shared: the card says how busy it was
        recent: list[float] = []
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = _lr(step, args)
            rows = train[torch.randint(len(train), (args.batch,), generator=g)]  # (B, seq)
            loss = model.train_step({"input_ids": rows, "labels": rows})
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            recent = (recent + [float(loss)])[-20:]
            if ctx.is_main_process and (step % 25 == 0 or step == args.steps - 1):
                elapsed = time.perf_counter() - start
                print(f"step {step:4d}  loss {float(loss):.3f}  lr {_lr(step, args):.2e}  {elapsed:6.0f} s", flush=True)
        train_s = time.perf_counter() - start
        final_train = sum(recent) / len(recent)
        eval_loss = _eval_loss(model, data["eval"], args.batch)

        prompts = SAMPLE_PROMPTS
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True)
        model.eval()
        ids = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        samples = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)

        staged = work / "model"
        model.save_pretrained(staged, max_shard_size=args.max_shard_size, tokenizer=tok)
        ctx.barrier()
        if ctx.is_main_process:
            # A published model needs no resume state: save_pretrained's RNG / trainer files are dropped.
            shutil.rmtree(staged / "rng", ignore_errors=True)
            (staged / "trainer_state.json").unlink(missing_ok=True)
            for f in staged.iterdir():
                f.chmod(0o644)
            stats = {
                **info, "steps": args.steps, "train_s": round(train_s, 1), "final_train_loss": round(final_train, 4),
                "eval_loss": round(eval_loss, 4), "python": platform.python_version(), "last_steps": len(recent), "world_size": ctx.world_size, "samples": dict(zip(prompts, samples)),
                "params": sum(s.params for s in model.plan.stages), "num_stages": model.plan.num_stages,
                "load_average": [round(x, 1) for x in load_start + os.getloadavg()],
                "command": _command(ctx.world_size, argv), "args": vars(args),
            }
            (staged / "README.md").write_text(model_card(stats, model.config), encoding="utf-8")
            (staged / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
            # Atomic replace: the old directory is moved aside, the new one renamed in, the old removed.
            old = work / "previous"
            if out.exists():
                os.rename(out, old)
            os.rename(staged, out)
            print(f"final train loss {final_train:.3f} (mean of the last {len(recent)} steps), eval loss {eval_loss:.3f} "
                  f"(perplexity {math.exp(eval_loss):.1f}), {train_s:.0f} s of training; wrote {out}")
            for prompt, text in zip(prompts, samples):
                print(f"  {prompt!r} -> {text!r}")
        ctx.barrier()
    finally:
        if ctx.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _command(world_size: int, argv: list[str] | None) -> str:
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return f"torchrun --nproc_per_node {world_size} scripts/make_default_model.py {args}"


def model_card(stats: dict, cfg) -> str:
    """The model card (README.md) from the run's ``training_stats.json`` values and the model config."""
    a = argparse.Namespace(**stats["args"])
    load = stats.get("load_average")
    busy = f" (load average {load[0]:g} at the start, {load[3]:g} at the end)" if load else stats.get("machine_note", "")
    samples = "\n".join(f"| `{p}` | `{' '.join(t.split())}` |" for p, t in stats["samples"].items())
    return f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, hf_pipeline, tiny]
---

# hf_pipeline default model

A {stats['params'] / 1e6:.1f}M-parameter LLaMA-architecture causal LM, the model `hf-pipeline generate`,
`scripts/generate.py`, `scripts/quickstart.py` and the notebooks use when no model is given. It writes
short docstring-like English; it is a demonstration model, not a useful assistant.

```python
import transformers
from hf_pipeline.default_model import default_model_path

path = default_model_path()
tok = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForCausalLM.from_pretrained(path)
print(tok.decode(model.generate(**tok("Return the", return_tensors="pt"), max_new_tokens=20)[0]))
```

Pipelined over 2 processes: `hf-pipeline generate --num-processes 2 "Return the"`.

## How it was made

```bash
{stats['command']}
```

- **Data**: every module, class and function docstring longer than 40 characters in the `.py` files of
  the Python {stats.get('python', platform.python_version())} standard library (tests, idlelib, lib2to3,
  turtledemo and ensurepip excluded), read with `ast`: {stats['docs']} docstrings, {stats['chars']:,} characters,
  {stats['tokens']:,} tokens; joined with `</s>`, cut into sequences of {a.seq} tokens and shuffled
  (seed {a.seed}); 2% ({stats['eval_rows']} sequences) held out.
- **Tokenizer**: byte-level BPE trained on the same text with `tokenizers`, {cfg.vocab_size} tokens
  (specials `<pad>`, `<s>`, `</s>`, `<unk>`).
- **Model**: `LlamaForCausalLM`, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}
  heads ({cfg.num_key_value_heads} key/value heads), MLP {cfg.intermediate_size}, untied embeddings, fp32.
- **Training**: hf_pipeline's pipelined trainer (`model.train_step`), schedule `{a.schedule}` with
  {a.virtual_stages} stages per rank on {stats['world_size']} CPU processes ({stats['num_stages']} stages,
  {a.n_microbatches} microbatches); AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate
  {a.lr:g}, {a.warmup} warmup steps then cosine decay to a tenth; gradient clipping at 1.0;
  {a.steps} steps of {a.batch} x {a.seq} tokens ({a.steps * a.batch * a.seq:,} tokens);
  {stats['train_s']:.0f} s of training on a 2-core CPU{busy}.
- **Result**: final training loss **{stats['final_train_loss']:.3f}** (mean of the last {stats['last_steps']} steps),
  held-out loss **{stats['eval_loss']:.3f}** (perplexity {math.exp(stats['eval_loss']):.1f}).

Greedy continuations (24 new tokens):

| prompt | continuation |
|---|---|
{samples}

Saved by `model.save_pretrained` (each rank wrote its own stages' tensors) as sharded safetensors
with an index; it loads with plain `transformers.AutoModelForCausalLM.from_pretrained(path)` too.
`training_stats.json` holds the numbers above. The training text is from CPython and is under the
Python Software Foundation License.
"""


if __name__ == "__main__":
    try:
        code = main()
    finally:
        destroy_distributed()
    sys.exit(code)
