"""The memory planner's predictions against what really gets allocated (within 10%).

* weight bytes per rank: against the loader's tensors on each rank (2 gloo ranks);
* activation bytes per microbatch: against the tensors autograd really saves when the stage runs
  on real weights (with transformers' own loss on the last stage), per family and dtype;
* KV-cache bytes per token: against a transformers ``DynamicCache`` after a real prefill;
* KV-cache bytes of a generate request with sliding-window layers (Mistral: all, Qwen2: some):
  exactly the bytes the caches of a real 2-rank pipelined generate hold, rank by rank, and those of
  transformers' own generate (a full-attention LLaMA is planned as before).
"""

import json

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.families.glue import attention_kinds
from hf_pipeline.families.recipe import get_recipe
from hf_pipeline.loading.stages import build_stage, materialize, meta_model
from hf_pipeline.memory.planner import plan_report
from hf_pipeline.memory.saved_tensors import measure_saved_bytes
from hf_pipeline.planning.actions import peak_in_flight
from hf_pipeline.planning.kv_cache_sizes import kv_cache_bytes_per_token, kv_cache_tokens
from hf_pipeline.planning.plan import make_plan
from hf_pipeline.planning.resolve import resolve_recipe

# predicted vs measured memory: allocator rounding and workspaces are a few %; a missed buffer or copy is >= 50%.
TOL = 0.10


def _close(predicted, measured, what):
    assert measured > 0, what
    err = abs(predicted - measured) / measured
    assert err <= TOL, f"{what}: predicted {predicted} vs measured {measured} ({err:.1%} off)"


def _real_saved_bytes(arch, auto, dtype, stages, microbatch, seq):
    """Per stage: bytes autograd saves running the real stages (real weights) on one microbatch."""
    cfg = tiny.config_for(arch)
    torch.manual_seed(0)
    ref = getattr(transformers, auto).from_config(cfg).to(dtype)
    skeleton = meta_model(cfg, auto)
    resolved = resolve_recipe(skeleton, get_recipe(cfg.model_type))
    # The loader's plan (from_pretrained knows no sequence length): the one the planner predicts for.
    plan = make_plan(skeleton, resolved, pp_size=stages, dtype=dtype)
    sd = ref.state_dict()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, tiny.VOCAB, (microbatch, seq), generator=g)
    inputs = {"input_ids": ids}
    if cfg.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, tiny.VOCAB, (microbatch, seq), generator=g)
    received, measured = (), []
    for spec in plan.stages:
        stage = build_stage(skeleton, resolved, spec)
        materialize(stage, sd, device=torch.device("cpu"), tied=resolved.tied)
        stage.train()
        params = list(stage.parameters())
        nbytes, out = measure_saved_bytes(lambda stage=stage, received=received: stage(*received, **inputs), params)
        outs = out if isinstance(out, tuple) else (out,)
        if spec.is_last:
            # transformers' own loss for this head, on the logits
            def loss(outs=outs):
                return ref.loss_function(logits=outs[0], labels=ids, vocab_size=cfg.vocab_size)

            loss_bytes, _ = measure_saved_bytes(loss, params)
            nbytes += loss_bytes
        measured.append(nbytes)
        received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
    return measured


@pytest.mark.parametrize(
    "arch,auto,dtype",
    [
        ("llama", "AutoModelForCausalLM", torch.float32),
        ("llama", "AutoModelForCausalLM", torch.bfloat16),
        ("gpt2", "AutoModelForCausalLM", torch.float32),
        ("bert", "AutoModelForMaskedLM", torch.bfloat16),
        ("t5", "AutoModelForSeq2SeqLM", torch.float32),
    ],
    ids=["llama-fp32", "llama-bf16", "gpt2-fp32", "bert-bf16", "t5-fp32"],
)
def test_activation_bytes_match_what_autograd_saves(arch, auto, dtype):
    batch, seq, stages = 8, 24, 2  # 2 stages x 2 microbatches of 4 sequences
    report = plan_report(tiny.config_for(arch), stages=stages, dtype=dtype, batch=batch, seq=seq, auto_class=auto,
                         n_microbatches=2)
    assert report.microbatch_size == 4
    measured = _real_saved_bytes(arch, auto, dtype, stages, report.microbatch_size, seq)
    for st, real in zip(report.stages, measured):
        _close(st.activation_bytes, real, f"{arch} {dtype} stage {st.index} activations")


