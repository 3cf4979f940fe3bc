"""Shard-by-shard loading (hf_pipeline/loading/weights.py), tested on what was read, not only on the result.

Checkpoints are real ``save_pretrained(max_shard_size=...)`` output of tiny models; files that must
be damaged are copies, so the module-scoped checkpoints stay intact.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import socket
import sys

import psutil
import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from safetensors.torch import load_file, save_file

from hf_pipeline.errors import CheckpointError, CheckpointNotFoundError
from hf_pipeline.loading import weights
from hf_pipeline.loading.checkpoint_files import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointIndex,
    checkpoint_nbytes,
    resolve_checkpoint,
)
from hf_pipeline.loading.key_renames import checkpoint_key_renames
from hf_pipeline.loading.weights import load_tensors

TINY = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _save(model: transformers.PreTrainedModel, directory: pathlib.Path, shard_size: str) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory, max_shard_size=shard_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(directory, reference state_dict) of a 4-layer Llama in >= 3 shards, untied head."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, **TINY,
    )
    directory = tmp_path_factory.mktemp("llama")
    sd = _save(transformers.LlamaForCausalLM(cfg), directory, "20KB")
    assert len(set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values())) >= 3
    return directory, sd


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """GPT-2 ties lm_head to wte; save_pretrained stores only transformer.wte.weight."""
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **TINY)
    directory = tmp_path_factory.mktemp("gpt2")
    sd = _save(transformers.GPT2LMHeadModel(cfg), directory, "20KB")
    return directory, sd


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A one-file checkpoint (model.safetensors, no index)."""
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, **TINY
    )
    directory = tmp_path_factory.mktemp("single")
    sd = _save(transformers.LlamaForCausalLM(cfg), directory, "10GB")
    assert not (directory / INDEX_NAME).exists() and (directory / SINGLE_NAME).is_file()
    return directory, sd


@pytest.fixture
def llama_copy(llama, tmp_path):
    """A copy of the Llama checkpoint that a test may damage."""
    directory, sd = llama
    return pathlib.Path(shutil.copytree(directory, tmp_path / "ckpt")), sd


@pytest.fixture
def spy(monkeypatch):
    """Records every shard the loader opens to read tensor data and every header it parses."""
    calls = {"opened": [], "headers": []}
    real_open, real_header = weights._open_shard, weights.read_shard_header

    def open_shard(path):
        calls["opened"].append(pathlib.Path(path).name)
        return real_open(path)

    def shard_header(path):
        calls["headers"].append(pathlib.Path(path).name)
        return real_header(path)

    monkeypatch.setattr(weights, "_open_shard", open_shard)
    monkeypatch.setattr(weights, "read_shard_header", shard_header)
    return calls


def _wanted(sd, names, dtype=None):
    return {n: (tuple(sd[n].shape), dtype or sd[n].dtype) for n in names}


def _layers(sd, *layers):
    return [k for k in sd if any(k.startswith(f"model.layers.{i}.") for i in layers)]


def _shard_of(directory, key):
    return json.loads((directory / INDEX_NAME).read_text())["weight_map"][key]


def _open_under(directory, *, mapped: bool = True) -> list[str]:
    """Files under directory that this process still has open (or, with mapped, memory-mapped)."""
    directory = str(pathlib.Path(directory).resolve())
    paths = [f.path for f in psutil.Process().open_files()]
    if mapped:
        paths += [line.split(maxsplit=5)[-1].strip() for line in open("/proc/self/maps") if len(line.split()) >= 6]
    return sorted({p for p in paths if p.startswith(directory)})


def _corrupt_dtype(directory, key) -> str:
    """Make the header name an unknown dtype (valid JSON, same length, same file size)."""
    shard = _shard_of(directory, key)
    path = directory / shard
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = bytes(data[8 : 8 + n])
    assert b'"dtype":"F32"' in header
    data[8 : 8 + n] = header.replace(b'"dtype":"F32"', b'"dtype":"Q32"', 1)
    path.write_bytes(bytes(data))
    return shard


# --- index ---------------------------------------------------------------------------------------


def test_index_of_sharded_checkpoint(llama, spy):
    directory, sd = llama
    index = CheckpointIndex.from_directory(directory)
    assert index.keys() == set(sd)
    assert spy["opened"] == [] and spy["headers"] == []  # the index JSON alone is enough
    groups = index.shards_for(_layers(sd, 3))
    assert groups and all(_shard_of(directory, k) == shard for shard, keys in groups.items() for k in keys)
    assert sorted(k for keys in groups.values() for k in keys) == sorted(_layers(sd, 3))
    shards = set(index.weight_map.values())
    assert checkpoint_nbytes(index) == sum((directory / s).stat().st_size for s in shards)
    with pytest.raises(CheckpointError, match="model.layers.7.mlp.up_proj.weight"):
        index.shards_for(["model.layers.7.mlp.up_proj.weight"])


