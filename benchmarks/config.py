"""What a run measures and at which size: the schedules, the sections, and :class:`Sizes`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPILED", "MEASURED", "SCHEDULES", "SECTIONS", "Sizes", "is_fixed"]

# (schedule, stages per rank); "auto": schedule="auto", n_microbatches="auto" (the cost model's pick);
# a name ending in MEASURED: that schedule loaded again with the split model.measure_split() advises.
MEASURED = "+measured-split"
# "default": neither schedule nor n_microbatches named (what a user gets); a name ending in COMPILED: that
# schedule with compile=True (each stage's blocks compiled).
COMPILED = "+compiled"
SCHEDULES = [
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2), ("zbv-zero-bubble", 2),
    ("dualpipev", 2), ("auto", None), ("zbv-zero-bubble" + MEASURED, 2), ("default", None), ("1f1b" + COMPILED, 1),
]


def is_fixed(name: str) -> bool:
    """A schedule named with its microbatch count, run as it is (not chosen, measured or compiled)."""
    return name not in ("auto", "default") and not name.endswith((MEASURED, COMPILED))
SECTIONS = ("load", "train", "generate", "bubble", "checkpointing", "lora", "serve", "mesh", "serve-http")


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Everything a run's size depends on; ``--quick`` swaps in tiny values."""

    # load: the >= 1 GB checkpoint
    load_hidden: int = 2048
    load_intermediate: int = 5632
    load_layers: int = 12
    load_heads: int = 16
    load_kv_heads: int = 4
    load_vocab: int = 32000
    load_shard_bytes: int = 100_000_000
    load_ranks: tuple[int, ...] = (1, 2, 4)
    # train / generate model: LLaMA-architecture, 12 layers, GQA
    hidden: int = 384
    intermediate: int = 1024  # ~8/3 x hidden, as LLaMA
    layers: int = 12
    heads: int = 6
    kv_heads: int = 2
    vocab: int = 8192
    seq: int = 128
    batch: int = 16
    n_microbatches: int = 8
    train_reps: int = 6
    prompts: int = 16
    prompt_len: int = 32
    prefill_chunk: int = 16  # the chunked-prefill run's prefill_chunk_size: 2 chunks of the prompt
    new_tokens: int = 64
    gen_reps: int = 3
    world: int = 2
    # train: the compiled row's torch.compile backend (quick: dynamo's graphs run by aten, seconds to compile)
    compile_backend: str = "inductor"
    # mesh: the mixture of experts (the train model's shape, experts in place of its MLP)
    moe_experts: int = 8
    moe_intermediate: int = 512
    # checkpointing: a long sequence, activations dominate
    ckpt_seq: int = 1024
    ckpt_batch: int = 4
    ckpt_microbatches: int = 4
    ckpt_reps: int = 2
    # serve: the seeded request stream (the train section's model)
    serve_requests: int = 32
    serve_rate: float = 4.0  # requests per second, Poisson arrivals
    serve_prompt_len: tuple[int, int] = (8, 64)
    serve_new_tokens: tuple[int, int] = (8, 48)
    serve_batch: int = 8
    serve_capacity_repeats: int = 3  # turns of the capacity measurement (every request at once, no HTTP)
    # serve-http: guidellm against live servers; the models by name (benchmarks.serve_http), the decode-heavy
    # one's shape (LLaMA, random weights, the bundled tokenizer), fixed prompt and output lengths
    http_models: tuple[str, ...] = ("tiny", "decode-heavy")
    http_concurrency: tuple[int, ...] = (1, 8)
    http_requests_per_stream: int = 4
    http_min_requests: int = 8
    http_prompt_tokens: int = 32
    http_output_tokens: int = 32
    heavy_hidden: int = 1024
    heavy_intermediate: int = 2816
    heavy_layers: int = 24
    heavy_heads: int = 16
    heavy_kv_heads: int = 4

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            load_hidden=64, load_intermediate=128, load_layers=4, load_heads=4, load_kv_heads=2, load_vocab=512,
            load_shard_bytes=60_000, load_ranks=(1, 2), hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2,
            vocab=256, seq=16, batch=8, n_microbatches=4, train_reps=1, prompts=4, prompt_len=8, prefill_chunk=2,
            new_tokens=8, gen_reps=1, compile_backend="aot_eager", moe_experts=4, moe_intermediate=64, ckpt_seq=64,
            ckpt_batch=4, ckpt_microbatches=2, ckpt_reps=1,
            serve_requests=6, serve_rate=50.0, serve_prompt_len=(2, 8), serve_new_tokens=(2, 6), serve_batch=4,
            serve_capacity_repeats=1,
            http_models=("tiny",), http_concurrency=(1, 2), http_requests_per_stream=2, http_min_requests=2,
            http_prompt_tokens=8, http_output_tokens=4,
        )
