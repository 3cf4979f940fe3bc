"""Continuous batching beyond one stage per rank (one spawned job per world size): at 4 ranks, LLaMA with tensor
parallelism (pp2 x tp2), Mixtral with expert parallelism (pp2 x ep2: each stage's two ranks keep half of every MoE
layer's experts; and pp2 x dp2 with the experts over the two replicas), Qwen3-MoE at pp2 x tp2 x ep2, LLaMA in two
data-parallel replicas (dp2 x pp2: rank 0 plans both replicas' rings, each runs its own rows), LLaMA FSDP-sharded
(pp2 x fsdp2: the fsdp ranks are such replicas; every FSDP unit is gathered as the ring starts and no all-gather
runs inside a ring op, counted by a patch on torch's all-gather) and the encoder-decoder T5 (encoder | decoder)
both with tensor parallelism and in two data-parallel replicas; at 2 ranks, LLaMA with two stages per rank,
interleaved (stages 0, 2 | 1, 3: the reply 3 -> 0 shares rank 1 -> 0 with stage 1 -> 2) and V-shaped (0, 3 | 1, 2:
two hand-overs within a rank), and experts over two replicas (Mixtral over dp2, gpt-oss over fsdp2). The engine
must report ``batching == "continuous"`` and serve a stream whose requests join and leave at different times
(different prompt lengths and ``max_new_tokens``, two ended early by a stop id from their own continuation, the
rest submitted while the first decodes, 3 slots for 7 requests); every greedy output equals transformers'
``generate`` of that request alone on one process, token for token (fp32: a tp rank's partial sums add up in
another order, ~1e-7 on logits of order 1, far below the gap between the top two logits these tiny models leave; a
row run with another row's positions, cache or plan moves its tokens)."""

from __future__ import annotations

import contextlib

import pytest
import tiny
import torch
from decoders import decoder_config
from harness import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# (prompt length, max_new_tokens); prompts are seeded word ids.
STREAM = [(3, 9), (8, 3), (5, 12), (2, 5), (10, 7), (4, 10), (6, 4)]
EARLY = (2, 5)  # requests ended by a stop id of their own continuation


def _serve(path: str, load: dict, requests: list[dict], auto: str = "AutoModelForCausalLM") -> dict | None:
    """Every rank: one continuous engine; rank 0 submits 3 requests, the rest once the first has tokens."""
    import hf_pipeline
    from hf_pipeline.serving import Engine

    model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **load)
    engine = Engine(model, max_batch=3, batching="continuous", idle_s=0.05)
    out: dict = {"batching": engine.batching, "reason": engine.static_reason, "stages": len(model.stages),
                 "dp": model.dims.dp_size, "pp": model.dims.pp_rank}
    with _counting_gathers() as gathers:
        out.update(_run(engine, model, requests))
    return {**out, "gathers": gathers}


@contextlib.contextmanager
def _counting_gathers():
    """Counts torch's all-gathers (FSDP2's unshard calls one per unit): ``{"all": n, "in_op": n}``, those run
    inside a continuous-ring op apart."""
    import torch.distributed as dist

    from hf_pipeline.continuous_batching.continuous_ring import ContinuousRing

    counts = {"all": 0, "in_op": 0}
    in_op = [False]
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    op = ContinuousRing._op

    def counted(original):
        def gather(*args, **kwargs):
            counts["all"] += 1
            counts["in_op"] += in_op[0]
            return original(*args, **kwargs)
        return gather

    def watched_op(self, *args, **kwargs):
        in_op[0] = True
        try:
            return op(self, *args, **kwargs)
        finally:
            in_op[0] = False

    for n in names:
        setattr(dist, n, counted(originals[n]))
    ContinuousRing._op = watched_op
    try:
        yield counts
    finally:
        for n in names:
            setattr(dist, n, originals[n])
        ContinuousRing._op = op


def _run(engine, model, requests: list[dict]) -> dict:
    if model.ctx.rank != 0:
        engine.serve_forever()
        return {"forwards": engine.forwards}
    choices = tiny.serve_staggered(engine, requests)
    return {"choices": [[(c.token_ids, c.finish_reason) for c in cs] for cs in choices],
            "peak_rows": engine.peak_rows, "steps": engine.decode_steps, "forwards": engine.forwards}


def _job(cases):
    torch.set_num_threads(1)
    return [_serve(*c) for c in cases]


def _requests(ref) -> list[dict]:
    return tiny.stopping_stream(ref, STREAM, EARLY)


def _moe(directory, family: str = "mixtral") -> str:
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(family)).save_pretrained(directory)
    return str(directory)