def test_single_file_checkpoint(single):
    directory, sd = single
    index = CheckpointIndex.from_directory(directory)
    assert index.weight_map == dict.fromkeys(sd, SINGLE_NAME)
    assert checkpoint_nbytes(index) == (directory / SINGLE_NAME).stat().st_size
    tensors, report = load_tensors(index, _wanted(sd, sd), expected_keys=set(sd))
    assert report.files_opened == [SINGLE_NAME]
    assert sorted(report.keys_read) == sorted(sd)
    for name, ref in sd.items():
        torch.testing.assert_close(tensors[name], ref, rtol=0, atol=0, msg=name)


# --- loading a stage -----------------------------------------------------------------------------


def test_stage_reads_only_its_shards_and_keys(llama, spy):
    directory, sd = llama
    index = CheckpointIndex.from_directory(directory)
    names = _layers(sd, 2, 3)
    tensors, report = load_tensors(index, _wanted(sd, names), expected_keys=set(sd))
    needed = sorted({index.weight_map[k] for k in names})
    assert len(needed) < len(set(index.weight_map.values()))  # a real subset, or the test proves nothing
    assert report.files_opened == needed
    assert spy["opened"] == needed and spy["headers"] == needed  # each needed shard once, no other touched
    assert sorted(report.keys_read) == sorted(names)
    assert report.bytes_read == sum(sd[k].numel() * sd[k].element_size() for k in names)
    assert set(tensors) == set(names)
    for name in names:
        assert tensors[name].device.type == "cpu"
        torch.testing.assert_close(tensors[name], sd[name], rtol=0, atol=0, msg=name)


def test_floating_tensors_are_cast_on_the_way(llama):
    directory, sd = llama
    names = _layers(sd, 0)
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, names, torch.bfloat16))
    for name in names:
        assert tensors[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(tensors[name], sd[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    # bytes_read counts what was stored (fp32), not the cast result.
    assert report.bytes_read == sum(sd[k].numel() * 4 for k in names)


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_tensor_parallel_parts_read_only_a_slice(llama, monkeypatch, target):
    """A part along dim 0 is a byte range of the shard; one along dim 1 is the slice's range of each row,
    read through the bounce buffer (made small here, so the slice spans several chunks) when cast."""
    directory, sd = llama
    monkeypatch.setattr(weights, "_CHUNK", 256)
    names = [n for n in _layers(sd, 1) if n.endswith(("q_proj.weight", "down_proj.weight", "norm.weight"))]
    parts = {n: ((1 if "down_proj" in n else 0), 1, 2) for n in names if not n.endswith("norm.weight")}
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, names, target), parts=parts)
    for name in names:
        want = sd[name] if name not in parts else sd[name].chunk(2, parts[name][0])[1]
        assert tensors[name].shape == want.shape, name
        torch.testing.assert_close(tensors[name], want.to(target), rtol=0, atol=0, msg=name)
    full = sum(sd[n].numel() * 4 for n in names)
    assert report.bytes_read == full - sum(sd[n].numel() * 4 // 2 for n in parts)  # half of each part never read


# (name, shape, part): row-parallel slices of a 2-D and a 3-D tensor on dims 1 and 2, packed blocks along
# dims 0 and 1, and uneven torch.chunk cuts (7 rows in 3 parts: 3, 3, 1; 5 in 4: 2, 2, 1, 0).
_SLICES = [
    ("rowwise", (6, 10), (1, 1, 2)),
    ("deep1", (3, 7, 4), (1, 2, 3)),
    ("deep2", (2, 3, 9), (2, 1, 4)),
    ("packed0", (12, 5), (0, 1, 2, 3)),
    ("packed1", (4, 15), (1, 0, 3, 3)),
    ("uneven", (5, 5), (1, 3, 4)),
    ("whole", (4, 6), (1, 0, 1)),
]


def _expected_slice(tensor: torch.Tensor, part: tuple[int, ...]) -> torch.Tensor:
    dim, index, count, *rest = part
    pieces = []
    for block in tensor.chunk(rest[0] if rest else 1, dim):
        cuts = block.chunk(count, dim)  # fewer than count when uneven: the missing last parts are empty
        pieces.append(cuts[index] if index < len(cuts) else block.narrow(dim, 0, 0))
    return torch.cat(pieces, dim)


@pytest.mark.parametrize("chunk", [1 << 20, 24])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_slices_read_only_their_bytes(tmp_path, monkeypatch, target, chunk):
    """Every slice equals slicing the whole tensor, and the file bytes read (counted at the read itself) and
    bytes_read are the slices' bytes alone: streaming whole rows would read 2x-7x as much (a whole tensor
    for an empty part)."""
    torch.manual_seed(0)
    sd = {name: torch.randn(shape) for name, shape, _ in _SLICES}
    save_file(sd, str(tmp_path / SINGLE_NAME))
    monkeypatch.setattr(weights, "_CHUNK", chunk)  # 24 bytes: the bounce buffer holds 6 elements, a part spans many
    read, real = [], weights._readinto

    def counting(f, offset, buffer):
        read.append(len(buffer))
        real(f, offset, buffer)

    monkeypatch.setattr(weights, "_readinto", counting)
    parts = {name: part for name, _, part in _SLICES}
    tensors, report = load_tensors(CheckpointIndex.from_directory(tmp_path), _wanted(sd, sd, target), parts=parts)
    kept = 0
    for name, _, part in _SLICES:
        want = _expected_slice(sd[name], part)
        assert tensors[name].shape == want.shape and tensors[name].dtype == target, name
        torch.testing.assert_close(tensors[name], want.to(target), rtol=0, atol=0, msg=name)
        kept += want.numel() * 4
    assert sum(read) == report.bytes_read == kept
    if chunk > 1000 and target == torch.float32:  # in place: at most one read per block of each outer row
        assert len(read) <= sum(math.prod(shape[: part[0]]) * (part[3:] or (1,))[0] for _, shape, part in _SLICES)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float64])
