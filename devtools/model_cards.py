"""The model cards (README.md) of the bundled models :mod:`devtools.make_default_model` writes.

One function per architecture fills the parts that differ (what the model is, its data, usage
and samples); :func:`model_card` puts them into the shared card with the run's figures.
"""

from __future__ import annotations

import argparse
import math
import platform

__all__ = ["model_card"]


def _stdlib_text(stats: dict) -> str:
    return (f"the `.py` files of the Python {stats.get('python', platform.python_version())} standard library (tests, "
            "idlelib, lib2to3, turtledemo and ensurepip excluded), read with `ast`")


def _card_llama(stats: dict, cfg, a: argparse.Namespace) -> dict[str, str]:
    samples = "\n".join(f"| `{p}` | `{' '.join(t.split())}` |" for p, t in stats["samples"].items())
    return {
        "tag": "text-generation", "name": "default model", "path_arg": "",
        "what": f"""A {stats['params'] / 1e6:.1f}M-parameter LLaMA-architecture causal LM, the model\
 `hf-pipeline generate`,
`scripts/generate.py`, `scripts/quickstart.py` and the notebooks use when no model is given. It writes
short docstring-like English; it is a demonstration model, not a useful assistant.""",
        "usage": """tok = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForCausalLM.from_pretrained(path)
print(tok.decode(model.generate(**tok("Return the", return_tensors="pt"), max_new_tokens=20)[0]))""",
        "after_usage": '\nPipelined over 2 processes: `hf-pipeline generate --num-processes 2 "Return the"`.\n',
        "data": f"""every module, class and function docstring longer than 40 characters in
  {_stdlib_text(stats)}: {stats['docs']} docstrings, {stats['chars']:,} characters,
  {stats['tokens']:,} tokens; joined with `</s>`, cut into sequences of {a.seq} tokens and shuffled
  (seed {a.seed}); 2% ({stats['eval_rows']} sequences) held out.""",
        "tokenizer": f"""byte-level BPE trained on the same text with `tokenizers`, {cfg.vocab_size} tokens
  (specials `<pad>`, `<s>`, `</s>`, `<unk>`).""",
        "model": f"""`LlamaForCausalLM`, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers,\
 {cfg.num_attention_heads}
  heads ({cfg.num_key_value_heads} key/value heads), MLP {cfg.intermediate_size}, untied embeddings, fp32.""",
        "tokens": f"{a.steps} steps of {a.batch} x {a.seq} tokens ({a.steps * a.batch * a.seq:,} tokens)",
        "loss": "training loss", "perplexity": True,
        "samples": f"""Greedy continuations (24 new tokens):

| prompt | continuation |
|---|---|
{samples}""",
    }


def _card_t5(stats: dict, cfg, a: argparse.Namespace) -> dict[str, str]:
    rows = "\n".join(
        f"| {s[len('summarize: '):][:70].replace('|', '/')}... | {v['reference'].replace('|', '/')} | "
        f"{v['summary'].replace('|', '/')} |"
        for s, v in stats["samples"].items()
    )
    return {
        "tag": "summarization", "name": "T5 model", "path_arg": '"t5"',
        "what": f"""A {stats['params'] / 1e6:.1f}M-parameter T5 (`T5ForConditionalGeneration`) that writes\
 the one-sentence summary
of a docstring: given `"summarize: " + docstring` it returns the docstring's first sentence (an
extractive summary). Notebook 03 (T5 seq2seq, pipelined) fine-tunes and generates with it. It is a
demonstration model: it has only ever seen Python docstrings.""",
        "usage": """tok = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
enc = tok("summarize: Return the number of items in the queue. The count is approximate.", return_tensors="pt")
print(tok.decode(model.generate(**enc, max_new_tokens=32)[0], skip_special_tokens=True))""",
        "after_usage": "",
        "data": f"""the docstrings longer than 40 characters in {_stdlib_text(stats)}
  ({stats['docs']} docstrings). A summary sentence ends with a period, has 3 to 20 words, lies in one
  paragraph and has more text after it; every one gives a pair: input `"summarize: "` + the docstring
  from that sentence on (whitespace joined, truncated to {a.seq} tokens), target the sentence (at most
  {a.target_seq} tokens). From the first sentence that is the summary task itself (*docstring -> its
  first sentence*); the later starts make {stats['train_rows'] + stats['eval_rows']:,} pairs in all, so
  the model learns to copy the summary out of its input rather than to remember docstrings. 2% of the
  pairs ({stats['eval_rows']}), whole docstrings with every pair made from them, are held out (seed {a.seed}).""",
        "tokenizer": f"""byte-level BPE trained on the docstrings with `tokenizers`, {cfg.vocab_size} tokens
  (specials `<pad>`, `<s>`, `</s>`, `<unk>`); every encoding ends with `</s>`, as T5's do; `<pad>` starts the\
 decoder.""",
        "model": f"""`T5ForConditionalGeneration`, d_model {cfg.d_model}, {cfg.num_layers} encoder and\
 {cfg.num_decoder_layers}
  decoder blocks, {cfg.num_heads} heads of {cfg.d_kv}, feed-forward {cfg.d_ff} (ReLU), tied embeddings, no\
 dropout, fp32.""",
        "tokens": f"{a.steps} steps of {a.batch} pairs ({a.steps * a.batch:,} pairs, about "
                  f"{a.steps * a.batch / max(1, stats['train_rows']):.0f} epochs)",
        "loss": "training loss (token cross-entropy of the summary)", "perplexity": False,
        "samples": f"""Greedy summaries of held-out docstrings (32 new tokens at most):

| docstring | first sentence | model |
|---|---|---|
{rows}""",
    }


