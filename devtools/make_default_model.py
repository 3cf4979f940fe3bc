"""Train a bundled model: a small LLaMA, T5 or BERT on the Python standard library's docstrings.

Run from the repository root:

    torchrun --nproc_per_node 2 -m devtools.make_default_model --out hf_pipeline/assets/default-model
    torchrun --nproc_per_node 2 -m devtools.make_default_model --arch t5 --out hf_pipeline/assets/default-t5
    torchrun --nproc_per_node 2 -m devtools.make_default_model --arch bert --out hf_pipeline/assets/default-bert

Everything it needs ships with Python and this package: the text is every module, class and function
docstring of the standard library's ``.py`` files (read with ``ast``, nothing imported), the
tokenizer is trained on that text with ``tokenizers``, and the model is trained with this package's
own pipelined trainer (``model.train_step``, interleaved 1F1B over the launched ranks, 2 stages per
rank) and written with ``model.save_pretrained`` as sharded safetensors. Rank 0 then writes the
tokenizer and a model card (``README.md``) with the command, the data, the configuration and the
measured losses, so anyone can reproduce it. The output directory is replaced atomically; nothing
else is touched.

``--arch`` picks the task (each architecture's pieces are one entry of ``ARCHS``):

- ``llama`` (default): causal LM on the docstrings packed into 128-token rows, byte-level BPE.
- ``t5``: extractive summaries, ``"summarize: " + docstring`` -> the docstring's first sentence, for
  docstrings of two sentences or more; byte-level BPE whose encodings end with ``</s>``.
- ``bert``: masked LM (15% of the tokens, as ``transformers.DataCollatorForLanguageModeling``) on the
  docstrings' paragraphs; a lower-cased WordPiece tokenizer with ``[MASK]``.

Run with ``--steps 3 --tiny`` for a smoke test (seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

import hf_pipeline
from devtools.collectives import broadcast_object
from devtools.docstring_corpus import BERT_SPECIALS, pack, paragraphs, stdlib_docstrings, summary_pairs, train_tokenizer
from devtools.llama import llama_config
from devtools.model_cards import model_card
from hf_pipeline.distributed.context import destroy_distributed, init_distributed

SAMPLE_PROMPTS = ["Return the", "This module provides", "If the file does not exist,", "The default value is"]
FILL_MASK_PROMPTS = ["Return the [MASK] of the file.", "Return a new [MASK] of the items.",
                     "If the file does not [MASK], raise an error.",
                     "This module provides [MASK] for working with sockets."]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="devtools.make_default_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="which model to train (default llama)")
    # None: the architecture's default, from ARCHS[arch].defaults.
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None, help="blocks (T5: in the encoder and in the decoder each)")
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None, help="LLaMA only")
    p.add_argument("--seq", type=int, default=None, help="tokens per training sequence (T5: of the input)")
    p.add_argument("--target-seq", type=int, default=None, help="T5 only: tokens per summary")
    p.add_argument("--batch", type=int, default=None, help="sequences per optimizer step (global batch)")
    p.add_argument("--n-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="interleaved-1f1b")
    p.add_argument("--virtual-stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default=None, help="shard size of the saved checkpoint")
    p.add_argument("--tiny", action="store_true", help="tiny model and corpus, for smoke tests")
    args = p.parse_args(argv)
    arch = ARCHS[args.arch]
    for key, value in {**arch.defaults, **(arch.tiny if args.tiny else {})}.items():
        if args.tiny and key in arch.tiny or getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------------------- data
def _t5_tokenizer(docs: list[str], args: argparse.Namespace) -> transformers.PreTrainedTokenizerFast:
    # T5's own tokenizers end every encoding with </s>: inputs and labels alike.
    from tokenizers import processors

    tok = train_tokenizer(docs, args.vocab_size)
    tok.model_max_length = args.seq  # truncation=True then cuts inputs where training did
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.eos_token_id)]
    )
    return tok


def _bert_tokenizer(docs: list[str], args: argparse.Namespace) -> transformers.PreTrainedTokenizerFast:
    """A lower-cased WordPiece tokenizer with BERT's specials and ``[CLS] ... [SEP]`` encodings."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.train_from_iterator(paragraphs(docs), trainer=trainers.WordPieceTrainer(
        vocab_size=args.vocab_size, special_tokens=BERT_SPECIALS, show_progress=False))
    cls, sep = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=args.seq, clean_up_tokenization_spaces=True,
    )