def test_casts_in_small_chunks(llama, monkeypatch, target):
    # A bounce buffer of 100 bytes: 25 fp32 elements a step, so every tensor takes many uneven steps.
    monkeypatch.setattr(weights, "_CHUNK", 100)
    directory, sd = llama
    names = _layers(sd, 1) + ["model.embed_tokens.weight"]
    tensors, _ = load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, names, target))
    for name in names:
        assert tensors[name].dtype == target
        torch.testing.assert_close(tensors[name], sd[name].to(target), rtol=0, atol=0, msg=name)


def _status_bytes(field: str) -> int:
    line = next(text for text in open("/proc/self/status") if text.startswith(field + ":"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_peak_memory_is_the_tensors_alone(tmp_path, target):
    # Each byte is held once: no mapped shard pages, no clone. The peak RSS (VmHWM, file pages
    # included) during loading stays within the loaded bytes plus the cast's bounce buffer.
    ref = {"big": torch.randn(6 * 1024 * 1024), "small": torch.randn(3, 5)}  # 24 MiB of fp32
    save_file(ref, tmp_path / SINGLE_NAME)
    index = CheckpointIndex.from_directory(tmp_path)
    wanted = {k: (tuple(v.shape), target) for k, v in ref.items()}
    import gc

    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = _status_bytes("VmRSS")
    tensors, _ = load_tensors(index, wanted)
    peak = _status_bytes("VmHWM") - base
    loaded = sum(t.numel() * t.element_size() for t in tensors.values())
    bounce = 0 if target == torch.float32 else weights._CHUNK
    assert peak <= loaded + bounce + (2 << 20), f"peak {peak / 2**20:.1f} MiB for {loaded / 2**20:.1f} MiB loaded"
    assert all(torch.equal(tensors[k], ref[k].to(target)) for k in ref)


def test_big_endian_hosts_swap_bytes(tmp_path, monkeypatch):
    # safetensors data is little-endian; on a big-endian host every element's bytes are reversed.
    ref = {"w": torch.randn(4, 3), "i": torch.arange(6, dtype=torch.int16)}
    save_file(ref, tmp_path / SINGLE_NAME)
    monkeypatch.setattr(weights.sys, "byteorder", "big")
    tensors, _ = load_tensors(
        CheckpointIndex.from_directory(tmp_path), {"w": ((4, 3), torch.float32), "i": ((6,), torch.int16)}
    )
    for k, v in ref.items():
        swapped = (
            v.view(-1).view(torch.uint8).view(-1, v.element_size()).flip(-1).contiguous().view(v.dtype).view(v.shape)
        )
        assert torch.equal(tensors[k], swapped), k


def test_integer_buffers_keep_their_dtype(tmp_path):
    ref = {
        "w": torch.randn(3, 4),
        "position_ids": torch.arange(8).unsqueeze(0),
        "mask": torch.ones(2, 2, dtype=torch.bool),
    }
    save_file(ref, tmp_path / SINGLE_NAME)
    wanted = {"w": ((3, 4), torch.float16), "position_ids": ((1, 8), torch.float16), "mask": ((2, 2), torch.bool)}
    tensors, report = load_tensors(CheckpointIndex.from_directory(tmp_path), wanted)
    assert tensors["w"].dtype == torch.float16
    assert tensors["position_ids"].dtype == torch.int64 and torch.equal(tensors["position_ids"], ref["position_ids"])
    assert tensors["mask"].dtype == torch.bool and torch.equal(tensors["mask"], ref["mask"])
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in ref.values())


def test_tied_weights_on_one_stage_are_read_once(gpt2):
    directory, sd = gpt2
    index = CheckpointIndex.from_directory(directory)
    assert "lm_head.weight" not in index.keys() and "transformer.wte.weight" in index.keys()
    names = ["transformer.wte.weight", "lm_head.weight"]
    tensors, report = load_tensors(index, _wanted(sd, names), aliases={"lm_head.weight": ["transformer.wte.weight"]})
    assert report.keys_read == ["transformer.wte.weight"]
    assert report.bytes_read == sd["transformer.wte.weight"].numel() * 4
    assert tensors["lm_head.weight"] is tensors["transformer.wte.weight"]
    torch.testing.assert_close(tensors["lm_head.weight"], sd["transformer.wte.weight"], rtol=0, atol=0)


def test_tied_head_alone_on_last_stage(gpt2):
    directory, sd = gpt2
    index = CheckpointIndex.from_directory(directory)
    aliases = {"lm_head.weight": ["missing.key", "transformer.wte.weight"]}  # the first alias the checkpoint has wins
    tensors, report = load_tensors(index, _wanted(sd, ["lm_head.weight", "transformer.ln_f.weight"]), aliases=aliases)
    read = ["transformer.ln_f.weight", "transformer.wte.weight"]
    assert sorted(report.keys_read) == read
    assert report.files_opened == sorted({index.weight_map[k] for k in read})
    torch.testing.assert_close(tensors["lm_head.weight"], sd["transformer.wte.weight"], rtol=0, atol=0)


def test_prefix_aliases(gpt2):
    # A base GPT2Model names its parameters without "transformer."; the head checkpoint has the prefix.
    directory, sd = gpt2
    full = ["transformer.wte.weight", "transformer.h.1.mlp.c_fc.weight"]
    base = [k.removeprefix("transformer.") for k in full]
    wanted = {b: (tuple(sd[f].shape), torch.float32) for b, f in zip(base, full)}
    aliases = {b: [f] for b, f in zip(base, full)}
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), wanted, aliases=aliases)
    assert sorted(report.keys_read) == sorted(full)
    for b, f in zip(base, full):
        torch.testing.assert_close(tensors[b], sd[f], rtol=0, atol=0, msg=b)


