"""``from_pretrained(..., pipeline=True)`` and the pipelined model against what transformers users write.

* transformers' everyday ``from_pretrained`` arguments, each accepted and effective (checked against
  transformers with the same argument) or refused with its own message: ``torch_dtype``,
  ``attn_implementation``, ``cache_dir`` / ``revision`` / ``local_files_only`` (a hub cache built
  here), ``subfolder``, ``low_cpu_mem_usage``, ``trust_remote_code``, ``device_map``;
* the ``PreTrainedModel`` attributes the pipelined model has, compared with transformers' values:
  ``generation_config`` (read by ``generate``, changeable as in transformers), ``can_generate()``,
  ``num_parameters()``, ``get_input_embeddings()`` / ``get_output_embeddings()``, ``device``,
  ``dtype``, ``name_or_path``;
* ``split`` in torch's ``{name: SplitPoint}`` form gives the plan of the equivalent names, on the
  recipe path and the traced path, and the same messages for bad splits;
* at 2 ranks: the README's Accelerate training loop, run as written, against transformers on one
  process after two optimizer steps; parameter counts and embeddings on the rank that holds them.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from torch.distributed.pipelining import SplitPoint

from hf_pipeline import AutoModelForCausalLM
from hf_pipeline.errors import CheckpointNotFoundError, InputError, PlanError
from hf_pipeline.planning.options import PipelineOptions

TOL = 1e-5  # fp32, the same HF modules on the same inputs: only summation order may differ
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> pathlib.Path:
    return tiny.make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_a_loaded_model_is_the_core_the_rooms_below_read(llama):
    # generation, training, checkpointing, serving... are typed against PipelineCore (tests/test_layering.py checks
    # what they read off it); a loaded model must carry every member it declares, attributes included.
    from hf_pipeline.core import PipelineCore

    model = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, device="cpu", progress=False)
    missing = [n for n in PipelineCore.__annotations__ if not hasattr(model, n)]
    assert not missing and isinstance(model, PipelineCore), f"a loaded model lacks {missing}"


# --------------------------------------------------------------------------- from_pretrained arguments
def test_torch_dtype_is_an_alias_of_dtype_and_dtype_wins(llama):
    model = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, torch_dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    both = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, torch_dtype=torch.bfloat16, dtype=torch.float32)
    assert {p.dtype for p in both.parameters()} == {torch.float32}  # as transformers: dtype wins


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attn_implementation_reaches_the_stages_and_equals_transformers(llama, impl):
    inputs = tiny.sample_inputs("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32, attn_implementation=impl).eval()
    model = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, attn_implementation=impl, virtual_stages=2)
    assert hf.config._attn_implementation == impl
    assert model.config._attn_implementation == impl
    assert {s.config._attn_implementation for s in model.stages} == {impl}
    torch.testing.assert_close(_logits(model, inputs), _logits(hf, inputs), atol=TOL, rtol=TOL)


def test_attn_implementation_is_checked_as_transformers_checks_it(llama):
    with pytest.raises(ValueError) as hf_error:
        transformers.AutoModelForCausalLM.from_pretrained(llama, attn_implementation="bogus")
    with pytest.raises(ValueError) as ours:
        AutoModelForCausalLM.from_pretrained(llama, pipeline=True, attn_implementation="bogus")
    assert str(ours.value) == str(hf_error.value)


def test_attn_implementation_leaves_a_given_config_alone(llama):
    config = transformers.AutoConfig.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, config=config, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert config._attn_implementation != "eager"


def test_subfolder_loads_the_checkpoint_inside(tmp_path, llama):
    shutil.copytree(llama, tmp_path / "repo" / "weights")
    (tmp_path / "repo" / "README.md").write_text("a repository with its checkpoint in a subfolder\n")
    inputs = tiny.sample_inputs("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "repo", subfolder="weights", dtype=torch.float32
    ).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", pipeline=True, subfolder="weights")
    torch.testing.assert_close(_logits(model, inputs), _logits(hf, inputs), atol=TOL, rtol=TOL)
    with pytest.raises(CheckpointNotFoundError, match="has no subfolder 'nope'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo", pipeline=True, subfolder="nope")


def _hub_cache(root: pathlib.Path, repo: str, snapshots: dict[str, pathlib.Path]) -> pathlib.Path:
    """A huggingface_hub cache holding ``repo`` at each ref of ``snapshots`` (ref -> checkpoint directory)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    for i, (ref, checkpoint) in enumerate(snapshots.items()):
        commit = f"{i + 1:040x}"
        shutil.copytree(checkpoint, folder / "snapshots" / commit)
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return root


