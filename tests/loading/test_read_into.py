"""``load_tensors(into=...)``: the reader fills the caller's tensors in place (FSDP's local shards)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_pipeline.errors import InternalError
from hf_pipeline.loading import weights
from hf_pipeline.loading.checkpoint_files import CheckpointIndex
from hf_pipeline.loading.weights import load_tensors


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(directory, reference state_dict) of a 2-layer Llama in several shards."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("llama")
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(directory, max_shard_size="20KB")
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_reads_each_part_into_the_given_tensor(llama, monkeypatch, target):
    """The stored dtype is read straight into the tensor, a cast goes through the bounce buffer (100 bytes
    here: many steps); both fill the caller's tensor (the same object comes back) with the chunk's values."""
    directory, sd = llama
    monkeypatch.setattr(weights, "_CHUNK", 100)
    names = [n for n in sd if n.startswith("model.layers.1.")] + ["lm_head.weight"]
    wanted = {n: (tuple(sd[n].shape), target) for n in names}
    parts = {n: (0, 1, 3) for n in names}  # the last of 3 dim-0 chunks: ceil(rows / 3) or fewer rows
    into = {n: torch.full_like(sd[n].chunk(3)[1], float("nan"), dtype=target) for n in names[::2]}
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), wanted, parts=parts, into=into)
    for n in names:
        torch.testing.assert_close(tensors[n], sd[n].chunk(3)[1].to(target), rtol=0, atol=0, msg=n)
        assert (n in into and tensors[n] is into[n]) == (n in into), n
    assert report.bytes_read == sum(sd[n].chunk(3)[1].numel() * 4 for n in names)


def test_a_destination_of_another_shape_or_dtype_is_refused(llama):
    directory, sd = llama
    name = "model.norm.weight"
    wanted = {name: (tuple(sd[name].shape), torch.float32)}
    for bad in (torch.zeros(3), torch.zeros(sd[name].shape, dtype=torch.float64)):
        with pytest.raises(InternalError, match="destination"):
            load_tensors(CheckpointIndex.from_directory(directory), wanted, into={name: bad})


@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_a_chunk_of_a_tensor_parallel_slice_is_read_into_the_tensor(llama, monkeypatch, target):
    """FSDP over tensor parallelism: fsdp rank 1 of 3's dim-0 chunk of tp rank 1 of 2's slice, colwise (a row
    range of a row range) and rowwise (the chunk's rows x the tp columns), equals slicing the whole tensor,
    straight into the caller's tensor, and reads exactly the bytes kept (a whole slice read counts 3x)."""
    directory, sd = llama
    monkeypatch.setattr(weights, "_CHUNK", 100)
    tp = {"model.layers.1.mlp.up_proj.weight": (0, 1, 2), "model.layers.1.mlp.down_proj.weight": (1, 1, 2),
          "model.layers.1.self_attn.o_proj.weight": (1, 1, 2)}
    names = [*tp, "model.layers.1.input_layernorm.weight"]  # a replicated norm: a plain dim-0 chunk
    parts = {n: (tp[n], (0, 1, 3)) if n in tp else (0, 1, 3) for n in names}
    want = {n: sd[n].chunk(2, tp[n][0])[1].chunk(3)[1] if n in tp else sd[n].chunk(3)[1] for n in names}
    into = {n: torch.full(want[n].shape, float("nan"), dtype=target) for n in names}
    wanted = {n: (tuple(sd[n].shape), target) for n in names}
    tensors, report = load_tensors(CheckpointIndex.from_directory(directory), wanted, parts=parts, into=into)
    for n in names:
        assert tensors[n] is into[n], n
        torch.testing.assert_close(tensors[n], want[n].to(target), rtol=0, atol=0, msg=n)
    assert report.bytes_read == sum(want[n].numel() * 4 for n in names)


def test_a_packed_dim0_part_is_read_whole_on_each_fsdp_rank_and_refused_under_hsdp():
    """GPT-2's c_attn bias (packed along dim 0) is read as its whole tp slice on every fsdp rank (FSDP keeps
    it whole there); its weight (packed along dim 1) and plain tensors get the fsdp rank's dim-0 chunk."""
    from hf_pipeline.errors import InputError
    from hf_pipeline.loading.fsdp import fsdp_parts, refuse_packed

    stage = torch.nn.Module()
    stage.c_attn = torch.nn.Linear(4, 12)  # names only: fsdp_parts reads no values
    stage.ln = torch.nn.LayerNorm(4)
    tp = {"c_attn.bias": (0, 1, 2, 3), "c_attn.weight": (1, 1, 2, 3)}
    parts = fsdp_parts([stage], 1, 2, tp_parts=tp)
    assert parts["c_attn.bias"] == (0, 1, 2, 3), parts
    assert parts["c_attn.weight"] == ((1, 1, 2, 3), (0, 1, 2)), parts
    assert parts["ln.weight"] == (0, 1, 2), parts
    plan = (("h.*.attn.c_attn", "packed_colwise:3"), ("h.*.mlp.c_fc", "colwise"))
    refuse_packed(plan)  # plain FSDP over tp: loaded
    with pytest.raises(InputError, match=r"c_attn.*HSDP"):
        refuse_packed(plan, replicas=2)
    refuse_packed((("h.*.mlp.c_fc", "colwise"),), replicas=2)