def test_the_name_itself_wins_over_aliases(llama):
    directory, sd = llama
    name, other = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    index = CheckpointIndex.from_directory(directory)
    tensors, report = load_tensors(index, _wanted(sd, [name]), aliases={name: [other]})
    assert report.keys_read == [name]
    torch.testing.assert_close(tensors[name], sd[name], rtol=0, atol=0)


def test_progress_bar_runs(llama):
    directory, sd = llama
    tensors, _ = load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, _layers(sd, 1)), progress=True)
    assert set(tensors) == set(_layers(sd, 1))


# --- file handles --------------------------------------------------------------------------------


def test_no_shard_stays_open_or_mapped(llama):
    # Tensors that were views of a file mapping would keep the shard mapped (and break if it is rewritten).
    directory, sd = llama
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, sd))
    assert len(report.files_opened) >= 3
    assert _open_under(directory) == []
    assert all(torch.equal(tensors[k], sd[k]) for k in sd)  # still valid after the files are closed


def test_no_shard_stays_open_after_an_error(llama_copy):
    directory, sd = llama_copy
    shard = _corrupt_dtype(directory, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=shard):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, sd))
    assert _open_under(directory) == []


# --- errors: keys and shapes ---------------------------------------------------------------------


def test_missing_key(llama):
    directory, sd = llama
    wanted = _wanted(sd, _layers(sd, 3))
    wanted["model.layers.4.mlp.up_proj.weight"] = ((64, 32), torch.float32)
    index = CheckpointIndex.from_directory(directory)
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.mlp\.up_proj\.weight") as e:
        load_tensors(index, wanted, aliases={"model.layers.4.mlp.up_proj.weight": ["alt.key"]})
    assert str(directory) in str(e.value) and "alt.key" in str(e.value) and "config" in str(e.value)


