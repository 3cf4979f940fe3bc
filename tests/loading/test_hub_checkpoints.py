"""Checkpoints as the hub has them: saved by older transformers versions, by other task classes, as .bin.

Each fixture is a tiny ``save_pretrained`` checkpoint edited the way such checkpoints differ from
today's saves (stale buffers, a missing pooler or head, the base-model prefix added or stripped,
an integer weight, PyTorch ``.bin`` files). For each, what ``transformers.from_pretrained`` does
(loads, warns, initialises) is recorded first, and ``pipeline=True`` must do the same at 1 and 2
ranks: equal outputs, the same missing weights initialised to the same values after the same
``torch.manual_seed`` (on the rank that owns them), the same warning, or a refusal that names the
feature.
"""

from __future__ import annotations

import io
import logging

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.errors import CheckpointError
from hf_pipeline.loading.checkpoint_files import CheckpointIndex

SEED = 1234  # torch.manual_seed before every load: missing weights are drawn from torch's generator
N_POS = tiny.config_for("bert").max_position_embeddings


def _add(extra):
    """An edit that adds ``extra`` (key -> tensor) to the first shard."""
    return lambda tensors, shard: {**tensors, **(extra if shard == 0 else {})}


def _gpt2_mask_buffers():
    # GPT-2 saved by transformers < 4.x stores each block's causal mask (attn.bias) and masked_bias.
    mask = torch.tril(torch.ones(N_POS, N_POS, dtype=torch.bool)).view(1, 1, N_POS, N_POS)
    out = {f"transformer.h.{i}.attn.bias": mask.clone() for i in range(4)}
    out.update({f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(4)})
    return out


# case -> (source arch, class the source is saved from, edit or None, class it is loaded as)
CASES = {
    # Buffers older saves stored and transformers now ignores silently.
    "bert-position-ids": (
        "bert",
        "AutoModelForMaskedLM",
        _add({"bert.embeddings.position_ids": torch.arange(N_POS)[None]}),
        "AutoModelForMaskedLM",
    ),
    "llama-inv-freq": (
        "llama",
        "AutoModelForCausalLM",
        _add({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(4) for i in range(4)}),
        "AutoModelForCausalLM",
    ),
    # attn.bias is in GPT-2's _keys_to_ignore_on_load_unexpected; masked_bias is not: transformers warns (UNEXPECTED).
    "gpt2-attn-bias": ("gpt2", "AutoModelForCausalLM", _add(_gpt2_mask_buffers()), "AutoModelForCausalLM"),
    # Base model from a task checkpoint and back: missing heads / poolers are initialised, with a warning.
    "bert-base-from-mlm": ("bert", "AutoModelForMaskedLM", None, "AutoModel"),
    "bert-mlm-from-base": ("bert", "AutoModel", None, "AutoModelForMaskedLM"),
    "bert-cls-from-base": ("bert", "AutoModel", None, "AutoModelForSequenceClassification"),
    "bert-cls-from-mlm": ("bert", "AutoModelForMaskedLM", None, "AutoModelForSequenceClassification"),
    "llama-lm-from-base": ("llama", "AutoModel", None, "AutoModelForCausalLM"),
    # The bert. prefix added to a base checkpoint / stripped from a task checkpoint.
    "bert-base-prefixed": ("bert", "AutoModel", lambda t, s: {f"bert.{k}": v for k, v in t.items()}, "AutoModel"),
    "bert-mlm-unprefixed": (
        "bert",
        "AutoModelForMaskedLM",
        lambda t, s: {k.removeprefix("bert."): v for k, v in t.items()},
        "AutoModelForMaskedLM",
    ),
    "bert-base-unprefixed-from-mlm": (
        "bert",
        "AutoModelForMaskedLM",
        lambda t, s: {k.removeprefix("bert."): v for k, v in t.items()},
        "AutoModel",
    ),
}
# What transformers must report for each case (checked on the reference, so the fixtures stay honest).
MISSING = {
    "bert-base-from-mlm": {"pooler.dense.weight", "pooler.dense.bias"},
    "bert-base-unprefixed-from-mlm": {"pooler.dense.weight", "pooler.dense.bias"},
    "bert-mlm-from-base": {
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
    },
    "bert-cls-from-base": {"classifier.weight", "classifier.bias"},
    "bert-cls-from-mlm": {"bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"},
    "llama-lm-from-base": {"lm_head.weight"},
}
WARNS = set(MISSING) | {"gpt2-attn-bias"}  # transformers logs a LOAD REPORT for these, and for no other case