def test_kv_cache_bytes_per_token_match_a_real_cache():
    for arch in ("llama", "gpt2", "qwen2"):
        cfg = tiny.config_for(arch)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        ids = torch.randint(3, tiny.VOCAB, (3, 11))
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        per_token = real / ids.numel()
        predicted = kv_cache_bytes_per_token(cfg, decoder_layers=cfg.num_hidden_layers, dtype=torch.float32)
        _close(predicted, per_token, f"{arch} KV cache per token")
        report = plan_report(cfg, stages=2, batch=3, seq=11)
        assert sum(s.kv_bytes_per_token for s in report.stages) == predicted
        # whole byte counts: the planner's per-rank products against the cache's tensors, equal but for float
        # rounding of the per-token figure; a layer missed or counted on two ranks moves the sum by 1/4
        # (4-layer models).
        assert sum(r.kv_cache_bytes for r in report.ranks) == pytest.approx(real)


def test_encoder_decoder_kv_includes_the_cross_attention_cache():
    cfg = tiny.config_for("t5")
    model = transformers.AutoModelForSeq2SeqLM.from_config(cfg).eval()
    ids = torch.randint(3, tiny.VOCAB, (2, 7))
    with torch.no_grad():
        cache = model(input_ids=ids, decoder_input_ids=ids, use_cache=True).past_key_values
    real = sum(
        t.numel() * t.element_size()
        for part in (cache.self_attention_cache, cache.cross_attention_cache)
        for layer in part.layers for t in (layer.keys, layer.values)
    )
    predicted = kv_cache_bytes_per_token(cfg, decoder_layers=cfg.num_decoder_layers, dtype=torch.float32)
    _close(predicted, real / ids.numel(), "t5 KV cache per token (self + cross)")
    report = plan_report(cfg, stages=2, batch=2, seq=7, auto_class="AutoModelForSeq2SeqLM")
    # encoder stages hold no cache
    decoding = [any("decoder.block" in m for m in s.modules) for s in report.stages]
    assert [s.kv_bytes_per_token > 0 for s in report.stages] == decoding


# --------------------------------------------------------------------------- sliding-window KV caches
WINDOW = 5
# (prompt tokens, new tokens): the first request decodes well past the window, the second stays inside it
REQUESTS = ((9, 6), (2, 2))
GEN_ROWS = 5  # odd: the generate microbatches differ in size
SLIDING = {
    "mistral": lambda: tiny.sliding_config("mistral", window=WINDOW, layers=4),  # every layer slides
    # stage 0: a full and a sliding layer
    "qwen2": lambda: tiny.sliding_config("qwen2", window=WINDOW, layers=4, full_layers=1),
    "llama": lambda: tiny.config_for("llama"),  # full attention: planned at full length, as before
}


def _storage_bytes(caches) -> tuple[int, int]:
    """(bytes of the storages the caches' keys and values keep alive, bytes their numel() shows)."""
    held, shown, seen = 0, 0, set()
    for cache in caches:
        for layer in cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                shown += t.numel() * t.element_size()
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    held += t.untyped_storage().nbytes()
    return held, shown


