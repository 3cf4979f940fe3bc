"""The continuous ring on sliding-window caches (transformers' ``DynamicSlidingWindowLayer``, window 5).

* Pure: :mod:`hf_pipeline.continuous_batching.group_cache` merges, right aligned, a group's cache with
  joining rows' and cuts columns no row uses, keeping each layer's own stored columns (a sliding
  layer: the last ``window - 1``, its ``cumulative_length`` the mask's columns); chunked attention,
  whose boundaries would move with the padding, is refused naming it.
* One process (one stage holds every layer): Gemma 3 and gpt-oss (sliding and full layers mixed),
  Mistral (every layer slides) and Qwen2 (full, then sliding) serve continuously
  (``engine.batching == "continuous"``) a stream whose prompts are shorter and longer than the window,
  half of it submitted while the first request decodes; every request's greedy tokens equal
  transformers' ``generate`` of it alone (exactly: greedy tokens).
* Two ranks (one spawned job): Qwen2 (stage 0 full layers only, stage 1 sliding only) and Gemma 3, the
  same stream, the same check, with prompts joining in chunks of 4 (chunked prefill: a row's own sliding
  cache grows chunk by chunk across the window, then merges with its group's). Prefix caching is off
  for these caches (``engine.prefix_reason`` names the sliding kind).
"""

from __future__ import annotations

import pathlib

import pytest
import tiny
import torch
import transformers
from decoders import decoder_config
from harness import run_distributed
from transformers import Cache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_pipeline.continuous_batching.group_cache import cut_columns, merge, merge_refusal

WINDOW = 5
# (prompt length, max_new_tokens): prompts from 2 to 14 tokens against a window of 5; the first two
# start the ring, the rest arrive once the first has tokens and join as rows leave.
STREAM = [(3, 12), (9, 4), (12, 9), (2, 6), (7, 10), (6, 3), (14, 8), (4, 11)]
FIRST = 2
MAX_BATCH = 3


def _config(name: str) -> transformers.PretrainedConfig:
    if name in ("mistral", "qwen2"):
        return tiny.sliding_config(name, window=WINDOW)  # qwen2: layers 0-2 full, 3-5 sliding
    return decoder_config(name)  # window 5, layers sliding, full, sliding, full


def _requests() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [dict(prompt_ids=torch.randint(5, tiny.VOCAB, (n,), generator=g).tolist(), max_new_tokens=m)
            for n, m in STREAM]


def _save(root: pathlib.Path, name: str) -> str:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(name)).save_pretrained(root / name)
    return str(root / name)


def _alone(path: str) -> list[list[int]]:
    """transformers' greedy generate of each request alone, cut at the EOS (2) as the engine cuts it."""
    ref = tiny.reference(path, "AutoModelForCausalLM")
    return [tiny.greedy_alone(ref, r["prompt_ids"], r["max_new_tokens"])[0] for r in _requests()]


def _stream(path: str, chunk: int | None = 512) -> dict | None:
    """Every rank: a continuous engine; rank 0 submits the first requests, the rest while the first decodes."""
    import hf_pipeline
    from hf_pipeline.serving import Engine

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    engine = Engine(model, max_batch=MAX_BATCH, batching="continuous", idle_s=0.05, prefill_chunk=chunk)
    if model.ctx.rank != 0:
        engine.serve_forever()
        return None
    out = {"tokens": [cs[0].token_ids for cs in tiny.serve_staggered(engine, _requests(), FIRST)]}
    return {**out, "mode": engine.batching, "reason": engine.static_reason, "steps": engine.decode_steps,
            "peak_rows": engine.peak_rows, "chunks": engine.prefill_chunks, "prefix": engine.prefix_reason}


def _check(name: str, got: dict, want: list[list[int]]) -> None:
    assert got["mode"] == "continuous" and got["reason"] is None, (name, got["reason"])
    for k, (tokens, expected) in enumerate(zip(got["tokens"], want)):
        assert tokens == expected, f"{name}: request {k} (prompt of {STREAM[k][0]}, window {WINDOW})"
    # Rows ran side by side: the pool was full at some step, and the ring took fewer steps than rows' tokens.
    assert got["peak_rows"] == MAX_BATCH, name
    assert got["steps"] < sum(len(t) for t in want), name


