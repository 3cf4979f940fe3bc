"""Per-stage re-sharding (hf_pipeline.tools.convert): same tensors, own files per rank, atomic output,
source untouched."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
import tiny
import torch
from harness import run_distributed
from safetensors import safe_open

from hf_pipeline.errors import InputError
from hf_pipeline.loading.checkpoint_files import INDEX_NAME, CheckpointIndex
from hf_pipeline.planning.options import parse_size
from hf_pipeline.tools.convert import (
    SHARED_FILE,
    ConvertError,
    convert_to_stages,
    merge_shards,
    stage_file_name,
    stage_keys,
)


def _digest(directory: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _tensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    index = CheckpointIndex.from_directory(directory)
    out = {}
    for shard, keys in index.shards_for(index.keys()).items():
        with safe_open(directory / shard, framework="pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_convert_and_merge_round_trip_exact(tmp_path, arch):
    src = tiny.make_checkpoint(tmp_path / "src", arch)
    before = _digest(src)
    report = convert_to_stages(src, tmp_path / "staged", num_stages=3)
    assert _digest(src) == before, "the source checkpoint must not change"

    staged = tmp_path / "staged"
    index = json.loads((staged / INDEX_NAME).read_text())
    files = set(index["weight_map"].values())
    assert {stage_file_name(s, 3) for s in range(3)} <= files
    assert index["metadata"]["hf_pipeline"]["num_stages"] == 3
    assert index["metadata"]["total_size"] == report.bytes_written
    assert (staged / "config.json").read_bytes() == (src / "config.json").read_bytes()
    original = _tensors(src)
    converted = _tensors(staged)
    assert original.keys() == converted.keys()
    for k in original:
        assert original[k].dtype == converted[k].dtype and torch.equal(original[k], converted[k]), k

    # Every key sits in the file of the one stage that needs it, or in the shared file when several do.
    _, keys = stage_keys(src, num_stages=3)
    for key, file in index["weight_map"].items():
        holders = [s for s, ks in keys.items() if key in ks]
        assert file == (stage_file_name(holders[0], 3) if len(holders) == 1 else SHARED_FILE), key

    # Plain transformers loads the per-stage layout; its state dict is the original one.
    ref = tiny.reference(src, tiny.AUTO[arch]).state_dict()
    got = tiny.reference(staged, tiny.AUTO[arch]).state_dict()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k

    merged = merge_shards(staged, tmp_path / "merged", max_shard_size="40KB")
    names = sorted(merged.files)
    assert len(names) > 1 and all(n.startswith("model-0") and "-of-" in n for n in names)
    back = _tensors(tmp_path / "merged")
    assert back.keys() == original.keys()
    for k in original:
        assert torch.equal(original[k], back[k]), k
    assert "hf_pipeline" not in json.loads((tmp_path / "merged" / INDEX_NAME).read_text())["metadata"]

    single = merge_shards(staged, tmp_path / "single", max_shard_size="1GB")
    assert list(single.files) == ["model.safetensors"] and not (tmp_path / "single" / INDEX_NAME).exists()


def test_shared_tensors_go_to_the_shared_file(tmp_path):
    # GPT-2 ties the LM head to the embedding: stage 0 and the last stage both read that tensor.
    src = tiny.make_checkpoint(tmp_path / "src", "gpt2")
    report = convert_to_stages(src, tmp_path / "out", num_stages=2)
    assert report.files[SHARED_FILE] == ["transformer.wte.weight"]
    assert report.stage_files == {
        0: (SHARED_FILE, stage_file_name(0, 2)),
        1: (SHARED_FILE, stage_file_name(1, 2)),
    }


def _load_both(original, converted, auto, kwargs):
    import hf_pipeline

    out = {}
    for name, path in (("original", original), ("converted", converted)):
        model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)
        out[name] = {
            "files": list(model.load_report.files_opened),
            "tensors": {k: p.detach().clone() for k, p in model.checkpoint_named_parameters()},
            "pp_rank": model.dims.pp_rank,
        }
    return out


def _load_cases(cases):
    return [_load_both(*case) for case in cases]


@pytest.mark.dist
def test_each_rank_opens_exactly_its_own_files(tmp_path):
    cases, reports = [], []
    # LLaMA: no shared tensor. T5 with 2 stages per rank (interleaved placement): per-stage files, plus
    # tied embeddings and the replicated relative bias in the shared file.
    for arch, kwargs in (("llama", {}), ("t5", {"virtual_stages": 2})):
        src = tiny.make_checkpoint(tmp_path / f"{arch}-src", arch)
        stages = 2 * kwargs.get("virtual_stages", 1)
        report = convert_to_stages(src, tmp_path / f"{arch}-staged", num_stages=stages,
                                   virtual_stages=kwargs.get("virtual_stages"))
        reports.append(report)
        cases.append((str(src), str(tmp_path / f"{arch}-staged"), tiny.AUTO[arch], kwargs))
    per_rank = run_distributed(_load_cases, 2, cases, timeout=240)
    for (src, _, auto, kwargs), report, i in zip(cases, reports, range(len(cases))):
        plan, _ = stage_keys(src, num_stages=2 * kwargs.get("virtual_stages", 1),
                             virtual_stages=kwargs.get("virtual_stages"))
        for rank in range(2):
            res = per_rank[rank][i]
            want = report.files_for_rank(plan, res["converted"]["pp_rank"])
            assert res["converted"]["files"] == want, (auto, rank, res["converted"]["files"], want)
            assert all(f.startswith("model-stage-") or f == SHARED_FILE for f in want)
            a, b = res["original"]["tensors"], res["converted"]["tensors"]
            assert a.keys() == b.keys() and a
            for k in a:
                assert torch.equal(a[k], b[k]), (auto, rank, k)
    # The two ranks of the untied LLaMA share no file at all.
    llama = [set(per_rank[r][0]["converted"]["files"]) for r in range(2)]
    assert not llama[0] & llama[1]
    # The two T5 ranks share no file but the shared one.
    t5 = [set(per_rank[r][1]["converted"]["files"]) for r in range(2)]
    assert t5[0] & t5[1] == {SHARED_FILE}
    assert len(t5[0]) == len(t5[1]) == 3  # two own stage files each


def test_output_is_atomic_and_never_inside_the_source(tmp_path, monkeypatch):
    from hf_pipeline.tools import convert

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    with pytest.raises(ConvertError, match="outside the source"):
        convert_to_stages(src, src / "inner", num_stages=2)
    with pytest.raises(ConvertError, match="outside the source"):
        convert_to_stages(src, src, num_stages=2)

    calls = []
    original_write = convert._Writer.write

    def failing_write(self, name, keys):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full")
        return original_write(self, name, keys)

    monkeypatch.setattr(convert._Writer, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        convert_to_stages(src, tmp_path / "out", num_stages=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "no partial output, no temporary directory left"
    monkeypatch.undo()

    convert_to_stages(src, tmp_path / "out", num_stages=2)
    with pytest.raises(ConvertError, match="already exists"):
        convert_to_stages(src, tmp_path / "out", num_stages=2)
    report = convert_to_stages(src, tmp_path / "out", num_stages=4, overwrite=True)
    assert set(report.stage_files) == {0, 1, 2, 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert len(list((tmp_path / "out").glob("model-stage-*"))) == 4


def test_parse_size_and_bad_plans(tmp_path):
    assert parse_size("500MB") == 500_000_000
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("40KB") == 40_000
    assert parse_size(123) == 123
    for bad in ("lots", "5XB", 0, "-1MB"):
        with pytest.raises(InputError):
            parse_size(bad)
    src = tiny.make_checkpoint(tmp_path / "src", "llama", shards=1)
    with pytest.raises(ConvertError, match="multiple of virtual_stages"):
        convert_to_stages(src, tmp_path / "out", num_stages=3, virtual_stages=2)
    with pytest.raises(ValueError, match="only 8 block halves"):
        convert_to_stages(src, tmp_path / "out", num_stages=9)
