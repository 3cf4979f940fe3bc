"""Bad input: every case raises a clear error on EVERY rank, within seconds, and never hangs.

Two spawned 2-rank jobs run all cases one after another (process start-up dominates these tiny
runs): one passes bad arguments / broken checkpoints to ``from_pretrained``, the other bad
arguments to the calls of a loaded model and ends with correct calls, whose numbers must still
equal transformers' — an agreed error leaves the process group usable.

Each case names the exception type and a fragment of the message every rank must show (the
failing rank its own error; the others, when only some ranks failed, a RankError quoting it).
``HF_PIPELINE_ERRORS_TABLE=path pytest tests/model/test_bad_inputs.py`` writes the observed messages as
the markdown table of ``docs/errors.md``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import time

import pytest
import tiny
import torch
from harness import run_distributed

_FAST_S = 10.0  # per case, on every rank; the collective timeout (300 s) is far away

# --------------------------------------------------------------------------- broken checkpoints


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _shards(path: pathlib.Path) -> list[str]:
    return sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _make_paths(tmp: pathlib.Path) -> dict[str, str]:
    good = tiny.make_checkpoint(tmp / "llama", "llama")
    shards = _shards(good)
    paths = {"llama": good}

    paths["missing_shard"] = _copy(good, tmp / "missing_shard")
    (paths["missing_shard"] / shards[1]).unlink()

    paths["index_names_missing_file"] = p = _copy(good, tmp / "index_names_missing_file")
    index = json.loads((p / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v == shards[-1])
    index["weight_map"][key] = "model-00099-of-00099.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps(index))

    paths["truncated_shard"] = p = _copy(good, tmp / "truncated_shard")
    data = (p / shards[-1]).read_bytes()
    (p / shards[-1]).write_bytes(data[: len(data) - 100])

    paths["corrupted_shard"] = p = _copy(good, tmp / "corrupted_shard")
    data = bytearray((p / shards[0]).read_bytes())
    data[8:24] = b"\xff" * 16  # the JSON header starts at byte 8
    (p / shards[0]).write_bytes(bytes(data))

    paths["unknown_model_type"] = p = _copy(good, tmp / "unknown_model_type")
    cfg = json.loads((p / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (p / "config.json").write_text(json.dumps(cfg))

    import transformers

    torch.manual_seed(0)
    # A family no recipe claims (VaultGemma)
    transformers.VaultGemmaForCausalLM(transformers.VaultGemmaConfig(
        vocab_size=96, hidden_size=16, num_hidden_layers=2, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )).save_pretrained(tmp / "no_recipe")
    paths["no_recipe"] = tmp / "no_recipe"

    paths["mistral"] = tiny.make_checkpoint(tmp / "mistral", "mistral")
    # Same architecture and files layout, other weights (another seed): only the bytes tell them apart.
    paths["llama_other_weights"] = tiny.make_checkpoint(tmp / "llama_other_weights", "llama", seed=1)
    paths["llama_other_config"] = p = _copy(good, tmp / "llama_other_config")
    cfg = json.loads((p / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (p / "config.json").write_text(json.dumps(cfg))
    paths["llama_int_weight"] = p = _copy(good, tmp / "llama_int_weight")
    from safetensors.torch import load_file, save_file

    index = json.loads((p / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(p / shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)  # same size: the index stays valid
    save_file(tensors, str(p / shard), metadata={"format": "pt"})
    (tmp / "bad_syntax.toml").write_text('model_types = ["llama"\nglue = "llama"\n')
    (tmp / "bad_field.toml").write_text(
        'model_types = ["llama"]\nglue = "frobnicate"\n[[stacks]]\nname = "decoder"\nblocks = "{base}layers"\n'
        '[heads.Model]\n'
        'modules = []\noutputs = ["last_hidden_state"]\noutput_class = "BaseModelOutputWithPast"\n'
    )
    recipe = (pathlib.Path(__file__).resolve().parents[2] / "model_recipes" / "llama.toml").read_text()
    (tmp / "bad_module.toml").write_text(recipe.replace('"{base}layers"', '"{base}decoder_blocks"'))
    paths.update({name: tmp / f"{name}.toml" for name in ("bad_syntax", "bad_field", "bad_module")})
    return {k: str(v) for k, v in paths.items()}


def _load(path: str, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)


def _register_then_load(recipe: str, path: str):
    import hf_pipeline
    from hf_pipeline.families import recipe as recipes

    try:
        hf_pipeline.register_recipe(recipe)
        return _load(path)
    finally:
        recipes._EXTRA.clear()  # later cases see the built-in recipes again


# name -> (call on every rank, exception type names accepted, message fragment (regex))
LOAD_CASES = {
    "unknown architecture (model_type transformers does not know)": (
        lambda p: _load(p["unknown_model_type"]), ("ValueError",), r"model type `frobnicator`"),
    "architecture without a recipe, split_method='recipe'": (
        lambda p: _load(p["no_recipe"], split_method="recipe"), ("RecipeError",),
        r"no pipeline recipe for model_type 'vaultgemma'"),
    "recipe file malformed: not valid TOML": (
        lambda p: __import__("hf_pipeline").register_recipe(p["bad_syntax"]), ("RecipeError",),
        r"bad_syntax\.toml: not valid TOML"),
    "recipe file malformed: bad field value": (
        lambda p: __import__("hf_pipeline").register_recipe(p["bad_field"]), ("RecipeError",),
        r"field 'glue' is 'frobnicate'; it must be one of"),
    "recipe names a module the model does not have": (
        lambda p: _register_then_load(p["bad_module"], p["mistral"]), ("RecipeError",), r"decoder_blocks"),
    "more stages than blocks": (
        # 4 LLaMA layers cut into halves give at most 8 stages
        lambda p: _load(p["llama"], num_stages=10, virtual_stages=5, schedule="looped-bfs"), ("PlanError",),
        r"10 stages.*8 block halves"),
    "world size not a multiple of num_stages / virtual_stages": (
        lambda p: _load(p["llama"], num_stages=3), ("ValueError",),
        r"num_stages=3 with virtual_stages=1 needs a multiple of 3 processes, but the world size is 2"),
    "num_stages not a multiple of virtual_stages": (
        lambda p: _load(p["llama"], num_stages=4, virtual_stages=3, schedule="looped-bfs"), ("ValueError",),
        r"num_stages=4 is not a multiple of virtual_stages=3"),
    "schedule needs one stage per rank, virtual_stages=2 given": (
        lambda p: _load(p["llama"], schedule="1f1b", virtual_stages=2), ("ScheduleError",),
        r"schedule '1f1b' needs virtual_stages 1 per rank, got 2"),
    "V schedule with virtual_stages=3": (
        lambda p: _load(p["llama"], schedule="zbv-zero-bubble", virtual_stages=3), ("ScheduleError",),
        r"schedule 'zbv-zero-bubble' needs virtual_stages 2 per rank, got 3"),
    "unknown schedule name": (
        lambda p: _load(p["llama"], schedule="2f2b"), ("ScheduleError",), r"unknown schedule '2f2b'; choose one of"),
    "shard file missing": (
        lambda p: _load(p["missing_shard"]), ("CheckpointError",),
        r"names shard 'model-00002-of-\d+\.safetensors'.*does not exist"),
    "index names a file that does not exist": (
        lambda p: _load(p["index_names_missing_file"]), ("CheckpointError",),
        r"names shard 'model-00099-of-00099\.safetensors'.*does not exist"),
    "shard truncated": (
        lambda p: _load(p["truncated_shard"]), ("CheckpointError", "RankError"),
        r"is truncated \(expected \d+ bytes, found \d+\)"),
    "shard header corrupted": (
        lambda p: _load(p["corrupted_shard"]), ("CheckpointError", "RankError"),
        r"(corrupted header|header is corrupted)"),
    "checkpoint misses keys (config has more layers)": (
        lambda p: _load(p["llama"], config=tiny.config_for("llama", num_hidden_layers=5)),
        ("CheckpointError", "RankError"),
        r"has no tensor for \d+ of this stage's parameters/buffers: model\.layers\.4\."),
    "checkpoint has unexpected keys (config has fewer layers)": (
        lambda p: _load(p["llama"], config=tiny.config_for("llama", num_hidden_layers=3)), ("CheckpointError",),
        r"holds \d+ tensor\(s\) the model does not have: model\.layers\.3\."),
    "checkpoint tensor of the wrong shape": (
        lambda p: _load(p["llama"], config=tiny.config_for("llama", intermediate_size=48)),
        ("CheckpointError", "RankError"),
        r"has shape \[64, 32\] but the model expects \[48, 32\]"),
    "dtype the device does not support": (
        lambda p: _load(p["llama"], dtype=torch.float8_e4m3fn), ("ValueError",),
        r"dtype torch\.float8_e4m3fn is not supported on device cpu"),
    "dtype that is not a floating point type": (
        lambda p: _load(p["llama"], dtype="int8"), ("ValueError",),
        r"dtype must be a floating point .*got torch\.int8"),
    "virtual_stages=0": (
        lambda p: _load(p["llama"], virtual_stages=0), ("ValueError",),
        r"virtual_stages must be a positive integer, got 0"),
    "num_stages=0": (
        lambda p: _load(p["llama"], num_stages=0), ("ValueError",), r"num_stages must be a positive integer, got 0"),
    "n_microbatches=0": (
        lambda p: _load(p["llama"], n_microbatches=0), ("ValueError",),
        r"n_microbatches must be a positive integer, got 0"),
    "an integer tensor where a float weight belongs": (
        lambda p: _load(p["llama_int_weight"]), ("CheckpointError", "RankError"),
        r"model\.norm\.weight.*model-\d+-of-\d+\.safetensors"),
    # Arguments or checkpoints that differ between ranks: one agreement at load names what differs.
    "split differs between ranks": (
        lambda p: _load(p["llama"], split="auto" if _rank() == 0 else ["model.layers.1"]), ("ValueError",),
        r"but split differs: split: rank 0: 'auto'; rank 1: \('model\.layers\.1'\)"),
    "n_microbatches differs between ranks": (
        lambda p: _load(p["llama"], n_microbatches=2 + 2 * _rank()), ("ValueError",),
        r"but n_microbatches differs: n_microbatches: rank 0: 2; rank 1: 4"),
    "dtype differs between ranks": (
        lambda p: _load(p["llama"], dtype=("float32", "bfloat16")[_rank()]), ("ValueError",),
        r"but dtype differs: dtype: rank 0: torch\.float32; rank 1: torch\.bfloat16"),
    "schedule differs between ranks": (
        lambda p: _load(p["llama"], schedule=("1f1b", "gpipe")[_rank()]), ("ValueError",),
        r"but schedule differs: schedule: rank 0: '1f1b'; rank 1: 'gpipe'"),
    "gather_output differs between ranks": (
        lambda p: _load(p["llama"], gather_output=bool(_rank())), ("ValueError",),
        r"but gather_output differs: gather_output: rank 0: False; rank 1: True"),
    # The mesh as given: named by argument, before a rank resolves another mesh (or an invalid one alone).
    "tp_size differs between ranks": (
        lambda p: _load(p["llama"], tp_size=(1, 2)[_rank()]), ("ValueError",),
        r"mesh arguments must be the same on every rank but tp_size differs: tp_size: rank 0: 1; rank 1: 2"),
    "fsdp_size differs between ranks": (
        lambda p: _load(p["llama"], fsdp_size=(1, 2)[_rank()]), ("ValueError",),
        r"but fsdp_size differs: fsdp_size: rank 0: 1; rank 1: 2"),
    "device_mesh dim names differ between ranks": (
        lambda p: _load(p["llama"], device_mesh=_mesh((("pp",), ("tp",))[_rank()])), ("ValueError",),
        r"but device_mesh differs: device_mesh: rank 0: .mesh_dim_names=\('pp',\), shape=\(2,\).; "
        r"rank 1: .mesh_dim_names=\('tp',\), shape=\(2,\)"),
    "device_mesh given on one rank only": (
        lambda p: _load(p["llama"], device_mesh=_mesh(("pp",)) if _rank() else None), ("ValueError",),
        r"but device_mesh differs: device_mesh: rank 0: None; rank 1: .mesh_dim_names=\('pp',\), shape=\(2,\)"),
    "checkpoint differs between ranks: another model's weights": (
        lambda p: _load(p[("llama", "llama_other_weights")[_rank()]]), ("ValueError",),
        r"but shard tails\.model-00001-of-\d+\.safetensors, .* differ: shard tails\.model-00001-of-\d+\.safetensors: "
        r"rank 0: '\w+'; rank 1: '\w+'"),
    "checkpoint differs between ranks: another config": (
        lambda p: _load(p[("llama", "llama_other_config")[_rank()]]), ("ValueError",),
        r"but config\.rms_norm_eps differs: config\.rms_norm_eps: rank 0: 1e-06; rank 1: 0\.001"),
    "checkpoint differs between ranks: a shard truncated on one rank's copy": (
        lambda p: _load(p[("llama", "truncated_shard")[_rank()]]), ("ValueError",),
        r"but shard sizes\.model-00005-of-00005\.safetensors and shard tails\.model-00005-of-00005\.safetensors "
        r"differ: "
        r"shard sizes\.model-00005-of-00005\.safetensors: rank 0: \d+; rank 1: \d+"),
}


def _run_cases(cases: dict, arg) -> dict[str, tuple[str, str, float] | None]:
    out = {}
    for name, (fn, _, _) in cases.items():
        start = time.monotonic()
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001 - the errors are the result
            out[name] = (type(e).__name__, str(e), time.monotonic() - start)
        else:
            out[name] = None
    return out


def _load_job(paths):
    import hf_pipeline  # noqa: F401 - imported and the group made before the clock of the first case starts
    from hf_pipeline.distributed.context import init_distributed

    init_distributed(device="cpu").barrier()
    return _run_cases(LOAD_CASES, paths)


def _type_matches(kind: str, types: tuple[str, ...]) -> bool:
    """``kind`` is one of ``types``, or a library class keeping one of them as its builtin base.

    Each class of hf_pipeline.errors keeps the builtin base of the raise it replaced (InputError is a
    ValueError, InputTypeError a TypeError): a case that expects ValueError accepts InputError.
    """
    import builtins

    from hf_pipeline import errors

    if kind in types:
        return True
    cls = getattr(errors, kind, None)
    bases = [getattr(builtins, t, None) for t in types]
    return isinstance(cls, type) and any(isinstance(b, type) and issubclass(cls, b) for b in bases)


def _check(cases: dict, per_rank: list[dict], table: list[tuple[str, str]]) -> None:
    problems = []
    for name, (_, types, pattern) in cases.items():
        for rank, results in enumerate(per_rank):
            got = results[name]
            if got is None:
                problems.append(f"{name}: rank {rank} raised nothing")
                continue
            kind, message, elapsed = got
            ok_type = _type_matches(kind, types)
            if not ok_type or not re.search(pattern, message, re.S):
                problems.append(f"{name}: rank {rank} raised {kind}: {message[:400]}")
            if elapsed > _FAST_S:
                problems.append(f"{name}: rank {rank} took {elapsed:.1f} s")
        first = per_rank[0][name]
        if first is not None:
            own = next((r[name] for r in per_rank if r[name] is not None and r[name][0] != "RankError"), first)
            table.append((name, f"{own[0]}: {own[1]}"))
    assert not problems, "\n".join(problems)


_TABLE: list[tuple[str, str]] = []


@pytest.mark.dist
def test_bad_loading_arguments_and_checkpoints_fail_on_every_rank(tmp_path):
    paths = _make_paths(tmp_path)
    per_rank = run_distributed(_load_job, 2, paths, timeout=240)
    _check(LOAD_CASES, per_rank, _TABLE)
    _write_table()


# --------------------------------------------------------------------------- bad call arguments
_MODEL: dict = {}


def _ids(batch: int, seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    return tiny.sample_inputs("llama", batch=batch, seq=seq, seed=seed)


def _with_labels(inputs: dict, labels=None) -> dict:
    return {**inputs, "labels": inputs["input_ids"].clone() if labels is None else labels}


def _rank() -> int:
    return int(os.environ["RANK"])


def _mesh(names: tuple[str, ...]):
    """A 1-D mesh over the whole world: it makes no new group, so building it differently per rank cannot hang."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=names)


