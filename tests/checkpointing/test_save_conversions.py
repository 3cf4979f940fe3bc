"""save_pretrained writes what transformers' save_pretrained writes for models it converts on load.

transformers 5 holds a mixture-of-experts layer's experts merged (``mlp.experts.gate_up_proj``) and saves them
back one tensor per expert, under the checkpoint's names (Mixtral's ``block_sparse_moe.experts.3.w1``); GPT-NeoX's
``lm_head`` is saved as ``embed_out``. Of the decoder families (tests/decoders.py) those are the ones its save
renames or splits (gpt_oss keeps its merged experts on disk). For Mixtral, Qwen3-MoE, DeepSeek-V3 (a dense layer,
then MoE layers) and GPT-NeoX, one spawned 2-rank job loads a checkpoint transformers saved, saves it pipelined
and reloads that save with ``pipeline=True``; here the save must hold transformers' own save's keys and tensors
(bitwise), index metadata included, each shard file holding one rank's layers, and load in transformers with the
same logits. Mixtral also saves optimizer state after a training step and resumes bitwise. At world 1, a
checkpoint already holding the merged tensors is saved as it is, as transformers does (it reverts only the
conversions its load went through).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
import transformers
from decoders import VOCAB, decoder_config
from harness import run_distributed
from safetensors import safe_open
from safetensors.torch import save_file

# fp32 logits of the same weights, pipelined vs transformers: summation order moves them ~1e-6 at width 32; a
# misplaced expert or a wrong split of gate / up moves them by 1e-2 or more.
TOL = 1e-5
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_neox")
SHARD = "40KB"  # several shards per rank, so the index is written and shards are cut per rank


def _source(root: pathlib.Path, model_type: str) -> pathlib.Path:
    """A checkpoint as transformers saves it (experts one tensor each)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(decoder_config(model_type))
    model.save_pretrained(root / model_type, max_shard_size=SHARD)
    return root / model_type


def _probe() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _files(directory: pathlib.Path) -> dict[str, dict[str, torch.Tensor]]:
    """shard file -> its tensors."""
    index = directory / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"
    ]
    out = {}
    for name in names:
        with safe_open(directory / name, "pt") as f:
            out[name] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def _tensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    return {k: t for shard in _files(directory).values() for k, t in shard.items()}


def _load(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)


def _resume_check(src: str, root: pathlib.Path) -> tuple[float, float]:
    """Train a step, save with optimizer state, resume in fresh objects: the next step's losses (continued, resumed)."""
    import hf_pipeline

    ids = _probe()
    model = _load(src, n_microbatches=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train_step({"input_ids": ids, "labels": ids})
    opt.step()
    opt.zero_grad()
    model.save_pretrained(root / "trained", optimizer=opt, step=1, max_shard_size=SHARD)
    model.train_step({"input_ids": ids, "labels": ids})
    opt.step()
    continued = float(model.train_step({"input_ids": ids, "labels": ids}))
    model2 = _load(root / "trained", n_microbatches=2)
    model2.train()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    assert hf_pipeline.load_training_state(model2, root / "trained", optimizer=opt2)["step"] == 1
    model2.train_step({"input_ids": ids, "labels": ids})
    opt2.step()
    return continued, float(model2.train_step({"input_ids": ids, "labels": ids}))


def _job(sources: dict[str, str], root: str) -> dict:
    out = {}
    for model_type, src in sources.items():
        target = pathlib.Path(root) / model_type
        model = _load(src, n_microbatches=2)
        names = [n for s in model.stages for n in s.state_dict()]
        layers = sorted({int(m) for n in names for m in re.findall(r"layers\.(\d+)\.", n)})
        model.save_pretrained(target, max_shard_size=SHARD)
        reloaded = _load(target, n_microbatches=2).eval()
        with torch.no_grad():
            out[model_type] = {"layers": layers, "logits": reloaded(input_ids=_probe()).logits}
    out["resume"] = _resume_check(sources["mixtral"], pathlib.Path(root) / "resume")
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_saves_are_transformers_own_and_load_in_both(tmp_path):
    sources = {t: str(_source(tmp_path / "src", t)) for t in FAMILIES}
    results = run_distributed(_job, 2, sources, str(tmp_path / "ours"), timeout=600)
    for model_type, src in sources.items():
        ours_dir, theirs_dir = tmp_path / "ours" / model_type, tmp_path / "theirs" / model_type
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        ref.save_pretrained(theirs_dir, max_shard_size=SHARD)
        ours, theirs = _tensors(ours_dir), _tensors(theirs_dir)
        assert set(ours) == set(theirs), (
            f"{model_type}: ours-only {sorted(set(ours) - set(theirs))[:4]}, "
            f"transformers-only {sorted(set(theirs) - set(ours))[:4]}"
        )
        for k in ours:
            assert ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k]), f"{model_type}: {k}"
        index = json.loads((ours_dir / "model.safetensors.index.json").read_text())
        their_index = json.loads((theirs_dir / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(ours), model_type
        for field in ("total_size", "total_parameters"):
            assert index["metadata"][field] == their_index["metadata"][field], (model_type, field)
        # Each rank wrote its own stages' tensors: no shard file holds layers of both ranks.
        owner = {i: r for r in range(2) for i in results[r][model_type]["layers"]}
        for name, shard in _files(ours_dir).items():
            ranks = {owner[int(m[1])] for k in shard if (m := re.search(r"layers\.(\d+)\.", k))}
            assert len(ranks) <= 1, f"{model_type}: {name} holds layers of ranks {ranks}"
        ids = _probe()
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            loaded = transformers.AutoModelForCausalLM.from_pretrained(ours_dir).eval()
            assert torch.equal(loaded(input_ids=ids).logits, want), f"{model_type}: transformers load of our save"
        for r in range(2):
            diff = (results[r][model_type]["logits"] - want).abs().max().item()
            assert diff <= TOL, f"{model_type} rank {r}: pipeline=True load of our save: {diff:.3g}"
    for r in range(2):
        continued, resumed = results[r]["resume"]
        assert continued == resumed, f"rank {r}: resumed loss {resumed} != continued {continued}"


def test_world_size_1_saves_per_expert_or_merged_as_the_checkpoint_was(tmp_path):
    """Experts stored one tensor each are saved so; a checkpoint holding the merged tensors is saved as it is."""
    src = _source(tmp_path / "src", "qwen3_moe")
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    merged = tmp_path / "merged"
    ref.config.save_pretrained(merged)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, merged / "model.safetensors")
    for directory, experts in ((src, "mlp.experts.3.gate_proj.weight"), (merged, "mlp.experts.gate_up_proj")):
        model = _load(directory, schedule="looped-bfs", virtual_stages=2, n_microbatches=2)
        model.save_pretrained(tmp_path / "out" / directory.name, max_shard_size=SHARD)
        ours = _tensors(tmp_path / "out" / directory.name)
        theirs_model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        theirs_model.save_pretrained(tmp_path / "theirs" / directory.name, max_shard_size=SHARD)
        theirs = _tensors(tmp_path / "theirs" / directory.name)
        assert f"model.layers.1.{experts}" in ours, directory.name
        assert set(ours) == set(theirs), directory.name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), directory.name
