"""Expert parallelism inside each stage equals single-process transformers, for every mixture-of-experts
family the generic decoder recipe claims, on the meshes pp x ep, pp x tp x ep and pp x fsdp x ep.

Each stage's ranks keep half of every MoE layer's experts (``Shard(0)`` of the stacked tensors), and the
experts get their tokens through transformers' own dispatch: all-reduce over the shared batch at inference,
all-to-all in training. On every rank, against transformers on one process (``tp_helpers.compare``):

- logits of a padded batch (1e-5: the experts' partial outputs are summed in another order, ~1e-7; an
  expert run twice or missed moves them by its whole contribution, ~1e-1 here);
- greedy tokens, token for token (and beam search at 4 ranks: pp2 x ep2 and pp2 x tp2 x ep2);
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps: losses and norms (relative 1e-5), every parameter
  afterwards gathered whole (1e-5; an expert gradient lost or doubled moves it by ~lr = 1e-3);
- the checkpoint ``save_pretrained`` writes after training, loaded by plain transformers, equal to the trained
  parameters (in transformers' own format: experts one tensor each);
- bytes read per rank: the stage's dense tensors and exactly half of its experts' bytes.

Load refusals, on every rank, name the class and the field: a dense model with ``ep_size``, and an
``ep_size`` that does not divide the experts.
"""

from __future__ import annotations

import json

import pytest
import torch
from decoders import decoder_config
from harness import run_distributed
from safetensors import safe_open
from tp_helpers import compare, exercise

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")  # every MoE family of decoder.toml
NEW = 4


def _checkpoint(root, model_type, **overrides):
    import transformers

    path = root / f"{model_type}{'-' if overrides else ''}{'-'.join(overrides)}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


def _load(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)


def _beam(model):
    import tiny

    prompt = tiny.sample_inputs("decoder", batch=2, seq=6)
    return model.generate(**prompt, max_new_tokens=NEW, num_beams=2, do_sample=False, pad_token_id=0)


def _case(path, kwargs, save_to, beam):
    from torch.distributed.tensor import DTensor

    model = _load(path, **kwargs)
    experts = {n: (tuple(p.to_local().shape), tuple(p.shape)) for n, p in model.named_parameters()
               if isinstance(p, DTensor) and ".experts." in n}
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in model.checkpoint_named_parameters()]
    res = {"experts": experts, "bytes": model.load_report.bytes_read, "mesh": (model.dims.pp_size, model.dims.tp_size),
           "kept": sum(t.numel() * t.element_size() for t in local)}
    if beam:
        res["beam"] = _beam(model)
    res.update(exercise(model, "decoder", pipelined=True, rows=4))
    if save_to:
        model.save_pretrained(save_to)
    return res


def _refusal(path, kwargs):
    try:
        _load(path, **kwargs)
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return f"{type(e).__name__}: {e}"
    return None


def _job(cases, refused):
    return {"cases": [_case(*c) for c in cases], "refused": [_refusal(*r) for r in refused]}


def _stored_bytes(path) -> tuple[int, int]:
    """(all tensors', expert tensors') stored bytes of a one-file checkpoint."""
    total = experts = 0
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for key in f.keys():
            size = f.get_slice(key).get_shape()
            n = torch.tensor(size).prod().item() * 4  # float32
            total += n
            experts += n if ".experts." in key else 0
    return total, experts


def _reference(path, beam=False):
    import tiny
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = {}
    if beam:
        prompt = tiny.sample_inputs("decoder", batch=2, seq=6)
        ref["beam"] = model.generate(**prompt, max_new_tokens=NEW, num_beams=2, do_sample=False, pad_token_id=0)
    ref.update(exercise(model, "decoder", pipelined=False, rows=4))
    return ref


def _check(name, per_rank, i, ref, saved, mesh, halves, share=2):
    """``share``: the ranks one tensor's experts are split over (ep, or ep x fsdp)."""
    import transformers

    for rank, res in enumerate(per_rank):
        case = res["cases"][i]
        assert case["mesh"] == mesh, f"{name} rank {rank}: mesh {case['mesh']}"
        assert case["experts"], f"{name} rank {rank}: no expert tensor is split"
        for key, (local, whole) in case["experts"].items():
            assert local[0] * share == whole[0] and local[1:] == whole[1:], f"{name} rank {rank}: {key} {local} {whole}"
        compare(f"{name} rank {rank}", case, ref)
        if "beam" in ref:
            assert torch.equal(case["beam"], ref["beam"]), f"{name} rank {rank}: beams {case['beam']} {ref['beam']}"
        if halves is not None:
            total, experts = halves
            assert case["bytes"] == total - experts // 2, f"{name} rank {rank}: read {case['bytes']} of {halves}"
    if saved:
        index = json.loads(open(f"{saved}/model.safetensors.index.json").read()) if not \
            __import__("os").path.exists(f"{saved}/model.safetensors") else None
        keys = set(index["weight_map"]) if index else set(safe_open(f"{saved}/model.safetensors", "pt").keys())
        assert not any(k.endswith("experts.gate_up_proj") for k in keys) or name == "gpt_oss", sorted(keys)[:5]
        back = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        params = dict(back.named_parameters())
        for key, got in per_rank[0]["cases"][i]["params"].items():
            assert torch.equal(params[key].detach(), got), f"{name}: saved {key} differs after reload"


