"""Experts over data-parallel ranks (``ep_over="data"``: transformers' ``ep_size > tp_size``) equal
single-process transformers with the same global batch, for Mixtral and Qwen3-MoE.

Each rank keeps half of every MoE layer's experts (``Shard(0)`` on its ep mesh: the same stage in 2
consecutive replicas, whose rows differ), and transformers' ``AllToAllEP`` exchanges the routed tokens
between the replicas. Meshes: pp1 x ep2 over dp2 (2 ranks); pp2 x dp2 with ep2 over the replicas under 1F1B
and ZBV, and pp1 x dp4 with ep2 (two ep groups: the expert gradients summed over the expert-replica group)
at 4 ranks, and dp2 x tp2 with ep4 (transformers' tp_mesh: each tp rank sends its slice of the shared rows).
Over FSDP ranks (the experts left out of FSDP, each rank keeping its own whole): fsdp4 with ep2 asked through
transformers' ``DistributedConfig(fsdp_size=4, ep_size=2)`` (two ep groups, its training state resumed), and
pp2 x fsdp2 with ep2 under 1F1B, and fsdp2 x tp2 with ep4 (``DistributedConfig(tp_size=2, fsdp_size=2,
ep_size=4)``: FSDP over the tp shards, the experts on their own mesh), and HSDP (two replicas of an
fsdp2-sharded pipeline, each replica's fsdp ranks an ep group, its training state resumed); there every byte
read is one kept, and
one AdamW ``foreach`` step over both meshes' DTensors equals the per-tensor loop.
On every rank, against transformers on one process (``tp_helpers.compare``, generate=False):

- logits of a padded batch (1e-5: the experts' outputs come back through the all-to-all in another
  summation order, ~1e-7; an expert missed or run twice moves them by its whole contribution, ~1e-1), and
  the loss of a forward with labels (relative 1e-5);
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps on a global batch of 8: losses and norms (relative
  1e-5), every parameter afterwards gathered whole (1e-5; an expert gradient summed over the ep group as well
  doubles it and moves the parameter by ~lr = 1e-3 after AdamW's normalisation of the second step's moments);
- ``save_pretrained`` reloaded by plain transformers equal to the trained parameters (exactly), and the training
  state saved with the optimizer resumed on the same mesh takes the next step with the same loss (exactly);
- bytes read per rank at pp1: the dense tensors and exactly half of the experts' bytes.

At 4 ranks Mixtral trains with the routers' load-balancing loss (``output_router_logits``). At 2 ranks a
forward failing on one rank while the other waits for it in the all-to-all raises on both, and the model
then runs on in fresh groups (the comparisons above follow it).

``generate`` runs every replica in lock step (rows padded until all replicas' rows are done): greedy tokens
equal transformers' on every mesh, and seeded sampling (all but ZBV and tp2, for time) equals the pipeline on
one process (its per-row streams), both with
EOS ids chosen so that one replica's rows all end while another's still generate, 5 prompts split 3 / 2 (or
2 / 1 / 1 / 1) over the replicas and every replica cut into the same number of microbatches. Beam search
(where sampling runs: two beams, and three with two returned, ``early_stopping=True`` and a length penalty)
equals transformers' on every rank, with EOS ids that end one replica's beam search steps before another's
(transformers' steps on each replica's share alone differ): a replica leaving the ring there hangs its peers in
the all-to-all.
"""

from __future__ import annotations

import pytest
import torch
from decoders import VOCAB, decoder_config
from harness import run_distributed
from safetensors import safe_open
from tp_helpers import EPS, LR, compare, exercise

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROWS, PROMPT, NEW = 5, 6, 8  # generate: prompts (5 rows: shares of 3 and 2 over 2 replicas), new tokens
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, seed=11)
# Beam search: transformers' defaults (early_stopping=False, length_penalty=1), then early_stopping=True with a
# length penalty and more beams than returned sequences.
BEAMS = (dict(num_beams=2), dict(num_beams=3, num_return_sequences=2, early_stopping=True, length_penalty=0.5))


def _checkpoint(root, model_type, **overrides):
    import transformers

    path = root / f"{model_type}{'-aux' if overrides else ''}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