def _llama_tokenizer(docs: list[str], args: argparse.Namespace) -> transformers.PreTrainedTokenizerFast:
    from hf_pipeline.tools.default_model import CHAT_TEMPLATE

    tok = train_tokenizer(docs, args.vocab_size)
    tok.chat_template = CHAT_TEMPLATE  # the server's chat route works out of the box
    return tok


# Each *_rows returns (tensors with one row per example, the examples' texts or None).
def _llama_rows(docs, tok, args) -> tuple[dict[str, torch.Tensor], list | None]:
    return {"input_ids": pack(docs, tok, args.seq)}, None


def _t5_rows(docs, tok, args) -> tuple[dict[str, torch.Tensor], list | None]:
    pairs = summary_pairs(docs)
    enc = tok([s for s, *_ in pairs], padding="max_length", truncation=True, max_length=args.seq, return_tensors="pt")
    labels = tok([t for _, t, *_ in pairs], padding="max_length", truncation=True, max_length=args.target_seq,
                 return_tensors="pt")
    # Padding is not a target: -100 is what transformers' T5 loss ignores.
    enc["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)  # (N, target_seq)
    # "docstring": the generic split holds whole docstrings out, with every pair made from them.
    tensors = {k: enc[k] for k in ("input_ids", "attention_mask", "labels")}
    return tensors | {"docstring": torch.tensor([p[2] for p in pairs])}, pairs


def _bert_rows(docs, tok, args) -> tuple[dict[str, torch.Tensor], list | None]:
    # Packed as BERT was: paragraphs joined with [SEP], rows of seq - 1 tokens after a [CLS]; no padding,
    # so every row gives seq * 15% predictions.
    rows = pack(paragraphs(docs), tok, args.seq - 1, sep=tok.sep_token_id)  # (N, seq - 1)
    ids = torch.cat([torch.full((len(rows), 1), tok.cls_token_id), rows], dim=1)  # (N, seq)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None


# Each *_batch turns selected rows into train_step's batch; ``seed`` fixes any randomness (the
# same value on every rank, so every rank passes the same batch).
def _llama_batch(rows: dict, tok, seed: int) -> dict:
    return {"input_ids": rows["input_ids"], "labels": rows["input_ids"]}


def _t5_batch(rows: dict, tok, seed: int) -> dict:
    return {k: v for k, v in rows.items() if k != "docstring"}


def _bert_batch(rows: dict, tok, seed: int) -> dict:
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=seed, return_tensors="pt")
    examples = [
        {"input_ids": i, "attention_mask": m}
        for i, m in zip(rows["input_ids"].tolist(), rows["attention_mask"].tolist())
    ]
    return dict(collator(examples))  # input_ids with [MASK] / random / kept tokens, labels -100 elsewhere


def _llama_config(args: argparse.Namespace, tok) -> transformers.LlamaConfig:
    return llama_config(
        hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, vocab=len(tok), max_pos=512, dtype="float32", rms_norm_eps=1e-5,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )


def _t5_config(args: argparse.Namespace, tok) -> transformers.T5Config:
    # No dropout: a few hundred steps on a small corpus underfit long before they overfit.
    return transformers.T5Config(
        vocab_size=len(tok), d_model=args.hidden, d_kv=args.hidden // args.heads, d_ff=args.intermediate,
        num_layers=args.layers, num_decoder_layers=args.layers, num_heads=args.heads, dropout_rate=0.0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
        dtype="float32",
    )