def test_pp1_ep2_every_moe_family_equals_transformers_reads_its_experts_and_saves_theirs(tmp_path):
    kwargs = {"ep_size": 2, "n_microbatches": 2}
    paths = {t: _checkpoint(tmp_path, t) for t in FAMILIES}
    cases = [(paths[t], kwargs, str(tmp_path / f"saved-{t}"), False) for t in FAMILIES]
    refused = [(_checkpoint(tmp_path, "qwen3"), kwargs),
               (_checkpoint(tmp_path, "mixtral", num_local_experts=3), kwargs)]
    per_rank = run_distributed(_job, 2, cases, refused, timeout=600)
    for i, t in enumerate(FAMILIES):
        _check(t, per_rank, i, _reference(paths[t]), cases[i][2], (1, 2), _stored_bytes(paths[t]))
    wants = (("Qwen3ForCausalLM with ep_size=2", "its config declares no experts"),
             ("MixtralForCausalLM: ep_size=2 does not divide the 3 experts", "config.num_local_experts"))
    for rank, res in enumerate(per_rank):
        for msg, want in zip(res["refused"], wants, strict=True):
            assert msg is not None and msg.startswith("InputError: "), f"rank {rank}: {msg}"
            assert all(w in msg for w in want), f"rank {rank}: {msg}"


def test_pp2_ep2_and_pp2_tp2_ep2_equal_transformers_at_4_ranks(tmp_path):
    from transformers.distributed import DistributedConfig

    mixtral, qwen3_moe = _checkpoint(tmp_path, "mixtral"), _checkpoint(tmp_path, "qwen3_moe")
    cases = [
        (mixtral, {"ep_size": 2, "n_microbatches": 2, "schedule": "GPipe"}, None, True),
        (qwen3_moe, {"distributed_config": DistributedConfig(pp_size=2, tp_size=2, ep_size=2), "n_microbatches": 4},
         None, True),
    ]
    per_rank = run_distributed(_job, 4, cases, [], timeout=900)
    _check("mixtral pp2 x ep2", per_rank, 0, _reference(mixtral, beam=True), None, (2, 2), None)
    _check("qwen3_moe pp2 x tp2 x ep2", per_rank, 1, _reference(qwen3_moe, beam=True), None, (2, 2), None)


def test_pp2_fsdp2_ep2_at_8_ranks_equals_transformers(tmp_path):
    """FSDP over expert-parallel stages: each of a stage's 2 expert-parallel ranks keeps 2 of 4 experts, and FSDP
    shards them (and everything else) over the 2 data-parallel ranks: 1 expert per rank."""
    qwen3_moe = _checkpoint(tmp_path, "qwen3_moe")
    cases = [(qwen3_moe, {"ep_size": 2, "fsdp_size": 2, "n_microbatches": 2}, None, False)]
    per_rank = run_distributed(_job, 8, cases, [], timeout=900)
    _check("qwen3_moe pp2 x fsdp2 x ep2", per_rank, 0, _reference(qwen3_moe), None, (2, 2), None, share=4)
    for rank, res in enumerate(per_rank):  # a rank reads its shards' bytes only: its experts' alone, merged
        case = res["cases"][0]
        assert case["bytes"] == case["kept"], (rank, case["bytes"], case["kept"])



def _fsdp_run(model, pipelined):
    """Logits of 3 rows, then one AdamW step on 6 rows (loss, clipped norm, every parameter after it): sizes
    3 data-parallel ranks split evenly."""
    import tiny
    from tp_helpers import gathered

    out = {}
    with torch.no_grad():
        out["logits"] = model(**tiny.sample_inputs("decoder", batch=3, seq=9)).logits
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    batch = tiny.make_batch("decoder", 6, seed=1)
    if pipelined:
        out["losses"], out["norms"] = [float(model.train_step(batch))], [float(model.clip_grad_norm_(1.0))]
    else:
        loss = model(**batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["losses"], out["norms"] = [float(loss.detach())], [float(norm)]
    opt.step()
    out["params"] = gathered(model) if pipelined else {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _fsdp_job(path):
    model = _load(path, fsdp_size=3, num_stages=1, n_microbatches=1)
    local = {n: p.to_local() for n, p in model.named_parameters()}
    res = {"bytes": model.load_report.bytes_read, "kept": sum(t.numel() * t.element_size() for t in local.values()),
           "experts": {n: t.shape[0] for n, t in local.items() if n.endswith("experts.gate_up_proj")}}
    return {**res, **_fsdp_run(model, pipelined=True)}


def test_fsdp_chunks_of_uneven_experts_read_only_their_experts_at_3_ranks(tmp_path):
    """FSDP alone over a mixture of experts whose experts its ranks do not divide: 4 experts over 3 ranks are
    chunked 2, 2 and none (as torch.chunk and FSDP2 chunk dim 0). Each rank merges its own chunk's experts from
    the per-expert tensors and reads nothing else (bytes read equal bytes kept: reading every expert and
    slicing would read 2x, or all 4 experts for the empty chunk), and the model equals transformers (logits,
    loss, clipped norm, parameters after an AdamW step; tolerances of ``tp_helpers.compare``)."""
    import transformers

    mixtral = _checkpoint(tmp_path, "mixtral")
    per_rank = run_distributed(_fsdp_job, 3, mixtral, timeout=900)
    ref = _fsdp_run(transformers.AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32).eval(), False)
    for rank, res in enumerate(per_rank):
        compare(f"mixtral fsdp3 rank {rank}", res, ref)
        assert res["bytes"] == res["kept"], (rank, res["bytes"], res["kept"])
    kept = [set(res["experts"].values()) for res in per_rank]
    assert kept == [{2}, {2}, {0}] and len(per_rank[0]["experts"]) >= 2, [res["experts"] for res in per_rank]