def _card_bert(stats: dict, cfg, a: argparse.Namespace) -> dict[str, str]:
    rows = "\n".join(f"| `{p}` | {', '.join(f'`{w}`' for w in top)} |" for p, top in stats["samples"].items())
    return {
        "tag": "fill-mask", "name": "BERT model", "path_arg": '"bert"',
        "what": f"""A {stats['params'] / 1e6:.1f}M-parameter BERT masked LM (`BertForMaskedLM`) trained on\
 Python docstrings: it fills
`[MASK]` in docstring-like English (the table below has its top 5 for a few sentences). Notebook 04
(BERT embeddings and fill-mask, pipelined) uses it. It is a demonstration model.""",
        "usage": """fill = transformers.pipeline("fill-mask", model=str(path))
print([r["token_str"] for r in fill("Return the [MASK] of the file.")])""",
        "after_usage": "",
        "data": f"""the paragraphs (split at blank lines) longer than 40 characters of every module, class and function
  docstring in {_stdlib_text(stats)} ({stats['docs']} docstrings): {stats['tokens']:,} tokens, packed as BERT's
  pre-training data is (paragraphs joined with `[SEP]`, rows of `[CLS]` + {a.seq - 1} tokens, no padding); shuffled
  (seed {a.seed}), 2% ({stats['eval_rows']} rows) held out. 15% of the tokens are chosen for prediction with
  transformers' `DataCollatorForLanguageModeling` (80% of them `[MASK]`, 10% a random token, 10% unchanged),
  seeded per step (the held-out rows with seeds training never used).""",
        "tokenizer": f"""lower-cased WordPiece trained on the paragraphs with `tokenizers`, {cfg.vocab_size}\
 tokens (specials
  `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`); encodings are `[CLS] ... [SEP]`.""",
        "model": f"""`BertForMaskedLM`, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers,\
 {cfg.num_attention_heads} heads,
  MLP {cfg.intermediate_size}, {cfg.max_position_embeddings} positions, tied input and output embeddings, no\
 dropout, fp32.""",
        "tokens": f"{a.steps} steps of {a.batch} x {a.seq} tokens ({a.steps * a.batch * a.seq:,} tokens, about "
                  f"{a.steps * a.batch / max(1, stats['train_rows']):.0f} epochs)",
        "loss": "training loss (cross-entropy of the chosen tokens)", "perplexity": True,
        "samples": f"""Top 5 for `[MASK]`:

| text | top 5 |
|---|---|
{rows}""",
    }


_CARDS = {"llama": _card_llama, "t5": _card_t5, "bert": _card_bert}


def model_card(stats: dict, cfg, *, auto_class: str) -> str:
    """The model card (README.md) from the run's ``training_stats.json`` values and the model config.

    Args:
        stats: the run's ``training_stats.json`` values (``args`` among them).
        cfg: the model's config.
        auto_class: the transformers Auto class that loads it (``AutoModelForCausalLM``, ...).
    """
    a = argparse.Namespace(**stats["args"])
    arch = getattr(a, "arch", "llama")
    c = _CARDS[arch](stats, cfg, a)
    load = stats.get("load_average")
    busy = stats.get("machine_note", "")
    if load:
        busy = f" (load average {load[0]:g} at the start, {load[3]:g} at the end)"
    ppl = f" (perplexity {math.exp(stats['eval_loss']):.1f})" if c["perplexity"] else ""
    return f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: {c['tag']}
tags: [{cfg.model_type}, hf_pipeline, tiny]
---

# hf_pipeline {c['name']}

{c['what']}

```python
import transformers
from hf_pipeline.tools.default_model import default_model_path

path = default_model_path({c['path_arg']})
{c['usage']}
```
{c['after_usage']}
## How it was made

```bash
{stats['command']}
```

- **Data**: {c['data']}
- **Tokenizer**: {c['tokenizer']}
- **Model**: {c['model']}
- **Training**: hf_pipeline's pipelined trainer (`model.train_step`), schedule `{a.schedule}` with
  {a.virtual_stages} stages per rank on {stats['world_size']} CPU processes ({stats['num_stages']} stages,
  {a.n_microbatches} microbatches); AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate
  {a.lr:g}, {a.warmup} warmup steps then cosine decay to a tenth; gradient clipping at 1.0;
  {c['tokens']};
  {stats['train_s']:.0f} s of training on a 2-core CPU{busy}.
- **Result**: final {c['loss']} **{stats['final_train_loss']:.3f}** (mean of the last {stats['last_steps']} steps),
  held-out loss **{stats['eval_loss']:.3f}**{ppl}.

{c['samples']}

Saved by `model.save_pretrained` (each rank wrote its own stages' tensors) as sharded safetensors
with an index; it loads with plain `transformers.{auto_class}.from_pretrained(path)` too.
`training_stats.json` holds the numbers above. The training text is from CPython and is under the
Python Software Foundation License.
"""
