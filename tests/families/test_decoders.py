"""Every family the generic decoder recipe claims (``model_recipes/decoder.toml``) equals transformers.

The families and their tiny configs are ``tests/decoders.py``: each exercises what its forward does
around the layers (embedding scale, logit soft-capping and scaling, sliding and full layers mixed,
attention sinks, ALiBi, partial rotary, parallel residual, learned positions, multi-latent attention).

* Pure: the recipe claims exactly the tested families; the roles found on a model class (the layer
  list, what runs before and after it, in the forward's own order: OPT's final norm is registered
  before its layers); malformed roles recipes are refused naming the field.
* One process, two stages (quick tier), for three families whose forwards differ most from LLaMA's:
  logits and greedy tokens.
* At 2 and 3 ranks (one spawned job each), every family: logits of a left-padded batch in
  microbatches, greedy ``generate`` with an EOS that ends some rows early, one ``train_step``'s loss
  and every gradient by checkpoint key (at 2 ranks the families take turns through every schedule,
  interleaved, zero-bubble and V schedules with two stages per rank); at 2 ranks beam search and a
  request stream through the serving engine (continuous batching, two stages per rank included), each
  request against transformers' ``generate`` of it alone.

Tolerances (fp32, the same kernels; only microbatching and the order of a few sums differ):
|logits| ~0.5 here, so 1e-5 absolute is ~100 fp32 ulps, while a dropped embedding scale, soft-cap or
a wrong mask moves them by 1e-2 or more; the loss 1e-5 relative; each gradient 1e-5 of its tensor's
largest reference entry, floored at 1e-6 of the model's largest gradient (a key bias's gradient is
mathematically zero, its reference entries rounding noise of ~1e-9).
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import tiny
import torch
from decoders import DECODERS, EXPERT_PARALLEL, STREAMED, decoder_config
from harness import run_distributed

TOL = LOSS_RTOL = GRAD_RTOL = 1e-5
GRAD_FLOOR = 1e-6
ROWS, SEQ, M = 6, 12, 3  # training and forward: 6 left-padded rows in 3 microbatches
NEW = 6
BEAMS = 2
# At 2 ranks the families take turns through the schedules (two stages per rank where the schedule
# runs them: one layer per stage), so every schedule trains several families; at 3 ranks, 1F1B.
SCHEDULES = (
    {"schedule": "1f1b"},
    {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2},
    {"schedule": "zbv-zero-bubble", "n_microbatches": 6},  # zero-bubble and V: a microbatch per stage at least
    {"schedule": "interleaved-zero-bubble", "virtual_stages": 2, "n_microbatches": 6},
    {"schedule": "looped-bfs", "virtual_stages": 2, "n_microbatches": 2},
    {"schedule": "dualpipev", "n_microbatches": 6},
    {"schedule": "gpipe"},
)
AUTO = "AutoModelForCausalLM"


def _inputs(seed: int = 2) -> dict[str, torch.Tensor]:
    return tiny.sample_inputs("llama", batch=ROWS, seq=SEQ, seed=seed)  # left padded, ids < 96


def _train_batch() -> dict[str, torch.Tensor]:
    batch = _inputs(seed=5)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _save(directory: pathlib.Path, model_type: str) -> str:
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type)).save_pretrained(
        directory, max_shard_size="40KB"  # several shards and an index, as published checkpoints
    )
    return str(directory)


# ----------------------------------------------------------------------------------------- pure
def test_the_decoder_recipe_claims_exactly_the_tested_families():
    from hf_pipeline.families.recipe import get_recipe

    recipe = get_recipe("qwen3")
    assert recipe.glue == "decoder" and recipe.roles
    assert set(recipe.model_types) == set(DECODERS)


def test_roles_are_found_on_each_class_in_the_forwards_order():
    from hf_pipeline.families.roles import decoder_roles
    from hf_pipeline.loading.stages import meta_model

    qwen3 = decoder_roles(meta_model(decoder_config("qwen3"), AUTO))
    assert (qwen3.blocks, qwen3.before, qwen3.after) == ("model.layers", ("model.embed_tokens",), ("model.norm",))
    assert qwen3.unweighted == ("model.rotary_emb",) and qwen3.head == ("lm_head",)
    # OPT keeps its layers in model.decoder and registers its final norm before them; its forward runs it after
    opt = decoder_roles(meta_model(decoder_config("opt"), AUTO))
    assert opt.blocks == "model.decoder.layers" and opt.after == ("model.decoder.final_layer_norm",)
    assert set(opt.before) == {"model.decoder.embed_tokens", "model.decoder.embed_positions"}
    bloom = decoder_roles(meta_model(decoder_config("bloom"), AUTO))  # the embedding's own norm runs first
    assert bloom.before == ("transformer.word_embeddings", "transformer.word_embeddings_layernorm")
    base = decoder_roles(meta_model(decoder_config("gemma3_text"), "AutoModel"))  # the base class: no head
    assert base.base == "" and base.blocks == "layers" and base.head == ()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.replace("roles = true\n", ""), r"names a role \['\{blocks\}'\]; set roles = true"),
        (lambda t: t.replace('blocks = "{blocks}"', 'blocks = "model.{blocks}"'), "a role stands alone"),
        (lambda t: t.replace('default = "rotary"\n', ""), "needs a 'default' kind"),
        (lambda t: t.replace('opt = "learned"', 'opt = "tabled"'), r"'positions.opt' is 'tabled'"),
        (lambda t: t.replace('xglm = "sinusoidal positions', 'gpt2 = "sinusoidal positions'),
         r"'unpacked.gpt2' names a model_type the recipe does not claim"),
        (lambda t: t.replace('bloom = "ALiBi biases built from the 2D attention mask"', "bloom = 1"),
         r"'unpacked.bloom' must be a str"),
    ],
    ids=["role without roles", "role inside a path", "positions without default", "unknown position kind",
         "unpacked type not claimed", "unpacked reason not a string"],
)
def test_malformed_roles_recipes_are_refused_naming_the_field(tmp_path, change, message):
    from hf_pipeline.families.recipe import RecipeError, load_recipe

    root = pathlib.Path(__file__).resolve().parents[2] / "model_recipes"
    path = tmp_path / "decoder.toml"
    path.write_text(change((root / "decoder.toml").read_text()))
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


def test_position_kinds_follow_each_family():
    from hf_pipeline.families.recipe import position_kind

    kinds = {t: position_kind(decoder_config(t)) for t in ("qwen3", "opt", "gpt_bigcode", "bloom", "xglm")}
    assert kinds == {"qwen3": "rotary", "opt": "learned", "gpt_bigcode": "learned", "bloom": "alibi",
                     "xglm": "sinusoidal"}


# ----------------------------------------------------------------------------- one process, 2 stages
def _no_softcap(ref):
    ref.config.final_logit_softcapping = None


def _no_final_norm(ref):
    ref.model.decoder.final_layer_norm = torch.nn.Identity()


def _all_full(ref):
    ref.config.layer_types = ["full_attention"] * ref.config.num_hidden_layers


# What each family's forward does around its layers, switched off in a copy of the reference: the
# quirk must move the logits here (else the comparison could not catch a stage that dropped it).
QUIRKS = {"gemma2": _no_softcap, "opt": _no_final_norm, "gemma3_text": _all_full}


# 3 to 4 s each on 2 shared cores, with generate: in the full suite. The quick tier keeps the base model
# class's two stages below, and gemma3_text's sliding layers in continuous_batching/test_ring_sliding_window.py.
@pytest.mark.equiv
@pytest.mark.parametrize("model_type", sorted(QUIRKS))
def test_two_stages_in_one_process_equal_transformers(tmp_path, model_type):
    import hf_pipeline

    path = _save(tmp_path / model_type, model_type)
    ref = tiny.reference(path, AUTO)
    plain = tiny.reference(path, AUTO)
    QUIRKS[model_type](plain)
    with torch.no_grad():
        moved = (plain(**_inputs()).logits - ref(**_inputs()).logits).abs().max().item()
    assert moved > 1e-2, f"{model_type}: its quirk does not move these logits ({moved:.3g})"
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, schedule="interleaved-1f1b", virtual_stages=2,
        n_microbatches=M,
    )
    assert [type(s.glue).__name__ for s in model.stages] == ["DecoderGlue"] * 2
    with torch.no_grad():
        diff = (model(**_inputs()).logits - ref(**_inputs()).logits).abs().max().item()
    assert diff <= TOL, f"{model_type}: logits differ by {diff:.3g}"
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(**_inputs(), **kw), ref.generate(**_inputs(), **kw)), model_type


def test_the_base_model_class_on_two_stages_equals_transformers(tmp_path):
    # AutoModel: the pruned base model's own forward runs the layers (not the stage's, which is the glue's)
    import transformers

    import hf_pipeline

    path = _save(tmp_path / "qwen3", "qwen3")
    ref = transformers.AutoModel.from_pretrained(path).eval()
    model = hf_pipeline.AutoModel.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, schedule="interleaved-1f1b", virtual_stages=2,
        n_microbatches=M,
    )
    with torch.no_grad():
        got, want = model(**_inputs()).last_hidden_state, ref(**_inputs()).last_hidden_state
    diff = (got - want).abs().max().item()
    assert got.shape == want.shape and diff <= TOL, f"last_hidden_state differs by {diff:.3g}"


# ----------------------------------------------------------------------------- every rank
def _case(path: str, eos: int, beam: bool, streamed: bool, text: str, load: dict) -> dict:
    import hf_pipeline
    from hf_pipeline.distributed.shards import full_tensor  # an expert-parallel gradient, whole

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, **{"n_microbatches": M, **load}
    )
    res = {"glues": sorted({type(s.glue).__name__ for s in model.stages})}
    with torch.no_grad():
        res["logits"] = model(**_inputs()).logits
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    res["ids"] = model.generate(**_inputs(), eos_token_id=eos, **kw)
    if beam:
        res["beam"] = model.generate(**_inputs(), eos_token_id=None, num_beams=BEAMS, **kw)
    if streamed:
        res["stream"] = _stream(model, text)
    model.train()
    res["loss"] = float(model.train_step(_train_batch()).detach())
    res["grads"] = tiny.tensors_by_key(model, lambda p: None if p.grad is None else full_tensor(p.grad))
    return res


STREAM = [(3, 6), (9, 3), (5, 8), (2, 4), (7, 5)]  # (prompt length, max_new_tokens)


def _stream_requests() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [dict(prompt_ids=torch.randint(5, tiny.VOCAB, (n,), generator=g).tolist(), max_new_tokens=m)
            for n, m in STREAM]


def _stream(model, text: str):
    """A continuous-batching engine on every rank; rank 0 submits the stream, 3 rows at a time."""
    from hf_pipeline.serving import CompletionRequest, Engine

    engine = Engine(model, tiny.word_tokenizer(pathlib.Path(text)), max_batch=3, batching="continuous", idle_s=0.05)
    if model.ctx.rank != 0:
        engine.serve_forever()
        return None
    # rows join and leave the running ring under every layout (V and interleaved: two stages per rank) and
    # within expert-parallel stages
    assert engine.batching == "continuous", engine.static_reason
    out: dict = {}

    def client():
        handles = [engine.submit(CompletionRequest(**r)) for r in _stream_requests()]
        out["tokens"] = [[c.token_ids for c in h.result(timeout=120)] for h in handles]
        engine.drain()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    engine.serve_forever()
    thread.join(timeout=60)
    return out["tokens"]


def _job(cases):
    torch.set_num_threads(1)
    out = []
    for model_type, *case in cases:
        try:
            out.append(_case(*case))
        except Exception:
            print(f"failed case: {model_type}", flush=True)
            raise
    return out


# ----------------------------------------------------------------------------- references (parent)
def _greedy(ref, eos):
    with torch.no_grad():
        return ref.generate(**_inputs(), max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)


def _pick_eos(ref) -> int:
    """A token that ends some rows of the greedy run early and not others (else the largest id)."""
    free = _greedy(ref, tiny.VOCAB + 5)[:, SEQ:]  # an id never produced: nobody stops
    for step in range(1, NEW - 1):
        for eos in free[:, step].tolist():
            lengths = {NEW if not (r == eos).any() else int((r == eos).nonzero()[0, 0]) for r in free}
            if eos != 0 and len(lengths) >= 2 and min(lengths) < NEW - 1:
                return int(eos)
    return tiny.VOCAB - 1


def _alone(ref, req: dict) -> list[int]:
    return tiny.greedy_alone(ref, req["prompt_ids"], req["max_new_tokens"])[0]  # the engine stops at EOS (2)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("decoders")
    text = str(tiny.text_file(root / "words.txt"))
    out = {}
    for model_type in sorted(DECODERS):
        path = _save(root / model_type, model_type)
        ref = tiny.reference(path, AUTO)
        eos = _pick_eos(ref)
        want = {"path": path, "eos": eos, "streamed": model_type in STREAMED}
        with torch.no_grad():
            want["logits"] = ref(**_inputs()).logits
        want["ids"] = _greedy(ref, eos)
        with torch.no_grad():
            want["beam"] = ref.generate(**_inputs(), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                        eos_token_id=None, num_beams=BEAMS)
        if want["streamed"]:
            want["stream"] = [[_alone(ref, r)] for r in _stream_requests()]
        ref.train()
        loss = ref(**_train_batch()).loss
        loss.backward()
        want["loss"] = float(loss)
        want["grads"] = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
        out[model_type] = want
    return out, text


def _check(model_type: str, want: dict, ranks: list[dict], world: int) -> None:
    what = f"{model_type} at {world} ranks"
    last = ranks[-1]  # outputs are on every rank; the loss on the last stage's
    assert all(r["glues"] == ["DecoderGlue"] for r in ranks), what
    diff = (last["logits"] - want["logits"]).abs().max().item()
    assert diff <= TOL, f"{what}: logits differ by {diff:.3g}"
    for r in ranks:
        assert torch.equal(r["ids"], want["ids"]), f"{what}: greedy tokens differ"
    if world != 3:
        assert torch.equal(ranks[0]["beam"], want["beam"]), f"{what}: beam search differs"
    if want["streamed"] and world != 3:
        assert ranks[0]["stream"] == want["stream"], f"{what}: the continuous stream differs"
    assert last["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), what
    got: dict[str, list[torch.Tensor]] = {}
    for r in ranks:  # a tensor two stages hold (tied) has a copy on each
        for key, copies in r["grads"].items():
            got.setdefault(key, []).extend(copies)
    assert set(got) == set(want["grads"]), f"{what}: gradients of {set(want['grads']) ^ set(got)}"
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in want["grads"].values())
    for key, ref_grad in want["grads"].items():
        for copy in got[key]:
            tol = max(GRAD_RTOL * ref_grad.abs().max().item(), floor)
            diff = (copy - ref_grad).abs().max().item()
            assert diff <= tol, f"{what}: gradient of {key} differs by {diff:.3g} (tolerance {tol:.3g})"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_decoder_family_equals_transformers(references, world):
    refs, text = references
    cases = [
        (t, w["path"], w["eos"], world == 2, w["streamed"] and world == 2, text,
         SCHEDULES[k % len(SCHEDULES)] if world == 2 else {})
        for k, (t, w) in enumerate(refs.items())
    ]
    per_rank = run_distributed(_job, world, cases, timeout=600)
    for k, model_type in enumerate(refs):
        _check(model_type, refs[model_type], [r[k] for r in per_rank], world)


# Expert parallelism at 4 ranks (pp2 x ep2: each stage's two ranks keep half of every MoE layer's experts),
# the mixture-of-experts families taking turns through the schedules.
MOE = EXPERT_PARALLEL
EP_SCHEDULES = (
    {"schedule": "1f1b"},
    {"schedule": "zbv-zero-bubble", "n_microbatches": 6},
    {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2},
    {"schedule": "dualpipev", "n_microbatches": 6},
    {"schedule": "interleaved-zero-bubble", "virtual_stages": 2, "n_microbatches": 6},
)


@pytest.mark.dist
@pytest.mark.slow
def test_moe_families_with_expert_parallelism_at_4_ranks_equal_transformers(references):
    refs, text = references
    assert set(MOE) <= set(DECODERS)
    cases = [(t, refs[t]["path"], refs[t]["eos"], True, refs[t]["streamed"], text, {"ep_size": 2, **EP_SCHEDULES[k]})
             for k, t in enumerate(MOE)]
    per_rank = run_distributed(_job, 4, cases, timeout=600)
    for k, model_type in enumerate(MOE):
        _check(model_type, refs[model_type], [r[k] for r in per_rank], 4)


def test_readme_table_is_rendered_from_the_tested_families():
    from decoders import support_table

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert support_table() in readme, "README's architectures table is stale: paste tests/decoders.py support_table()"