def test_many_missing_keys_are_listed_briefly(llama):
    directory, _ = llama
    wanted = {f"model.layers.{i}.extra.weight": ((1,), torch.float32) for i in range(15)}
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.extra\.weight.*\(5 more\)"):
        load_tensors(CheckpointIndex.from_directory(directory), wanted)


def test_unexpected_keys_checked_from_the_index_only(llama, spy):
    directory, sd = llama
    index = CheckpointIndex.from_directory(directory)
    expected = set(sd) - {"model.layers.3.mlp.down_proj.weight"}  # as if the config had lost a module
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*ignore_unexpected") as e:
        load_tensors(index, _wanted(sd, _layers(sd, 0)), expected_keys=expected)
    assert str(directory) in str(e.value)
    assert spy["opened"] == [] and spy["headers"] == []
    _, report = load_tensors(
        index, _wanted(sd, _layers(sd, 0)), expected_keys=expected, ignore_unexpected=[r"\.down_proj\."]
    )
    assert sorted(report.keys_read) == sorted(_layers(sd, 0))


def test_shape_mismatch(llama, spy):
    directory, sd = llama
    name = "model.layers.2.mlp.gate_proj.weight"
    wanted = _wanted(sd, _layers(sd, 0, 2))
    wanted[name] = ((48, 32), torch.float32)
    with pytest.raises(CheckpointError, match=rf"{name}.*\[64, 32\].*\[48, 32\]"):
        load_tensors(CheckpointIndex.from_directory(directory), wanted)
    assert spy["opened"] == []  # found from the headers, before any data was read


def test_shape_mismatch_through_an_alias_names_both(gpt2):
    directory, sd = gpt2
    index = CheckpointIndex.from_directory(directory)
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight.*lm_head\.weight.*\[128, 32\].*\[5, 32\]"):
        load_tensors(
            index, {"lm_head.weight": ((5, 32), torch.float32)}, aliases={"lm_head.weight": ["transformer.wte.weight"]}
        )


# --- errors: files -------------------------------------------------------------------------------


def test_shard_missing_at_index_time(llama_copy):
    directory, sd = llama_copy
    key = "model.layers.3.self_attn.q_proj.weight"
    shard = _shard_of(directory, key)
    first = next(
        k for k, s in json.loads((directory / INDEX_NAME).read_text())["weight_map"].items() if s == shard
    )
    (directory / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}.*{first}"):
        CheckpointIndex.from_directory(directory)


def test_shard_deleted_after_indexing(llama_copy):
    directory, sd = llama_copy
    index = CheckpointIndex.from_directory(directory)
    shard = _shard_of(directory, "model.layers.3.self_attn.q_proj.weight")
    (directory / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        load_tensors(index, _wanted(sd, _layers(sd, 3)))


def test_index_names_a_nonexistent_file(llama_copy):
    directory, _ = llama_copy
    index_path = directory / INDEX_NAME
    data = json.loads(index_path.read_text())
    data["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model-99999-of-99999\.safetensors.*model\.norm\.weight"):
        CheckpointIndex.from_directory(directory)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": ["a"]}'])
def test_unreadable_index(llama_copy, text):
    directory, _ = llama_copy
    (directory / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=INDEX_NAME):
        CheckpointIndex.from_directory(directory)


def test_truncated_shard(llama_copy, spy):
    directory, sd = llama_copy
    index = CheckpointIndex.from_directory(directory)
    shard = _shard_of(directory, "model.layers.3.mlp.up_proj.weight")
    path = directory / shard
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"{shard}.*truncated \(expected {size} bytes, found {size - 100}\)"):
        load_tensors(index, _wanted(sd, _layers(sd, 3)))
    assert spy["opened"] == []  # detected from the header, the data was never opened
    # A stage that does not need the damaged shard loads fine: that shard is not even looked at.
    others = [k for k in sd if index.weight_map[k] != shard][:4]
    before = len(spy["headers"])
    _, report = load_tensors(index, _wanted(sd, others))
    assert shard not in report.files_opened and shard not in spy["headers"][before:]