def _m():
    return _MODEL["llama"]


CALL_CASES = {
    "train_step: batch not divisible by n_microbatches": (
        lambda _: _m().train_step(_with_labels(_ids(3, 9))), ("ValueError",),
        r"a training batch of 3 rows does not split into n_microbatches=2 equal microbatches"),
    "forward (GPT-2, learned positions): sequence too long": (
        lambda _: _MODEL["gpt2"](**_ids(2, 130)), ("ValueError",),
        r"input_ids has 130 tokens, more than the model's maximum of 128"),
    "generate (GPT-2, learned positions): prompt + max_new_tokens beyond the maximum positions": (
        lambda _: _MODEL["gpt2"].generate(**_ids(2, 120), max_new_tokens=16), ("ValueError",),
        r"the prompt has 120 tokens \+ 16 new tokens = 136, more than the model's maximum of 128"),
    "generate: empty prompt batch": (
        lambda _: _m().generate(torch.empty(0, 5, dtype=torch.long), max_new_tokens=2), ("ValueError",),
        r"holds no prompts"),
    "generate: empty prompt list": (
        lambda _: _m().generate([], max_new_tokens=2), ("ValueError",), r"the prompt list is empty"),
    "generate: prompts of mixed types": (
        lambda _: _m().generate(["a prompt", [5, 6, 7]], max_new_tokens=2), ("ValueError",),
        r"prompts must all be strings or all be token-id lists, got a mix: ids \(first at index 1\), text \(first at "
        r"index 0\)"),
    "generate: untokenized prompt list": (
        lambda _: _m().generate(["a prompt", "another"], max_new_tokens=2), ("TypeError",),
        r"got a list of text prompts; pass tok\(prompts, return_tensors='pt', padding=True\)"),
    "generate: unsupported mode (beam sampling)": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, num_beams=2, do_sample=True), ("ValueError",),
        r"generation mode 'beam_sample' is not supported by pipelined generation"),
    "generate: num_return_sequences > num_beams": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, num_beams=2, num_return_sequences=3), ("ValueError",),
        r"`num_return_sequences` \(3\) has to be smaller or equal to `num_beams` \(2\)"),
    "generate: token_healing": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, token_healing=True), ("ValueError",),
        r"token_healing is not supported"),
    "generate: quantized KV cache": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, cache_implementation="quantized"), ("ValueError",),
        r"cache_implementation='quantized' is not supported by pipelined generation"),
    "generate: prefill_chunk_size of 0": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, prefill_chunk_size=0), ("ValueError",),
        r"prefill_chunk_size must be a positive number of positions"),
    "forward: inputs differ between ranks": (
        lambda _: _m()(**_ids(2, 9, seed=1 + _rank())), ("ValueError",),
        r"model inputs must be the same on every rank but input_ids differs: input_ids: rank 0: Tensor\(.*\); rank 1: "
        r"Tensor\("),
    "train_step: batch differs between ranks": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9, seed=1 + _rank()))), ("ValueError",),
        r"the training batch differs across ranks"),
    "generate: inputs differ between ranks": (
        lambda _: _m().generate(**_ids(2, 5, seed=1 + _rank()), max_new_tokens=2), ("ValueError",),
        r"generate inputs must be the same on every rank"),
    "forward: labels shape does not match input_ids": (
        lambda _: _m()(**_with_labels(_ids(2, 9), torch.zeros(2, 7, dtype=torch.long))), ("ValueError",),
        r"labels shape \(2, 7\) does not match input_ids \(2, 9\)"),
    "train_step: labels shape does not match input_ids": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9), torch.zeros(2, 7, dtype=torch.long))), ("ValueError",),
        r"labels shape \(2, 7\) does not match input_ids \(2, 9\)"),
    "train_step: labels with the wrong number of rows": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9), torch.zeros(4, 9, dtype=torch.long))), ("ValueError",),
        r"labels has 4 rows but the batch has 2"),
    "train_step: no labels": (
        lambda _: _m().train_step(_ids(2, 9)), ("ValueError",), r"the batch has no 'labels'"),
    # Bad values: found on every rank before anything is sent (torch would raise on one stage only).
    "forward: token id >= vocab_size": (
        lambda _: _m()(input_ids=_bad_ids(2, 9, 96)), ("ValueError",),
        r"input_ids holds token id 96 at \[1, 4\], outside the model's vocabulary of 96 tokens \(config\.vocab_size\)"),
    "forward: negative token id": (
        lambda _: _m()(input_ids=_bad_ids(2, 9, -1)), ("ValueError",),
        r"input_ids holds token id -1 at \[1, 4\], outside the model's vocabulary"),
    "generate: token id >= vocab_size": (
        lambda _: _m().generate(input_ids=_bad_ids(2, 5, 96), max_new_tokens=2), ("ValueError",),
        r"input_ids holds token id 96 at \[1, 2\]"),
    "generate: negative token id": (
        lambda _: _m().generate(input_ids=_bad_ids(2, 5, -7), max_new_tokens=2), ("ValueError",),
        r"input_ids holds token id -7 at \[1, 2\]"),
    "train_step: labels >= vocab_size": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9), _bad_ids(2, 9, 96))), ("ValueError",),
        r"labels hold token id 96 at \[1, 4\], outside the model's 96 tokens \(config\.vocab_size\); labels must be "
        r"in \[0, 95\], or -100"),
    "train_step: negative labels other than -100": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9), _bad_ids(2, 9, -1))), ("ValueError",),
        r"labels hold token id -1 at \[1, 4\]"),
    "forward: labels >= vocab_size": (
        lambda _: _m()(**_with_labels(_ids(2, 9), _bad_ids(2, 9, 200))), ("ValueError",), r"labels hold token id 200"),
    "forward: float input_ids": (
        lambda _: _m()(input_ids=_ids(2, 9)["input_ids"].float()), ("ValueError",),
        r"input_ids must hold integer token ids, got dtype torch\.float32"),
    "forward: input_ids of shape (B, 0)": (
        lambda _: _m()(input_ids=torch.zeros(2, 0, dtype=torch.long)), ("ValueError",),
        r"input_ids of shape \(2, 0\) holds no tokens"),
    "forward: 1-D input_ids": (
        lambda _: _m()(input_ids=_ids(2, 9)["input_ids"][0]), ("ValueError",),
        r"input_ids must be \(batch, length\), got shape \(9,\) \(1-D\); for one sequence pass input_ids\[None\]"),
    "forward: 3-D input_ids": (
        lambda _: _m()(input_ids=_ids(2, 9)["input_ids"][None]), ("ValueError",),
        r"input_ids must be \(batch, length\), got shape \(1, 2, 9\) \(3-D\)"),
    "forward: input_ids as a list": (
        lambda _: _m()(input_ids=[[5, 6, 7], [8, 9, 10]]), ("ValueError",),
        r"input_ids must be a \(batch, length\) tensor of token ids, got list"),
    "train_step: float input_ids": (
        lambda _: _m().train_step({"input_ids": _ids(2, 9)["input_ids"].float(), "labels": _ids(2, 9)["input_ids"]}),
        ("ValueError",),
        r"input_ids must hold integer token ids"),
    "generate: float input_ids": (
        lambda _: _m().generate(input_ids=_ids(2, 5)["input_ids"].float(), max_new_tokens=2), ("ValueError",),
        r"input_ids must hold integer token ids"),
    "generate: 1-D input_ids": (
        lambda _: _m().generate(input_ids=_ids(2, 5)["input_ids"][0], max_new_tokens=2), ("ValueError",),
        r"got shape \(5,\) \(1-D\)"),
    "generate: 3-D input_ids": (
        lambda _: _m().generate(input_ids=_ids(2, 5)["input_ids"][None], max_new_tokens=2), ("ValueError",),
        r"got shape \(1, 2, 5\) \(3-D\)"),
    "generate (GPT-2, learned positions): max_new_tokens far beyond the maximum positions": (
        lambda _: _MODEL["gpt2"].generate(**_ids(2, 5), max_new_tokens=10**12), ("ValueError",),
        r"the prompt has 5 tokens \+ 1000000000000 new tokens = 1000000000005, more than the model's maximum of 128 "
        r"positions "
        r"\(config\.max_position_embeddings\); generate at most 123 new tokens \(max_new_tokens=123\)$"),
    # Every index tensor against the table it indexes, the effective generation length, dtypes as
    # transformers takes them: refused on every rank before anything is sent.
    "generate (GPT-2, learned positions): max_length beyond the maximum positions": (
        lambda _: _MODEL["gpt2"].generate(**_ids(2, 5), max_length=200), ("ValueError",),
        r"the prompt has 5 tokens \+ 195 new tokens = 200, more than the model's maximum of 128 positions "
        r"\(config\.max_position_embeddings\); .*max_new_tokens=123"),
    "generate (GPT-2, learned positions): GenerationConfig(max_new_tokens=...) beyond the maximum positions": (
        lambda _: _MODEL["gpt2"].generate(
            **_ids(2, 5), generation_config=__import__("transformers").GenerationConfig(max_new_tokens=200)),
        ("ValueError",), r"the prompt has 5 tokens \+ 200 new tokens = 205, more than the model's maximum of 128"),
    "forward (GPT-2, learned positions): position_ids outside the position table": (
        lambda _: _MODEL["gpt2"](**_ids(2, 9), position_ids=torch.arange(120, 129).expand(2, 9)), ("ValueError",),
        r"position_ids holds 128 at \[0, 8\], outside the table of 128 entries it indexes "
        r"\(config\.max_position_embeddings\); position_ids must be in \[0, 127\]"),
    "forward (GPT-2): token_type_ids outside the embedding it indexes": (
        lambda _: _MODEL["gpt2"](**_ids(2, 9), token_type_ids=torch.full((2, 9), 96)), ("ValueError",),
        r"token_type_ids holds 96 at \[0, 0\], outside the table of 96 entries it indexes \(config\.vocab_size\)"),
    "generate (GPT-2): token_type_ids outside the embedding it indexes": (
        lambda _: _MODEL["gpt2"].generate(**_ids(2, 5), token_type_ids=torch.full((2, 5), 96), max_new_tokens=2),
        ("ValueError",), r"token_type_ids holds 96 at \[0, 0\], outside the table of 96 entries"),
    "forward: int16 input_ids": (
        lambda _: _m()(input_ids=_ids(2, 9)["input_ids"].short()), ("ValueError",),
        r"input_ids has dtype torch\.int16, but embeddings take torch\.long or torch\.int32 indices \(transformers "
        r"raises the same\); pass input_ids\.long\(\)"),
    "generate: uint8 input_ids": (
        lambda _: _m().generate(input_ids=_ids(2, 5)["input_ids"].to(torch.uint8), max_new_tokens=2), ("ValueError",),
        r"input_ids has dtype torch\.uint8, but embeddings take torch\.long or torch\.int32"),
    "train_step: int32 labels": (
        lambda _: _m().train_step(_with_labels(_ids(2, 9), _ids(2, 9)["input_ids"].int())), ("ValueError",),
        r"labels must be a torch\.long tensor for causal_lm, got dtype torch\.int32 \(transformers' loss takes Long "
        r"targets"),
    "forward: inputs_embeds of the wrong hidden size": (
        lambda _: _m()(inputs_embeds=torch.zeros(2, 9, 7)), ("ValueError",),
        r"inputs_embeds must be a floating point tensor of shape \(batch, length, 32\) \(config\.hidden_size\), "
        r"got shape \(2, 9, 7\)"),
    "generate: seed=nan": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, seed=float("nan")), ("TypeError",),
        r"seed must be an int \(or None to sample from torch's global stream as transformers does\), got nan of "
        r"type float"),
    "generate: seed='abc'": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, seed="abc"), ("TypeError",),
        r"seed must be an int .*got 'abc' of type str"),
    "generate: streamer without put/end": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, streamer=object()), ("TypeError",),
        r"streamer must have put\(ids\) and end\(\) methods \(transformers' BaseStreamer, e\.g\. TextStreamer\), "
        r"got object without put\(\) and end\(\)"),
    "forward: 1-D attention_mask": (
        lambda _: _m()(input_ids=_ids(2, 9)["input_ids"], attention_mask=torch.ones(9, dtype=torch.long)),
        ("ValueError",),
        r"attention_mask must be \(batch, length\) like input_ids \(2, 9\), got shape \(9,\) \(1-D\); pass "
        r"attention_mask\[None\]"),
    "generate: 1-D attention_mask": (
        lambda _: _m().generate(
            input_ids=_ids(2, 5)["input_ids"], attention_mask=torch.ones(5, dtype=torch.long), max_new_tokens=2),
        ("ValueError",), r"attention_mask shape \(5,\) does not match input_ids \(2, 5\)"),
    # Generation arguments transformers rejects: its own checks, on every rank, its exception type.
    "generate: temperature=0 with sampling": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, temperature=0.0), ("ValueError",),
        r"`temperature` \(=0\.0\) has to be a strictly positive float.*\(generate arguments: .*temperature=0\.0"),
    "generate: top_k < 0": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, top_k=-1), ("ValueError",),
        r"`top_k` has to be a strictly positive integer, but is -1 \(generate arguments: .*top_k=-1"),
    "generate: repetition_penalty < 0": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, repetition_penalty=-1.0), ("ValueError",),
        r"`penalty` has to be a strictly positive float, but is -1\.0 \(generate arguments: "
        r".*repetition_penalty=-1\.0"),
    "generate: stop_strings without a tokenizer": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, stop_strings=["x"]), ("ValueError",),
        r"There are one or more stop strings.*could not locate a tokenizer.*\(generate arguments: "
        r".*stop_strings=\['x'\]"),
    "generate: max_new_tokens=0": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=0), ("ValueError",),
        r"`max_new_tokens` must be greater than 0, but is 0"),
    "generate: min_p outside [0, 1]": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, min_p=2.0), ("ValueError",),
        r"`min_p` has to be a float in the \[0, 1\] interval"),
    "generate: typical_p=0": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, typical_p=0.0), ("ValueError",),
        r"`typical_p` has to be a float > 0 and < 1"),
    "generate: bad_words_ids outside the vocabulary": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, bad_words_ids=[[200]]), ("ValueError",),
        r"The model vocabulary size is 96, but the following tokens were being biased: \[200\]"),
    "generate: max_new_tokens not a number": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens="5"), ("TypeError",),
        r"not supported between instances of 'str' and 'int'.*max_new_tokens='5'"),
    # Per-call arguments that differ between ranks: one small digest, before anything else is exchanged.
    "forward: call kwargs differ between ranks": (
        lambda _: _m()(**_ids(2, 9), output_hidden_states=bool(_rank())), ("ValueError",),
        r"model inputs must be the same on every rank but output_hidden_states differs: output_hidden_states: rank 0: "
        r"False; rank 1: True"),
    "generate: generation config differs between ranks": (
        lambda _: _m().generate(
            **_ids(2, 5),
            generation_config=__import__("transformers").GenerationConfig(max_new_tokens=2, top_k=5 + _rank()),
        ),
        ("ValueError",),
        r"generate inputs must be the same on every rank but generation_config\.top_k differs: "
        r"generation_config\.top_k: rank 0: 5; rank 1: 6"),
    "generate: max_new_tokens differs between ranks": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2 + _rank()), ("ValueError",),
        r"but kwargs\.max_new_tokens differs: kwargs\.max_new_tokens: rank 0: 2; rank 1: 3"),
    "generate: seed differs between ranks": (
        lambda _: _m().generate(**_ids(2, 5), max_new_tokens=2, do_sample=True, seed=_rank()), ("ValueError",),
        r"but seed differs: seed: rank 0: 0; rank 1: 1"),
}


