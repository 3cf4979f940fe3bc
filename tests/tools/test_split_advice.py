"""model.measure_split(): the fit of measured stage times, the planner with a measured head, and at 2
ranks a head made slow that the measured split relieves."""

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
from hf_pipeline.tools.split_advice import fit_stage_costs


def _llama(layers: int = 12):
    return transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1024, max_position_embeddings=256,
    )


def test_fit_takes_the_blocks_rate_from_stages_without_a_head_and_measures_the_head():
    # 4 stages: the first holds an embedding (no FLOPs), the last the head (1e6 FLOPs per token).
    # Blocks cost 2 s per FLOP/token; the head 3 s per FLOP/token there: 1.5 blocks' worth per FLOP.
    blocks = [3e6, 3e6, 4e6, 2e6]
    extras = [{"embed": 0.0}, {}, {}, {"norm": 0.0, "lm_head": 1e6}]
    seconds = [2 * b for b in blocks]
    seconds[3] += 3 * 1e6
    alpha, measured = fit_stage_costs(blocks, extras, seconds)
    # the fit of exact synthetic times (no noise): float64 rounding only (default 1e-6 relative); a wrong share
    # or rate moves a figure by 1e-1 or more.
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
    # 1F1B with one microbatch per stage, named: the sleep below is per microbatch, and the bounds are set for 2
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", dtype=torch.float32,
                                                 progress=False, num_stages=num_stages, schedule="1f1b",
                                                 n_microbatches=2)
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
    # fp32 loss, relative: summation order ~1e-6; a wrong mask or label, or a dropped microbatch, moves it by 1e-2
    # or more.
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
