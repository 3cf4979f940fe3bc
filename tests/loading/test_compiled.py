"""``compile=``: each stage's whole blocks compiled with ``torch.compile`` (regional), on one process with
two stages (interleaved 1F1B), against the same model loaded eager and against transformers.

- With ``backend="aot_eager"`` (dynamo's graphs run by aten, no fusion: fast, and the same arithmetic) the
  logits, the loss and every gradient equal the eager pipeline's to 1e-6 (measured 0.0), greedy tokens
  are the same, and dynamo captured graphs: a forward graph shared by the blocks (one code object, one
  graph, not one per block) and one for training. Generation steps run compiled too (their caches'
  ``update`` left out of the graph): the first ``generate`` captures the prefill's and the decode step's
  graphs, and a longer one with other lengths adds none (dynamic shapes: not a graph per step, per cache
  length or per block), its tokens equal to the eager pipeline's.
- With the default backend (inductor: fused C++ kernels) the logits equal transformers' to 1e-5 and the loss
  to 1e-5 relative (fusion reorders sums: measured 9e-8 and 5e-7; a block skipped or run twice moves them
  by 1e-1).
- At 2 ranks (1F1B, ZBV, and fsdp2: FSDP2 gathers around the compiled forwards) the same equalities hold.
- Bad values and the stages this version does not compile (traced; tensor or expert parallelism: DTensor
  blocks) are refused naming the option.
"""

from __future__ import annotations

import types

import pytest
import tiny
import torch

from hf_pipeline.errors import InputError
from hf_pipeline.loading.compiled import check_compile

LOAD = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2, "device": "cpu"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.set_num_threads(1)
    path = tiny.make_checkpoint(tmp_path_factory.mktemp("compiled") / "llama", "llama")
    return path, tiny.reference(path, "AutoModelForCausalLM")


def _run(model) -> dict:
    inputs = tiny.sample_inputs("llama", batch=2, seq=8)
    out = {}
    with torch.no_grad():
        out["logits"] = model(**inputs).logits
    out["tokens"] = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    batch = tiny.make_batch("llama", 4, seed=1)
    out["loss"] = float(model.train_step(batch).detach()) if hasattr(model, "train_step") else None
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return out


@pytest.mark.equiv  # torch.compile's tracing: about 5 s on 2 shared cores
def test_compiled_blocks_equal_the_eager_pipeline_and_share_one_graph(llama):
    from torch._dynamo.utils import counters

    import hf_pipeline

    path, _ = llama
    eager_model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **LOAD)
    eager = _run(eager_model)
    before = counters["stats"]["unique_graphs"]
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, compile={"backend": "aot_eager"},
                                                             **LOAD)
    blocks = [b for s in model.stages for b in s.blocks]
    assert len(blocks) == 4 and [s.compiled_blocks for s in model.stages] == [2, 2]
    inputs = tiny.sample_inputs("llama", batch=2, seq=8)
    with torch.no_grad():
        model(**inputs)
    assert counters["stats"]["unique_graphs"] - before == 1, "one forward graph shared by the 4 blocks"
    before = counters["stats"]["unique_graphs"]
    got = _run(model)
    graphs = counters["stats"]["unique_graphs"] - before
    # training's one and the generation steps' pieces (prefill and decode, each split around the cache update; one
    # row per microbatch and several specialise apart): with generation eager, only training's
    assert graphs >= 3, f"{graphs} graphs for generate and training"
    before = counters["stats"]["unique_graphs"]
    longer = {"max_new_tokens": 9, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(**inputs, **longer), eager_model.generate(**inputs, **longer))
    assert counters["stats"]["unique_graphs"] == before, "a longer generate compiled again"
    assert (got["logits"] - eager["logits"]).abs().max().item() <= 1e-6
    assert torch.equal(got["tokens"], eager["tokens"])
    assert abs(got["loss"] - eager["loss"]) <= 1e-6 * abs(eager["loss"])
    assert set(got["grads"]) == set(eager["grads"]) and got["grads"]
    for name, grad in eager["grads"].items():
        assert (got["grads"][name] - grad).abs().max().item() <= 1e-6, name


