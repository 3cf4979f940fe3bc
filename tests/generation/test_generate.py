"""Pipelined generation and inference tasks equal single-process transformers, at world sizes 1, 2, 3.

Every architecture that generates (GPT-2, LLaMA, T5) runs with 1 and 2 virtual stages per rank:
  * greedy ids equal ``transformers`` ``generate(do_sample=False)`` token for token, for a
    left-padded batch of prompts of different lengths whose EOS id is picked from a reference run so
    that some rows stop before others;
  * sampling with a fixed seed gives the same ids at every world size (the world-1 pipelined run is
    the reference: the per-row seeded stream is by design not transformers' global one);
  * decoder-only models with ``prefill_chunk_size=3`` (chunks that cut through the left padding)
    equal transformers' chunked prefill token for token, in as many prefill steps as chunks;
  * each rank's peak KV-cache bytes (from the Cache tensors) equal its share of transformers' cache
    for the same request, and the shares add up to it;
  * repeated calls leave no Cache object and no tensor memory behind.
BERT (fill-mask top-k, embeddings, sequence classification) goes through the same ``model(...)``
call and equals transformers at world 2 and 3. One spawned job per world size runs all of it.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import tiny
import torch
from harness import run_distributed

NEW = 10  # new tokens per request
CHUNK = 3  # prefill_chunk_size of the chunked requests: 8-token prompts in 3 chunks
# fp32 forward outputs below 1 in the tiny models (BERT logits 0.47; one ulp 6e-8): another summation order
# moves them ~1e-6; a wrong mask or position 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5  # fp32 forward outputs: same kernels, only summation order may differ
GEN_ARCHS = ("llama", "gpt2", "t5")
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=11)


# --------------------------------------------------------------------------- helpers run on every rank
class _Collect:
    """A streamer that records what it is given."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def _generating_blocks(model) -> int:
    """Decoder layers whose KV cache this rank keeps: those whose attention (half) it runs."""
    stack = model.resolved.stacks[-1]
    return sum(1 for st in model.stages for b in st.spec.attention_blocks if b in stack.blocks)


def _live_memory() -> tuple[int, int]:
    """(live transformers Cache objects, bytes of all live tensors) in this process."""
    from transformers.cache_utils import Cache

    gc.collect()
    caches = tensors = 0
    seen: set[int] = set()
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        kinds = [(isinstance(o, Cache), isinstance(o, torch.Tensor)) for o in objects]
    for obj, (is_cache, is_tensor) in zip(objects, kinds):
        if is_cache:
            caches += 1
        elif is_tensor and not obj.is_meta:
            try:
                key = obj.untyped_storage().data_ptr()
            except RuntimeError:
                continue  # a fake tensor torch.export left behind in this process (an earlier traced model): no memory
            if key not in seen:
                seen.add(key)
                tensors += obj.untyped_storage().nbytes()
    return caches, tensors


def _run_generation(case):
    import hf_pipeline

    model = getattr(hf_pipeline, case["auto"]).from_pretrained(
        case["path"], pipeline=True, device="cpu", progress=False, **case["load"]
    )
    res = {"blocks": _generating_blocks(model), "num_stages": model.plan.num_stages, "pp_size": model.plan.pp_size}
    for label, inputs, kwargs in case["requests"]:
        streamer = _Collect() if label.endswith("stream") else None
        ids, stats = model.generate(**inputs, **kwargs, streamer=streamer, return_stats=True)
        res[label] = {
            "ids": ids,
            "peak": stats.peak_cache_bytes,
            "new_tokens": stats.new_tokens,
            "prefill_steps": stats.prefill_steps,
            "n_microbatches": stats.n_microbatches,
            "seconds": stats.seconds,
            "split": stats.time_split,
        }
        if streamer is not None:
            res[label]["puts"], res[label]["ended"] = streamer.puts, streamer.ended
    if case.get("repeat"):
        inputs, kwargs = case["repeat"]
        memory = []
        for _ in range(3):  # the first call may create lasting state (e.g. the generation config); later ones may not
            model.generate(**inputs, **kwargs)
            memory.append(_live_memory())
        res["memory"] = memory
    return res


