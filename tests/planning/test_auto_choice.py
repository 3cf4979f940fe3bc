"""schedule="auto" / n_microbatches="auto" and model.tune(): the cost model's simulation against the
schedules' own bubble formulas, the candidates' rules, the memory budget, and at 2 ranks a model
loaded with "auto" (and then tuned) that trains exactly as transformers does."""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.errors import InputError
from hf_pipeline.memory.auto_choice_costs import choose
from hf_pipeline.planning.schedules import get_schedule
from hf_pipeline.planning.simulate import simulate_step
from hf_pipeline.tools.profile import schedule_actions

# pytest.approx's default (1e-6 relative) compares the simulation's float64 arithmetic on exact stage costs
# (1.0, 0.5, 2.0) with closed forms: rounding only; a missed action, fill or drain moves a figure by 1e-2 or more.


def _llama(layers: int = 12):
    return transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=256,
    )


@pytest.mark.parametrize("name,p,v,m",
                         [("gpipe", 2, 1, 8), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 6), ("interleaved-1f1b", 2, 2, 8),
                          ("interleaved-1f1b", 4, 2, 8)])
def test_simulated_step_of_equal_stages_has_the_theoretical_bubble(name, p, v, m):
    step, busy = simulate_step(name, pp_size=p, virtual_stages=v, n_microbatches=m, stage_cost=[1.0 / v] * (p * v))
    assert all(b == pytest.approx(3 * m) for b in busy.values())  # F 1x + B 2x per microbatch
    theory = get_schedule(name).theoretical_bubble(pp_size=p, n_microbatches=m, virtual_stages=v)
    assert 1 - 3 * m / step == pytest.approx(theory)


def test_simulation_sees_imbalance_and_overhead():
    # The slowest stage sets the pace: 1F1B with a 2x stage takes about 2x as long.
    even, _ = simulate_step("1f1b", pp_size=2, virtual_stages=1, n_microbatches=8, stage_cost=[1.0, 1.0])
    skew, _ = simulate_step("1f1b", pp_size=2, virtual_stages=1, n_microbatches=8, stage_cost=[1.0, 2.0])
    assert skew / even == pytest.approx(51 / 27)  # 8 x 3 x 2 on the slow rank + its fill and drain
    # Overhead per action: every action a rank runs pays it (zero-bubble schedules run up to 3 per
    # microbatch and stage, fewer where I + W run fused as one backward).
    zb, busy = simulate_step("zbv-zero-bubble", pp_size=2, virtual_stages=2, n_microbatches=8, stage_cost=[0.5] * 4,
                             overhead=0.5)
    zb0, busy0 = simulate_step("zbv-zero-bubble", pp_size=2, virtual_stages=2, n_microbatches=8, stage_cost=[0.5] * 4,
                               overhead=0.0)
    actions = schedule_actions("zbv-zero-bubble", pp_size=2, n_microbatches=8, virtual_stages=2)
    assert 2 * 8 * 2 < len(actions[0]) < 3 * 8 * 2  # some pairs fused, not all
    for r in (0, 1):
        assert busy[r] - busy0[r] == pytest.approx(0.5 * len(actions[r]))
        assert zb >= busy0[r] + 0.5 * len(actions[r])


def test_auto_chooses_the_best_simulated_candidate_and_respects_fixed_values():
    cfg = _llama()
    kwargs, choice = choose(cfg, 2, device_type="cpu", tune_batch=(16, 128), schedule="auto", n_microbatches="auto",
                            auto_class="AutoModelForCausalLM")
    usable = [e for e in choice.estimates if e.usable]
    best = min(e.relative_step for e in usable)
    chosen = next(e for e in usable if e.candidate == choice.chosen)
    # relative step times from one cost model: 1e-4 absorbs float ties only; a worse candidate is slower
    # by >= 1e-2.
    assert chosen.relative_step == pytest.approx(best, abs=1e-4)
    assert kwargs["schedule"] == choice.chosen.schedule and kwargs["n_microbatches"] == choice.chosen.n_microbatches
    # every candidate trains the batch: m divides the rows and meets the schedule's rules
    for e in choice.estimates:
        c = e.candidate
        assert 16 % c.n_microbatches == 0
        assert get_schedule(c.schedule).training_problem(pp_size=2, virtual_stages=c.virtual_stages,
                                                         n_microbatches=c.n_microbatches) is None
    assert {"1f1b", "interleaved-1f1b", "zbv-zero-bubble"} <= {e.candidate.schedule for e in choice.estimates}
    # A fixed schedule: only its microbatch counts are considered; a fixed count: only the schedules.
    kwargs, choice = choose(cfg, 2, device_type="cpu", tune_batch=(16, 128), schedule="1f1b", n_microbatches="auto",
                            auto_class="AutoModelForCausalLM")
    assert {e.candidate.schedule for e in choice.estimates} == {"1f1b"} and kwargs["schedule"] == "1f1b"
    assert {e.candidate.n_microbatches for e in choice.estimates} == {2, 4, 8, 16}  # 1F1B needs m >= 2 stages
    _, choice = choose(cfg, 2, device_type="cpu", tune_batch=(16, 128), schedule="auto", n_microbatches=8,
                       auto_class="AutoModelForCausalLM")
    assert {e.candidate.n_microbatches for e in choice.estimates} == {8}
    # More per-action overhead favours fewer, bigger microbatches.
    _, cheap = choose(cfg, 2, device_type="cpu", tune_batch=(16, 128), schedule="1f1b", n_microbatches="auto",
                      overhead_tokens=0, auto_class="AutoModelForCausalLM")
    _, dear = choose(cfg, 2, device_type="cpu", tune_batch=(16, 128), schedule="1f1b", n_microbatches="auto",
                     overhead_tokens=4096, auto_class="AutoModelForCausalLM")
    assert cheap.chosen.n_microbatches == 16 and dear.chosen.n_microbatches < 16
    assert "automatic schedule choice (cost model" in str(cheap) and "* 1f1b v=1 m=16" in str(cheap)