def _bert_config(args: argparse.Namespace, tok) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=args.intermediate, max_position_embeddings=max(128, args.seq), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=tok.pad_token_id, dtype="float32",
    )


# Each *_samples shows what the trained (pipelined) model does, for the model card: {input: output}.
def _llama_samples(model, tok, texts) -> dict[str, Any]:
    prompts = SAMPLE_PROMPTS
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    return dict(zip(prompts, tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)))


def _t5_samples(model, tok, texts) -> dict[str, Any]:
    held_out = [(s, t) for s, t, _, start in texts if start == 0][:4]  # whole docstrings the model never saw
    enc = tok([s for s, _ in held_out], return_tensors="pt", padding=True, truncation=True)
    ids = model.generate(**enc, max_new_tokens=32, do_sample=False)
    summaries = tok.batch_decode(ids, skip_special_tokens=True)
    return {s: {"reference": t, "summary": o} for (s, t), o in zip(held_out, summaries)}


def _bert_samples(model, tok, texts) -> dict[str, Any]:
    enc = tok(FILL_MASK_PROMPTS, return_tensors="pt", padding=True)
    logits = model(**enc).logits  # (B, T, V)
    at = enc["input_ids"] == tok.mask_token_id  # one [MASK] per prompt
    top = logits[at].topk(5, dim=-1).indices  # (B, 5)
    return {p: [tok.decode([t]) for t in row] for p, row in zip(FILL_MASK_PROMPTS, top.tolist())}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arch:
    """What differs between the bundled models; everything else in this script is shared."""

    auto_class: str  # hf_pipeline's and transformers' auto class
    model_class: str  # the transformers class the config builds
    defaults: dict[str, Any]  # argparse values the command line leaves out
    tiny: dict[str, Any]  # --tiny overrides
    tokenizer: Callable[[list[str], argparse.Namespace], Any]
    rows: Callable[[list[str], Any, argparse.Namespace], tuple[dict[str, torch.Tensor], list | None]]
    batch: Callable[[dict, Any, int], dict]
    config: Callable[[argparse.Namespace, Any], Any]
    samples: Callable[[Any, Any, list | None], dict[str, Any]]


_COMMON = dict(steps=700, warmup=30, max_shard_size="4MB")
ARCHS: dict[str, Arch] = {
    "llama": Arch(
        auto_class="AutoModelForCausalLM", model_class="LlamaForCausalLM",
        defaults=dict(_COMMON, vocab_size=2048, hidden=256, layers=4, intermediate=704, heads=4, kv_heads=2, seq=128,
                      batch=16, lr=2e-3),
        tiny=dict(vocab_size=320, hidden=32, layers=4, intermediate=64, heads=4, kv_heads=2, seq=32, batch=8),
        tokenizer=_llama_tokenizer, rows=_llama_rows, batch=_llama_batch, config=_llama_config, samples=_llama_samples,
    ),
    "t5": Arch(
        auto_class="AutoModelForSeq2SeqLM", model_class="T5ForConditionalGeneration",
        defaults=dict(_COMMON, vocab_size=2048, hidden=128, layers=2, intermediate=512, heads=4, seq=48, target_seq=24,
                      batch=32, lr=3e-3, steps=2000, warmup=50, max_shard_size="1MB"),
        tiny=dict(vocab_size=320, hidden=32, layers=2, intermediate=64, heads=4, seq=32, target_seq=16, batch=8),
        tokenizer=_t5_tokenizer, rows=_t5_rows, batch=_t5_batch, config=_t5_config, samples=_t5_samples,
    ),
    "bert": Arch(
        auto_class="AutoModelForMaskedLM", model_class="BertForMaskedLM",
        defaults=dict(_COMMON, vocab_size=2048, hidden=128, layers=4, intermediate=512, heads=4, seq=32, batch=128,
                      lr=2e-3, steps=1500, warmup=100, max_shard_size="1MB"),
        tiny=dict(vocab_size=320, hidden=32, layers=4, intermediate=64, heads=4, seq=32, batch=8),
        tokenizer=_bert_tokenizer, rows=_bert_rows, batch=_bert_batch, config=_bert_config, samples=_bert_samples,
    ),
}


