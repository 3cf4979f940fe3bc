"""What backpropagating the pipelined forward costs against ``model.train_step``, paired on one loaded model.

    torchrun --nproc-per-node 2 -m devtools.backward_cost CHECKPOINT --rows 16 --seq 128 --reps 5

Both compute the same gradients of the model's own loss on one random batch: ``model.train_step(batch)``, and
``model(**batch).loss.backward()`` (``hf_pipeline/training/differentiable.py``: the forward, the outputs gathered
on every rank and the loss computed there, then the pipeline's step with the output gradients). They take turns,
``--reps`` times each after one untimed call of each; rank 0 prints the median seconds of each and their ratio.
Run with one thread per rank (``OMP_NUM_THREADS=1``), nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

__all__ = ["measure", "main"]


def measure(path: str, *, rows: int, seq: int, reps: int) -> dict[str, float] | None:
    """Median seconds of each way on this rank's clock; the ratio on rank 0 (None elsewhere)."""
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    ways = {"train_step": lambda: model.train_step(batch), "forward_backward": lambda: model(**batch).loss.backward()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(reps + 1):
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            if rep:  # the first of each builds its schedule
                times[name].append(time.perf_counter() - start)
            model.zero_grad()
    if model.ctx.rank != 0:
        return None
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {**medians, "ratio": medians["forward_backward"] / medians["train_step"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.checkpoint, rows=args.rows, seq=args.seq, reps=args.reps)
    if result is not None:
        print(f"train_step {result['train_step']:.3f} s, forward + loss.backward() {result['forward_backward']:.3f} s: "
              f"{result['ratio']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