def test_cache_dir_revision_and_local_files_only_find_the_cached_snapshot(tmp_path, llama):
    other = tiny.make_checkpoint(tmp_path / "other", "llama", seed=1)
    cache = _hub_cache(tmp_path / "cache", "org/tiny", {"main": llama, "v1": other})
    inputs = tiny.sample_inputs("llama")
    for revision in ("main", "v1"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            "org/tiny", cache_dir=cache, revision=revision, local_files_only=True, dtype=torch.float32,
        ).eval()
        model = AutoModelForCausalLM.from_pretrained(
            "org/tiny", pipeline=True, cache_dir=cache, revision=revision, local_files_only=True,
        )
        torch.testing.assert_close(_logits(model, inputs), _logits(hf, inputs), atol=TOL, rtol=TOL)
    assert model.name_or_path == "org/tiny" == hf.name_or_path
    with pytest.raises(CheckpointNotFoundError, match=re.escape(str(cache))):
        AutoModelForCausalLM.from_pretrained("org/tiny", pipeline=True, cache_dir=cache, revision="v2")
    with pytest.raises(CheckpointNotFoundError):
        AutoModelForCausalLM.from_pretrained("org/tiny", pipeline=True, cache_dir=tmp_path / "empty")


def test_low_cpu_mem_usage_is_accepted_and_changes_nothing(llama):
    inputs = tiny.sample_inputs("llama")
    plain = AutoModelForCausalLM.from_pretrained(llama, pipeline=True)
    model = AutoModelForCausalLM.from_pretrained(llama, pipeline=True, low_cpu_mem_usage=True, local_files_only=False)
    torch.testing.assert_close(_logits(model, inputs), _logits(plain, inputs), atol=0, rtol=0)


def test_trust_remote_code_is_refused_for_checkpoints_with_their_own_code(tmp_path, llama):
    AutoModelForCausalLM.from_pretrained(llama, pipeline=True, trust_remote_code=True)  # no custom code: loads
    custom = shutil.copytree(llama, tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"trust_remote_code=True: .* has its own modelling code .* pipeline=True never runs"
    ):
        AutoModelForCausalLM.from_pretrained(custom, pipeline=True, trust_remote_code=True)
    AutoModelForCausalLM.from_pretrained(
        custom, pipeline=True
    )  # transformers' own LlamaForCausalLM, as transformers does


def test_device_map_is_refused_saying_the_pipeline_places_stages(llama):
    for device_map in ("auto", {"": "cpu"}):
        with pytest.raises(
            InputError,
            match=r"device_map=.* is not supported with pipeline=True: the pipeline places the stages itself",
        ):
            AutoModelForCausalLM.from_pretrained(llama, pipeline=True, device_map=device_map)
    AutoModelForCausalLM.from_pretrained(llama, pipeline=True, device_map=None)


def test_unknown_arguments_are_still_a_type_error(llama):
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['load_in_8bit'\] with pipeline=True"):
        AutoModelForCausalLM.from_pretrained(llama, pipeline=True, load_in_8bit=True)


# --------------------------------------------------------------------------- PreTrainedModel attributes
def test_attributes_equal_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "ckpt", "llama-tied")
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_new_tokens=3).save_pretrained(
        path
    )
    hf = tiny.reference(path, "AutoModelForCausalLM")
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)

    assert model.generation_config.to_dict() == transformers.GenerationConfig.from_pretrained(path).to_dict()
    assert model.generation_config.to_dict() == hf.generation_config.to_dict()
    assert model.can_generate() and hf.can_generate()
    for kw in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert model.num_parameters(**kw) == hf.num_parameters(**kw), kw
        assert model.num_parameters(local=True, **kw) == hf.num_parameters(**kw), kw  # one rank holds it all
    assert model.get_input_embeddings() is model.stages[0].model.embed_tokens
    assert model.get_output_embeddings() is model.stages[-1].lm_head
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, one Parameter
    assert (model.device, model.dtype, model.name_or_path) == (hf.device, hf.dtype, hf.name_or_path)

    # generate reads model.generation_config: changing it changes the default, as in transformers.
    ids = tiny.sample_inputs("llama", batch=2, seq=5, pad_left=False)["input_ids"]
    assert model.generate(ids).shape[1] == 5 + 3
    model.generation_config.max_new_tokens = 4
    hf.generation_config.max_new_tokens = 4
    torch.testing.assert_close(model.generate(ids), hf.generate(ids, do_sample=False), atol=0, rtol=0)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_new_tokens=2
    )
    assert model.generate(ids).shape[1] == 5 + 2