def _prepare(args: argparse.Namespace, work: pathlib.Path) -> dict:
    """Rank 0: corpus, tokenizer, tokenized rows and the randomly initialised checkpoint in ``work``."""
    arch = ARCHS[args.arch]
    start = time.perf_counter()
    docs = stdlib_docstrings(limit=40 if args.tiny else None)
    tok = arch.tokenizer(docs, args)
    rows, texts = arch.rows(docs, tok, args)
    n = len(next(iter(rows.values())))
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n, generator=g)
    n_eval = max(args.batch, n // 50)  # 2% held out, at least one batch
    if "docstring" in rows:  # rows made from one docstring stay together: held-out docstrings, 2% of the rows
        held = torch.randperm(len(docs), generator=g)
        rank = torch.empty_like(held)
        rank[held] = torch.arange(len(docs))
        order = order[torch.argsort(rank[rows["docstring"][order]], stable=True)]
        cut = int(rank[rows["docstring"][order[n_eval - 1]]])
        n_eval = int((rank[rows["docstring"]] <= cut).sum())  # up to the end of the last held-out docstring
    rows = {k: v[order] for k, v in rows.items()}
    texts = [texts[i] for i in order.tolist()] if texts is not None else None
    torch.save({
        "train": {k: v[n_eval:] for k, v in rows.items()}, "eval": {k: v[:n_eval] for k, v in rows.items()},
        "eval_texts": texts[:n_eval] if texts is not None else None,
    }, work / "data.pt")
    tok.save_pretrained(work / "tokenizer")
    torch.manual_seed(args.seed)
    model = getattr(transformers, arch.model_class)(arch.config(args, tok))
    if model.can_generate():  # BERT's masked LM does not
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            decoder_start_token_id=getattr(model.config, "decoder_start_token_id", None),
        )
    model.save_pretrained(work / "init")
    return {
        "docs": len(docs), "chars": sum(len(d) for d in docs),
        "tokens": int(rows["input_ids"].ne(tok.pad_token_id).sum()),
        "train_rows": n - n_eval, "eval_rows": n_eval, "prepare_s": time.perf_counter() - start,
    }


def _lr(step: int, args: argparse.Namespace) -> float:
    # Linear warmup, then cosine decay to a tenth of the peak.
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def _eval_loss(model, arch: Arch, tok, rows: dict, batch: int, seed: int) -> float:
    """Mean loss over ``rows`` (pipelined forward with labels), same value on every rank."""
    model.eval()
    total, count = 0.0, 0
    n = len(rows["input_ids"])
    for i in range(0, n - batch + 1, batch):
        x = arch.batch({k: v[i : i + batch] for k, v in rows.items()}, tok, seed + i)
        out = model(**x)
        total += float(out.loss) * batch
        count += batch
    model.train()
    return total / max(count, 1)


