"""PipelineTrainer on one process (all stages local): what it refuses, iterable datasets, activation checkpointing.

The refusals are raised at construction from the arguments alone, so every rank of a job raises the
same one (the multi-rank test checks one of them on every rank); here each is checked to name its
argument, and the model to stay usable afterwards.
"""

from __future__ import annotations

import pathlib

import pytest
import tiny
import torch
import transformers
from test_trainer import TOL, _args, _assert_params_equal, _dataset, _logs

import hf_pipeline
from hf_pipeline.errors import UsageError


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return str(tiny.make_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def _pipelined(path):
    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2)


REFUSED = [  # (TrainingArguments overrides, other constructor arguments, what the message names)
    ({"per_device_train_batch_size": 3}, {}, "per_device_train_batch_size=3"),
    ({"torch_compile": True}, {}, "torch_compile=True"),
    ({"fsdp": "full_shard"}, {}, "fsdp="),
    ({"fp16": True}, {}, "fp16=True"),
    ({}, {"model_init": lambda: None}, "model_init"),
]


@pytest.fixture(scope="module")
def refused_model(llama_path):
    return _pipelined(llama_path)


def _refuse(model, tmp_path, overrides, extra, named) -> None:
    args = {"per_device_train_batch_size": 4, **overrides}
    batch = args.pop("per_device_train_batch_size")
    try:
        built = _args(tmp_path, batch, **args)
    except ValueError as e:  # transformers' own check came first (e.g. fp16 on CPU): it names it too
        assert named.split("=")[0] in str(e)
        return
    with pytest.raises(UsageError, match=named.replace("(", r"\(")):
        hf_pipeline.PipelineTrainer(model=model, args=built, train_dataset=_dataset("llama"), **extra)


@pytest.mark.parametrize("overrides, extra, named", REFUSED)
def test_refused_at_construction_naming_the_argument(refused_model, tmp_path, overrides, extra, named):
    _refuse(refused_model, tmp_path, overrides, extra, named)


@pytest.mark.equiv
def test_a_model_every_refusal_was_raised_for_still_trains(llama_path, tmp_path):
    # Nothing ran before any refusal: one model refused by every case in turn then trains.
    model = _pipelined(llama_path)
    for i, case in enumerate(REFUSED):
        _refuse(model, tmp_path / str(i), *case)
    trainer = hf_pipeline.PipelineTrainer(model=model, args=_args(tmp_path / "ok", 4), train_dataset=_dataset("llama"),
                                          eval_dataset=_dataset("llama", 8))
    trainer.train()
    assert trainer.state.global_step > 0


def test_a_tensor_parallel_or_fsdp_model_or_an_adapter_on_fsdp_is_not_refused(tmp_path):
    # Their checkpoints carry the optimizer state gathered whole (tests/checkpointing/test_tp_resume.py trains at tp,
    # tests/integrations/test_trainer_fsdp.py at fsdp, tests/integrations/test_lora_fsdp.py an adapter at fsdp); a
    # stand-in with the attributes the table reads keeps this in-process.
    from types import SimpleNamespace

    from hf_pipeline.integrations.trainer_refusals import check_arguments

    def model(**dims):
        return SimpleNamespace(n_microbatches=2, microbatches_for=lambda rows, training, seq=None: 2,
                               dims=SimpleNamespace(**dims))

    for dims in ({"tp_size": 2}, {"fsdp_size": 1}, {"fsdp_size": 2}):
        check_arguments(_args(tmp_path, 4), model(**dims))
    check_arguments(_args(tmp_path, 4), model(tp_size=2), adapter=True)
    check_arguments(_args(tmp_path, 4), model(fsdp_size=2), adapter=True)


def test_an_unpipelined_model_is_refused(llama_path, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path)
    with pytest.raises(UsageError, match="PipelineTrainer trains a pipelined model.*LlamaForCausalLM"):
        hf_pipeline.PipelineTrainer(model=model, args=_args(tmp_path, 4), train_dataset=_dataset("llama"))


def test_iterable_dataset_trains_as_transformers_trainer(llama_path, tmp_path):
    # An iterable dataset has no sampler: both read it in its own order, max_steps bounds the run.
    data = _dataset("llama").remove_columns("note")

    def run(trainer_class, model, out):
        args = _args(out, 4, eval_strategy="no", save_strategy="no")
        trainer = trainer_class(model=model, args=args, train_dataset=data.to_iterable_dataset())
        trainer.train()
        return _logs(trainer.state.log_history)

    model = _pipelined(llama_path)
    got = run(hf_pipeline.PipelineTrainer, model, tmp_path / "p")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    want = run(transformers.Trainer, ref_model, tmp_path / "r")
    assert [e.get("step") for e in got] == [e.get("step") for e in want] == [1, 2, 3, 4, 4]
    for g, w in zip(got[:4], want[:4]):
        assert g["loss"] == pytest.approx(w["loss"], rel=TOL)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=TOL)
    _assert_params_equal(dict(model.checkpoint_named_parameters()), ref_model.state_dict(), "iterable")


