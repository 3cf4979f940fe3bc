"""The default schedule and microbatch count (a load that names neither): the simulated choice of
``schedule="auto"`` over the schedules of today's placement, named options honoured, the fallback where
the choice cannot plan, a chosen count adapting to each call's rows, and at 2 ranks a model loaded with
the default that trains and answers as transformers does."""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.memory.auto_choice_costs import choose, chooser, default_choice
from hf_pipeline.planning.auto_choice import same_placement
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.schedules import fitting_microbatches, get_schedule

CAUSAL = "AutoModelForCausalLM"


def _llama(layers: int = 8):
    return transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=256,
    )


# (4, 2) is the path of (4, None) and (2, 2) together, and the longest (1.5 s): in the full suite.
@pytest.mark.parametrize("world,v", [(2, None), (4, None), (2, 2), pytest.param(4, 2, marks=pytest.mark.equiv)])
def test_default_picks_what_auto_picks_among_the_schedules_of_its_placement(world, v):
    cfg = _llama()
    kwargs, choice = default_choice(cfg, world, device_type="cpu", auto_class=CAUSAL, virtual_stages=v)
    _, auto = choose(cfg, world, device_type="cpu", auto_class=CAUSAL, schedule="auto", n_microbatches="auto",
                     virtual_stages=v or 1)
    old = PipelineOptions.resolve(cfg, world, auto_class=CAUSAL, virtual_stages=v)  # the fixed default
    # Same simulation: every default candidate is one of auto's, with the same estimate (one cost model, the
    # same arithmetic: equal to float rounding; 1e-9 absorbs nothing else).
    by_auto = {e.candidate: e for e in auto.estimates}
    for e in choice.estimates:
        assert same_placement(get_schedule(e.candidate.schedule), old)
        assert e.relative_step == pytest.approx(by_auto[e.candidate].relative_step, abs=1e-9)
    # ... and the pick is auto's best among those the default may take (its placement, no more activations live).
    usable = [e for e in choice.estimates if e.usable]
    best = min(e.relative_step for e in usable)
    assert by_auto[choice.chosen].relative_step == pytest.approx(best, abs=1e-4)
    if same_placement(get_schedule(auto.chosen.schedule), old) and auto.chosen in {e.candidate for e in usable}:
        assert choice.chosen == auto.chosen
    # Never slower than the old default by the same model (1F1B / interleaved 1F1B, one microbatch per stage).
    was = next(e for e in choice.estimates if (e.candidate.schedule, e.candidate.n_microbatches)
               == (old.schedule.name, old.n_microbatches))
    assert best <= was.relative_step
    opts = PipelineOptions.resolve(cfg, world, auto_class=CAUSAL, **{
        k: val for k, val in kwargs.items() if k != "auto_class"})
    assert (opts.schedule.name, opts.n_microbatches) == (choice.chosen.schedule, choice.chosen.n_microbatches)
    assert opts.adapt_microbatches and opts.virtual_stages == old.virtual_stages
    assert f"schedule {choice.chosen.schedule!r}, n_microbatches={choice.chosen.n_microbatches}: chosen" in \
        opts.schedule_note
    # The note says which placements it did not weigh, unless the user placed the stages (named virtual_stages).
    assert ("placements with more stages per rank (the interleaved and V schedules) are not considered"
            in opts.schedule_note) == (v is None)
    # The arithmetic is the same every time (so on every rank): the same note, word for word.
    again, _ = default_choice(cfg, world, device_type="cpu", auto_class=CAUSAL, virtual_stages=v)
    assert again["schedule_note"] == kwargs["schedule_note"]


@pytest.mark.unit
def test_named_options_are_honoured_and_only_neither_chooses():
    # Named: no chooser at all (resolve keeps today's defaults for the other one); neither: the default's choice.
    assert chooser("1f1b", None, tune_batch=None, max_memory=None) is None
    assert chooser(None, 4, tune_batch=None, max_memory=None) is None
    assert chooser(None, None, tune_batch=None, max_memory=None).func is default_choice
    assert chooser("auto", None, tune_batch=None, max_memory=None).func is choose
    opts = PipelineOptions.resolve(_llama(), 2, auto_class=CAUSAL, schedule="gpipe")
    assert (opts.schedule.name, opts.n_microbatches, opts.adapt_microbatches) == ("gpipe", 2, False)


@pytest.mark.unit
@pytest.mark.parametrize("case", ["traced", "t5", "one rank", "no candidate"])
def test_default_falls_back_to_the_fixed_default_with_a_note(case):
    # (meshes with tp / ep / fsdp are chosen for: tests/planning/test_mesh_choice.py)
    cfg, world, kw, why = _llama(), 2, {"auto_class": CAUSAL}, ""
    if case == "traced":
        kw, why = {**kw, "split_method": "trace"}, "traced"
    elif case == "t5":
        cfg, kw, why = tiny.config_for("t5"), {"auto_class": "AutoModelForSeq2SeqLM"}, "encoder-decoder"
    elif case == "one rank":
        world, why = 1, "one stage per pipeline"
    else:  # the choice itself fails (no count trains one row on 2 stages): never an error, the old default
        kw, why = {**kw, "tune_batch": (1, 16)}, "found none"
    tune = kw.pop("tune_batch", None)
    kwargs, choice = default_choice(cfg, world, device_type="cpu", tune_batch=tune, **kw)
    opts = PipelineOptions.resolve(cfg, world, **kwargs)
    old = PipelineOptions.resolve(cfg, world, **kw)
    assert choice is None and not opts.adapt_microbatches
    assert (opts.schedule, opts.n_microbatches, opts.virtual_stages) == (old.schedule, old.n_microbatches,
                                                                         old.virtual_stages)
    assert "the fixed default, not chosen automatically because" in opts.schedule_note and why in opts.schedule_note