def _train(model, arch: Arch, tok, train: dict, args: argparse.Namespace, ctx) -> tuple[float, list[float]]:
    """The training steps (random rows, the same on every rank); returns (seconds, the last 20 losses)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)  # same batches on every rank
    n_train = len(train["input_ids"])
    start = time.perf_counter()
    recent: list[float] = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        pick = torch.randint(n_train, (args.batch,), generator=g)
        loss = model.train_step(arch.batch({k: v[pick] for k, v in train.items()}, tok, args.seed + step))
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [float(loss)])[-20:]
        if ctx.is_main_process and (step % 25 == 0 or step == args.steps - 1):
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  loss {float(loss):.3f}  lr {_lr(step, args):.2e}  {elapsed:6.0f} s", flush=True)
    return time.perf_counter() - start, recent


def _publish(staged: pathlib.Path, out: pathlib.Path, work: pathlib.Path, stats: dict, model, arch: Arch) -> None:
    """Rank 0: the card and figures into the saved model, then the model renamed into ``out`` atomically."""
    # A published model needs no resume state: save_pretrained's RNG / trainer files are dropped.
    shutil.rmtree(staged / "rng", ignore_errors=True)
    (staged / "trainer_state.json").unlink(missing_ok=True)
    for f in staged.iterdir():
        f.chmod(0o644)
    card = model_card(stats, model.config, auto_class=arch.auto_class)
    (staged / "README.md").write_text(card, encoding="utf-8")
    (staged / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    # Atomic replace: the old directory is moved aside, the new one renamed in, the old removed.
    old = work / "previous"
    if out.exists():
        os.rename(out, old)
    os.rename(staged, out)


def main(argv: list[str] | None = None) -> int:
    """Train and write the model; see the module docstring."""
    args = _parse(argv)
    arch = ARCHS[args.arch]
    ctx = init_distributed(device="cpu")
    out = pathlib.Path(args.out).resolve()
    # One work directory for every rank: rank 0 makes it and tells the others where it is.
    work = pathlib.Path(broadcast_object(
        tempfile.mkdtemp(prefix=".make-default-", dir=out.parent) if ctx.is_main_process else None))
    try:
        info = broadcast_object(_prepare(args, work) if ctx.is_main_process else None)
        data = torch.load(work / "data.pt")
        tok = transformers.AutoTokenizer.from_pretrained(work / "tokenizer")

        model = getattr(hf_pipeline, arch.auto_class).from_pretrained(
            work / "init", pipeline=True, schedule=args.schedule, virtual_stages=args.virtual_stages,
            n_microbatches=args.n_microbatches, device="cpu", dtype=torch.float32, progress=False,
        )
        model.train()
        if ctx.is_main_process:
            print(model.plan, flush=True)
            print(f"corpus: {info['docs']} docstrings, {info['chars']} characters, {info['train_rows']} training "
                  f"rows, {info['tokens']} tokens", flush=True)
        load_start = os.getloadavg()  # the machine may be shared: the card says how busy it was
        train_s, recent = _train(model, arch, tok, data["train"], args, ctx)
        final_train = sum(recent) / len(recent)
        # Held-out masks are drawn from seeds the training steps never used.
        eval_loss = _eval_loss(model, arch, tok, data["eval"], args.batch, seed=args.seed + 10**6)

        model.eval()
        samples = arch.samples(model, tok, data["eval_texts"])

        staged = work / "model"
        model.save_pretrained(staged, max_shard_size=args.max_shard_size, tokenizer=tok)
        ctx.barrier()
        if ctx.is_main_process:
            stats = {
                **info, "steps": args.steps, "train_s": round(train_s, 1), "final_train_loss": round(final_train, 4),
                "eval_loss": round(eval_loss, 4), "python": platform.python_version(), "last_steps": len(recent),
                "world_size": ctx.world_size, "samples": samples,
                "params": _params(arch, model.config), "num_stages": model.plan.num_stages,
                "load_average": [round(x, 1) for x in load_start + os.getloadavg()],
                "command": _command(ctx.world_size, argv), "args": vars(args),
            }
            _publish(staged, out, work, stats, model, arch)
            print(f"final train loss {final_train:.3f} (mean of the last {len(recent)} steps), eval loss "
                  f"{eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f}), {train_s:.0f} s of training; wrote {out}")
            for prompt, text in samples.items():
                print(f"  {prompt[:80]!r} -> {text!r}")
        ctx.barrier()
    finally:
        if ctx.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _params(arch: Arch, config) -> int:
    """Parameters of the whole model, tied ones once (stages each hold their own copy of a tied embedding)."""
    with torch.device("meta"):
        return sum(p.numel() for p in getattr(transformers, arch.model_class)(config).parameters())


def _command(world_size: int, argv: list[str] | None) -> str:
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return f"torchrun --nproc_per_node {world_size} -m devtools.make_default_model {args}"


if __name__ == "__main__":
    try:
        code = main()
    finally:
        destroy_distributed()
    sys.exit(code)
