"""Sliding-window attention in the LLaMA family equals transformers: forward, training, generation,
at world sizes 1, 2, 3.

Two tiny 6-layer models whose window (5) is shorter than every sequence, so the window changes the
numbers (checked against transformers with the window switched off):
  * Mistral with ``sliding_window=5``: every layer slides;
  * Qwen2 with ``use_sliding_window=True, max_window_layers=3``: layers 0-2 full, 3-5 sliding
    (``config.layer_types``), so a stage may hold layers of both kinds, whose KV caches differ in
    length once a sequence passes the window.
Each spawned job (one per world size) loads each model with two stage layouts (one stage per rank
with 1F1B, blocks cut between attention and MLP at world 2 and a stage holding a full and a
sliding layer at world 3; two stages per rank with interleaved 1F1B) and on every rank compares:
  * logits of a left-padded batch of 5 rows in 3 microbatches (the last one padded);
  * greedy ``generate`` ids, token for token, for 12-token prompts + 10 new tokens with an EOS that
    stops some rows early (finished rows are dropped from the sliding caches too), and again with
    ``prefill_chunk_size=CHUNK`` against transformers' chunked prefill (the window spans chunks);
  * one ``train_step`` on 9 left-padded rows: loss, the gradient of every parameter by name, and
    every parameter after an AdamW step.
Configs with attention kinds the family cannot compute are refused at load (single process).

Tolerances as in ``test_train.py`` / ``test_forward.py`` (fp32, same kernels, only summation order
differs): logits 1e-5 absolute, loss 1e-5 relative, gradients 1e-5 of the tensor's largest
reference entry, parameters after AdamW 1e-5 absolute (``EPS`` as there).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

WINDOW = 5
LAYERS = 6
SEQ = 16  # forward and training sequences
PROMPT, NEW = 12, 10  # generation: prompt + new tokens = 22 > WINDOW
CHUNK = 4  # chunked prefill: 3 chunks of the prompt, each shorter than the window
ROWS_FWD, ROWS_GEN, ROWS_TRAIN = 5, 5, 9  # odd batches; forward pads 5 rows to 3 microbatches of 2
M = 3
# fp32 logits below 1 (Mistral 0.41, Qwen2 0.39; one ulp 6e-8): sums of 32-64 terms over 4-6 layers keep another
# summation order's rounding near 1e-6; a wrong mask, window or position moves them by 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5
LOSS_RTOL = GRAD_RTOL = PARAM_ATOL = 1e-5
LR, EPS = 1e-3, 1e-5
AUTO = "AutoModelForCausalLM"
ARCHS = ("mistral", "qwen2")

# world size -> (label, load options) run in that job; each model also trains with its schedule.
LAYOUTS = {
    1: [("1f1b", {"schedule": "1f1b"}), ("interleaved", {"schedule": "interleaved-1f1b", "virtual_stages": 2})],
    # stage 0 ends with layer 3's attention half (Qwen2: sliding after three full layers), stage 1
    # starts with its MLP half
    2: [
        ("1f1b-cut", {"schedule": "1f1b", "split": ["model.layers.3.post_attention_layernorm"]}),
        ("interleaved", {"schedule": "interleaved-1f1b", "virtual_stages": 2}),
    ],
    # stage 1 holds layers 2 (full) and 3 (sliding) in Qwen2
    3: [
        ("1f1b", {"schedule": "1f1b", "split": ["model.layers.2", "model.layers.4"]}),
        ("interleaved", {"schedule": "interleaved-1f1b", "virtual_stages": 2}),
    ],
}


def _config(arch: str, **overrides):
    import transformers

    common = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, vocab_size=tiny.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        return transformers.MistralConfig(**{"sliding_window": WINDOW, **common, **overrides})
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **{"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 3, **common, **overrides}
        )
    if arch == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    raise ValueError(arch)


def _save(directory, config, seed: int = 0) -> str:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, max_shard_size="40KB")  # several shards, as real checkpoints
    return str(directory)


def _train_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    batch = tiny.sample_inputs("llama", batch=ROWS_TRAIN, seq=SEQ, seed=seed)  # left padded: 0, 2, 4, ... pads
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _fwd_inputs():
    return tiny.sample_inputs("llama", batch=ROWS_FWD, seq=SEQ, seed=2)


def _gen_inputs():
    return tiny.sample_inputs("llama", batch=ROWS_GEN, seq=PROMPT, seed=3)


# --------------------------------------------------------------------------- every rank
def _case(path, load, eos):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, n_microbatches=M, **load
    )
    res = {"halves": [s.spec.halves for s in model.stages], "blocks": [s.spec.blocks for s in model.stages]}
    with torch.no_grad():
        res["logits"] = model(**_fwd_inputs()).logits
    res["ids"] = model.generate(**_gen_inputs(), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
    res["chunked_ids"] = model.generate(
        **_gen_inputs(), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos, prefill_chunk_size=CHUNK
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    res["loss"] = float(model.train_step(_train_batch()).detach())
    res["grads"] = tiny.tensors_by_key(model, lambda p: p.grad)
    opt.step()
    res["params"] = tiny.tensors_by_key(model, lambda p: p)
    return res


def _job(cases):
    out = []
    for what, path, load, eos in cases:
        try:
            out.append(_case(path, load, eos))
        except Exception:
            print(f"failed case: {what}", flush=True)
            raise
    return out


# --------------------------------------------------------------------------- references (parent process)
def _pick_eos(ref, inputs) -> int:
    """A token that ends some rows of the greedy run early and not others."""
    free = _greedy(ref, inputs, tiny.VOCAB + 5)[:, PROMPT:]  # an id never produced: nobody stops
    for step in range(1, NEW - 2):
        for row in range(free.shape[0]):
            eos = int(free[row, step])
            out = _greedy(ref, inputs, eos)[:, PROMPT:]
            lengths = [int((r == eos).nonzero()[0, 0]) + 1 if (r == eos).any() else NEW for r in out]
            if eos != 0 and min(lengths) < NEW - 1 and len(set(lengths)) >= 2:
                return eos
    raise AssertionError("no token ends some rows early; change the tiny model seed")


def _greedy(ref, inputs, eos, **kwargs):
    with torch.no_grad():
        return ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos, **kwargs)


def _unwindowed(path):
    """The same weights with every layer full: what the glue computed before per-layer masks."""
    ref = tiny.reference(path, AUTO)
    if getattr(ref.config, "layer_types", None) is not None:
        ref.config.layer_types = ["full_attention"] * LAYERS  # Qwen2 picks each layer's mask from these
    else:
        ref.config.sliding_window = None  # Mistral: one mask kind for all layers
    return ref


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sliding")
    out = {}
    for arch in ARCHS:
        path = _save(root / arch, _config(arch))
        ref = tiny.reference(path, AUTO)
        with torch.no_grad():
            logits = ref(**_fwd_inputs()).logits
        eos = _pick_eos(ref, _gen_inputs())
        ids = _greedy(ref, _gen_inputs(), eos)
        chunked = _greedy(ref, _gen_inputs(), eos, prefill_chunk_size=CHUNK)
        # The window must matter for these inputs, else the comparisons below could not fail.
        full = _unwindowed(path)
        with torch.no_grad():
            assert (full(**_fwd_inputs()).logits - logits).abs().max() > 1e-2, (
                f"{arch}: the window does not change the logits"
            )
        assert not torch.equal(_greedy(full, _gen_inputs(), eos), ids), (
            f"{arch}: the window does not change the generated ids"
        )
        ref.train()
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
        loss = ref(**_train_batch()).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        opt.step()
        params = {n: p.detach().clone() for n, p in ref.named_parameters()}
        out[arch] = {
            "path": path,
            "logits": logits,
            "eos": eos,
            "ids": ids,
            "chunked_ids": chunked,
            "loss": float(loss.detach()),
            "grads": grads,
            "params": params,
        }
    return out


def _check(what, results, ref):
    for r, res in enumerate(results):
        diff = (res["logits"] - ref["logits"]).abs().max().item()
        assert diff <= TOL, f"{what} rank {r}: logits max abs diff {diff:.3g}"
        assert torch.equal(res["ids"], ref["ids"]), (
            f"{what} rank {r}: generated ids\n{res['ids']}\n!= transformers\n{ref['ids']}"
        )
        assert torch.equal(res["chunked_ids"], ref["chunked_ids"]), (
            f"{what} rank {r}: chunked prefill ids\n{res['chunked_ids']}\n!= transformers\n{ref['chunked_ids']}"
        )
        assert abs(res["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (
            f"{what} rank {r}: loss {res['loss']} != {ref['loss']}"
        )
        for key, copies in res["grads"].items():
            want = ref["grads"][key]
            for got in copies:
                diff = (got - want).abs().max().item()
                assert diff <= GRAD_RTOL * want.abs().max().item() + 1e-9, (
                    f"{what} rank {r}: gradient of {key}: max abs diff {diff:.3g}"
                )
        for key, copies in res["params"].items():
            for got in copies:
                diff = (got - ref["params"][key]).abs().max().item()
                assert diff <= PARAM_ATOL, (
                    f"{what} rank {r}: parameter {key} after an AdamW step: max abs diff {diff:.3g}"
                )
    covered = {k for res in results for k in res["grads"]}
    assert covered == set(ref["grads"]), (
        f"{what}: no rank returned a gradient for {sorted(set(ref['grads']) - covered)}"
    )


@pytest.mark.dist
@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=[f"w{w}" for w in sorted(LAYOUTS)])
def test_sliding_window_equals_transformers(references, world):
    cases, names = [], []
    for arch in ARCHS:
        ref = references[arch]
        for label, load in LAYOUTS[world]:
            names.append(f"{arch} {label} world={world}")
            cases.append((names[-1], ref["path"], load, ref["eos"]))
    per_rank = run_distributed(_job, world, cases, timeout=400)
    for i, name in enumerate(names):
        results = [r[i] for r in per_rank]
        _check(name, results, references[name.split()[0]])
        if "cut" in name:  # the layout really cut layer 3 between its halves
            assert any(h for res in results for h in res["halves"]), f"{name}: no block was cut"


# --------------------------------------------------------------------------- single process
def test_attention_kinds_follow_transformers():
    from transformers.cache_utils import DynamicCache

    from hf_pipeline.families.glue import attention_kinds

    full, sliding = "full_attention", "sliding_attention"
    assert attention_kinds(_config("mistral")) == (sliding,) * LAYERS
    assert attention_kinds(_config("llama")) == (full,) * LAYERS
    assert attention_kinds(_config("qwen2")) == (full,) * 3 + (sliding,) * 3
    no_window = _config("qwen2", use_sliding_window=False)
    assert attention_kinds(no_window) == (full,) * LAYERS
    # The KV cache transformers builds from the config has the same kinds, by global layer index.
    for cfg in (_config("mistral"), _config("qwen2"), no_window):
        cache = DynamicCache(config=cfg)
        assert tuple(sliding if s else full for s in cache.is_sliding) == attention_kinds(cfg)


@pytest.mark.parametrize(
    "arch,overrides,message",
    [
        ("qwen2", {"layer_types": ["chunked_attention", "full_attention"] * 3}, "chunked_attention"),
        (
            "qwen2",
            {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"] * 3},
            "sliding_window is None",
        ),
        (
            "llama",
            {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 3},
            "does not follow config.layer_types",
        ),
    ],
    ids=["qwen2-chunked", "qwen2-sliding-without-window", "llama-layer-types"],
)
def test_unsupported_attention_kinds_refused_at_load(tmp_path, arch, overrides, message):
    import hf_pipeline

    path = _save(tmp_path / arch, _config(arch, **overrides))
    with pytest.raises(ValueError, match=message):
        hf_pipeline.AutoModelForCausalLM.from_pretrained(
            path, pipeline=True, device="cpu", progress=False, num_stages=2, virtual_stages=2
        )
