"""Supervised fine-tuning of a causal LM with ``transformers.Trainer`` on a pipelined model: LoRA by default.

``hf_pipeline.PipelineTrainer`` takes the Trainer's own arguments: this script is what a Trainer
user writes, with ``pipeline=True`` in ``from_pretrained`` and ``PipelineTrainer`` for ``Trainer``.
By default it trains a LoRA adapter (``peft.get_peft_model``: each rank adapts its own stages; the
base weights stay frozen); ``--full`` trains every weight instead.
The data file (.txt one text per line, .json/.jsonl with a ``text`` field) is tokenised with the
model's tokenizer (truncated to ``--max-length``) and padded per batch by transformers'
``DataCollatorForLanguageModeling``.

Run (2 processes, one pipeline of 2 stages; more processes than stages give data parallelism):

    torchrun --nproc_per_node 2 scripts/finetune.py --model path/to/model --data train.txt \\
        --output-dir out --steps 200 --batch-size 8 --n-microbatches 4

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune.py --model path/to/model \\
        --data train.txt --output-dir out --steps 200

    # continue from the last checkpoint in --output-dir:
    torchrun --nproc_per_node 2 scripts/finetune.py ... --output-dir out --resume

    # LoRA r=16 on every attention and MLP projection, activation checkpointing, and a merged copy:
    torchrun --nproc_per_node 2 scripts/finetune.py ... --lora-r 16 --lora-alpha 32 \
        --lora-targets all-linear --activation-checkpointing --merge

``<output-dir>/checkpoint-<step>`` (every ``--save-every`` steps) is the Trainer's checkpoint: with
LoRA the adapter in PEFT's format (gathered from every rank) and the training state, with ``--full``
a normal transformers model and the training state. ``<output-dir>/final`` holds the adapter (load
it with ``peft.PeftModel.from_pretrained(base_model, "<output-dir>/final")``) or the full model,
with the tokenizer; ``--merge`` also writes ``<output-dir>/merged``, the base model with the adapter
merged into its weights, a normal transformers checkpoint. The Trainer's log (loss, learning rate,
gradient norm per ``--log-every`` steps) is in each checkpoint's ``trainer_state.json``.
"""

from __future__ import annotations

import argparse
import pathlib

import datasets
import peft
import torch
import transformers

import hf_pipeline


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a local model directory (config, weights, tokenizer)")
    p.add_argument("--data", required=True, help=".txt (one text per line) or .json/.jsonl with a 'text' field")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="rows per pipeline replica and batch")
    p.add_argument("--grad-accum", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--n-microbatches", type=int, default=None, help="default: the number of stages")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--max-length", type=int, default=128, help="tokens per text (longer ones are truncated)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    p.add_argument("--full", action="store_true", help="train every weight instead of a LoRA adapter")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", nargs="+", default=None,
                   help="module names to adapt (default: peft's choice for the architecture; 'all-linear': every "
                        "projection inside the blocks)")
    p.add_argument("--merge", action="store_true", help="also save the base model with the adapter merged in")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward pass (less memory, more compute)")
    args = p.parse_args(argv)
    if args.full and args.merge:
        p.error("--merge merges a LoRA adapter: leave it out with --full")
    return args


def _dataset(path: str, tokenizer, max_length: int) -> datasets.Dataset:
    kind = "text" if pathlib.Path(path).suffix in (".txt", ".md") else "json"
    data = datasets.load_dataset(kind, data_files=path, split="train")
    data = data.filter(lambda row: bool(row["text"].strip()))
    return data.map(
        lambda rows: tokenizer(rows["text"], truncation=True, max_length=max_length),
        batched=True, remove_columns=data.column_names,
    )


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        args.model, pipeline=True, n_microbatches=args.n_microbatches, dtype=torch.float32
    )
    transformers.set_seed(args.seed)  # the same adapter draw on every rank (each keeps its stages' part)
    trained = model if args.full else peft.get_peft_model(model, _lora_config(args))
    training = transformers.TrainingArguments(
        args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
        logging_steps=args.log_every, save_steps=args.save_every, seed=args.seed, report_to=[],
        use_cpu=model.device.type == "cpu", disable_tqdm=not model.ctx.is_main_process,
        gradient_checkpointing=args.activation_checkpointing,
    )
    trainer = hf_pipeline.PipelineTrainer(
        model=trained, args=training, train_dataset=_dataset(args.data, tokenizer, args.max_length),
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    out = pathlib.Path(args.output_dir)
    trainer.save_model(str(out / "final"))  # collective: the adapter (gathered) or every rank's stages
    if args.merge:
        trained.merge_and_unload().save_pretrained(out / "merged", tokenizer=tokenizer)  # collective
    if model.ctx.is_main_process:
        what = "model" if args.full else "LoRA adapter"
        print(f"trained {trainer.state.global_step} steps on {model.ctx.world_size} rank(s); "
              f"last loss {trainer.state.log_history[-2].get('loss')}; {what} in {out / 'final'}")


def _lora_config(args: argparse.Namespace) -> peft.LoraConfig:
    targets = args.lora_targets
    targets = targets[0] if targets == ["all-linear"] else targets  # peft's spelling for every linear layer
    return peft.LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets,
        task_type="CAUSAL_LM",
    )


if __name__ == "__main__":
    main()