def _load(path, kwargs):
    import hf_pipeline

    if "distributed_config" not in kwargs:
        kwargs = {"ep_size": 2, "ep_over": "data", **kwargs}
    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)


def _prompts():
    import tiny

    return tiny.sample_inputs("decoder", batch=ROWS, seq=PROMPT)


def _generations(model, gen) -> dict:
    """Greedy, seeded sampling and beam search in lock step (3 microbatches asked for: over 2 replicas the shares
    are 3 and 2 prompts, and both cut theirs into 2, as many as the smallest share allows)."""
    inputs, out = _prompts(), {}
    common = dict(max_new_tokens=NEW, pad_token_id=0, n_microbatches=3)
    out["greedy"], stats = model.generate(
        **inputs, do_sample=False, eos_token_id=gen["greedy"], return_stats=True, **common
    )
    out["microbatches"], out["prefill_steps"] = stats.n_microbatches, stats.prefill_steps
    if "sampled" in gen:
        out["sampled"] = model.generate(**inputs, eos_token_id=gen["sampled"], **SAMPLING, **common)
    if "beam" in gen:
        beam = dict(eos_token_id=gen["beam"], do_sample=False, **common)
        out["beam"] = [model.generate(**inputs, **beam, **b) for b in BEAMS]
    return out


def _resume(model, path, kwargs, save_dir):
    """One more step saved with its optimizer, then the next step on the model and on the resumed save."""
    import tiny

    from hf_pipeline.checkpointing.training_state import load_training_state

    def step(m, opt, seed):
        loss = float(m.train_step(tiny.make_batch("decoder", 8, seed=seed)))
        m.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    step(model, opt, 3)
    model.save_pretrained(save_dir, optimizer=opt, step=1)
    went_on = step(model, opt, 4)
    resumed = _load(save_dir, kwargs)
    resumed.train()
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR, eps=EPS)
    load_training_state(resumed, save_dir, optimizer=opt)
    return went_on, step(resumed, opt, 4)


def _survives(model) -> dict:
    """A forward failing on the last rank only, before its first MoE layer, while the others wait for it in the
    all-to-all: every rank raises (the culprit its own error), and the model runs on in fresh groups (the ep
    mesh rebound: the comparisons that follow use it)."""
    import tiny

    def fail_once(module, args):
        handle.remove()
        raise ValueError("a bug in the last rank")

    last = model.ctx.rank == model.ctx.world_size - 1
    if last:
        handle = model.stages[0].register_forward_pre_hook(fail_once)
    try:
        model(**tiny.sample_inputs("decoder", batch=2, seq=5))
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return {"raised": type(e).__name__, "last": last}
    return {"raised": None, "last": last}


def _foreach_matches_loop(model) -> float:
    """One AdamW step with ``foreach=True`` over FSDP shards (fsdp mesh) and experts (ep mesh) at once, against the
    per-tensor loop on the same gradients: the largest difference of any local shard afterwards."""
    import tiny

    from hf_pipeline.distributed.shards import local_tensor

    model.train()
    model.train_step(tiny.make_batch("decoder", 8, seed=6))
    params = [p for p in model.parameters() if p.grad is not None]
    start = [local_tensor(p.detach()).clone() for p in params]
    after = []
    for foreach in (False, True):
        with torch.no_grad():
            for p, t in zip(params, start, strict=True):
                local_tensor(p.detach()).copy_(t)
        torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=foreach).step()
        after.append([local_tensor(p.detach()).clone() for p in params])
    return max((a - b).abs().max().item() for a, b in zip(*after, strict=True))


def _case(path, kwargs, save_to, resume_to, survive, gen):
    from torch.distributed.tensor import DTensor

    model = _load(path, kwargs)
    res = {"experts": {n: (tuple(p.to_local().shape), tuple(p.shape)) for n, p in model.named_parameters()
                       if isinstance(p, DTensor) and ".experts." in n},
           "bytes": model.load_report.bytes_read, "dims": (model.dims.pp_size, model.dims.dp_size, model.dims.tp_size),
           **_generations(model, gen), "kept": _kept(model)}
    if survive:
        res["survived"] = _survives(model)
    res["labelled"] = _labelled_loss(model)
    res.update(exercise(model, "decoder", pipelined=True, generate=False, rows=4))
    model.save_pretrained(save_to)
    if resume_to:
        res["resumed"] = _resume(model, path, kwargs, resume_to)
    if model.dims.fsdp_size > 1:
        res["foreach"] = _foreach_matches_loop(model)
    return res