def test_models_without_a_generation_head_say_so_as_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "bert", "bert")
    hf = tiny.reference(path, "AutoModelForMaskedLM")
    from hf_pipeline import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(path, pipeline=True)
    assert model.can_generate() is hf.can_generate() is False
    assert not hasattr(hf, "generation_config") and not hasattr(model, "generation_config")  # as transformers: absent
    assert model.num_parameters() == hf.num_parameters()
    assert model.get_input_embeddings() is model.stages[0].bert.embeddings.word_embeddings
    assert model.get_output_embeddings() is model.stages[-1].cls.predictions.decoder


# --------------------------------------------------------------------------- split as {name: SplitPoint}
def _plan(config, split, *, traced: bool):
    options = PipelineOptions.resolve(
        config, None, num_stages=3, split=split, split_method="trace" if traced else "recipe"
    )
    if traced:
        from hf_pipeline.loading.trace import trace_front_end

        return trace_front_end(config, options, device=torch.device("cpu")).plan
    from hf_pipeline.loading.stages import recipe_front_end

    return recipe_front_end(config, options).plan


def _opt_config():
    return transformers.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, vocab_size=tiny.VOCAB, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )


SPLITS = [  # (SplitPoint dict, the names it means)
    ({"{p}.1": SplitPoint.BEGINNING, "{p}.3": SplitPoint.BEGINNING}, ["{p}.1", "{p}.3"]),
    ({"{p}.0": SplitPoint.END, "{p}.2": SplitPoint.END}, ["{p}.1", "{p}.3"]),
    ({"{p}.1": SplitPoint.END, "{p}.3": SplitPoint.BEGINNING}, ["{p}.2", "{p}.3"]),
]


@pytest.mark.parametrize("traced", [False, True], ids=["recipe", "trace"])
def test_split_points_plan_as_the_names_they_mean(traced):
    config, prefix = (_opt_config(), "model.decoder.layers") if traced else (tiny.config_for("llama"), "model.layers")
    # Split points become names before either front end sees them; tracing (two traces a spec) checks one
    # spec with both kinds of point.
    for spec, names in SPLITS[2:] if traced else SPLITS:
        spec = {k.format(p=prefix): v for k, v in spec.items()}
        names = [n.format(p=prefix) for n in names]
        by_points, by_names = _plan(config, spec, traced=traced), _plan(config, names, traced=traced)
        assert by_points.split_points == tuple(names)
        assert [s.blocks for s in by_points.stages] == [s.blocks for s in by_names.stages]
        assert by_points == by_names


@pytest.mark.parametrize("traced", [False, True], ids=["recipe", "trace"])
def test_bad_split_points_give_the_messages_of_bad_names(traced):
    config, prefix = (_opt_config(), "model.decoder.layers") if traced else (tiny.config_for("llama"), "model.layers")
    bad = [
        (
            {f"{prefix}.9": SplitPoint.BEGINNING, f"{prefix}.2": SplitPoint.BEGINNING},
            [f"{prefix}.9", f"{prefix}.2"],
        ),  # no such block
        ({f"{prefix}.1": SplitPoint.BEGINNING}, [f"{prefix}.1"]),  # too few for 3 stages
        ({f"{prefix}.2": SplitPoint.END, f"{prefix}.1": SplitPoint.BEGINNING}, [f"{prefix}.3", f"{prefix}.1"]),  # order
        ({f"{prefix}.0": SplitPoint.END, f"{prefix}.1": SplitPoint.BEGINNING}, [f"{prefix}.1", f"{prefix}.1"]),  # twice
        (
            {f"{prefix}.3": SplitPoint.END, f"{prefix}.1": SplitPoint.BEGINNING},
            [f"{prefix}.4", f"{prefix}.1"],
        ),  # after the last
    ]
    for spec, names in bad:
        with pytest.raises(PlanError) as by_names:
            _plan(config, names, traced=traced)
        with pytest.raises(PlanError) as by_points:
            _plan(config, spec, traced=traced)
        assert str(by_points.value) == str(by_names.value)


def test_split_points_must_be_torch_split_points_on_indexed_blocks():
    config = tiny.config_for("llama")
    with pytest.raises(
        InputError, match=r"the value for 'model.layers.1' must be torch.distributed.pipelining.SplitPoint"
    ):
        PipelineOptions.resolve(config, None, num_stages=2, split={"model.layers.1": "BEGINNING"})
    with pytest.raises(InputError, match=r"SplitPoint.END of 'model.norm' needs a block of a module list"):
        PipelineOptions.resolve(config, None, num_stages=2, split={"model.norm": SplitPoint.END})
    with pytest.raises(InputError, match=r"split keys must be module names"):
        PipelineOptions.resolve(config, None, num_stages=2, split={1: SplitPoint.BEGINNING})