def _run_inference(case):
    import hf_pipeline

    model = getattr(hf_pipeline, case["auto"]).from_pretrained(
        case["path"], pipeline=True, device="cpu", progress=False, **case["load"]
    )
    out = model(**case["inputs"])
    return {name: getattr(out, name) for name in model.resolved.head.outputs}


def _job(gen_cases, inference_cases):
    return [_run_generation(c) for c in gen_cases], [_run_inference(c) for c in inference_cases]


# --------------------------------------------------------------------------- references (parent process)
def _prompts(arch: str):
    # Decoder-only prompts are left padded (2 and 4 pads on some rows); T5's encoder input right padded.
    return tiny.sample_inputs("llama", batch=6, seq=8, pad_left=arch != "t5")


def _greedy(ref, inputs, **kwargs):
    with torch.no_grad():
        return ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)


def _pick_eos(ref, inputs, start: int) -> int:
    """A token id that ends some rows mid-way and not others (so EOS handling is really exercised)."""
    free = _greedy(ref, inputs, eos_token_id=tiny.VOCAB + 5)[:, start:]  # an id never produced: no early stop
    for step in range(1, NEW - 2):
        for row in range(free.shape[0]):
            eos = int(free[row, step])
            if eos == 0:
                continue
            out = _greedy(ref, inputs, eos_token_id=eos)[:, start:]
            lengths = [int((r == eos).nonzero()[0, 0]) + 1 if (r == eos).any() else NEW for r in out]
            if min(lengths) < NEW - 1 and len(set(lengths)) >= 2:
                return eos
    raise AssertionError("no token ends some rows early; change the tiny model seed")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(len(specials), tiny.VOCAB)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