def test_continuous_ring_under_tensor_expert_and_data_parallelism_at_4_ranks(tmp_path):
    llama = str(tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1))
    # T5 at the default init scale answers every prompt with the same token; 3x gives varied outputs.
    t5 = str(tiny.make_checkpoint(tmp_path / "t5", "t5", shards=1, initializer_factor=3.0))
    mixtral = _moe(tmp_path / "mixtral")
    paths = {"llama tp2": (llama, {"tp_size": 2}), "mixtral ep2": (mixtral, {"ep_size": 2}),
             "mixtral ep2 over dp2": (mixtral, {"num_stages": 2, "ep_size": 2, "ep_over": "data"}),
             "qwen3-moe tp2 x ep2": (_moe(tmp_path / "qwen3_moe", "qwen3_moe"), {"tp_size": 2, "ep_size": 2}),
             "llama dp2": (llama, {"num_stages": 2}), "llama fsdp2": (llama, {"num_stages": 2, "fsdp_size": 2}),
             "t5 tp2": (t5, {"tp_size": 2}), "t5 dp2": (t5, {"num_stages": 2})}
    autos = {name: "AutoModelForSeq2SeqLM" if name.startswith("t5") else "AutoModelForCausalLM" for name in paths}
    refs = {name: tiny.reference(path, autos[name]) for name, (path, _) in paths.items()}
    requests = {name: _requests(ref) for name, ref in refs.items()}
    cases = [(path, load, requests[name], autos[name]) for name, (path, load) in paths.items()]
    per_rank = run_distributed(_job, 4, cases, timeout=600)
    for k, name in enumerate(paths):
        ranks = [r[k] for r in per_rank]
        assert all(r["batching"] == "continuous" for r in ranks), (name, ranks[0]["reason"])
        got = ranks[0]
        assert all(r["forwards"] > 0 for r in ranks), name  # every rank (both replicas) ran rows
        if name == "mixtral ep2 over dp2":  # each stage's expert group (its rank in each replica): one forward count
            assert all(len({r["forwards"] for r in ranks if r["pp"] == pp}) == 1 for pp in (0, 1)), ranks
        if name == "llama fsdp2":  # gathered as each ring starts (a unit per block and stage), never in an op
            assert all(r["gathers"]["all"] > 0 and r["gathers"]["in_op"] == 0 for r in ranks), \
                [r["gathers"] for r in ranks]
        if name in ("llama dp2", "llama fsdp2", "t5 dp2", "mixtral ep2 over dp2"):  # two replicas of 3 slots: more
            assert ranks[0]["dp"] == 2 and got["peak_rows"] > 3, (name, got["peak_rows"])  # rows than one holds
        else:
            assert got["peak_rows"] == 3, (name, got["peak_rows"])  # the slots were shared: rows waited and joined
        for j, req in enumerate(requests[name]):
            assert got["choices"][j] == [tiny.alone_choice(refs[name], req)], (name, j, req)
        assert all(got["choices"][j][0][1] == "stop" for j in EARLY), name


def test_continuous_ring_with_two_stages_per_rank_and_experts_over_replicas_at_2_ranks(tmp_path):
    """Two stages per rank (LLaMA), and experts over two data-parallel replicas (``ep_over="data"``): Mixtral in
    two replicas, gpt-oss (sliding-window layers: a joining op's prefill forwards vary with its rows) FSDP-sharded
    over two. Each replica's rows differ, yet every MoE layer's all-to-all needs both ranks: each op's forward
    count must match over the expert group (asserted: equal on both ranks), else the ring hangs."""
    llama = str(tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1))
    layouts = {"interleaved": (llama, {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2}),
               "V": (llama, {"schedule": "zbv-zero-bubble", "n_microbatches": 4}),
               "mixtral ep2 over dp2": (_moe(tmp_path / "mixtral"), {"num_stages": 1, "ep_size": 2, "ep_over": "data"}),
               "gpt-oss ep2 over fsdp2": (_moe(tmp_path / "gpt_oss", "gpt_oss"),
                                          {"num_stages": 1, "ep_size": 2, "ep_over": "data", "fsdp_size": 2})}
    refs = {name: tiny.reference(path, "AutoModelForCausalLM") for name, (path, _) in layouts.items()}
    requests = {name: _requests(ref) for name, ref in refs.items()}
    per_rank = run_distributed(_job, 2, [(path, load, requests[name]) for name, (path, load) in layouts.items()],
                               timeout=600)
    for k, name in enumerate(layouts):
        ranks = [r[k] for r in per_rank]
        assert all(r["batching"] == "continuous" for r in ranks), (name, ranks[0]["reason"])
        got = ranks[0]
        if "over" in name:  # two replicas of 3 slots, each with rows of its own; one forward count per op
            assert ranks[0]["dp"] == 2 and got["peak_rows"] > 3, (name, got["peak_rows"])
            assert ranks[0]["forwards"] == ranks[1]["forwards"], (name, [r["forwards"] for r in ranks])
        else:
            assert all(r["stages"] == 2 for r in ranks), name
            assert got["peak_rows"] == 3, (name, got["peak_rows"])
        for j, req in enumerate(requests[name]):
            assert got["choices"][j] == [tiny.alone_choice(refs[name], req)], (name, j, req)
        assert all(got["choices"][j][0][1] == "stop" for j in EARLY), name