def _kept(model) -> int:
    """Bytes of the parameters this rank holds as loaded (its FSDP chunks, its experts whole, plain tensors)."""
    from hf_pipeline.distributed.shards import local_tensor

    unique = {id(p): local_tensor(p.detach()) for p in model.parameters()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _labelled_loss(model) -> float:
    """The loss of a forward with labels (inference: every replica runs the whole batch, the same microbatches)."""
    import tiny

    with torch.no_grad():
        return float(model(**tiny.make_batch("decoder", 4, seed=5)).loss)


def _job(cases):
    return [_case(*c) for c in cases]


def _reference(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {"labelled": _labelled_loss(model), **exercise(model, "decoder", pipelined=False, generate=False, rows=4)}


def _lengths(ids: torch.Tensor, eos: list[int]) -> list[int]:
    """Each row's new tokens up to and including its first EOS (``NEW`` when none)."""
    hit = torch.isin(ids[:, PROMPT:], torch.tensor(eos))
    return [int(row.nonzero()[0, 0]) + 1 if row.any() else NEW for row in hit]


def _replica_ends(lengths: list[int], replicas: int) -> list[int]:
    """The step at which each data-parallel replica's last row finishes (its contiguous share of the rows)."""
    from hf_pipeline.generation.microbatches import microbatch_bounds

    return [max(lengths[lo:hi]) for lo, hi in microbatch_bounds(len(lengths), replicas)]


def _eos_ending_replica_0_first(generate) -> list[int]:
    """EOS ids (some row's early tokens in the 2-replica split's first share) that end replica 0's rows while
    replica 1 still generates: the replicas' last steps differ, and replica 0 must step on with padded rows."""
    free = generate([VOCAB + 5])  # an id never produced: no row stops early
    for step in range(3):
        eos = sorted({int(free[r, PROMPT + step]) for r in range(ROWS - ROWS // 2)} - {0})
        ends = _replica_ends(_lengths(generate(eos), eos), 2)
        if ends[0] < ends[1]:
            return eos
    raise AssertionError("no EOS ends replica 0 first; change the prompts")


def _beam_steps(model, eos: list[int], replicas: int) -> list[list[int]]:
    """Per beam configuration, the steps transformers' beam search takes on each replica's share of the prompts
    alone (it calls its stopping criteria once per step: a counter among them, which stops nothing, counts them)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_pipeline.generation.microbatches import microbatch_bounds

    class Count(StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, ids, scores, **kwargs):
            self.calls += 1
            return torch.zeros(ids.shape[0], dtype=torch.bool)

    steps = []
    for b in BEAMS:
        steps.append([])
        for lo, hi in microbatch_bounds(ROWS, replicas):
            count = Count()
            share = {k: v[lo:hi] for k, v in _prompts().items()}
            with torch.no_grad():
                model.generate(**share, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos, do_sample=False,
                               stopping_criteria=StoppingCriteriaList([count]), **b)
            steps[-1].append(count.calls)
    return steps


def _eos_splitting_beams(model) -> tuple[list[int], list[list[int]]]:
    """EOS ids (some early tokens of the 2-replica split's first share) with which the 2 replicas' beam searches
    end at different steps under every beam configuration (one replica must step on for the other), and those
    steps (:func:`_beam_steps`)."""
    with torch.no_grad():
        free = model.generate(**_prompts(), max_new_tokens=NEW, pad_token_id=0, eos_token_id=VOCAB + 5,
                              do_sample=False, **BEAMS[0])
    for step in range(3):
        eos = sorted({int(free[r, PROMPT + step]) for r in range(ROWS - ROWS // 2)} - {0})
        steps = _beam_steps(model, eos, 2)
        if all(len(set(ends)) > 1 for ends in steps):
            return eos, steps
    raise AssertionError("no EOS ends the replicas' beam searches at different steps; change the prompts")


def _generation_refs(path, *, beam: bool) -> tuple[dict, dict]:
    """(EOS ids for greedy and for sampling (and beam search), what each gives on one process): greedy and beam
    search from transformers, and seeded sampling from the pipelined model on one process without experts split
    (the seeded per-row streams are the pipeline's documented semantics, not transformers' one global stream:
    tests/generation does the same). Beam search on Mixtral only: on the tiny Qwen3-MoE every early token as EOS
    ends both replicas' beam searches at the last step."""
    import transformers

    import hf_pipeline

    # transformers' own generate fails with output_router_logits on (the flag changes no logits): off here.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_router_logits=False
    ).eval()
    one = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", num_stages=1)

    def greedy(eos):
        with torch.no_grad():
            return model.generate(**_prompts(), max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)

    def sampled(eos):
        return one.generate(**_prompts(), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0, **SAMPLING)

    eos = {"greedy": _eos_ending_replica_0_first(greedy), "sampled": _eos_ending_replica_0_first(sampled)}
    want = {"sampled": sampled(eos["sampled"]), "greedy": greedy(eos["greedy"])}
    if beam:
        eos["beam"], want["beam_steps"] = _eos_splitting_beams(model)
        with torch.no_grad():
            want["beam"] = [model.generate(**_prompts(), max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos["beam"],
                                           do_sample=False, **b) for b in BEAMS]
    assert not torch.equal(want["sampled"], want["greedy"]), "sampling should differ from greedy"
    return eos, want


def _halves(path) -> tuple[int, int]:
    """(all tensors', expert tensors') stored bytes of a one-file float32 checkpoint."""
    total = experts = 0
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for key in f.keys():
            n = torch.tensor(f.get_slice(key).get_shape()).prod().item() * 4
            total, experts = total + n, experts + (n if ".experts." in key else 0)
    return total, experts


def _check(name, per_rank, i, path, saved, dims, pp1, gen, share=2):
    import transformers

    eos, expect = gen
    ref = _reference(path)
    # The rows' EOS steps differ between this mesh's replicas (so some replica steps on with finished rows).
    for what in ("greedy", "sampled"):
        ends = _replica_ends(_lengths(expect[what], eos[what]), dims[1])
        assert len(set(ends)) > 1, f"{name}: {what} replicas all end at step {ends}"
    # transformers' beam search on each of 2 replicas' shares alone ends at different steps (so one replica's
    # ring must step on for the other's, or its peers wait for it in the all-to-all): Mixtral's meshes are dp2.
    for b, ends in zip(BEAMS, expect["beam_steps"], strict=True) if "beam" in expect else ():
        assert dims[1] == 2 and len(set(ends)) > 1, f"{name}: beam search {b} ends at steps {ends} (dp{dims[1]})"
    total, experts = _halves(path)
    for rank, res in enumerate(per_rank):
        case = res[i]
        assert case["dims"] == dims, f"{name} rank {rank}: dims {case['dims']}"
        assert case["experts"], f"{name} rank {rank}: no expert tensor is split"
        for key, (local, whole) in case["experts"].items():
            assert local[0] * share == whole[0] and local[1:] == whole[1:], f"{name} rank {rank}: {key} {local} {whole}"
        compare(f"{name} rank {rank}", case, ref)
        # fp32 mean loss, relative: summation order ~1e-7; an expert's tokens lost or doubled move it >= 1e-3.
        assert abs(case["labelled"] - ref["labelled"]) <= 1e-5 * abs(ref["labelled"]), (name, rank, case["labelled"])
        if pp1:
            assert case["bytes"] == total - experts // 2, f"{name} rank {rank}: read {case['bytes']} of {total}"
        # Greedy: token for token transformers' (pad after EOS, as wide as the longest row); sampling: the
        # pipeline on one process, exactly (an argmax flipped by the all-to-all's summation order, ~1e-7 on
        # logits, would be a near-tie the tiny models do not have; a replica stepping out of lock hangs or
        # feeds another replica's rows).
        assert torch.equal(case["greedy"], expect["greedy"]), f"{name} rank {rank}: greedy {case['greedy']}"
        if "sampled" in case:
            assert torch.equal(case["sampled"], expect["sampled"]), f"{name} rank {rank}: sampled {case['sampled']}"
        # Beam search (Mixtral, where sampling runs): transformers' sequences on one process, exactly (the
        # replicas' shares gathered, padded with its fill id to the longest returned beam; a near-tie flipped by
        # the all-to-all's ~1e-7 the tiny models do not have; a replica out of lock step hangs its peers).
        assert ("beam" in case) == ("beam" in expect and "sampled" in case), f"{name} rank {rank}: beam ran?"
        for b, got, want in zip(BEAMS, case["beam"], expect["beam"], strict=True) if "beam" in case else ():
            assert torch.equal(got, want), f"{name} rank {rank}: beam search {b}: {got} != {want}"
        # Every replica cuts its share into as many microbatches (3 asked, capped by the smallest share), and
        # feeds each prompt in one forward.
        assert (case["microbatches"], case["prefill_steps"]) == (min(3, ROWS // dims[1]), 1), (name, rank)
        if "foreach" in case:  # under FSDP: every byte read is one kept (its chunks, its experts), and no other
            assert case["bytes"] == case["kept"], f"{name} rank {rank}: read {case['bytes']}, keeps {case['kept']}"
            # AdamW foreach over the fsdp and ep meshes' DTensors at once equals its per-tensor loop (the same
            # fp32 arithmetic: a tensor left out, or stepped on the wrong mesh's view, moves it by ~lr = 1e-3).
            assert case["foreach"] <= 1e-7, f"{name} rank {rank}: foreach differs by {case['foreach']}"
        if "survived" in case:
            want = "ValueError" if case["survived"]["last"] else "RankError"
            assert case["survived"]["raised"] == want, f"{name} rank {rank}: {case['survived']}"
        if "resumed" in case:
            went_on, resumed = case["resumed"]
            assert went_on == resumed, f"{name} rank {rank}: step after resume {resumed} != {went_on}"
    params = dict(transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).named_parameters())
    for key, got in per_rank[0][i]["params"].items():
        assert torch.equal(params[key].detach(), got), f"{name}: saved {key} differs after reload"


def test_pp1_ep2_over_dp2_mixtral_and_qwen3_moe_equal_transformers(tmp_path):
    paths = {t: _checkpoint(tmp_path, t) for t in ("mixtral", "qwen3_moe")}
    gens = {t: _generation_refs(paths[t], beam=t == "mixtral") for t in paths}
    kwargs = {"num_stages": 1, "n_microbatches": 2}
    cases = [(paths[t], kwargs, str(tmp_path / f"saved-{t}"), str(tmp_path / "state") if t == "mixtral" else None,
              t == "qwen3_moe", gens[t][0]) for t in paths]
    per_rank = run_distributed(_job, 2, cases, timeout=600, env={"HF_PIPELINE_TIMEOUT": "60"})
    for i, t in enumerate(paths):
        _check(f"{t} pp1 x ep2 over dp2", per_rank, i, paths[t], cases[i][2], (1, 2, 1), pp1=True, gen=gens[t])


def test_pp2_x_dp2_pp1_x_dp4_dp2_x_tp2_fsdp_and_hsdp_with_experts_over_replicas_equal_transformers(tmp_path):
    from transformers.distributed import DistributedConfig

    # Mixtral with the routers' load-balancing loss in its loss (train_step and the labelled forward).
    paths = {"mixtral": _checkpoint(tmp_path, "mixtral", output_router_logits=True, router_aux_loss_coef=0.1),
             "qwen3_moe": _checkpoint(tmp_path, "qwen3_moe")}
    gens = {t: _generation_refs(paths[t], beam=t == "mixtral") for t in paths}
    # Sampling and beam search where the ring or the ep groups change (pp2, two ep groups); greedy alone at ZBV
    # and tp2 (time).
    greedy_only = {"greedy": gens["qwen3_moe"][0]["greedy"]}
    cases = [
        (paths["mixtral"], {"num_stages": 2, "schedule": "1f1b", "n_microbatches": 2}, str(tmp_path / "s-1f1b"),
         str(tmp_path / "state"), False, gens["mixtral"][0]),
        (paths["qwen3_moe"], {"num_stages": 4, "schedule": "zbv-zero-bubble", "n_microbatches": 4},
         str(tmp_path / "s-zbv"), None, False, greedy_only),
        (paths["qwen3_moe"], {"num_stages": 1, "n_microbatches": 1}, str(tmp_path / "s-dp4"), None, False,
         gens["qwen3_moe"][0]),
        (paths["qwen3_moe"], {"num_stages": 1, "n_microbatches": 2, "tp_size": 2, "ep_size": 4},
         str(tmp_path / "s-tp2"), None, False, greedy_only),
        # Experts over FSDP ranks: transformers' own DistributedConfig (two ep groups of 2 of the 4 fsdp ranks),
        # with its training state resumed, and pp2 x fsdp2 under 1F1B with the routers' loss; greedy generate in
        # lock step on both.
        (paths["qwen3_moe"], {"num_stages": 1, "n_microbatches": 2,
                              "distributed_config": DistributedConfig(fsdp_size=4, ep_size=2)},
         str(tmp_path / "s-fsdp4"), str(tmp_path / "state-fsdp4"), False, greedy_only),
        (paths["mixtral"], {"num_stages": 2, "schedule": "1f1b", "n_microbatches": 2, "fsdp_size": 2},
         str(tmp_path / "s-fsdp2"), None, False, {"greedy": gens["mixtral"][0]["greedy"]}),
        # HSDP: two replicas of an fsdp2-sharded pipeline, each replica's two fsdp ranks an ep group (dense
        # gradients all-reduced over the replicas by FSDP, expert gradients over the expert-replica group).
        (paths["qwen3_moe"], {"num_stages": 1, "n_microbatches": 1, "fsdp_size": 2, "ep_size": 2, "ep_over": "data"},
         str(tmp_path / "s-hsdp"), str(tmp_path / "state-hsdp"), False, greedy_only),
        # fsdp2 x tp2 with ep4 (Qwen3-MoE's per-head norms under tp x fsdp: tests/loading/test_hsdp.py).
        (paths["mixtral"], {"num_stages": 1, "n_microbatches": 2,
                            "distributed_config": DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4)},
         str(tmp_path / "s-fsdp2-tp2"), None, False, {"greedy": gens["mixtral"][0]["greedy"]}),
    ]
    per_rank = run_distributed(_job, 4, cases, timeout=900)
    mixtral, qwen = (paths["mixtral"], gens["mixtral"]), (paths["qwen3_moe"], gens["qwen3_moe"])
    _check("mixtral pp2 x dp2 1F1B", per_rank, 0, mixtral[0], cases[0][2], (2, 2, 1), pp1=False, gen=mixtral[1])
    _check("qwen3_moe pp2 x dp2 ZBV", per_rank, 1, qwen[0], cases[1][2], (2, 2, 1), pp1=False, gen=qwen[1])
    _check("qwen3_moe pp1 x dp4", per_rank, 2, qwen[0], cases[2][2], (1, 4, 1), pp1=True, gen=qwen[1])
    _check("qwen3_moe dp2 x tp2, ep4", per_rank, 3, qwen[0], cases[3][2], (1, 2, 2), pp1=False, gen=qwen[1], share=4)
    _check("qwen3_moe fsdp4, ep2", per_rank, 4, qwen[0], cases[4][2], (1, 4, 1), pp1=False, gen=qwen[1])
    _check("mixtral pp2 x fsdp2 1F1B, ep2", per_rank, 5, mixtral[0], cases[5][2], (2, 2, 1), pp1=False, gen=mixtral[1])
    _check("qwen3_moe dp2 x fsdp2, ep2", per_rank, 6, qwen[0], cases[6][2], (1, 4, 1), pp1=False, gen=qwen[1])
    _check("mixtral fsdp2 x tp2, ep4", per_rank, 7, mixtral[0], cases[7][2], (1, 2, 2), pp1=False, gen=mixtral[1],
           share=4)