def test_shard_cut_inside_its_header(llama_copy):
    directory, sd = llama_copy
    shard = _shard_of(directory, "model.norm.weight")
    path = directory / shard
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=rf"{shard}.*truncated"):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, ["model.norm.weight"]))


def test_shard_with_extra_bytes(llama_copy):
    directory, sd = llama_copy
    shard = _shard_of(directory, "model.norm.weight")
    with open(directory / shard, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{shard}.*corrupted"):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, ["model.norm.weight"]))


@pytest.mark.parametrize("where", ["json", "length"])
def test_corrupted_header(llama_copy, where):
    directory, sd = llama_copy
    shard = _shard_of(directory, "model.layers.1.mlp.up_proj.weight")
    path = directory / shard
    data = bytearray(path.read_bytes())
    if where == "json":
        data[8:24] = b"\xff" * 16
    else:
        data[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}.*(corrupted|truncated)"):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, _layers(sd, 1)))


def test_unknown_dtype_in_header(llama_copy, spy):
    directory, sd = llama_copy
    shard = _corrupt_dtype(directory, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=rf"{shard}.*corrupted.*unknown dtype 'Q32'"):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, _layers(sd, 1)))
    assert spy["opened"] == []  # found from the header, before any data was read


def _rewrite_header(path: pathlib.Path, edit) -> None:
    """Apply edit(header dict) and write the header back, padded to its old length (same data offsets)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n, b" ") + data[8 + n :])


@pytest.mark.parametrize("damage", ["size", "overlap"])
def test_entry_offsets_are_checked(llama_copy, damage, spy):
    # The loader reads bytes at the header's offsets itself, so offsets that disagree with the
    # shape, or tensors that overlap, must be refused as safetensors refuses them.
    directory, sd = llama_copy
    key = "model.layers.1.mlp.up_proj.weight"
    shard = _shard_of(directory, key)

    def edit(header):
        entry = header[key]
        if damage == "size":
            entry["shape"] = [entry["shape"][0] // 2, entry["shape"][1]]
        else:
            other = next(v for k, v in header.items() if k not in (key, "__metadata__") and v["data_offsets"][0] > 0)
            begin, stop = other["data_offsets"]
            other["data_offsets"] = [begin - 4, stop - 4]

    _rewrite_header(directory / shard, edit)
    match = r"needs \d+ bytes but its data_offsets span" if damage == "size" else "not where the previous tensor ends"
    with pytest.raises(CheckpointError, match=rf"{shard}.*corrupted.*{match}"):
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, _layers(sd, 1)))
    assert spy["opened"] == []


def test_shard_truncated_while_loading(llama_copy, monkeypatch):
    # The headers were fine, then the file shrank (overwritten by a concurrent save): an error naming
    # the shard as changed during the read (the short read, naming the key, is its cause), and no
    # descriptor left open. A file that ends early without changing: tests/loading/test_load_races.py.
    directory, sd = llama_copy
    key = "model.layers.3.mlp.down_proj.weight"
    shard = _shard_of(directory, key)
    real_open = weights._open_shard

    def open_after_truncation(path):
        if path.name == shard:
            with open(path, "r+b") as f:
                f.truncate(8 + int.from_bytes(f.read(8), "little") + 4)  # the header and 4 bytes of data
        return real_open(path)

    monkeypatch.setattr(weights, "_open_shard", open_after_truncation)
    with pytest.raises(CheckpointError, match=rf"changed while it was read: {shard} was rewritten") as info:
        load_tensors(CheckpointIndex.from_directory(directory), _wanted(sd, _layers(sd, 3)))
    assert re.search(rf"{shard}.*ended while reading '", str(info.value.__cause__))
    assert _open_under(directory) == []


def test_directory_without_safetensors(tmp_path, llama):
    _, sd = llama
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*save_pretrained.*safe_serialization"):
        CheckpointIndex.from_directory(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=rf"no safetensors checkpoint.*{tmp_path.name}"):
        CheckpointIndex.from_directory(tmp_path)


# --- resolve_checkpoint --------------------------------------------------------------------------


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty local HF cache, offline mode, and sockets that fail loudly if anything tries the network."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment at import time; the constant is what snapshot_download uses.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError("resolve_checkpoint tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def test_resolve_local_directory(llama):
    directory, _ = llama
    assert resolve_checkpoint(directory) == directory
    assert resolve_checkpoint(str(directory)) == directory


def test_resolve_a_file_says_pass_the_directory(llama):
    directory, _ = llama
    with pytest.raises(CheckpointNotFoundError, match="directory"):
        resolve_checkpoint(directory / INDEX_NAME)


def test_resolve_hub_id_from_the_local_cache(offline_cache, single):
    directory, sd = single
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_cache / "models--org--tiny"
    shutil.copytree(directory, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_checkpoint("org/tiny")
    assert path.resolve() == (repo / "snapshots" / commit).resolve()
    assert resolve_checkpoint("org/tiny", revision=commit).resolve() == path.resolve()
    tensors, _ = load_tensors(CheckpointIndex.from_directory(path), _wanted(sd, ["model.norm.weight"]))
    torch.testing.assert_close(tensors["model.norm.weight"], sd["model.norm.weight"], rtol=0, atol=0)


def test_resolve_uncached_id_fails_clearly_offline(offline_cache):
    with pytest.raises(CheckpointNotFoundError, match=r"org/not-cached.*not a local directory") as e:
        resolve_checkpoint("org/not-cached")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, CheckpointError)
    assert str(offline_cache) in str(e.value)  # says where it looked


def test_resolve_missing_path_that_is_no_hub_id(offline_cache):
    with pytest.raises(CheckpointNotFoundError, match=r"no/such/local/dir.*neither a local directory.*nor a hub id"):
        resolve_checkpoint("no/such/local/dir")


def test_resolve_missing_revision(offline_cache, single):
    directory, _ = single
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_cache / "models--org--tiny"
    shutil.copytree(directory, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    with pytest.raises(CheckpointNotFoundError, match="v2"):
        resolve_checkpoint("org/tiny", revision="v2")
    assert os.environ["HF_HUB_OFFLINE"] == "1"


# --- checkpoint key renames ----------------------------------------------------------------------


def _rename_keys(src: pathlib.Path, dst: pathlib.Path, rename, extra=None) -> pathlib.Path:
    """Copy a sharded checkpoint with every key rewritten by rename (None drops it); extra(keys) adds tensors."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {rename(k): v for k, v in load_file(dst / shard).items() if rename(k) is not None}
        if extra is not None:
            tensors.update(extra(tensors))
        save_file(tensors, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    index["weight_map"] = weight_map
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def _gamma_beta(key: str) -> str:
    # BERT checkpoints from before PyTorch-style names (TF ports, old transformers) store LayerNorm gamma/beta.
    return key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")


def _gpt2_hub_layout(key: str) -> str | None:
    # The hub's gpt2 was saved from GPT2Model: no "transformer." prefix and no (tied) lm_head.
    return None if key == "lm_head.weight" else key.removeprefix("transformer.")


def _gpt2_causal_masks(tensors):
    # ... and it stores each block's causal-mask buffer, which transformers ignores on load.
    layers = {k.split(".")[1] for k in tensors if k.startswith("h.")}
    n = tiny.config_for("gpt2").n_positions
    return {f"h.{i}.attn.bias": torch.tril(torch.ones(n, n)).view(1, 1, n, n) for i in layers}


LEGACY = {  # case -> (arch, auto class the checkpoint is saved from and loaded as)
    "bert-gamma-beta": ("bert", "AutoModelForMaskedLM"),
    "bert-base-gamma-beta": ("bert", "AutoModel"),  # BertModel keys: no "bert." prefix
    "gpt2-hub-layout": ("gpt2", "AutoModelForCausalLM"),
}


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """case -> (directory with legacy key names, transformers' output on it, its output on the original,
    output name)."""
    root = tmp_path_factory.mktemp("legacy")
    sources = {
        "bert-gamma-beta": (tiny.make_checkpoint(root / "bert-src", "bert"), _gamma_beta, None),
        "bert-base-gamma-beta": (
            tiny.make_checkpoint(root / "bert-base-src", "bert", auto="AutoModel"),
            _gamma_beta,
            None,
        ),
        "gpt2-hub-layout": (tiny.make_checkpoint(root / "gpt2-src", "gpt2"), _gpt2_hub_layout, _gpt2_causal_masks),
    }
    cases = {}
    for case, (arch, auto) in LEGACY.items():
        src, rename, extra = sources[case]
        path = _rename_keys(src, root / case, rename, extra)
        inputs = tiny.sample_inputs(arch)
        with torch.no_grad():
            got = tiny.reference(path, auto)(**inputs)
            original = tiny.reference(src, auto)(**inputs)
        out = "logits" if auto != "AutoModel" else "last_hidden_state"
        cases[case] = (path, getattr(got, out), getattr(original, out), out)
    return cases


def _legacy_forward(cases: dict, **kwargs) -> dict:
    import hf_pipeline

    results = {}
    for case, (path, arch, auto, out) in cases.items():
        model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)
        results[case] = (getattr(model(**tiny.sample_inputs(arch)), out), list(model.load_report.keys_read))
    return results