MASKED_TEXTS = [
    "w10 w11 [MASK] w12",
    "w20 [MASK] w30 w31 w32 w33 w34",
    "[MASK] w7",
    "w40 w41 w42 w43 [MASK]",
    "w50 [MASK] w51",
    "w9 w8 w7 w6 w5 [MASK] w60 w61",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls: extra threads only add synchronisation (and contend with the spawned ranks).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import transformers

    import hf_pipeline

    root = tmp_path_factory.mktemp("generate")
    out = {"gen": {}, "bert": {}}
    for arch in GEN_ARCHS:
        # 6 blocks everywhere, so 3 ranks x 2 virtual stages still get one block each.
        # T5 at the default init scale answers every prompt with the same token; 3x gives varied outputs.
        extra = {"t5": {"initializer_factor": 3.0}, "llama": {"num_hidden_layers": 6}, "gpt2": {"n_layer": 6}}[arch]
        path = tiny.make_checkpoint(root / arch, arch, **extra)
        ref = tiny.reference(path, tiny.AUTO[arch])
        inputs = _prompts(arch)
        start = 1 if arch == "t5" else inputs["input_ids"].shape[1]
        eos = _pick_eos(ref, inputs, start)
        greedy = _greedy(ref, inputs, eos_token_id=eos)
        chunked = _greedy(ref, inputs, eos_token_id=eos, prefill_chunk_size=CHUNK) if arch != "t5" else None
        with torch.no_grad():  # no early stop: the cache reaches its full size
            full = ref.generate(
                **inputs,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
            )
        from hf_pipeline.generation.kv_cache import cache_nbytes

        # The sampling reference is the pipelined model on one process with one stage.
        model = getattr(hf_pipeline, tiny.AUTO[arch]).from_pretrained(
            path, pipeline=True, device="cpu", progress=False, num_stages=1
        )
        sample_kwargs = dict(SAMPLING, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
        sampled = model.generate(**inputs, **sample_kwargs)
        del model
        out["gen"][arch] = {
            "path": str(path),
            "inputs": inputs,
            "eos": eos,
            "greedy": greedy,
            "chunked": chunked,
            "full": full.sequences,
            "cache_bytes": cache_nbytes(full.cache),
            "layers": ref.config.get_text_config(decoder=True).num_hidden_layers
            if arch != "t5"
            else ref.config.num_decoder_layers,
            "sampled": sampled,
            "sample_kwargs": sample_kwargs,
        }
        assert not torch.equal(sampled[:, start:], greedy[:, start:]), f"{arch}: sampling should differ from greedy"

    tok = _tokenizer()
    enc = tok(MASKED_TEXTS, return_tensors="pt", padding=True)
    for auto in ("AutoModelForMaskedLM", "AutoModel", "AutoModelForSequenceClassification"):
        path = tiny.make_checkpoint(root / f"bert-{auto}", "bert", auto=auto)
        ref = tiny.reference(path, auto)
        with torch.no_grad():
            want = ref(**enc)
        entry = {"path": str(path), "want": want}
        if auto == "AutoModelForMaskedLM":
            fill = transformers.pipeline("fill-mask", model=ref, tokenizer=tok, top_k=5)
            entry["fill"] = fill(MASKED_TEXTS)
        out["bert"][auto] = entry
    out["bert_inputs"] = dict(enc)
    out["mask_id"] = tok.mask_token_id
    return out


def _gen_cases(assets, world: int):
    cases = []
    for arch in GEN_ARCHS:
        a = assets["gen"][arch]
        greedy_kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=a["eos"], pad_token_id=0)
        full_kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        for virtual in (1, 2):
            requests = [("greedy", a["inputs"], greedy_kwargs), ("sampled", a["inputs"], a["sample_kwargs"])]
            if a["chunked"] is not None:
                requests.append(("chunked", a["inputs"], dict(greedy_kwargs, prefill_chunk_size=CHUNK)))
            case = {
                "arch": arch,
                "virtual": virtual,
                "path": a["path"],
                "auto": tiny.AUTO[arch],
                # n_microbatches at load plans training steps; generate keeps one microbatch per stage
                "load": {"virtual_stages": virtual, **({"n_microbatches": 4} if virtual == 1 else {})},
            }
            if virtual == 1:
                requests.append(("full", a["inputs"], full_kwargs))
            else:  # one microbatch per stage: two ops of a rank at one tick, two messages to one peer at one tick
                requests.append(("per_stage", a["inputs"], dict(greedy_kwargs, n_microbatches=2 * world)))
            if virtual == 1 and arch == "llama":
                requests.append(("naive", a["inputs"], dict(greedy_kwargs, n_microbatches=1)))
                requests.append(("stream", a["inputs"], greedy_kwargs))
                requests.append(("chunked_stream", a["inputs"], dict(greedy_kwargs, prefill_chunk_size=CHUNK)))
                case["repeat"] = (a["inputs"], greedy_kwargs)
            case["requests"] = requests
            cases.append(case)
    if world == 2:
        # Layers cut between attention and MLP at stage boundaries: the attention half keeps the
        # layer's cache. v2 has a stage with an attention half alone (llama) or an MLP half first (gpt2).
        cuts = {
            "llama": [
                ["model.layers.2.post_attention_layernorm"],
                [
                    "model.layers.1",
                    "model.layers.1.post_attention_layernorm",
                    "model.layers.3.post_attention_layernorm",
                ],
            ],
            "gpt2": [["transformer.h.3.ln_2"], ["transformer.h.0.ln_2", "transformer.h.2", "transformer.h.2.ln_2"]],
        }
        for arch, splits in cuts.items():
            a = assets["gen"][arch]
            for virtual, split in zip((1, 2), splits):
                cases.append(
                    {
                        "arch": arch,
                        "virtual": virtual,
                        "path": a["path"],
                        "auto": tiny.AUTO[arch],
                        "load": {"virtual_stages": virtual, "split": split},
                        "requests": [
                            (
                                "greedy",
                                a["inputs"],
                                dict(max_new_tokens=NEW, do_sample=False, eos_token_id=a["eos"], pad_token_id=0),
                            ),
                            ("sampled", a["inputs"], a["sample_kwargs"]),
                            (
                                "full",
                                a["inputs"],
                                dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0),
                            ),
                            (
                                "chunked",
                                a["inputs"],
                                dict(
                                    max_new_tokens=NEW,
                                    do_sample=False,
                                    eos_token_id=a["eos"],
                                    pad_token_id=0,
                                    prefill_chunk_size=CHUNK,
                                ),
                            ),
                        ],
                    }
                )
        # A V layout (zbv-zero-bubble: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2): its ranks run
        # ops of two stages at one tick, microbatch first (timetable.ops_at).
        a = assets["gen"]["llama"]
        greedy = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=a["eos"], pad_token_id=0)
        cases.append({
            "arch": "llama", "virtual": 2, "path": a["path"], "auto": "AutoModelForCausalLM",
            "load": {"schedule": "zbv-zero-bubble"},
            "requests": [
                ("greedy", a["inputs"], greedy), ("sampled", a["inputs"], a["sample_kwargs"]),
                ("full", a["inputs"], dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)),
                ("per_stage", a["inputs"], dict(greedy, n_microbatches=4)),
                ("chunked", a["inputs"], dict(greedy, prefill_chunk_size=CHUNK)),
            ],
        })
        # two data-parallel replicas of a one-stage pipeline
        a = assets["gen"]["llama"]
        cases.append(
            {
                "arch": "llama",
                "virtual": 1,
                "path": a["path"],
                "auto": "AutoModelForCausalLM",
                "load": {"num_stages": 1},
                "requests": [
                    (
                        "greedy",
                        a["inputs"],
                        dict(max_new_tokens=NEW, do_sample=False, eos_token_id=a["eos"], pad_token_id=0),
                    ),
                    ("sampled", a["inputs"], a["sample_kwargs"]),
                    (
                        "chunked",
                        a["inputs"],
                        dict(
                            max_new_tokens=NEW,
                            do_sample=False,
                            eos_token_id=a["eos"],
                            pad_token_id=0,
                            prefill_chunk_size=CHUNK,
                        ),
                    ),
                ],
            }
        )
    return cases


