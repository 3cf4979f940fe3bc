"""Tier 1: PipelineOptions check themselves however they are made (resolve or dataclasses.replace)."""

import dataclasses

import pytest
import tiny
import torch
from harness import run_distributed

from hf_pipeline.errors import InputError, ScheduleError
from hf_pipeline.planning.options import PipelineOptions


def _options(**kw):
    return PipelineOptions.resolve(tiny.config_for("llama"), 2, auto_class="AutoModelForCausalLM", **kw)


def test_resolved_options_fill_the_defaults():
    opts = _options(virtual_stages=2)
    assert (opts.schedule.name, opts.num_stages, opts.pp_size, opts.dp_size, opts.n_microbatches) == (
        "interleaved-1f1b", 4, 2, 1, 4,
    )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_n_microbatches_refused_as_given_and_through_replace(bad):
    message = rf"n_microbatches must be a positive integer, got {bad!r}"
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _options(n_microbatches=bad)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(_options(), n_microbatches=bad)


def test_replace_checks_the_placement():
    opts = _options()
    with pytest.raises(ScheduleError, match=r"schedule '1f1b' needs virtual_stages 1 per rank, got 2"):
        dataclasses.replace(opts, virtual_stages=2, num_stages=4)
    with pytest.raises(InputError, match=r"num_stages=3 must be pp_size x virtual_stages = 2 x 1"):
        dataclasses.replace(opts, num_stages=3)


# --------------------------------------------------------------------------- a default schedule never refuses
@pytest.mark.parametrize(
    "pp_size,virtual_stages,m,want",
    [
        (3, 1, 3, "1f1b"),  # the default trains: kept
        (3, 1, 2, "gpipe"),  # 1F1B needs m >= 3; GPipe ties looped BFS on the bubble and runs one stage like 1F1B
        (2, 1, 1, "gpipe"),
        (2, 2, 4, "interleaved-1f1b"),
        (2, 2, 5, "looped-bfs"),  # interleaved schedules need a multiple of their rounds (2): only looped BFS trains
    ],
)
def test_the_choice_follows_the_schedule_rules(pp_size, virtual_stages, m, want):
    from hf_pipeline.planning.schedules import SCHEDULES, choose_schedule, default_schedule

    spec, note = choose_schedule(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m)
    assert spec.name == want
    rules = dict(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m)
    assert spec.training_problem(**rules) is None and spec.accepts_virtual(virtual_stages)
    default = SCHEDULES[default_schedule(virtual_stages)]
    if want == default.name:
        assert note == f"schedule {want!r}: the default (no schedule was named)"
    else:
        problem = default.training_problem(**rules)
        assert note == (
            f"schedule {want!r}: chosen because no schedule was named and the default {default.name!r} {problem}"
        )
        trains = [s for s in SCHEDULES.values() if s.layout == default.layout and s.accepts_virtual(virtual_stages)
                  and s.training_problem(**rules) is None]
        assert spec.theoretical_bubble(**rules) == min(s.theoretical_bubble(**rules) for s in trains)


def test_resolve_picks_a_schedule_that_trains_only_when_none_was_named():
    opts = PipelineOptions.resolve(tiny.config_for("llama"), 3, auto_class="AutoModelForCausalLM", n_microbatches=2)
    assert opts.schedule.name == "gpipe"
    assert opts.schedule_note == (
        "schedule 'gpipe': chosen because no schedule was named and the default '1f1b' needs n_microbatches >= the "
        "number of stages (3) to train, got 2"
    )
    named = PipelineOptions.resolve(
        tiny.config_for("llama"), 3, auto_class="AutoModelForCausalLM", n_microbatches=2, schedule="1f1b"
    )
    assert named.schedule.name == "1f1b" and named.schedule_note == ""  # asked for: kept, refused at training
    assert _options().schedule_note == "schedule '1f1b': the default (no schedule was named)"


def _grads_by_key(model) -> dict[str, torch.Tensor]:
    layout = model.param_layout
    return {
        layout.key_of.get(name, name): p.grad.detach().clone()
        for stage in model.stages for name, p in stage.named_parameters() if p.grad is not None
    }


def _unnamed_schedule_job(path: str):
    from hf_pipeline import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", n_microbatches=2, progress=False)
    model.train()
    loss = model.train_step(tiny.make_batch("llama", 4, seed=1))
    return {"schedule": model.schedule.name, "note": model.options.schedule_note, "loss": float(loss),
            "grads": _grads_by_key(model)}


@pytest.mark.dist
def test_three_ranks_two_microbatches_no_schedule_named_trains_like_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    per_rank = run_distributed(_unnamed_schedule_job, 3, str(path), timeout=300)
    ref = tiny.reference(path, "AutoModelForCausalLM").train()
    ref_loss = ref(**tiny.make_batch("llama", 4, seed=1)).loss
    ref_loss.backward()
    seen = set()
    for rank, res in enumerate(per_rank):
        assert res["schedule"] == "gpipe" and "no schedule was named" in res["note"], (rank, res["note"])
        # fp32 loss and gradients, relative: summation order ~1e-6; a dropped microbatch moves them >= 1e-2, a
        # gradient off by 2x 100%.
        assert res["loss"] == pytest.approx(ref_loss.item(), rel=1e-5), f"rank {rank}: loss"
        for key, got in res["grads"].items():
            want = ref.get_parameter(key).grad
            diff = (got - want).abs().max().item()
            assert diff <= 1e-5 * want.abs().max().item() + 1e-9, f"rank {rank}: gradient of {key}: max diff {diff:.3g}"
            seen.add(key)
    assert seen == {n for n, _ in ref.named_parameters()}, "every parameter's gradient came back from some rank"


def test_the_memory_report_says_which_schedule_was_chosen_and_why():
    from hf_pipeline.memory.planner import plan_report

    chosen = plan_report(tiny.config_for("llama"), stages=3, n_microbatches=2, batch=2, seq=8)
    assert chosen.schedule == "gpipe"
    assert any("chosen because no schedule was named" in n for n in chosen.notes), chosen.notes
    named = plan_report(tiny.config_for("llama"), stages=3, n_microbatches=3, batch=3, seq=8, schedule="1f1b")
    assert not any("schedule" in n for n in named.notes), named.notes


@pytest.mark.parametrize(
    "config_class, model_class",
    [("Gemma3Config", "Gemma3ForConditionalGeneration"), ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
     ("LlavaConfig", "LlavaForConditionalGeneration")],
)
def test_multimodal_models_are_refused_naming_the_class_and_the_tower(config_class, model_class):
    import transformers

    from hf_pipeline.errors import InputError
    from hf_pipeline.planning.options import PipelineOptions

    config = getattr(transformers, config_class)()
    with pytest.raises(InputError, match=rf"{model_class} is a multimodal model \(vision_config besides"):
        PipelineOptions.resolve(config, 2, auto_class=model_class)