def test_memory_budget_leaves_out_what_does_not_fit():
    cfg = _llama(layers=4)
    _, free = choose(cfg, 2, device_type="cpu", tune_batch=(8, 64), schedule="1f1b", n_microbatches="auto",
                     max_memory="100GB", auto_class="AutoModelForCausalLM")
    peaks = {e.candidate.n_microbatches: e.peak_bytes for e in free.estimates}
    assert all(p > 0 for p in peaks.values()) and peaks[2] > peaks[8]  # bigger microbatches keep more activations
    budget = (peaks[2] + peaks[8]) // 2
    _, tight = choose(cfg, 2, device_type="cpu", tune_batch=(8, 64), schedule="1f1b", n_microbatches="auto",
                      max_memory=budget, auto_class="AutoModelForCausalLM")
    left_out = {e.candidate.n_microbatches for e in tight.estimates if not e.usable}
    assert 2 in left_out and tight.chosen.n_microbatches not in left_out
    assert all(e.peak_bytes <= budget for e in tight.estimates if e.usable)
    with pytest.raises(InputError, match="no schedule fits max_memory"):
        choose(cfg, 2, device_type="cpu", tune_batch=(8, 64), schedule="1f1b", n_microbatches="auto", max_memory=1000,
               auto_class="AutoModelForCausalLM")


def test_tune_batch_without_auto_is_refused(tmp_path):
    from hf_pipeline import AutoModelForCausalLM

    path = tiny.make_checkpoint(tmp_path / "ck", "llama", shards=1)
    with pytest.raises(InputError, match="tune_batch / max_memory plan the automatic choice"):
        # With neither named, tune_batch plans the default's choice (tests/planning/test_default_choice.py).
        AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="1f1b", tune_batch=(8, 16), device="cpu",
                                             progress=False)


def _auto_then_tune(path):
    from hf_pipeline import AutoModelForCausalLM

    torch.manual_seed(0)
    batch = tiny.make_batch("llama", rows=8)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    ref(**batch).loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", dtype=torch.float32, schedule="auto", n_microbatches="auto",
        tune_batch=(8, 9), progress=False,
    )
    model.train()
    picked = (model.schedule.name, model.plan.virtual_stages, model.n_microbatches)

    def worst() -> float:
        got = dict(model.checkpoint_named_parameters())
        return max(float((got[n].grad - want[n]).abs().max() / want[n].abs().max()) for n in got)

    loss = float(model.train_step(batch))
    first = worst()
    for p in model.parameters():
        p.grad = None
    tuned = model.tune(batch, steps=1)
    assert all(p.grad is None for p in model.parameters())  # tune leaves no gradients behind
    after = (model.schedule.name, model.n_microbatches)
    loss2 = float(model.train_step(batch))
    return {
        "picked": picked, "chosen": str(model.auto_choice.chosen), "loss": loss, "loss2": loss2,
        "ref_loss": float(ref(**batch).loss),
        "grad_err": first, "grad_err_after_tune": worst(),
        "tuned": (tuned.chosen.schedule, tuned.chosen.n_microbatches), "after": after,
        "tried": sorted({e.candidate.schedule for e in tuned.estimates}),
        "times": [e.measured_seconds for e in tuned.estimates],
    }


@pytest.mark.dist
def test_auto_loaded_and_tuned_model_trains_as_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "ck", "llama")
    for res in run_distributed(_auto_then_tune, 2, str(path), timeout=240):
        name, v, m = res["picked"]
        assert res["chosen"] == f"{name} v={v} m={m}"
        # fp32 loss and gradients, relative: summation order ~1e-6; a dropped microbatch moves them >= 1e-2, a
        # gradient off by 2x 100%.
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-5)
        assert res["loss2"] == pytest.approx(res["ref_loss"], rel=1e-5)
        assert res["grad_err"] < 1e-5 and res["grad_err_after_tune"] < 1e-5, res
        assert res["after"] == res["tuned"]  # the model now runs what tune measured fastest
        assert len(res["tried"]) >= 2 and all(t > 0 for t in res["times"])


def test_auto_schedule_alone_keeps_the_default_microbatch_count():
    # schedule="auto" without n_microbatches="auto": each candidate runs the loader's default, one per stage.
    _, choice = choose(_llama(), 2, device_type="cpu", tune_batch=(16, 128), schedule="auto",
                       auto_class="AutoModelForCausalLM")
    assert {(e.candidate.virtual_stages, e.candidate.n_microbatches) for e in choice.estimates} <= {(1, 2), (2, 4)}
    assert {"1f1b", "zbv-zero-bubble"} <= {e.candidate.schedule for e in choice.estimates}


def test_step_graph_built_once_per_layout():
    # The cost model simulates many candidates and splits: one schedule layout's action graph is
    # built once and reused for any stage costs (the planner's load time depends on it).
    from hf_pipeline.planning import simulate

    simulate._step_graph.cache_clear()
    a, _ = simulate_step("interleaved-1f1b", pp_size=2, virtual_stages=2, n_microbatches=4,
                         stage_cost=[1.0, 1.0, 1.0, 1.0])
    b, _ = simulate_step("interleaved-1f1b", pp_size=2, virtual_stages=2, n_microbatches=4,
                         stage_cost=[1.0, 2.0, 1.0, 1.0])
    info = simulate._step_graph.cache_info()
    assert (info.misses, info.hits) == (1, 1) and b > a