def _output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _capture():
    """A handler collecting what transformers' loggers print (the load report goes to transformers.modeling_utils)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    transformers.utils.logging.get_logger("transformers").addHandler(handler)
    return stream, handler


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """case -> (path, arch, auto, transformers' output, its missing keys, their values, whether it warned)."""
    root = tmp_path_factory.mktemp("hub")
    sources: dict = {}
    out = {}
    for case, (arch, saved_as, edit, auto) in CASES.items():
        src = sources.get((arch, saved_as))
        if src is None:
            src = sources[(arch, saved_as)] = tiny.make_checkpoint(root / f"src-{arch}-{saved_as}", arch, auto=saved_as)
        path = tiny.edit_checkpoint(src, root / case, edit) if edit is not None else src
        stream, handler = _capture()
        try:
            torch.manual_seed(SEED)
            ref, info = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        finally:
            transformers.utils.logging.get_logger("transformers").removeHandler(handler)
        assert info["missing_keys"] == MISSING.get(case, set()), (case, info)
        assert ("LOAD REPORT" in stream.getvalue()) == (case in WARNS), (case, stream.getvalue())
        with torch.no_grad():
            want = _output(ref.eval()(**tiny.sample_inputs(arch)))
        state = ref.state_dict()
        out[case] = (path, arch, auto, want, {k: state[k].clone() for k in info["missing_keys"]}, case in WARNS)
    return out


def _load_cases(jobs: dict, **kwargs) -> dict:
    """Load and run every case pipelined (on each rank): output, initialised values, what was read, the log."""
    import hf_pipeline

    results = {}
    for case, (path, arch, auto) in jobs.items():
        stream, handler = _capture()
        try:
            torch.manual_seed(SEED)
            model = getattr(hf_pipeline, auto).from_pretrained(
                path, pipeline=True, device="cpu", progress=False, **kwargs
            )
        finally:
            transformers.utils.logging.get_logger("transformers").removeHandler(handler)
        out = _output(model(**tiny.sample_inputs(arch)))
        params = {
            n: p for stage in model.stages for n, p in stage.named_parameters(remove_duplicate=False)
        }  # tied twins too
        initialized = {n: params[n].detach().clone() for n in model.load_report.initialized if n in params}
        results[case] = dict(
            out=out,
            initialized=initialized,
            reported=list(model.load_report.initialized),
            keys_read=list(model.load_report.keys_read),
            log=stream.getvalue(),
            rank=model.ctx.rank,
        )
    return results


def _jobs(hub):
    return {case: (path, arch, auto) for case, (path, arch, auto, *_) in hub.items()}


def _check(hub, per_rank: list[dict]):
    for case, (path, _, _, want, missing, warns) in hub.items():
        seen: dict[str, int] = {}
        for results in per_rank:
            got = results[case]
            # fp32 outputs: summation order moves them ~1e-6 in the tiny models; a wrong or misnamed
            # weight moves them by 1e-2 or more.
            assert (got["out"] - want).abs().max().item() <= 1e-5, case
            assert set(got["keys_read"]) <= CheckpointIndex.from_directory(path).keys(), case
            # Each initialised weight is on the rank that owns it, equal to transformers' after the same seed.
            assert set(got["reported"]) == set(got["initialized"]), case
            for name, value in got["initialized"].items():
                torch.testing.assert_close(value, missing[name], rtol=0, atol=0, msg=f"{case}: {name}")
                seen[name] = got["rank"]
            if got["rank"] == 0:
                assert ("LOAD REPORT" in got["log"]) == warns, (case, got["log"])
                for name in missing:
                    assert name.split(".")[-2] in got["log"], (case, name)  # the report names the keys (grouped)
            else:
                assert "LOAD REPORT" not in got["log"], case  # one report, from the main process
        assert set(seen) == set(missing), (case, sorted(seen), sorted(missing))


def test_hub_checkpoints_load_as_transformers_loads_them(hub):
    # One process, two stages on it: the cut, the tied heads and the initialised weights per stage.
    _check(hub, [_load_cases(_jobs(hub), num_stages=2, virtual_stages=2, schedule="interleaved-1f1b")])


def test_initialized_weights_live_on_the_owning_stage(hub):
    results = _load_cases(
        {"llama-lm-from-base": _jobs(hub)["llama-lm-from-base"]},
        num_stages=2,
        virtual_stages=2,
        schedule="interleaved-1f1b",
    )
    assert results["llama-lm-from-base"]["reported"] == ["lm_head.weight"]


def _int_weight(tensors, shard):
    return {k: (v.to(torch.int64) if k == "model.norm.weight" else v) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def int_weight(tmp_path_factory):
    root = tmp_path_factory.mktemp("intw")
    path = tiny.edit_checkpoint(tiny.make_checkpoint(root / "src", "llama"), root / "int", _int_weight)
    shard = CheckpointIndex.from_directory(path).weight_map["model.norm.weight"]
    return path, shard


def _load_error(path, auto):
    import hf_pipeline

    try:
        getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False)
    except Exception as e:  # noqa: BLE001 - the test checks type and text
        return type(e).__name__, str(e)
    return None


def test_integer_weight_names_key_and_shard(int_weight):
    path, shard = int_weight
    with pytest.raises(
        CheckpointError, match=rf"'model\.norm\.weight' in shard '{shard}'.*stored as I64.*floating point"
    ):
        import hf_pipeline

        hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)


