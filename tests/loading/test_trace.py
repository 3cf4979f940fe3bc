"""The torch.export fallback (``split_method="trace"``) equals single-process transformers.

Architectures without a recipe (OPT with tied embeddings, Phi with rotary embeddings and a biased
LM head, Bloom with ALiBi) and LLaMA forced through the tracer, loaded from real >= 3-shard
checkpoints:
  * forward logits equal transformers (fp32, max abs diff 1e-5) at world sizes 1, 2 and 3, with 1
    and 2 virtual stages; at 3 stages the traced graph feeds stage 2 from stage 0 (the attention
    mask, rotary cos/sin), which has to be carried through stage 1;
  * a new input shape re-traces without reading the checkpoint again, onto the same Parameters; a
    batch that ``forward`` pads to the same microbatch shape reuses the trace and the runtime;
  * ``train_step`` at world size 2 gives transformers' loss and every parameter's gradient (rel
    1e-5) through torch's 1F1B (OPT, tied embedding / LM head on two ranks), interleaved 1F1B and
    interleaved zero-bubble (looped layout, 2 stages per rank) and ZBV zero-bubble (V layout: the
    tied LLaMA embedding and LM head on two stages of one rank) with LLaMA forced through the
    tracer, and 1F1B with T5 (decoder inputs shifted from the labels; the encoder's output and the
    position bias cross stages);
  * architectures that cannot be traced on meta weights fail at load with the model class and the
    reason (GPT-J: torch.export's own error; Falcon: a constant lost on the meta device);
    ``generate()`` says it needs a recipe.
One spawned job per world size.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

# fp32 logits of the tiny traced models are below 1 (OPT 0.56, BLOOM 0.81; one ulp 6e-8); sums of 32-64 terms over
# 4 layers keep another summation order's rounding near 1e-6; a wrong mask, position or tied weight moves them by
# 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5  # fp32: the same aten kernels on the same inputs; only summation order could differ
# fp32 loss and gradients (relative to the norm): summation order ~1e-6; a dropped microbatch moves them >= 1e-2,
# a gradient off by 2x 100%.
GRAD_RTOL = 1e-5
GRAD_ATOL = 1e-7
SGD_LR = 0.5  # large enough that one update is far above rounding

_COMMON = dict(vocab_size=tiny.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(arch: str) -> transformers.PretrainedConfig:
    """Tiny configs (4 blocks) of architectures that have no recipe; dropout off for exact gradients."""
    if arch == "opt":
        return transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **_COMMON,
        )
    if arch == "phi":
        return transformers.PhiConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            **_COMMON,
        )
    if arch == "bloom":
        return transformers.BloomConfig(
            hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **_COMMON
        )
    if arch == "falcon":
        return transformers.FalconConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, **_COMMON)
    if arch == "gptj":
        return transformers.GPTJConfig(n_embd=32, n_layer=4, n_head=4, n_positions=128, rotary_dim=4, **_COMMON)
    return tiny.config_for(arch)


def _checkpoint(directory: pathlib.Path, arch: str) -> str:
    """``save_pretrained`` of a seeded random model in >= 3 safetensors shards."""
    if arch in ("llama", "llama-tied"):
        return str(tiny.make_checkpoint(directory, arch))
    if arch == "llama-tied6":  # enough blocks for 6 traced stages (3 ranks x 2 in a V)
        return str(tiny.make_checkpoint(directory, "llama-tied", num_hidden_layers=6))
    if arch == "t5":
        return str(tiny.make_checkpoint(directory, arch, dropout_rate=0.0))  # dropout off for exact gradients
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch))
    biggest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{max(total // 4, biggest + 1) // 1000}KB")
    shards = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) >= 3, shards
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("traced")
    return {
        arch: _checkpoint(root / arch, arch)
        for arch in ("opt", "phi", "bloom", "llama", "llama-tied", "llama-tied6", "t5")
    }


def _reference(path: str, batch: int = 6, seq: int = 9) -> torch.Tensor:
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        return ref(**tiny.sample_inputs("llama", batch=batch, seq=seq)).logits


def _load(path: str, auto: str = "AutoModelForCausalLM", **kwargs):
    import hf_pipeline

    # The tracer, unless a test asks otherwise: these families also have a recipe (decoder.toml).
    kwargs.setdefault("split_method", "trace")
    return getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)


def _train_batch(arch: str) -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs(arch, batch=8, seq=9)
    if arch == "t5":
        # No decoder inputs: the model shifts them from the labels, as transformers does.
        return {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
            "labels": inputs["decoder_input_ids"],
        }
    return {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}


# --------------------------------------------------------------------------- run on every rank
def _forward(path: str, kwargs: dict, batch: int = 6, seq: int = 9) -> dict:
    model = _load(path, **kwargs)
    inputs = tiny.sample_inputs("llama", batch=batch, seq=seq)
    out = model(**inputs)
    made = (len(model.stages[0].tracer.traces), len(model.runtime))
    # One row fewer pads (repeating the last row) to the same microbatch shape: nothing is traced again.
    fewer = model(**{k: v[:-1] for k, v in inputs.items()})
    return {
        "logits": out.logits,
        "fewer_logits": fewer.logits,
        "made": made,
        "made_after_fewer": (len(model.stages[0].tracer.traces), len(model.runtime)),
        "class": type(model).__name__,
        "output_class": type(out).__name__,
        "plan": [(s.index, s.rank, s.blocks, s.modules) for s in model.plan.stages],
        "local": [s.spec.index for s in model.stages],
        "names": sorted(n for n, _ in model.checkpoint_named_parameters()),
        "keys_read": sorted(model.load_report.keys_read),
    }


def _train(path: str, arch: str, kwargs: dict) -> dict:
    model = _load(path, tiny.AUTO.get(arch, "AutoModelForCausalLM"), **kwargs)
    loss = model.train_step(_train_batch(arch))
    grads = {n: p.grad.clone() for n, p in model.checkpoint_named_parameters() if p.grad is not None}
    # One optimizer step over model.parameters(): a tied tensor held as two Parameters would move twice.
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    params = {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}
    return {
        "loss": loss, "grads": grads, "params": params, "class": type(model).__name__,
        "local": [(s.spec.index, s.spec.rank) for s in model.stages],
    }


def _job(forward_cases: list, train_cases: list) -> dict:
    # One spawned job runs everything of a world size: process start-up dominates these tiny runs.
    return {
        "forward": [_forward(path, kwargs) for path, kwargs in forward_cases],
        "train": [_train(path, arch, kwargs) for path, arch, kwargs in train_cases],
    }


# --------------------------------------------------------------------------- checks
def _saved_keys(path: str) -> set[str]:
    return set(json.loads((pathlib.Path(path) / "model.safetensors.index.json").read_text())["weight_map"])


def _check_forward(results: list[dict], path: str, world: int, what: str) -> None:
    want = _reference(path)
    plan = results[0]["plan"]
    for rank, res in enumerate(results):
        assert res["class"] == "TracedPipelinedModel", what
        assert res["logits"].shape == want.shape, what
        diff = (res["logits"] - want).abs().max().item()
        assert diff <= TOL, f"{what} rank {rank}: max abs diff {diff}"
        # 5 rows pad to the microbatches of 6: the trace and the runtime of 6 rows served them.
        assert res["fewer_logits"].shape == want[:-1].shape, what
        diff = (res["fewer_logits"] - want[:-1]).abs().max().item()
        assert diff <= TOL, f"{what} rank {rank}, one row fewer: max abs diff {diff}"
        assert res["made"] == (1, 1) and res["made_after_fewer"] == (1, 1), (what, res["made"], res["made_after_fewer"])
        assert res["plan"] == plan, f"{what}: rank {rank} built another plan"
        assert res["local"] == [i for i, r, _, _ in plan if r == rank], what
    # Each rank read only its own stages' tensors; together they read the whole checkpoint.
    saved = _saved_keys(path)
    assert all(len(r["keys_read"]) < len(saved) for r in results), what
    assert set().union(*(r["keys_read"] for r in results)) == saved, what


def test_find_blocks_is_the_largest_list_of_same_class_modules():
    from hf_pipeline.loading.stages import meta_model
    from hf_pipeline.loading.trace import find_blocks

    assert find_blocks(meta_model(_config("opt"), "AutoModelForCausalLM")) == "model.decoder.layers"
    assert find_blocks(meta_model(_config("bloom"), "AutoModelForCausalLM")) == "transformer.h"
    # T5 has two stacks; the decoder's blocks (with cross-attention) hold more parameters.
    assert find_blocks(meta_model(tiny.config_for("t5"), "AutoModelForSeq2SeqLM")) == "decoder.block"


@pytest.mark.slow
def test_world_size_1_runs_traced_stages_in_sequence_and_retraces_without_reloading(checkpoints):
    import hf_pipeline
    from hf_pipeline.model import TracedPipelinedModel

    for arch in ("opt", "phi", "bloom"):
        path = checkpoints[arch]
        model = _load(path, num_stages=2, virtual_stages=2)  # split_method="auto": no recipe -> traced
        assert isinstance(model, TracedPipelinedModel) and isinstance(model, hf_pipeline.model.PipelinedModel)
        assert [s.spec.index for s in model.stages] == [0, 1]
        text = str(model.plan)
        assert "2 stages on 1 rank(s)" in text and model.plan.stages[0].blocks[0] in text
        # Stage parameter names are checkpoint keys, and every key was read exactly once.
        saved = _saved_keys(path)
        assert sorted(model.load_report.keys_read) == sorted(saved)
        shapes = ((6, 9), (3, 5)) if arch != "bloom" else ((6, 9),)
        for batch, seq in shapes:
            out = model(**tiny.sample_inputs("llama", batch=batch, seq=seq))
            diff = (out.logits - _reference(path, batch, seq)).abs().max().item()
            assert diff <= TOL, f"{arch} {batch}x{seq}: max abs diff {diff}"
        # The second shape was a new trace, wired to the loaded Parameters: nothing read again.
        tracer = model.stages[0].tracer
        assert len(tracer.traces) == len(shapes)  # one per input shape
        params = {id(p) for _, p in model.checkpoint_named_parameters()}
        for trace in tracer.traces.values():
            for runner in trace.runners.values():
                assert {id(p) for p in runner.parameters()} <= params
        assert sorted(model.load_report.keys_read) == sorted(saved)


def test_llama_can_be_forced_through_the_tracer_and_recipes_stay_the_default(checkpoints):
    from hf_pipeline.model import PipelinedModel

    path = checkpoints["llama"]
    traced = _load(path, num_stages=2, virtual_stages=2, split_method="trace")
    assert type(traced).__name__ == "TracedPipelinedModel"
    out = traced(**tiny.sample_inputs("llama", batch=6, seq=9))
    assert (out.logits - _reference(path)).abs().max().item() <= TOL
    # Every linear of the traced graphs goes through weight_pass.linear, which zero-bubble steps
    # make defer its weight gradient to W (the graph's own aten.linear could not).
    from hf_pipeline.runtime import weight_pass

    (trace,) = traced.stages[0].tracer.traces.values()
    graphs = [
        m.__dict__.get("graph") or getattr(m, "_graph", None) for r in trace.runners.values() for m in r.graph.modules()
    ]
    targets = [n.target for g in graphs if isinstance(g, torch.fx.Graph) for n in g.nodes]
    assert targets.count(weight_pass.linear) == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert torch.ops.aten.linear.default not in targets
    assert type(_load(path, num_stages=2, virtual_stages=2, split_method="auto")) is PipelinedModel  # has a recipe
    # OPT too (the generic decoder recipe); a family no recipe claims is refused by "recipe" (test_recipes.py)
    assert type(_load(checkpoints["opt"], split_method="auto")) is PipelinedModel
    with pytest.raises(ValueError, match="split_method must be one of"):
        _load(path, split_method="export")


@pytest.mark.equiv  # traces a model twice: about 2.5 s on 2 shared cores
def test_untraceable_model_and_generate_fail_with_what_to_do(tmp_path, checkpoints):
    from hf_pipeline.loading.trace import TraceError

    path = _checkpoint(tmp_path / "gptj", "gptj")
    with pytest.raises(TraceError) as info:
        _load(path, num_stages=2, virtual_stages=2)
    msg = str(info.value)
    assert "GPTJForCausalLM" in msg and "torch.export" in msg and "recipe" in msg
    assert "FakeTensorDeviceMismatchError" in msg  # the export failure's own first line
    # Falcon: transformers up to 5.24 builds index constants on the (meta) weights' device, which
    # is caught at load; from 5.25 on they do not depend on the weights, and the traced model must
    # then be exact.
    falcon = _checkpoint(tmp_path / "falcon", "falcon")
    try:
        traced_falcon = _load(falcon, num_stages=2, virtual_stages=2)
    except TraceError as e:
        assert re.search(r"FalconForCausalLM captured the constant 'transformer\.h\.0\..*meta device", str(e)), str(e)
    else:
        out = traced_falcon(**tiny.sample_inputs("llama", batch=6, seq=9))
        assert (out.logits - _reference(falcon)).abs().max().item() <= TOL
    model = _load(checkpoints["opt"])
    with pytest.raises(TraceError, match="needs a recipe"):
        model.generate(tiny.sample_inputs("llama", batch=1)["input_ids"], max_new_tokens=2)


def _reference_training(path: str, arch: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[set[str]]]:
    """Transformers' loss and gradients by parameter name, and the names of each distinct tensor (ties)."""
    ref = tiny.reference(path, tiny.AUTO.get(arch, "AutoModelForCausalLM")).train()
    loss = ref(**_train_batch(arch)).loss
    loss.backward()
    named = list(ref.named_parameters(remove_duplicate=False))
    aliases: dict[int, set[str]] = {}
    for n, p in named:
        aliases.setdefault(id(p), set()).add(n)
    return loss.detach(), {n: p.grad for n, p in named if p.grad is not None}, list(aliases.values())