def _check_legacy(legacy, results):
    for case, (got, keys_read) in results.items():
        path, want, original, _ = legacy[case]
        # transformers really renamed (its model equals the one saved with today's names) ...
        torch.testing.assert_close(want, original, rtol=0, atol=0, msg=case)
        # ... and so does the pipeline.
        # fp32 outputs: summation order moves them ~1e-6 in the tiny models; a wrong or misnamed weight moves
        # them by 1e-2 or more.
        assert (got - want).abs().max().item() <= 1e-5, case
        stored = CheckpointIndex.from_directory(path).keys()
        assert set(keys_read) <= stored, case
        if case.startswith("bert"):
            assert any(k.endswith("LayerNorm.gamma") for k in keys_read), case


def _legacy_jobs(legacy):
    return {case: (legacy[case][0], LEGACY[case][0], LEGACY[case][1], legacy[case][3]) for case in LEGACY}


def test_checkpoint_key_renames_are_transformers_own():
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(tiny.config_for("bert"))
    keys = [
        "bert.embeddings.LayerNorm.gamma",
        "bert.encoder.layer.0.output.LayerNorm.beta",
        "bert.embeddings.word_embeddings.weight",
    ]
    assert checkpoint_key_renames(model, keys) == {
        "bert.embeddings.LayerNorm.gamma": "bert.embeddings.LayerNorm.weight",
        "bert.encoder.layer.0.output.LayerNorm.beta": "bert.encoder.layer.0.output.LayerNorm.bias",
    }