@pytest.mark.equiv  # torch.compile's tracing of the continuous ring's steps: about 10 s
def test_compiled_stages_serve_continuously_equal_to_transformers(llama):
    """The serving engine's continuous ring on compiled stages (its caches are the compiled kind: the steps run
    compiled): a staggered stream of 7 requests over 3 slots, two ended by stop ids, each equal to transformers'
    generate of that request alone; dynamo captured the steps' graphs."""
    from torch._dynamo.utils import counters

    import hf_pipeline
    from hf_pipeline.serving import Engine

    path, ref = llama
    stream = [(3, 9), (8, 3), (5, 12), (2, 5), (10, 7), (4, 10), (6, 4)]
    requests = tiny.stopping_stream(ref, stream, (2, 5))
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, compile={"backend": "aot_eager"},
                                                             **LOAD)
    engine = Engine(model, max_batch=3, batching="continuous", idle_s=0.05)
    assert engine.batching == "continuous", engine.static_reason
    torch.compiler.reset()  # graphs an earlier test compiled for the same code would be reused, not counted
    before = counters["stats"]["unique_graphs"]
    choices = tiny.serve_staggered(engine, requests)
    assert counters["stats"]["unique_graphs"] > before, "the ring's steps ran eager"
    for j, (got, req) in enumerate(zip(choices, requests, strict=True)):
        assert [(c.token_ids, c.finish_reason) for c in got] == [tiny.alone_choice(ref, req)], (j, req)


@pytest.mark.dist  # inductor runs the C++ compiler in processes of its own: not a quick-tier test
@pytest.mark.slow
def test_inductor_compiled_blocks_equal_transformers(llama):
    import hf_pipeline

    path, ref = llama
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, compile=True, **LOAD)
    inputs = tiny.sample_inputs("llama", batch=2, seq=8)
    with torch.no_grad():
        diff = (model(**inputs).logits - ref(**inputs).logits).abs().max().item()
    assert diff <= 1e-5, diff
    batch = tiny.make_batch("llama", 4, seed=1)
    model.train()
    loss, want = float(model.train_step(batch).detach()), float(ref(**batch).loss.detach())
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)


@pytest.mark.unit
@pytest.mark.parametrize(("setting", "options", "wants"), [
    ("yes", {}, "compile must be True, False or a dict of torch.compile arguments, got 'yes'"),
    ({"backend": "inductor", "cudagraphs": True}, {}, "['cudagraphs'] are not torch.compile arguments"),
    (True, {"traced": True}, "the stages are traced"),
    (True, {"tp_size": 2}, "tensor parallelism shards the blocks"),
    (True, {"ep_size": 2}, "expert parallelism splits the experts"),
])
def test_bad_values_and_meshes_are_refused_naming_the_option(setting, options, wants):
    resolved = types.SimpleNamespace(**{"traced": False, "tp_size": 1, "ep_size": 1, "fsdp_size": 1, **options})
    with pytest.raises(InputError) as err:
        check_compile(setting, resolved)
    assert wants in str(err.value)
    assert check_compile(False, resolved) is None and check_compile(None, resolved) is None


def _two_ranks(path, load):
    from torch._dynamo.utils import counters

    import hf_pipeline

    eager = _run(hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **load))
    before = counters["stats"]["unique_graphs"]
    compiled = _run(hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True,
                                                                     compile={"backend": "aot_eager"}, **load))
    compiled["graphs"] = counters["stats"]["unique_graphs"] - before
    return eager, compiled


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_stages_equal_eager_at_two_ranks_through_1f1b_zbv_and_fsdp(llama):
    """Each rank compiles its own stages (torch's metadata inference and every microbatch run the compiled
    blocks): logits, greedy tokens, the loss and this rank's gradients equal the eager pipeline's (aot_eager:
    the same arithmetic, measured 0.0). Under FSDP (fsdp2, one stage) FSDP2's hooks gather each block's
    parameters around its compiled forward; its gradients are this rank's shards."""
    from harness import run_distributed

    path, _ = llama
    for load in ({"schedule": "1f1b", "n_microbatches": 2, "device": "cpu"},
                 {"schedule": "zbv-zero-bubble", "n_microbatches": 4, "device": "cpu"},
                 {"num_stages": 1, "fsdp_size": 2, "n_microbatches": 2, "device": "cpu"}):
        for rank, (eager, got) in enumerate(run_distributed(_two_ranks, 2, path, load, timeout=600)):
            what = f"{load.get('schedule', 'fsdp2')} rank {rank}"
            assert got["graphs"] >= 2, f"{what}: {got['graphs']} graphs captured: the blocks did not run compiled"
            assert (got["logits"] - eager["logits"]).abs().max().item() <= 1e-6, what
            assert torch.equal(got["tokens"], eager["tokens"]), what
            assert abs(got["loss"] - eager["loss"]) <= 1e-6 * abs(eager["loss"]), what
            assert set(got["grads"]) == set(eager["grads"]) and got["grads"], what
            for name, grad in eager["grads"].items():
                assert (got["grads"][name] - grad).abs().max().item() <= 1e-6, (what, name)