def _generate_cache_bytes(paths):
    """Per model and request: (held, shown) bytes of this rank's caches once a pipelined generate has run.

    Every ``DynamicCache`` built in this process is recorded (the generator drops its own references
    when a microbatch finishes; the recorded ones keep their final contents).
    """
    from transformers.cache_utils import DynamicCache

    import hf_pipeline

    made: list = []
    original = DynamicCache.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    DynamicCache.__init__ = recording
    out = {}
    try:
        for arch, path in paths.items():
            model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
            for prompt, new in REQUESTS:
                made.clear()
                inputs = tiny.sample_inputs("llama", batch=GEN_ROWS, seq=prompt, seed=3)
                model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
                out[arch, prompt, new] = _storage_bytes(made)
    finally:
        DynamicCache.__init__ = original
    return out


@pytest.mark.dist
def test_sliding_window_kv_cache_equals_what_pipelined_generate_holds(tmp_path):
    paths = {}
    for arch, config in SLIDING.items():
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(config())
        ref.save_pretrained(tmp_path / arch)
        paths[arch] = str(tmp_path / arch)
    per_rank = run_distributed(_generate_cache_bytes, 2, paths, timeout=240)
    for arch, path in paths.items():
        cfg = transformers.AutoConfig.from_pretrained(path)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for prompt, new in REQUESTS:
            what = f"{arch} prompt {prompt} + {new} new tokens"
            seq = prompt + new - 1  # tokens a layer's cache has seen: the last new token is never fed back
            report = plan_report(path, stages=2, batch=GEN_ROWS, seq=seq)
            for rank in range(2):
                held, shown = per_rank[rank][arch, prompt, new]
                planned = report.ranks[rank].kv_cache_bytes
                assert planned == held, f"{what} rank {rank}: planned {planned}, caches hold {held}"
            # transformers' own generate keeps the same caches in one process
            inputs = tiny.sample_inputs("llama", batch=GEN_ROWS, seq=prompt, seed=3)
            with torch.no_grad():
                cache = ref.generate(
                    **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                    eos_token_id=None,
                    return_dict_in_generate=True,
                ).past_key_values
            hf_held, hf_shown = _storage_bytes([cache])
            assert sum(r.kv_cache_bytes for r in report.ranks) == hf_held, f"{what}: planned vs transformers' generate"
            assert sum(per_rank[r][arch, prompt, new][1] for r in range(2)) == hf_shown, what
            # the estimate before windows
            full_length = GEN_ROWS * seq * sum(s.kv_bytes_per_token for s in report.stages)
            sliding = attention_kinds(cfg).count("sliding_attention")
            # one token of one layer
            one = GEN_ROWS * kv_cache_bytes_per_token(cfg, decoder_layers=1, dtype=torch.float32)
            if seq <= WINDOW or not sliding:
                # the window is not full (or there is none): every layer holds every token, as planned before
                assert hf_held == full_length, what
            else:
                # each sliding layer holds WINDOW tokens, not seq; they are the WINDOW-token concatenation of
                # which its keys / values are views of the last WINDOW - 1
                assert full_length - hf_held == sliding * one * (seq - WINDOW), what
                assert hf_held - hf_shown == sliding * one, what


def test_kv_cache_tokens_follow_the_layer_kinds():
    full, window = 12, WINDOW
    assert kv_cache_tokens(SLIDING["mistral"](), seq=full) == (window,) * 4
    assert kv_cache_tokens(SLIDING["qwen2"](), seq=full) == (full,) + (window,) * 3
    assert kv_cache_tokens(SLIDING["qwen2"](), seq=3) == (3,) * 4
    assert kv_cache_tokens(SLIDING["llama"](), seq=full) == (full,) * 4
    report = plan_report(SLIDING["mistral"](), stages=2, batch=2, seq=full)
    assert any("4 of 4 decoder layers slide" in n for n in report.notes), report.notes
    assert not any("slide" in n for n in plan_report(SLIDING["llama"](), stages=2, batch=2, seq=full).notes)