# --- PyTorch .bin checkpoints: refused at once, converted by hf-pipeline convert --merge -------------


@pytest.fixture(scope="module")
def pytorch_ckpts(tmp_path_factory):
    """name -> (directory of .bin files, arch, auto, transformers' output on it)."""
    root = tmp_path_factory.mktemp("bin")
    out = {}
    for name, arch, shards in (("gpt2-bin", "gpt2", 1), ("llama-bin-sharded", "llama", 3)):
        torch.manual_seed(0)
        auto = tiny.AUTO[arch]
        model = getattr(transformers, auto).from_config(tiny.config_for(arch))
        path = tiny.save_pytorch_checkpoint(model, root / name, shards=shards)
        assert not list(path.glob("*.safetensors"))
        ref = tiny.reference(path, auto)  # transformers loads .bin files
        with torch.no_grad():
            out[name] = (path, arch, auto, _output(ref(**tiny.sample_inputs(arch))))
    return out


def test_pytorch_checkpoint_is_refused_with_the_convert_command(pytorch_ckpts):
    import hf_pipeline

    for name, (path, _, auto, _) in pytorch_ckpts.items():
        with pytest.raises(CheckpointError, match=rf"pytorch_model.*hf-pipeline convert {path} OUT_DIR --merge") as e:
            getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False)
        assert "no safetensors checkpoint" in str(e.value), name


def test_converted_pytorch_checkpoint_loads(pytorch_ckpts, tmp_path):
    import hf_pipeline
    from hf_pipeline.cli import main

    for name, (path, arch, auto, want) in pytorch_ckpts.items():
        out = tmp_path / name
        assert main(["convert", str(path), str(out), "--merge", "--max-shard-size", "20KB"]) == 0
        assert not list(out.glob("*.bin")) and list(out.glob("*.safetensors")), name
        model = getattr(hf_pipeline, auto).from_pretrained(
            out,
            pipeline=True,
            device="cpu",
            progress=False,
            num_stages=2,
            virtual_stages=2,
            schedule="interleaved-1f1b",
        )
        # fp32 outputs: summation order moves them ~1e-6 in the tiny models; a wrong or misnamed weight moves
        # them by 1e-2 or more.
        assert (_output(model(**tiny.sample_inputs(arch))) - want).abs().max().item() <= 1e-5, name
        ref = tiny.reference(out, auto)  # and transformers loads the converted checkpoint as it loaded the .bin
        with torch.no_grad():
            assert (_output(ref(**tiny.sample_inputs(arch))) - want).abs().max().item() == 0, name