def _reference_step(path: str, arch: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parameters by name before and after one SGD step of transformers on the training batch."""
    ref = tiny.reference(path, tiny.AUTO.get(arch, "AutoModelForCausalLM")).train()
    before = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    ref(**_train_batch(arch)).loss.backward()
    torch.optim.SGD(ref.parameters(), lr=SGD_LR).step()
    return before, {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}


def _check_training(per_rank: list[dict], path: str, arch: str, what: str) -> set[str]:
    """The loss on every rank and each parameter's gradient, by checkpoint name; returns the names seen."""
    want_loss, want_grads, tensors = _reference_training(path, arch)
    before, after = _reference_step(path, arch)
    names: set[str] = set()
    for rank, got in enumerate(per_rank):
        assert got["class"] == "TracedPipelinedModel", what
        assert torch.allclose(got["loss"], want_loss, rtol=GRAD_RTOL, atol=0), (what, rank, got["loss"], want_loss)
        bad = []
        for name, g in got["grads"].items():
            want = want_grads[name]
            # GRAD_ATOL: the key-projection biases get a gradient that is zero in exact arithmetic
            # (softmax ignores a shift shared by all keys), so only rounding noise is compared there.
            err = (g - want).norm().item()
            if err > GRAD_RTOL * want.norm().item() + GRAD_ATOL:
                bad.append(f"{name}: |diff| {err:.3g}, |want| {want.norm().item():.3g}")
        assert not bad, f"{what} rank {rank} gradients differ: " + "; ".join(bad)
        names |= set(got["grads"])
        # After the step each parameter must equal transformers' to a small fraction of the update
        # (a tensor stepped twice is off by a whole update).
        for name, got_p in got["params"].items():
            update = (after[name] - before[name]).norm().item()
            err = (got_p - after[name]).norm().item()
            assert err <= 1e-4 * update + 1e-7, (
                f"{what} rank {rank} {name}: off by {err:.3g} after one step (update {update:.3g})"
            )
    # Every parameter got its gradient on some rank, under one of its names (a tied tensor under
    # the name of the module each stage runs it as).
    assert names <= set(want_grads), (what, sorted(names - set(want_grads)))
    missing = [sorted(group) for group in tensors if not group & names]
    assert not missing, (what, missing)
    return names


@pytest.mark.dist
def test_world_size_2_forward_and_training_through_every_schedule_kind_equal_transformers(checkpoints):
    cases = [
        ("phi", {"n_microbatches": 2}),
        ("opt", {"n_microbatches": 4, "virtual_stages": 2}),  # 4 stages: values carried across 3 boundaries
        ("llama", {"n_microbatches": 2, "split_method": "trace"}),
    ]
    forced = {"split_method": "trace", "n_microbatches": 4}
    train = [
        ("opt", {"schedule": "1f1b", "n_microbatches": 4}),
        ("llama", {**forced, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
        ("llama", {**forced, "schedule": "interleaved-zero-bubble", "virtual_stages": 2}),
        ("llama-tied", {**forced, "schedule": "zbv-zero-bubble", "virtual_stages": 2}),
        ("t5", {"split_method": "trace", "schedule": "1f1b", "n_microbatches": 2}),
    ]
    per_rank = run_distributed(
        _job, 2, [(checkpoints[a], kw) for a, kw in cases], [(checkpoints[a], a, kw) for a, kw in train], timeout=600
    )
    for i, (arch, kw) in enumerate(cases):
        _check_forward([r["forward"][i] for r in per_rank], checkpoints[arch], 2, f"{arch} {kw}")
    for i, (arch, kw) in enumerate(train):
        what = f"{arch} {kw.get('schedule')}"
        _check_training([r["train"][i] for r in per_rank], checkpoints[arch], arch, what)
        local = [r["train"][i]["local"] for r in per_rank]
        if kw.get("virtual_stages") == 2:
            layout = (
                [[(0, 0), (3, 0)], [(1, 1), (2, 1)]]
                if "zbv" in kw["schedule"]
                else [[(0, 0), (2, 0)], [(1, 1), (3, 1)]]
            )
            assert local == layout, (what, local)
        if arch == "opt":
            # The tied LM head (= the embedding) on both ranks.
            assert "model.decoder.embed_tokens.weight" in per_rank[0]["train"][i]["grads"]
            assert "lm_head.weight" in per_rank[1]["train"][i]["grads"]
        if arch == "llama-tied":
            # V layout: the embedding (stage 0) and the tied LM head (stage 3) on rank 0 are one
            # Parameter there (gradients summed in it, stepped once), as in the unsplit model.
            tied = {"model.embed_tokens.weight", "lm_head.weight"}
            assert len(tied & set(per_rank[0]["train"][i]["params"])) == 1, (
                what,
                sorted(per_rank[0]["train"][i]["params"]),
            )
            assert len(tied & set(per_rank[0]["train"][i]["grads"])) == 1, what


@pytest.mark.dist
def test_world_size_3_carries_values_past_a_stage(checkpoints):
    cases = [("opt", {"n_microbatches": 3}), ("phi", {"n_microbatches": 3})]
    # A tied LLaMA traced into a V of 6 stages on 3 ranks: the embedding (stage 0) and the tied LM head
    # (stage 5) share rank 0, as one Parameter stepped once.
    train = [
        (
            "llama-tied6",
            {"split_method": "trace", "schedule": "zbv-zero-bubble", "virtual_stages": 2, "n_microbatches": 8},
        )
    ]
    per_rank = run_distributed(
        _job, 3, [(checkpoints[a], kw) for a, kw in cases], [(checkpoints[a], a, kw) for a, kw in train], timeout=600
    )
    for i, (arch, _kw) in enumerate(cases):
        results = [r["forward"][i] for r in per_rank]
        _check_forward(results, checkpoints[arch], 3, arch)
        assert [len(b) for _, _, b, _ in results[0]["plan"]] in ([1, 2, 1], [2, 1, 1], [1, 1, 2])
    for i, (arch, _kw) in enumerate(train):
        _check_training([r["train"][i] for r in per_rank], checkpoints[arch], arch, f"{arch} zbv at 3 ranks")
        assert [r["train"][i]["local"] for r in per_rank] == [[(0, 0), (5, 0)], [(1, 1), (4, 1)], [(2, 2), (3, 2)]]
        tied = {"model.embed_tokens.weight", "lm_head.weight"}
        assert len(tied & set(per_rank[0]["train"][i]["params"])) == 1, sorted(per_rank[0]["train"][i]["params"])