# ----------------------------------------------------------------------------------------- pure
def _layer(window: int | None, columns: int, rows: int, fill: float) -> DynamicLayer:
    """A cache layer after a prompt of ``columns`` tokens (keys and values all ``fill``), as the model leaves it."""
    layer = DynamicLayer() if window is None else DynamicSlidingWindowLayer(sliding_window=window)
    kv = torch.full((rows, 1, columns, 2), fill)
    layer.update(kv, kv.clone())
    return layer


@pytest.mark.unit
@pytest.mark.parametrize("old, new", [(7, 3), (3, 7), (2, 3), (8, 9)])
def test_merge_and_cut_keep_each_layers_own_last_columns(old, new):
    # A full and a sliding layer (window 5: stores 4 columns) side by side, as a mixed stage holds them.
    group = Cache(layers=[_layer(None, old, 2, 1.0), _layer(WINDOW, old, 2, 1.0)])
    fresh = Cache(layers=[_layer(None, new, 1, 2.0), _layer(WINDOW, new, 1, 2.0)])
    mask = merge(group, torch.ones(2, old, dtype=torch.long), fresh, torch.ones(1, new, dtype=torch.long))
    total = max(old, new)
    assert mask.tolist() == [[0] * (total - old) + [1] * old] * 2 + [[0] * (total - new) + [1] * new]
    full, sliding = group.layers
    for layer, stored in ((full, total), (sliding, min(total, WINDOW - 1))):
        assert layer.keys.shape == layer.values.shape == (3, 1, stored, 2)
        # Each row's last columns are its own keys; what the mask hides is zeros.
        want = (mask[:, -stored:].float() * torch.tensor([1.0, 1.0, 2.0])[:, None])[:, None, :, None].expand(3, 1,
                                                                                                          stored, 2)
        assert torch.equal(layer.keys, want)
    assert sliding.cumulative_length == total and sliding.get_mask_sizes(1) == (min(total, WINDOW - 1) + 1,
                                                                               max(total - WINDOW + 1, 0))
    # The joining row leaves and the others' padding goes: columns cut from the left.
    group.batch_select_indices(torch.tensor([0, 1]))
    cut = total - old
    cut_columns(group, cut, old)
    assert full.keys.shape[2] == old and sliding.keys.shape[2] == min(old, WINDOW - 1)
    assert sliding.cumulative_length == old and bool((sliding.keys == 1.0).all())


@pytest.mark.unit
def test_chunked_attention_is_refused_naming_it_and_sliding_families_are_not():
    for name in ("gemma3_text", "gpt_oss", "mistral", "qwen2", "qwen3", "cohere2", "starcoder2"):
        assert merge_refusal(_config(name)) is None, name
    chunked = transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=tiny.VOCAB, attention_chunk_size=8,
    )
    reason = merge_refusal(chunked)
    assert reason is not None and "'chunked_attention' (DynamicSlidingWindowLayer)" in reason, reason


# ----------------------------------------------------------------------------------------- one process
# gemma3_text (sliding and full layers mixed) stays in the quick tier; the other families are the same path
# with other layer kinds, in the full suite (5 to 8 s each on 2 shared cores).
_MORE = pytest.mark.equiv


@pytest.mark.parametrize(
    "name", ["gemma3_text", pytest.param("gpt_oss", marks=_MORE), pytest.param("mistral", marks=_MORE),
             pytest.param("qwen2", marks=_MORE)]
)
def test_sliding_window_family_streams_continuously_equal_to_each_request_alone(tmp_path, name):
    path = _save(tmp_path, name)
    _check(name, _stream(path), _alone(path))


# ----------------------------------------------------------------------------------------- two ranks
def _job(paths: list[str]) -> list[dict | None]:
    torch.set_num_threads(1)
    return [_stream(p, chunk=4) for p in paths]


@pytest.mark.dist
@pytest.mark.slow  # 6 to 16 s on 2 shared cores (the ranks' start-up)
def test_sliding_window_streams_at_2_ranks(tmp_path):
    names = ["qwen2", "gemma3_text"]
    paths = [_save(tmp_path, n) for n in names]
    per_rank = run_distributed(_job, 2, paths, timeout=300)
    assert per_rank[1] == [None, None]
    for name, path, got in zip(names, paths, per_rank[0]):
        _check(name, got, _alone(path))
        assert got["chunks"] > 0 and "sliding_attention" in got["prefix"], (name, got["chunks"], got["prefix"])