@pytest.mark.unit
def test_a_chosen_count_fits_each_call():
    spec = get_schedule("1f1b")
    fit = lambda rows, training: fitting_microbatches(spec, pp_size=2, virtual_stages=1, n_microbatches=8,  # noqa: E731
                                                      rows=rows, training=training)
    assert [fit(r, True) for r in (16, 8, 6, 4, 2)] == [8, 8, 6, 4, 2]  # divides the rows, >= 2 stages for 1F1B
    assert fit(3, True) == 3 and fit(1, True) == 8  # 1 row cannot train on 2 stages: the usual check says why
    assert [fit(r, False) for r in (16, 5, 1)] == [8, 5, 1]  # a forward pads its last microbatch


@pytest.mark.unit
def test_a_training_call_runs_the_count_with_the_shortest_simulated_step_for_its_shape():
    """The benchmark's LLaMA (hidden 384, 12 layers) on 2 CPU ranks, the default having chosen 1F1B with 16: a
    16 x 512 step runs 16 microbatches, a 16 x 128 one 8 (measured faster there: the per-action overhead weighs
    more against short microbatches), 12 rows the count that divides them; without a length, the most that fit."""
    from hf_pipeline.memory.auto_choice_costs import _loader_plan
    from hf_pipeline.planning.auto_choice import call_microbatches

    cfg = transformers.LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
                                   num_attention_heads=6, num_key_value_heads=6, vocab_size=2048,
                                   max_position_embeddings=512)
    flops = tuple(s.flops_per_token for s in _loader_plan(cfg, PipelineOptions.resolve(cfg, 2)).stages)
    call = lambda rows, seq: call_microbatches("1f1b", pp_size=2, virtual_stages=1, n_microbatches=16,  # noqa: E731
                                               rows=rows, training=True, seq=seq, flops=flops, device_type="cpu")
    assert [call(16, 512), call(16, 128), call(16, None), call(12, 128), call(4, 128)] == [16, 8, 16, 12, 4]
    forward = call_microbatches("1f1b", pp_size=2, virtual_stages=1, n_microbatches=16, rows=5, training=False,
                                seq=128, flops=flops, device_type="cpu")
    assert forward == 5  # a forward pads: the most up to its rows


def _default_trains_as_transformers(path):
    from hf_pipeline import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False)
    named = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False, schedule="gpipe", n_microbatches=2)
    out = {"note": model.options.schedule_note, "chosen": str(model.auto_choice.chosen),
           "picked": (model.schedule.name, model.n_microbatches), "named": (named.schedule.name, named.n_microbatches,
                                                                            named.options.schedule_note)}
    ref.train()
    model.train()
    for rows in (8, 6):  # 8 rows run the chosen count; 6 the most that divide them
        batch = tiny.make_batch("llama", rows=rows, seed=rows)
        ref.zero_grad()
        want_loss = float(ref(**batch).loss)
        ref(**batch).loss.backward()
        want = {n: p.grad.clone() for n, p in ref.named_parameters()}
        for p in model.parameters():
            p.grad = None
        loss = float(model.train_step(batch))
        got = dict(model.checkpoint_named_parameters())
        out[f"loss{rows}"] = (loss, want_loss)
        out[f"grad{rows}"] = max(float((got[n].grad - want[n]).abs().max() / want[n].abs().max()) for n in got)
        out[f"m{rows}"] = model.microbatches_for(rows, training=True)
    model.eval()
    ref.eval()
    ids = tiny.make_batch("llama", rows=3)["input_ids"]  # fewer rows than the chosen count: a forward still runs
    out["logits"] = float((model(ids).logits - ref(ids).logits).abs().max())
    return out


@pytest.mark.dist
def test_default_loaded_model_trains_as_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "ck", "llama")
    results = run_distributed(_default_trains_as_transformers, 2, str(path), timeout=240)
    assert results[0]["note"] == results[1]["note"]  # one choice, identical on every rank
    for res in results:
        name, m = res["picked"]
        assert res["chosen"] == f"{name} v=1 m={m}" and m > 2, res  # a count beyond the old one per stage
        assert res["named"] == ("gpipe", 2, "")  # named options as they were, no note
        assert (res["m8"], res["m6"]) == (min(m, 8), 6)
        for rows in (8, 6):
            # fp32 loss and gradients, relative: summation order ~1e-6; a dropped or doubled microbatch moves the
            # loss >= 1e-2 and a gradient by 100%.
            loss, want = res[f"loss{rows}"]
            assert loss == pytest.approx(want, rel=1e-5) and res[f"grad{rows}"] < 1e-5, res
        assert res["logits"] < 1e-5  # fp32 forward, same math: rounding only