def _inference_cases(assets, world: int):
    # Fill-mask and embeddings at every world size; sequence classification (same path, another head) at 2.
    return [
        {"auto": auto, "path": entry["path"], "inputs": assets["bert_inputs"], "load": {"n_microbatches": 3}}
        for auto, entry in assets["bert"].items()
        if world == 2 or auto != "AutoModelForSequenceClassification"
    ]


def _fill_mask_topk(logits: torch.Tensor, input_ids: torch.Tensor, mask_id: int, k: int = 5):
    """transformers' fill-mask post-processing: softmax at the mask position, top k."""
    out = []
    for row in range(input_ids.shape[0]):
        pos = int((input_ids[row] == mask_id).nonzero()[0, 0])
        probs = logits[row, pos].softmax(-1)
        values, ids = probs.topk(k)
        out.append((ids.tolist(), values.tolist()))
    return out


# --------------------------------------------------------------------------- checks
def _check_generation(assets, cases, per_rank, world):
    for c, case in enumerate(cases):
        a = assets["gen"][case["arch"]]
        where = f"{case['arch']} world={world} virtual={case['virtual']} load={case['load']}"
        results = [r[0][c] for r in per_rank]
        for rank, res in enumerate(results):
            got = res["greedy"]["ids"]
            assert torch.equal(got, a["greedy"]), (
                f"{where} rank {rank}: greedy ids differ from transformers\n{got}\n{a['greedy']}"
            )
            assert torch.equal(res["sampled"]["ids"], a["sampled"]), (
                f"{where} rank {rank}: seeded sampling differs from the world-1 run"
            )
            if "naive" in res:
                assert torch.equal(res["naive"]["ids"], a["greedy"]), f"{where}: n_microbatches=1 differs"
            if "full" in res:
                assert torch.equal(res["full"]["ids"], a["full"]), f"{where}: min_new_tokens run differs"
            if "per_stage" in res:
                assert torch.equal(res["per_stage"]["ids"], a["greedy"]), f"{where}: one microbatch per stage differs"
            assert res["greedy"]["prefill_steps"] == 1, where
            rows = a["inputs"]["input_ids"].shape[0]
            # One microbatch per pipeline rank, not per stage (2 stages per rank: every weight read twice per token)
            assert res["greedy"]["n_microbatches"] == min(res["pp_size"], rows), (where, res["greedy"])
            # the call's time in parts that never overlap, "other" the remainder (rounding: 1 us)
            split = res["greedy"]["split"]
            assert set(split) == {"compute", "fill", "wait", "drain", "other"} and min(split.values()) >= 0, split
            assert split["compute"] > 0 and sum(split.values()) == pytest.approx(res["greedy"]["seconds"], abs=1e-6)
            if "chunked" in res:
                assert torch.equal(res["chunked"]["ids"], a["chunked"]), (
                    f"{where}: chunked prefill differs from transformers'"
                )
                chunks = -(-a["inputs"]["input_ids"].shape[1] // CHUNK)
                assert res["chunked"]["prefill_steps"] == chunks, (
                    f"{where}: {res['chunked']['prefill_steps']} prefill steps, not {chunks}"
                )
        if "full" in results[0]:
            # Each rank holds the cache of its own layers only; together, the whole model's. A rank's
            # first stage may free a finished microbatch's cache while a later stage of the same
            # rank still has that microbatch's last step to run, so a rank's peak may miss at most
            # one token per layer of the full cache (and never exceeds it).
            per_layer = a["cache_bytes"] // a["layers"]
            tokens = a["full"].shape[1] - 1  # steps a layer's cache holds (the last new token is never fed back)
            peaks = [res["full"]["peak"] for res in results]
            for rank, res in enumerate(results):
                full, slack = per_layer * res["blocks"], per_layer * res["blocks"] // tokens
                assert full - slack <= res["full"]["peak"] <= full, (
                    f"{where} rank {rank}: cache {peaks} vs {per_layer} x {res['blocks']} layers"
                )
            assert a["cache_bytes"] * (1 - 1 / tokens) <= sum(peaks) <= a["cache_bytes"], (
                f"{where}: rank caches {peaks} do not add up to transformers' {a['cache_bytes']}"
            )
        for label, want in (("stream", a["greedy"]), ("chunked_stream", a["chunked"])):
            if label not in results[0]:
                continue
            start = a["inputs"]["input_ids"].shape[1]
            for rank, res in enumerate(results):
                puts = res[label]["puts"]
                if rank != world - 1:
                    assert puts == [] and not res[label]["ended"], (
                        f"{where} {label}: only the last stage's rank streams"
                    )
                    continue
                assert torch.equal(puts[0], a["inputs"]["input_ids"]) and res[label]["ended"]
                assert torch.equal(torch.stack(puts[1:], dim=1), want[:, start:]), (
                    f"{where} {label}: streamed tokens differ"
                )
        if "memory" in results[0]:
            for rank, res in enumerate(results):
                caches = [m[0] for m in res["memory"]]
                tensors = [m[1] for m in res["memory"]]
                assert caches == [0] * len(caches), f"{where} rank {rank}: Cache objects left behind {caches}"
                assert len(set(tensors[1:])) == 1, f"{where} rank {rank}: live tensor bytes grow over calls {tensors}"


def _check_inference(assets, cases, per_rank, world):
    assert all(len(r[1]) == len(cases) for r in per_rank)
    for c, case in enumerate(cases):
        auto = case["auto"]
        entry = assets["bert"][auto]
        want = entry["want"]
        for rank, r in enumerate(per_rank):
            got = r[1][c]
            for name, value in got.items():
                diff = (value - getattr(want, name)).abs().max().item()
                assert diff <= TOL, f"bert {auto} world={world} rank {rank} {name}: max abs diff {diff}"
            if auto == "AutoModelForMaskedLM":
                topk = _fill_mask_topk(got["logits"], assets["bert_inputs"]["input_ids"], assets["mask_id"])
                for row, ((ids, scores), hf) in enumerate(zip(topk, entry["fill"])):
                    assert ids == [h["token"] for h in hf], (
                        f"world={world} rank {rank} text {row}: fill-mask top-5 ids differ"
                    )
                    # fp32 fill-mask probabilities (here <= 0.017: ~1/VOCAB; one ulp 2e-9): a logit moved by
                    # TOL moves one by <= 0.017 x 1e-5, so noise stays near 1e-7; a wrong mask or position
                    # moves them by 1e-2 or more. Measured: max diff 0 under ATEN_CPU_CAPABILITY=default and
                    # =avx2 (this test passes under both).
                    assert max(abs(s - h["score"]) for s, h in zip(scores, hf)) <= 1e-6
            if auto == "AutoModelForSequenceClassification":
                assert torch.equal(got["logits"].argmax(-1), want.logits.argmax(-1))


@pytest.mark.equiv  # every request kind on 3 architectures: about 4 s on 2 shared cores (test_beam.py's stays quick)
def test_generate_world_1(assets):
    # One process, all stages local: the same ring, with local hand-offs instead of messages.
    cases = _gen_cases(assets, 1)
    _check_generation(assets, cases, [_job(cases, [])], 1)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_generate_and_inference_across_ranks(assets, world):
    cases, inference = _gen_cases(assets, world), _inference_cases(assets, world)
    per_rank = run_distributed(_job, world, cases, inference, timeout=400)
    _check_generation(assets, cases, per_rank, world)
    _check_inference(assets, inference, per_rank, world)


# --------------------------------------------------------------------------- single-process API checks
def test_generation_config_json_is_merged_like_transformers(tmp_path):
    import transformers

    import hf_pipeline
    from hf_pipeline.generation.generate import prepare_generation_config

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    transformers.GenerationConfig(
        do_sample=True, temperature=0.55, top_k=7, eos_token_id=[2, 5], pad_token_id=0
    ).save_pretrained(path)
    ref = tiny.reference(path, "AutoModelForCausalLM")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    ours, _ = prepare_generation_config(model, None, max_new_tokens=3, top_p=0.8)
    theirs, _ = ref._prepare_generation_config(None, max_new_tokens=3, top_p=0.8)
    assert ours.to_dict() == theirs.to_dict()
    assert (ours.temperature, ours.top_k, ours.top_p, ours.eos_token_id) == (0.55, 7, 0.8, [2, 5])


def test_stop_strings_and_several_eos_equal_transformers(tmp_path):
    import hf_pipeline
    from hf_pipeline.tools.default_model import byte_level_tokenizer

    tok = byte_level_tokenizer()  # stop strings need a tokenizer that decodes text faithfully
    path = tiny.make_checkpoint(tmp_path / "llama", "llama", vocab_size=len(tok))
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs = _prompts("llama")
    start = inputs["input_ids"].shape[1]
    free = _greedy(ref, inputs, eos_token_id=len(tok) + 5)[:, start:]
    stop = tok.decode(free[1, 2:4])  # a two-token string row 1 produces
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, num_stages=2, virtual_stages=2
    )
    kwargs = dict(
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=[int(free[0, 2]), int(free[4, 5])],
        stop_strings=[stop],
    )
    with torch.no_grad():
        want = ref.generate(**inputs, tokenizer=tok, **kwargs)
    got = model.generate(**inputs, tokenizer=tok, **kwargs)
    assert torch.equal(got, want)
    assert (got[:, start:] == 0).any(), "some rows should have stopped early"


