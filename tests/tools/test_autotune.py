"""schedule="auto" / n_microbatches="auto" and model.tune(): the cost model's simulation against the
schedules' own bubble formulas, the candidates' rules, the memory budget, and at 2 ranks a model
loaded with "auto" (and then tuned) that trains exactly as transformers does; model.measure_split():
the fit of measured stage times, the planner with a measured head, and at 2 ranks a head made slow
that the measured split relieves."""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.errors import InputError
from hf_pipeline.families.recipe import get_recipe
from hf_pipeline.loading.stages import meta_model
from hf_pipeline.planning.plan import PlanError, make_plan
from hf_pipeline.planning.schedules import get_schedule
from hf_pipeline.tools.autotune import choose, fit_stage_costs, simulate_step
from hf_pipeline.tools.profile import schedule_actions


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
        AutoModelForCausalLM.from_pretrained(path, pipeline=True, tune_batch=(8, 16), device="cpu", progress=False)


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


# ----------------------------------------------------------------------------- measured split
def test_fit_takes_the_blocks_rate_from_stages_without_a_head_and_measures_the_head():
    # 4 stages: the first holds an embedding (no FLOPs), the last the head (1e6 FLOPs per token).
    # Blocks cost 2 s per FLOP/token; the head 3 s per FLOP/token there: 1.5 blocks' worth per FLOP.
    blocks = [3e6, 3e6, 4e6, 2e6]
    extras = [{"embed": 0.0}, {}, {}, {"norm": 0.0, "lm_head": 1e6}]
    seconds = [2 * b for b in blocks]
    seconds[3] += 3 * 1e6
    alpha, measured = fit_stage_costs(blocks, extras, seconds)
    assert alpha == pytest.approx(2.0)
    assert measured == {"lm_head": pytest.approx(1.5e6)}
    # Two FLOP-doing modules on one stage share what it takes beyond its blocks by their FLOPs.
    _, shared = fit_stage_costs([1e6, 1e6], [{}, {"dense": 1e6, "decoder": 3e6}], [1.0, 1.0 + 8.0])
    assert shared == {"dense": pytest.approx(2e6), "decoder": pytest.approx(6e6)}
    # A head faster than its FLOPs say is measured as such; one that takes no time beyond the blocks is 0.
    assert fit_stage_costs([1e6, 1e6], [{}, {"h": 1e6}], [1.0, 1.25])[1] == {"h": pytest.approx(0.25e6)}
    assert fit_stage_costs([1e6, 1e6], [{}, {"h": 1e6}], [1.0, 0.5])[1] == {"h": 0.0}
    with pytest.raises(InputError, match="cannot be told apart"):
        fit_stage_costs([1e6], [{"h": 1e6}], [1.0])


def _head_stage_blocks(plan) -> float:
    last = plan.stages[-1]
    return len(last.blocks) - 0.5 * len(last.halves)


def test_a_measured_head_moves_blocks_between_stages():
    config = _llama(layers=8)
    config.vocab_size = 4096  # a head of about 2 blocks' FLOPs
    model = meta_model(config, "AutoModelForCausalLM")
    recipe = get_recipe("llama")
    plain = make_plan(model, recipe, pp_size=2)
    head_flops = 2.0 * config.hidden_size * config.vocab_size
    # The head's own FLOP count as its measured cost: the same plan.
    same = make_plan(model, recipe, pp_size=2, measured_flops={"lm_head": head_flops})
    assert same.split_points == plain.split_points
    # A head as costly as 4 of its FLOP counts leaves the last stage fewer blocks; a free one, more.
    heavy = make_plan(model, recipe, pp_size=2, measured_flops={"lm_head": 4 * head_flops})
    free = make_plan(model, recipe, pp_size=2, measured_flops={"lm_head": 0.0})
    assert _head_stage_blocks(heavy) < _head_stage_blocks(plain) < _head_stage_blocks(free)
    assert heavy.stages[-1].flops_per_token > 4 * head_flops  # the stage's cost counts the measured head
    with pytest.raises(PlanError, match="measured_flops names .*model.layers.0"):
        make_plan(model, recipe, pp_size=2, measured_flops={"model.layers.0": 1.0})


def _measure_with_slow_head(path, sleep_s, num_stages=None):
    import time

    from hf_pipeline import AutoModelForCausalLM

    torch.manual_seed(0)
    batch = tiny.make_batch("llama", rows=8)
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False, num_stages=num_stages)
    model.train()
    before = {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}
    head = model.get_output_embeddings()
    if head is not None and sleep_s:  # the rank holding the head: make it cost far more than its FLOPs
        head.register_forward_hook(lambda *a: time.sleep(sleep_s))
    advice = model.measure_split(batch, steps=1)
    no_grads = all(p.grad is None for p in model.parameters())
    after = dict(model.checkpoint_named_parameters())
    loss = float(model.train_step(batch))
    return {
        "split": advice.split, "current": advice.current,
        "head_blocks": advice.measured_flops["lm_head"] / advice.block_flops,
        "head_seconds": advice.measured_flops["lm_head"] * advice.seconds_per_flop,
        "stage_seconds": advice.stage_seconds,
        "counted_blocks": advice.counted_flops["lm_head"] / advice.block_flops, "text": str(advice),
        "unchanged": all(torch.equal(before[n], after[n]) for n in before), "no_grads_left": no_grads, "loss": loss,
        "ranks": advice.rank_seconds, "predicted": advice.predicted_rank_seconds,
    }


@pytest.mark.dist
@pytest.mark.parametrize("world,num_stages", [(2, None), (4, 2)])  # 4: two pipeline replicas, their times averaged
def test_measured_split_relieves_a_slow_head_on_every_rank_alike(tmp_path, world, num_stages):
    path = tiny.make_checkpoint(tmp_path / "ck", "llama")
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref_loss = float(ref(**tiny.make_batch("llama", rows=8)).loss)
    res = run_distributed(_measure_with_slow_head, world, str(path), 0.05, num_stages, timeout=240)
    assert all(r["text"] == res[0]["text"] and r["split"] == res[0]["split"] for r in res)  # one advice, agreed
    r = res[0]
    assert r["current"] == ("model.layers.2",)
    # The head's 50 ms sleep per microbatch is measured apart from the blocks (give or take the blocks'
    # own spread: the first stage's blocks and embedding set their rate), where its FLOPs rate it below one block.
    assert 0.8 * 0.05 < r["head_seconds"] < 0.05 + r["stage_seconds"][0], r["text"]
    assert r["counted_blocks"] < 1 < r["head_blocks"], r["text"]
    # the last stage keeps only the last block (or its second half), and the predicted ranks are closer than measured
    assert r["split"] in (("model.layers.3",), ("model.layers.3.post_attention_layernorm",)), r["text"]
    assert max(r["predicted"]) / min(r["predicted"]) < max(r["ranks"]) / min(r["ranks"])
    assert r["unchanged"] and r["no_grads_left"]  # measuring trains no weights and leaves no gradients
    assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)  # and leaves the model as it was


def test_measure_split_refuses_one_rank_and_bad_steps_by_name(tmp_path):
    from hf_pipeline import AutoModelForCausalLM

    path = tiny.make_checkpoint(tmp_path / "ck", "llama", shards=1)
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32, progress=False)
    batch = tiny.make_batch("llama", rows=4)
    with pytest.raises(InputError, match="pipeline of 2 or more ranks"):
        model.measure_split(batch)
    for steps in (0, 1.5, True):
        with pytest.raises(InputError, match="steps must be a positive integer"):
            model.measure_split(batch, steps=steps)
    assert float(model.train_step(batch)) > 0  # still usable


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