def test_from_pretrained_takes_split_points(llama):
    model = AutoModelForCausalLM.from_pretrained(
        llama, pipeline=True, virtual_stages=2, split={"model.layers.0": SplitPoint.END}
    )
    assert model.plan.split_points == ("model.layers.1",)
    hf = tiny.reference(llama, "AutoModelForCausalLM")
    inputs = tiny.sample_inputs("llama")
    torch.testing.assert_close(_logits(model, inputs), _logits(hf, inputs), atol=TOL, rtol=TOL)


# --------------------------------------------------------------------------- 2 ranks: Accelerate, counts
def _readme_accelerate_loop() -> str:
    text = README.read_text()
    section = text.split("### Training with Accelerate", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _batches() -> list[dict[str, torch.Tensor]]:
    rows = tiny.sample_inputs("llama", batch=8, seq=9, seed=3, pad_left=False)
    labels = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    return [
        {"input_ids": rows["input_ids"][i], "attention_mask": rows["attention_mask"][i], "labels": labels[i]}
        for i in range(8)
    ]


def _accelerate_rank(path: str):
    from torch.utils.data import DataLoader

    # The README's loop, exactly: it defines the Accelerator, the model, the optimizer and scheduler.
    scope = {"path": path, "loader": DataLoader(_batches(), batch_size=4, shuffle=False)}
    exec(_readme_accelerate_loop(), scope)
    model, optimizer, scheduler = scope["model"], scope["optimizer"], scope["scheduler"]
    params = {name: p.detach().clone() for name, p in model.checkpoint_named_parameters()}
    accelerated = type(optimizer).__name__, type(scheduler).__name__, type(model).__name__
    counts = {
        "whole": model.num_parameters(), "local": model.num_parameters(local=True),
        "trainable": model.num_parameters(only_trainable=True),
        "no_embeddings": model.num_parameters(exclude_embeddings=True),
        "input_embeddings": type(model.get_input_embeddings()).__name__,
        "output_embeddings": type(model.get_output_embeddings()).__name__,
        "input_is_stage_module": (
            model.get_input_embeddings() is (model.stages[0].model.embed_tokens if model.dims.pp_rank == 0 else None)
        ),
    }
    return params, accelerated, counts, scheduler.get_last_lr()


def _reference_steps(path, lr_fn) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    hf = tiny.reference(path, "AutoModelForCausalLM").train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_fn)
    rows = _batches()
    for start in (0, 4):
        batch = {k: torch.stack([r[k] for r in rows[start : start + 4]]) for k in rows[0]}
        hf(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in hf.state_dict(keep_vars=True).items()}, scheduler.get_last_lr()


@pytest.mark.dist
def test_readme_accelerate_loop_at_2_ranks_equals_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "ckpt", "llama-tied")
    results = run_distributed(_accelerate_rank, 2, str(path), timeout=300)
    ref, ref_lr = _reference_steps(path, lambda step: 1.0 / (1 + step))
    hf = tiny.reference(path, "AutoModelForCausalLM")
    seen = set()
    for rank, (params, accelerated, counts, last_lr) in enumerate(results):
        # The model is not wrapped.
        assert accelerated == ("AcceleratedOptimizer", "AcceleratedScheduler", "PipelinedModel"), accelerated
        # the same LambdaLR arithmetic on both sides: float rounding only; one step too many moves 1 / (1 + step)
        # by 25% or more.
        assert last_lr == pytest.approx(ref_lr)  # the scheduler stepped once per step, not once per process
        for name, p in params.items():
            torch.testing.assert_close(
                p, ref[name], atol=TOL, rtol=TOL, msg=lambda m, name=name, rank=rank: f"{name} (rank {rank}): {m}"
            )
            seen.add(name)
        assert counts["whole"] == hf.num_parameters() and counts["trainable"] == hf.num_parameters(only_trainable=True)
        assert counts["no_embeddings"] == hf.num_parameters(exclude_embeddings=True)
        assert counts["input_is_stage_module"]
    assert {r[2]["input_embeddings"] for r in results} == {"Embedding", "NoneType"}
    assert [r[2]["output_embeddings"] for r in results] == ["NoneType", "Linear"]
    # Local counts add up to the whole model plus the tied embedding / LM head held on both ranks.
    tied = hf.get_input_embeddings().weight.numel()
    assert sum(r[2]["local"] for r in results) == hf.num_parameters() + tied
    assert seen == {n for n, _ in hf.named_parameters()} | {"lm_head.weight"}


@pytest.mark.equiv  # generates without a cache on both sides: about 3 s on 2 shared cores
def test_generate_use_cache_false_gives_transformers_tokens(tmp_path):
    # The pipeline always decodes with per-stage KV caches; use_cache=False (which transformers
    # honours by recomputing every step) must give the same tokens, not be an error.
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, num_stages=2, virtual_stages=2
    )
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs = tiny.sample_inputs("llama", batch=3, seq=7)
    want = ref.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=False), want)