def _bad_ids(batch: int, seq: int, value: int) -> torch.Tensor:
    """Valid ids except one, at [batch - 1, seq // 2 - 1 or so]: the message must say where."""
    ids = _ids(batch, seq)["input_ids"].clone()
    ids[batch - 1, (seq - 1) // 2] = value
    return ids


def _call_job(llama: str, gpt2: str):
    _MODEL["llama"] = _load(llama, n_microbatches=2)
    _MODEL["gpt2"] = _load(gpt2, n_microbatches=2)
    results = _run_cases(CALL_CASES, None)
    # After all that the pipeline still works: agreed errors never stop the process group.
    model = _m()
    inputs = _ids(2, 9)
    logits = model(**inputs).logits
    ids = model.generate(**_ids(2, 5), max_new_tokens=3, do_sample=False)
    loss = model.train_step(_with_labels(inputs))
    return results, logits, ids, loss


@pytest.mark.dist
def test_bad_call_arguments_fail_on_every_rank_and_leave_the_pipeline_usable(tmp_path):
    llama = tiny.make_checkpoint(tmp_path / "llama", "llama")
    gpt2 = tiny.make_checkpoint(tmp_path / "gpt2", "gpt2")
    per_rank = run_distributed(_call_job, 2, str(llama), str(gpt2), timeout=240)
    _check(CALL_CASES, [r[0] for r in per_rank], _TABLE)
    _write_table()
    ref = tiny.reference(llama, "AutoModelForCausalLM")
    inputs = _ids(2, 9)
    with torch.no_grad():
        want = ref(**_with_labels(inputs))
    want_ids = ref.generate(**_ids(2, 5), max_new_tokens=3, do_sample=False)
    for _, logits, ids, loss in per_rank:
        # fp32 logits and loss: summation order ~1e-6; a wrong weight, mask or position moves them by 1e-2 or
        # more.
        assert (logits - want.logits).abs().max() <= 1e-5
        assert torch.equal(ids, want_ids)
        assert abs(loss.item() - want.loss.item()) <= 1e-5


def _write_table() -> None:
    target = os.environ.get("HF_PIPELINE_ERRORS_TABLE")
    if not target:
        return
    rows = ["| case | error raised on every rank |", "| --- | --- |"]
    for name, message in _TABLE:
        text = re.sub(r"/tmp/\S*?/(pytest-of-\w+/)?pytest-\d+/[^/\s]+/", "<dir>/", message)
        text = text.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {name} | {text} |")
    pathlib.Path(target).write_text("\n".join(rows) + "\n")


# --------------------------------------------------------------------------- the checks alone
def test_validation_helpers():
    from hf_pipeline.runtime import checks as validate
    from hf_pipeline.runtime.prompt_checks import check_prompts

    assert validate.max_positions(tiny.config_for("gpt2")) == 128  # n_positions, through attribute_map
    assert validate.max_positions(tiny.config_for("t5")) is None  # relative positions: no limit
    validate.check_sequence_length(tiny.config_for("gpt2"), 128)
    with pytest.raises(ValueError, match=r"has 100 tokens \+ 29 new tokens = 129"):
        validate.check_sequence_length(tiny.config_for("gpt2"), 100, what="the prompt", new_tokens=29)
    # Rotary positions (LLaMA) have no table to run off: longer inputs run, as in transformers.
    validate.check_sequence_length(tiny.config_for("llama"), 100, what="the prompt", new_tokens=29)
    validate.check_microbatches(batch=6, n_microbatches=4, training=False)  # inference pads
    validate.check_microbatches(batch=1, n_microbatches=4, training=False)  # fewer rows than microbatches too
    with pytest.raises(ValueError, match=r"batch size 1 is smaller than n_microbatches=4"):
        validate.check_microbatches(batch=1, n_microbatches=4, training=True)
    with pytest.raises(ValueError, match=r"e\.g\. 4 or 8"):
        validate.check_microbatches(batch=6, n_microbatches=4, training=True)
    assert check_prompts(["a", "b"]) == "text"
    assert check_prompts([[1, 2], [3]]) == "ids"
    for bad, pattern in [
        ("one string", "must be a list"), ([], "empty"), ([[1], []], "prompt 1 is an empty token list"),
        (["x", [1, 2]], "got a mix: ids .first at index 1., text .first at index 0."),
        (["x", 1.5], "got a float at index 1"), ([[1, True]], "got a list holding non-int items at index 0"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            check_prompts(bad)
    ids = torch.zeros(2, 5, dtype=torch.long)
    validate.check_labels("causal_lm", ids, input_ids=ids)
    validate.check_labels("sequence_classification", torch.tensor([0, 1]), input_ids=ids)
    validate.check_labels("seq2seq_lm", torch.zeros(2, 3, dtype=torch.long), input_ids=ids)
    with pytest.raises(ValueError, match="has no loss"):
        validate.check_labels(None, ids, input_ids=ids)
    with pytest.raises(ValueError, match="integer token ids"):
        validate.check_labels("masked_lm", ids.float(), input_ids=ids)
    with pytest.raises(ValueError, match=r"labels has 3 rows but the batch has 2"):
        validate.check_labels("sequence_classification", torch.tensor([0, 1, 1]), input_ids=ids)
