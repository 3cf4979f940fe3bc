"""Replicas of FSDP-sharded pipelines (HSDP: dp2 x fsdp2 on 4 gloo ranks), and FSDP over tensor-parallel
shards (tp2 x fsdp2), equal single-process transformers.

One 4-rank job loads a 4-layer LLaMA as 2 replicas x 2 fsdp ranks of a one-rank pipeline of 2 stages
(interleaved 1F1B: each rank runs both stages), so the mesh is (dp=2, fsdp=2, pp=1) and FSDP2 gets its
2-D (dp, fsdp) sub-mesh: it shards over fsdp and all-reduces the gradient chunks over dp. Against
transformers on one process:

- each rank keeps half of the parameter elements (its fsdp rank's dim-0 chunks; both replicas the
  same chunks) and reads exactly those bytes;
- forward logits of a batch of 4 (one row per data-parallel rank; abs 1e-5) and greedy ``generate``;
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps on a batch of 8 split over the 4 data-parallel
  ranks: losses and total norms (relative 1e-5) and every parameter afterwards (abs 1e-5). A gradient
  reduced over fsdp only (not the replicas), or once more by our own replica sum, is off by 2x in
  the first norm; a norm summed over the replicas too is off by sqrt(2);
- ``save_pretrained(optimizer=...)`` after step 2 writes one normal checkpoint (one writer) that plain
  transformers loads with the trained values, and AdamW states gathered whole equal transformers';
- the same mesh resumes it (``load_training_state``) and takes step 3: the same loss and parameters as
  the uninterrupted run, bit for bit, and transformers' third step within 1e-5;
- a base-model checkpoint loaded as a causal LM: the missing ``lm_head`` is drawn as transformers draws
  it after the same ``torch.manual_seed`` (exactly), each rank keeping its chunk.

The same job then loads tp2 x fsdp2 (the mesh (fsdp=2, pp=1, tp=2): FSDP2 over the tensor-parallel
``DTensor`` shards, as torchtitan composes them) and runs the same sequence with the same checks: a rank
keeps about a quarter of the tensor-parallel layers and reads exactly the bytes it keeps (its fsdp chunk
of its tp slice of each tensor), and the total norm sums the
(fsdp, tp) shards over both groups and the fsdp-only ones (norms, embeddings) over fsdp alone (a sum over
one group only was 1.22 instead of 1.39 in the first step). GPT-2 (untied, no dropout) runs the same
sequence on that mesh: its packed ``c_attn`` bias (tp rank t holds ``[q_t, k_t, v_t]``) is kept whole
on each fsdp rank, and every gathered tensor, the saved checkpoint and the resumed step equal
transformers' (FSDP's dim-0 chunk of it gathered the values out of order, some repeated). Qwen3 too: its
per-head ``q_norm`` / ``k_norm`` are whole on every tp rank, each rank's gradient from its own heads, summed over
tp by a hook FSDP's unsharded parameters must get as well.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from decoders import decoder_config
from harness import run_distributed
from tp_helpers import EPS, LR, compare, gathered

pytestmark = pytest.mark.dist

SEED = 1234  # torch.manual_seed before loading a checkpoint without lm_head: it is drawn from the generator
HSDP = {"fsdp_size": 2, "num_stages": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b", "n_microbatches": 2}
TP_FSDP = {**HSDP, "tp_size": 2}  # FSDP2 over the tensor-parallel shards: a (fsdp=2, pp=1, tp=2) mesh


GPT2 = {"tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # no shared stage


def _prompt(arch):
    return tiny.sample_inputs(arch, batch=4, seq=6)  # a row per data-parallel rank (fewer are refused)


def _load(path, kwargs=HSDP):  # noqa: B006 - read only
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)


def _step(model, opt, step: int, arch: str = "llama") -> tuple[float, float]:
    loss = float(model.train_step(tiny.make_batch(arch, 8, seed=step)))
    norm = float(model.clip_grad_norm_(1.0))
    opt.step()
    opt.zero_grad()
    return loss, norm


def _case(path, save_dir, kwargs, arch="llama"):
    """Load, forward, generate, two clipped AdamW steps, save with the optimizer, a third step; then the
    save resumed on the same mesh and its third step."""
    from hf_pipeline.checkpointing.training_state import load_training_state

    model = _load(path, kwargs)
    dims = model.dims
    local = [p.to_local() for s in model.stages for p in s.parameters()]
    res = {"dims": (dims.dp_size, dims.replicas, dims.fsdp_size, dims.pp_size, dims.fsdp_rank), "plan": str(model.plan),
           "kept": sum(t.numel() for t in local), "read": model.load_report.bytes_read, "loaded": gathered(model)}
    with torch.no_grad():
        res["logits"] = model(**tiny.sample_inputs(arch, batch=4, seq=9)).logits
    res["tokens"] = model.generate(**_prompt(arch), max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    res["losses"], res["norms"] = (list(x) for x in zip(*[_step(model, opt, step, arch) for step in (1, 2)]))
    res["params"] = gathered(model)
    model.save_pretrained(save_dir, optimizer=opt, step=2, max_shard_size="50KB")
    res["third"] = _step(model, opt, 3, arch)[0]
    res["third_params"] = gathered(model)
    resumed = _load(save_dir, kwargs)
    resumed.train()
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR, eps=EPS)
    res["resumed_step"] = load_training_state(resumed, save_dir, optimizer=opt)["step"]
    res["resumed"] = _step(resumed, opt, 3, arch)[0]
    res["resumed_params"] = gathered(resumed)
    return res


def _job(path, save_dir, base, tp_dir, gpt2, gpt2_dir, qwen3, qwen3_dir):
    res = _case(path, save_dir, HSDP)
    torch.manual_seed(SEED)
    headless = _load(base)
    res["initialized"], res["lm_head"] = headless.load_report.initialized, gathered(headless)["lm_head.weight"]
    res["tp"] = _case(path, tp_dir, TP_FSDP)
    res["packed"] = _case(gpt2, gpt2_dir, TP_FSDP, "gpt2")  # GPT-2's fused c_attn under tp x fsdp
    res["qk_norm"] = _case(qwen3, qwen3_dir, TP_FSDP)  # Qwen3's per-head norms: gradients summed over tp
    return res


def _reference(path, arch="llama") -> dict:
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        out = {"logits": ref(**tiny.sample_inputs(arch, batch=4, seq=9)).logits}
    out["tokens"] = ref.generate(**_prompt(arch), max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    out["losses"], out["norms"] = [], []
    for step in (1, 2, 3):
        loss = ref(**tiny.make_batch(arch, 8, seed=step)).loss
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        if step == 2:
            out["params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
            out["exp_avg"] = {n: opt.state[p]["exp_avg"].clone() for n, p in ref.named_parameters()}
    out["third_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _check_case(what: str, res: dict, ref: dict) -> None:
    """Two steps as transformers' (compare), and the resumed third step as the uninterrupted one and transformers'."""
    compare(what, res, {**ref, "losses": ref["losses"][:2], "norms": ref["norms"][:2]})
    assert res["resumed_step"] == 2 and res["resumed"] == res["third"], (what, res["resumed"], res["third"])
    for key, want in res["third_params"].items():
        assert torch.equal(res["resumed_params"][key], want), f"{what}: {key} differs after the resumed step"
    # fp32 loss, relative: summation order ~1e-6; a wrong mask or label, or a dropped microbatch, moves it by 1e-2
    # or more.
    assert abs(res["third"] - ref["losses"][2]) <= 1e-5 * ref["losses"][2], (what, res["third"], ref["losses"])
    third = {"losses": [], "norms": [], "logits": ref["logits"], "params": ref["third_params"]}
    compare(f"{what}, step 3", {**third, "params": res["third_params"]}, third)


@pytest.mark.slow
def test_dp2_by_fsdp2_and_tp2_by_fsdp2_equal_transformers_save_and_resume(tmp_path):
    import transformers

    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    save_dir = tmp_path / "checkpoint-2"
    base = str(tiny.make_checkpoint(tmp_path / "base", "llama", auto="AutoModel"))
    tp_dir = tmp_path / "tp-checkpoint-2"
    gpt2 = str(tiny.make_checkpoint(tmp_path / "gpt2", "gpt2", **GPT2))
    gpt2_dir = tmp_path / "gpt2-checkpoint-2"
    qwen3, qwen3_dir = tmp_path / "qwen3", tmp_path / "qwen3-checkpoint-2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config("qwen3")).save_pretrained(qwen3)
    per_rank = run_distributed(_job, 4, path, str(save_dir), base, str(tp_dir), gpt2, str(gpt2_dir), str(qwen3),
                               str(qwen3_dir), timeout=600)
    ref, ref_gpt2, ref_qwen3 = _reference(path), _reference(gpt2, "gpt2"), _reference(str(qwen3))
    torch.manual_seed(SEED)
    head = tiny.reference(base, "AutoModelForCausalLM").lm_head.weight.detach()
    whole = sum(t.numel() for t in ref["params"].values())
    stored = {n: p.detach() for n, p in tiny.reference(path, "AutoModelForCausalLM").named_parameters()}
    want_gpt2 = {n: p.detach() for n, p in tiny.reference(gpt2, "AutoModelForCausalLM").named_parameters()}
    for rank, res in enumerate(per_rank):
        what = f"rank {rank} dp2 x fsdp2"
        assert res["dims"] == (4, 2, 2, 1, rank % 2), f"{what}: (dp, replicas, fsdp, pp, fsdp rank) {res['dims']}"
        assert "mesh: dp=2 x fsdp=2 x pp=1" in res["plan"], res["plan"]
        assert abs(res["kept"] - whole / 2) <= 0.02 * whole, f"{what}: keeps {res['kept']} of {whole}"
        assert res["read"] == 4 * res["kept"], f"{what}: read {res['read']} bytes to keep {res['kept']} elements"
        _check_case(what, res, ref)
        assert res["initialized"] == ["lm_head.weight"], (what, res["initialized"])
        assert torch.equal(res["lm_head"], head), f"{what}: the drawn lm_head differs from transformers'"
        tp = res["tp"]  # tp2 x fsdp2: each rank keeps a quarter of the tensor-parallel layers' weights
        assert tp["dims"] == (2, 1, 2, 1, rank // 2) and "fsdp=2 x pp=1 x tp=2" in tp["plan"], (tp["dims"], tp["plan"])
        assert tp["kept"] < 0.4 * whole, f"rank {rank} tp2 x fsdp2: keeps {tp['kept']} of {whole}"
        # Each rank reads only its fsdp chunk of its tp slice (a whole slice read was 2.47x what it keeps).
        assert tp["read"] == 4 * tp["kept"], f"rank {rank} tp2 x fsdp2: read {tp['read']} to keep {tp['kept']}"
        _check_case(f"rank {rank} tp2 x fsdp2", tp, ref)
        for case, loaded in ((what, res["loaded"]), (f"rank {rank} tp2 x fsdp2", tp["loaded"])):
            assert set(loaded) == set(stored), (case, sorted(set(loaded) ^ set(stored)))
            for key, want in stored.items():  # the shards' placements put the bytes read back in place
                assert torch.equal(loaded[key], want), f"{case}: loaded {key} differs"
        # Qwen3's q_norm / k_norm (whole on every tp rank, each rank's gradient from its heads alone) summed over
        # tp under FSDP too: a tp rank's own share alone was off by ~3e-3 after 2 steps.
        _check_case(f"rank {rank} Qwen3 tp2 x fsdp2", res["qk_norm"], ref_qwen3)
        packed, case = res["packed"], f"rank {rank} GPT-2 tp2 x fsdp2"  # c_attn.bias whole on each fsdp rank
        assert packed["read"] == 4 * packed["kept"], f"{case}: read {packed['read']} to keep {packed['kept']}"
        _check_case(case, packed, ref_gpt2)
        assert set(packed["loaded"]) == set(want_gpt2), (case, sorted(set(packed["loaded"]) ^ set(want_gpt2)))
        for key, want in want_gpt2.items():
            assert torch.equal(packed["loaded"][key], want), f"{case}: loaded {key} differs"
    for where, params, want_ref in ((save_dir, per_rank[0]["params"], ref), (tp_dir, per_rank[0]["tp"]["params"], ref),
                                    (gpt2_dir, per_rank[0]["packed"]["params"], ref_gpt2)):
        saved = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        for key, want in params.items():
            assert torch.equal(saved.get_parameter(key).detach(), want), f"{where}: saved {key} differs"
        states = {}
        for name in sorted((where / "optimizer").glob("pp-*.pt")):
            states.update(torch.load(name, weights_only=True)["state"])
        assert set(states) == set(want_ref["exp_avg"]), sorted(set(states) ^ set(want_ref["exp_avg"]))
        for key, want in want_ref["exp_avg"].items():
            d = (states[key]["exp_avg"] - want).abs().max().item()
            # fp32 Adam exp_avg (~1e-3): noise ~1e-9; the wrong shard's state or a missing step differs
            # by ~1e-3.
            assert d <= 1e-6, f"{where}: saved exp_avg of {key}: max abs diff {d} (largest {want.abs().max().item()})"