# --- T5 with labels and no decoder_input_ids ---------------------------------------------------------


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """(path, inputs, labels, transformers' loss) for T5 called with labels only (no dropout: train mode
    equals eval)."""
    path = tiny.make_checkpoint(tmp_path_factory.mktemp("t5"), "t5", dropout_rate=0.0)
    inputs = tiny.sample_inputs("t5")
    labels = inputs.pop("decoder_input_ids")
    labels[0, -2:] = -100  # ignored positions: transformers' _shift_right turns them into pad tokens
    ref = tiny.reference(path, "AutoModelForSeq2SeqLM")
    with torch.no_grad():
        want = ref(**inputs, labels=labels).loss
    return path, inputs, labels, want


def _t5_losses(path, inputs, labels, *, forward: bool, **kwargs):
    import hf_pipeline

    model = hf_pipeline.AutoModelForSeq2SeqLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, **kwargs
    )
    out = {"train": model.train_step({**inputs, "labels": labels}).detach()}
    if forward:
        out["forward"] = model(**inputs, labels=labels).loss
    return out


def test_t5_train_step_with_labels_only(t5):
    path, inputs, labels, want = t5
    got = _t5_losses(path, inputs, labels, forward=False, num_stages=2, virtual_stages=2, schedule="interleaved-1f1b")
    # fp32 T5 losses: summation order ~1e-6 relative; a wrong label shift or missing weight moves them by 1e-2 or
    # more.
    torch.testing.assert_close(got["train"], want, rtol=1e-5, atol=1e-6)


def test_t5_forward_with_labels_only(t5):
    path, inputs, labels, want = t5
    got = _t5_losses(path, inputs, labels, forward=True, num_stages=2, virtual_stages=2, schedule="interleaved-1f1b")
    torch.testing.assert_close(got["forward"], want, rtol=1e-5, atol=1e-6)


# --- 2 and 3 ranks: one spawned job runs every case ------------------------------------------------------


def _rank_job(jobs, int_path, t5_args):
    return {
        "cases": _load_cases(jobs),
        "int": _load_error(int_path, "AutoModelForCausalLM"),
        "t5": _t5_losses(*t5_args, forward=True, n_microbatches=4),
    }  # 4 rows: 1F1B on 3 stages needs m >= 3


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_hub_checkpoints_on_two_and_three_ranks(hub, int_weight, t5, world):
    path, shard = int_weight
    t5_path, inputs, labels, want = t5
    results = run_distributed(_rank_job, world, _jobs(hub), path, (t5_path, inputs, labels), timeout=400)
    assert len(results) == world
    _check(hub, [r["cases"] for r in results])
    # The norm is on the last stage: its rank names key and shard, the other quotes it.
    kinds = [r["int"][0] for r in results]
    assert "CheckpointError" in kinds and all(k in ("CheckpointError", "RankError") for k in kinds), results
    assert all("model.norm.weight" in r["int"][1] and shard in r["int"][1] for r in results), results
    for r in results:
        # same tolerance as above: fp32 T5 losses.
        torch.testing.assert_close(r["t5"]["train"], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["t5"]["forward"], want, rtol=1e-5, atol=1e-6)


def test_recipes_say_which_positions_end_at_max_position_embeddings():
    from hf_pipeline.families.recipe import position_kind

    kinds = {arch: position_kind(tiny.config_for(arch)) for arch in ("llama", "mistral", "qwen2", "gpt2", "bert", "t5")}
    assert kinds == {
        "llama": "rotary",
        "mistral": "rotary",
        "qwen2": "rotary",
        "gpt2": "learned",
        "bert": "learned",
        "t5": "relative",
    }