def _loaded_weight_bytes(path, runs):
    from hf_pipeline import AutoModelForCausalLM

    out = []
    for kwargs in runs:
        model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)
        out.append({
            "weights": sum(p.numel() * p.element_size() for _, p in model.checkpoint_named_parameters()),
            "read": model.load_report.bytes_read,
        })
    return out


@pytest.mark.dist
def test_weight_bytes_match_what_the_loader_allocates(tmp_path):
    runs = [{"n_microbatches": 2}, {"virtual_stages": 2, "n_microbatches": 4},
            {"dtype": "bfloat16", "n_microbatches": 2}]
    paths = {arch: str(tiny.make_checkpoint(tmp_path / arch, arch)) for arch in ("llama", "llama-tied")}
    results = run_distributed(_loaded_per_arch, 2, paths, runs, timeout=240)
    for arch, path in paths.items():
        for i, kwargs in enumerate(runs):
            v = kwargs.get("virtual_stages", 1)
            report = plan_report(path, stages=2 * v, virtual_stages=v, dtype=kwargs.get("dtype", "float32"))
            for rank in range(2):
                got = results[rank][arch][i]
                predicted = report.ranks[rank].weight_bytes
                _close(predicted, got["weights"], f"{arch} {kwargs} rank {rank} weight bytes")
                assert predicted == got["weights"], (arch, kwargs, rank)  # the same modules and dtype: exact


def _loaded_per_arch(paths, runs):
    return {arch: _loaded_weight_bytes(path, runs) for arch, path in paths.items()}


def test_in_flight_microbatches_follow_the_schedule():
    # 1F1B keeps p - r microbatches alive on rank r; GPipe all m; activations of 1 byte each count them.
    report = plan_report(tiny.config_for("llama"), stages=4, batch=8, seq=8, n_microbatches=8)
    assert [r.in_flight[r.rank] for r in report.ranks] == [4, 3, 2, 1]
    gpipe = plan_report(tiny.config_for("llama"), stages=4, batch=8, seq=8, n_microbatches=8, schedule="gpipe")
    assert [r.in_flight[r.rank] for r in gpipe.ranks] == [8, 8, 8, 8]
    peak, at = peak_in_flight(["0F0", "0F1", "0I0", "0F2", "0W0", "0B1", "0B2"], {0: 10})
    assert (peak, at) == (30, {0: 3})  # a split backward frees at W, not at I
    for r in report.ranks:
        assert r.train_peak_bytes == 2 * r.weight_bytes + r.activation_bytes + r.p2p_buffer_bytes
        assert r.generate_peak_bytes == r.weight_bytes + r.kv_cache_bytes


def test_report_outputs_and_inputs(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    report = plan_report(path, stages=2, dtype="bf16", batch=4, seq=16)
    d = json.loads(report.to_json())
    assert d["dtype"] == "bfloat16" and d["num_stages"] == 2 and len(d["stages"]) == 2 and len(d["ranks"]) == 2
    assert d["total_weight_bytes"] == sum(s["weight_bytes"] for s in d["stages"])  # untied: each weight once
    text, md = str(report), report.to_markdown()
    for s in ("model.layers.0-1", "lm_head", "train peak", "generate peak", "KV cache"):
        assert s in text and s in md
    assert md.count("\n|") >= 6
    # a config.json file, a dict and a config object give the same plan as the directory
    same = [plan_report(path / "config.json", stages=2, dtype="bf16", batch=4, seq=16),
            plan_report(tiny.config_for("llama").to_dict(), stages=2, dtype="bf16", batch=4, seq=16)]
    assert all([s.weight_bytes for s in r.stages] == [s.weight_bytes for s in report.stages] for r in same)
    with pytest.raises(ValueError, match="multiple of virtual_stages"):
        plan_report(path, stages=3, virtual_stages=2)
    with pytest.raises(ValueError, match="dtype"):
        plan_report(path, stages=2, dtype="int8")
    with pytest.raises(FileNotFoundError, match="config.json"):
        plan_report(tmp_path, stages=2)