@pytest.mark.equiv  # Trainer runs against transformers' (as each below): 3 to 6 s each on 2 shared cores
@pytest.mark.parametrize("argument", ["activation_checkpointing", "gradient_checkpointing"])
def test_activation_checkpointing(llama_path, tmp_path, argument):
    model = _pipelined(llama_path)
    if not hasattr(model, "activation_checkpointing_enable"):
        # Until the model has the method, the argument is refused by name before anything runs.
        with pytest.raises(UsageError, match=f"{argument}.*=True needs PipelinedModel.activation_checkpointing_enable"):
            hf_pipeline.PipelineTrainer(model=model, args=_args(tmp_path, 4, **{argument: True}),
                                        train_dataset=_dataset("llama"))
        pytest.skip("PipelinedModel has no activation_checkpointing_enable yet")
    args = _args(tmp_path / "p", 4, eval_strategy="no", save_strategy="no", **{argument: True})
    hf_pipeline.PipelineTrainer(model=model, args=args, train_dataset=_dataset("llama")).train()
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    transformers.Trainer(model=ref, args=_args(tmp_path / "r", 4, eval_strategy="no", save_strategy="no"),
                         train_dataset=_dataset("llama")).train()
    _assert_params_equal(dict(model.checkpoint_named_parameters()), ref.state_dict(), argument)


def test_the_trainer_methods_overridden_exist_in_transformers_with_the_same_arguments():
    import inspect

    import trl

    from hf_pipeline.compat import TRAINER_HELPERS, TRAINER_OVERRIDES, TRL_DPO_OVERRIDES
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    # transformers' Trainer's methods, and trl's DPOTrainer's for the ones only it has.
    for owner, names in ((transformers.Trainer, TRAINER_OVERRIDES), (trl.DPOTrainer, TRL_DPO_OVERRIDES)):
        for name in names:
            theirs = inspect.signature(getattr(owner, name)).parameters
            ours = inspect.signature(getattr(PipelineTrainerMixin, name)).parameters
            assert list(ours) == list(theirs), f"{name}: {owner.__name__} takes {list(theirs)}"
    for name in TRAINER_HELPERS:
        assert callable(getattr(transformers.Trainer, name, None)), name
    # Every underscored Trainer method the mixin defines is listed (and so checked above).
    defined = {n for n in vars(PipelineTrainerMixin) if n.startswith("_") and not n.startswith("__")}
    listed = set(TRAINER_OVERRIDES) | set(TRL_DPO_OVERRIDES)
    assert defined - {"_gather_nothing", "_store_callback_states", "_reload_model", "_take_over_fused_head",
                       "_padding_free_rows", "_find_adapter"} == listed


@pytest.mark.equiv
def test_save_total_limit_and_resume_true_as_transformers(llama_path, tmp_path):
    def run(trainer_class, load, out):
        args = _args(out, 4, eval_strategy="no", save_steps=1, save_total_limit=2)
        trainer_class(model=load(), args=args, train_dataset=_dataset("llama")).train()
        kept = sorted(p.name for p in out.glob("checkpoint-*"))
        resumed = trainer_class(model=load(), args=args, train_dataset=_dataset("llama"))
        resumed.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir
        params = resumed.model.checkpoint_named_parameters() if trainer_class is not transformers.Trainer else (
            resumed.model.state_dict(keep_vars=True).items())
        return kept, resumed.state.global_step, {n: p.detach().clone() for n, p in params}

    got = run(hf_pipeline.PipelineTrainer, lambda: _pipelined(llama_path), tmp_path / "p")
    want = run(transformers.Trainer, lambda: transformers.AutoModelForCausalLM.from_pretrained(
        llama_path, dtype=torch.float32), tmp_path / "r")
    assert got[0] == want[0] == ["checkpoint-3", "checkpoint-4"]
    assert got[1] == want[1]
    _assert_params_equal(got[2], want[2], "resume_from_checkpoint=True")


def test_evaluation_needs_the_outputs_on_every_rank(llama_path, tmp_path):
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(llama_path, pipeline=True, gather_output=False)
    trainer = hf_pipeline.PipelineTrainer(model=model, args=_args(tmp_path, 4), train_dataset=_dataset("llama"),
                                          eval_dataset=_dataset("llama", 8))
    with pytest.raises(UsageError, match="gather_output=False"):
        trainer.evaluate()