def test_checkpoint_key_renames_without_transformers_mapping(monkeypatch):
    # A transformers without conversion mappings: only the legacy LayerNorm names are renamed.
    monkeypatch.setitem(sys.modules, "transformers.core_model_loading", None)  # makes the import fail
    with torch.device("meta"):
        model = transformers.BertModel(tiny.config_for("bert"))
    keys = ["embeddings.LayerNorm.gamma", "embeddings.LayerNorm.beta", "pooler.dense.weight"]
    assert checkpoint_key_renames(model, keys) == {
        "embeddings.LayerNorm.gamma": "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.beta": "embeddings.LayerNorm.bias",
    }


def test_legacy_key_names_load_as_transformers_loads_them(legacy):
    # World size 1, in process, two stages on this rank: the cut and the tied GPT-2 head see renamed keys.
    results = _legacy_forward(_legacy_jobs(legacy), num_stages=2, virtual_stages=2, schedule="interleaved-1f1b")
    _check_legacy(legacy, results)


@pytest.mark.dist
def test_legacy_key_names_load_pipelined(legacy):
    results = run_distributed(_legacy_forward, 2, _legacy_jobs(legacy), timeout=180)
    for rank_results in results:
        _check_legacy(legacy, rank_results)


def test_legacy_names_missing_say_what_was_tried(legacy, tmp_path):
    # A renamed key that is gone is reported by the name the model wants.
    path = legacy["bert-gamma-beta"][0]
    broken = _rename_keys(path, tmp_path / "bert", lambda k: None if k == "bert.embeddings.LayerNorm.gamma" else k)
    import hf_pipeline

    with pytest.raises(CheckpointError, match=r"bert\.embeddings\.LayerNorm\.weight"):
        hf_pipeline.AutoModelForMaskedLM.from_pretrained(broken, pipeline=True, device="cpu", progress=False)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path, where):
    # The index travels with the checkpoint: a shard name that climbs out of the folder would make every rank
    # read a file the checkpoint does not hold. Refused as transformers refuses it, before anything is read.
    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.errors import CheckpointError

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(path / victim, outside / victim)  # a real shard there: without the check it would load
    name = f"../elsewhere/{victim}" if where == "parent" else str(outside / victim)
    index["weight_map"] = {k: (name if v == victim else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
        CheckpointIndex.from_directory(path)
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
        AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    # A name inside the folder (a sub-folder included) is still a shard of the checkpoint.
    (path / "sub").mkdir()
    shutil.move(str(path / victim), path / "sub" / victim)
    index["weight_map"] = {k: (f"sub/{victim}" if v == name else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    assert f"sub/{victim}" in set(CheckpointIndex.from_directory(path).weight_map.values())