def test_unsupported_requests_fail_with_a_fix(tmp_path):
    import hf_pipeline

    path = tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    inputs = _prompts("llama")
    with pytest.raises(ValueError, match="generation mode 'beam_sample' is not supported"):
        model.generate(**inputs, num_beams=2, do_sample=True, max_new_tokens=2)
    with pytest.raises(TypeError, match="not GenerationConfig fields"):
        model.generate(**inputs, max_new_tokens=2, not_a_field=3)
    # GenerationConfig fields that would change the result and that the ring does not implement are
    # refused by name, not ignored; a bad prefill_chunk_size likewise
    with pytest.raises(ValueError, match="token_healing"):
        model.generate(**inputs, max_new_tokens=2, token_healing=True)
    with pytest.raises(ValueError, match="cache_implementation='quantized'"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="quantized")
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            model.generate(**inputs, max_new_tokens=2, prefill_chunk_size=bad)
    # the model stays usable: the same call without them runs
    assert model.generate(**inputs, max_new_tokens=2, prefill_chunk_size=2).shape == (
        inputs["input_ids"].shape[0],
        inputs["input_ids"].shape[1] + 2,
    )
    bert = tiny.make_checkpoint(tmp_path / "bert", "bert", shards=1)
    mlm = hf_pipeline.AutoModelForMaskedLM.from_pretrained(bert, pipeline=True, device="cpu", progress=False)
    with pytest.raises(TypeError, match="AutoModelForCausalLM"):
        mlm.generate(**inputs, max_new_tokens=2)
    # transformers' chunked prefill on an encoder-decoder model cuts the encoder's mask to the chunk
    # (its tokens differ from its own unchunked run on padded inputs): refused by name
    t5 = tiny.make_checkpoint(tmp_path / "t5", "t5", shards=1)
    seq2seq = hf_pipeline.AutoModelForSeq2SeqLM.from_pretrained(t5, pipeline=True, device="cpu", progress=False)
    with pytest.raises(ValueError, match="prefill_chunk_size=3 is not supported for encoder-decoder models"):
        seq2seq.generate(**inputs, max_new_tokens=2, prefill_chunk_size=3)