def _user_folders(out):
    """Folders of the user's in output_dir that rotation must never remove (transformers' removes them)."""
    for name in ("checkpoint-notes", "checkpoint-1000"):
        (out / name).mkdir(parents=True)
        (out / name / "notes.txt").write_text(f"{name}: mine")


def _kept_user_folders(out) -> None:
    for name in ("checkpoint-notes", "checkpoint-1000"):
        assert (out / name / "notes.txt").read_text() == f"{name}: mine", f"{name} was removed or changed"


@pytest.mark.equiv
def test_rotation_removes_only_the_trainers_own_checkpoints(llama_path, tmp_path):
    out = tmp_path / "out"
    _user_folders(out)
    args = _args(out, 4, eval_strategy="no", save_steps=1, save_total_limit=1)
    hf_pipeline.PipelineTrainer(model=_pipelined(llama_path), args=args, train_dataset=_dataset("llama")).train()
    _kept_user_folders(out)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1000", "checkpoint-4", "checkpoint-notes"]


@pytest.mark.equiv
def test_keeping_only_the_best_checkpoint_at_the_end_removes_only_the_trainers(llama_path, tmp_path):
    # With save_total_limit=1 and a best checkpoint, transformers removes every checkpoint-<number> but the best
    # when training ends.
    out = tmp_path / "out"
    _user_folders(out)
    args = _args(out, 4, eval_steps=1, save_steps=1, save_total_limit=1, load_best_model_at_end=True)
    trainer = hf_pipeline.PipelineTrainer(model=_pipelined(llama_path), args=args, train_dataset=_dataset("llama"),
                                          eval_dataset=_dataset("llama", 8))
    trainer.train()
    _kept_user_folders(out)
    best = pathlib.Path(trainer.state.best_model_checkpoint).name
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted(["checkpoint-1000", best, "checkpoint-notes"])
    assert trainer.args.save_total_limit == 1


def test_what_rotation_takes_for_the_trainers_checkpoint(tmp_path):
    # A folder is the Trainer's only while its mark names it and the save that wrote its weights.
    import json
    import shutil

    from hf_pipeline.checkpointing.directory import SAVE_ID_KEY
    from hf_pipeline.integrations.trainer_checkpoints import MARK_NAME, mark_checkpoint, written_by_trainer

    def checkpoint(name, save_id="0123456789ab"):
        path = tmp_path / name
        path.mkdir()
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {SAVE_ID_KEY: save_id}}))
        return path

    ours = checkpoint("checkpoint-2")
    mark_checkpoint(ours)
    assert written_by_trainer(ours)
    shutil.copytree(ours, tmp_path / "checkpoint-900")  # copied by the user under another name
    assert not written_by_trainer(tmp_path / "checkpoint-900")
    saved_since = checkpoint("checkpoint-3")
    mark_checkpoint(saved_since)
    (saved_since / "model.safetensors.index.json").write_text(json.dumps({"metadata": {SAVE_ID_KEY: "bbbbbbbbbbbb"}}))
    assert not written_by_trainer(saved_since)  # the user saved a model into it since
    (tmp_path / "checkpoint-5").symlink_to(ours)  # a link: its target is not removed through it
    assert not written_by_trainer(tmp_path / "checkpoint-5")
    garbage = checkpoint("checkpoint-6")
    (garbage / MARK_NAME).write_text("{not json")
    assert not written_by_trainer(garbage)
    adapter = tmp_path / "checkpoint-7"  # an adapter checkpoint: no weights index, the mark names no save
    adapter.mkdir()
    mark_checkpoint(adapter)
    assert written_by_trainer(adapter)
    (tmp_path / "checkpoint-notes").mkdir()
    assert not written_by_trainer(tmp_path / "checkpoint-notes") and not written_by_trainer(tmp_path / "missing")


def test_a_trainer_without_the_mixin_is_refused_at_construction_naming_it(llama_path, tmp_path):
    # transformers' own Trainer (TRL's SFTTrainer and DPOTrainer are subclasses of it) would run the
    # pipelined model as one module in its step: refused while it is built, plain or wrapped by peft.
    import peft

    model = _pipelined(llama_path)
    args = transformers.TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    for candidate in (model, wrapped):
        with pytest.raises(UsageError, match=r"pipelined LlamaForCausalLM is trained by hf_pipeline.PipelineTrainer"):
            transformers.Trainer(model=candidate, args=args)
    # the mixin builds its Trainer on the same model, which is placed by the pipeline
    trainer = hf_pipeline.PipelineTrainer(model=wrapped, args=args, train_dataset=_dataset("llama", 8))
    assert trainer.pipelined is model and not trainer.is_distributed_loading_by_transformers
