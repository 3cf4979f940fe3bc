"""TRL's SFTTrainer on a pipelined model through PipelineTrainerMixin, against SFTTrainer on one process.

trl comes with the ``test`` extra (``pip install -e ".[test]"``), so CI runs this; the importorskip only guards a
bare install. fp32 (SFTConfig defaults to bf16, whose autocast differs between an unsplit model and
stages) and without gradient checkpointing (SFTConfig turns it on; see README).
"""

from __future__ import annotations

import os
import pathlib

import datasets
import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from test_trainer import TOL, _assert_params_equal

pytest.importorskip("trl")


def _data(directory: str):
    text = tiny.text_file(pathlib.Path(directory) / "text.txt", lines=32)
    return datasets.Dataset.from_dict({"text": text.read_text().splitlines()}), tiny.word_tokenizer(text)


def _config(out: str):
    from trl import SFTConfig

    return SFTConfig(
        out, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=2,
        max_grad_norm=0.5, logging_steps=1, max_steps=4, seed=7, report_to=[], use_cpu=True, disable_tqdm=True,
        max_length=16, save_strategy="no", gradient_checkpointing=False, activation_checkpointing=False, bf16=False,
    )


def _logs(trainer) -> list[dict]:
    return [{k: e[k] for k in ("loss", "grad_norm", "learning_rate") if k in e} for e in trainer.state.log_history]


def _sft_rank(path: str, directory: str):
    from trl import SFTTrainer

    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer):
        pass

    data, tokenizer = _data(directory)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2)
    out = os.path.join(directory, f"rank{os.environ['RANK']}")
    trainer = PipelineSFTTrainer(model=model, args=_config(out), train_dataset=data, processing_class=tokenizer)
    trainer.train()
    return _logs(trainer), {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}


@pytest.mark.dist
@pytest.mark.slow
def test_sft_trainer_through_the_mixin_equals_sft_trainer(tmp_path):
    from trl import SFTTrainer

    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    results = run_distributed(_sft_rank, 2, path, str(tmp_path), timeout=300)
    data, tokenizer = _data(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = SFTTrainer(model=model, args=_config(str(tmp_path / "ref")), train_dataset=data, processing_class=tokenizer)
    ref.train()
    want = _logs(ref)
    for rank, (logs, params) in enumerate(results):
        assert len(logs) == len(want)
        for got, expected in zip(logs, want):
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), f"rank {rank} {key}"
        _assert_params_equal(params, model.state_dict(), f"rank {rank}")


def _packed_config(out: str, batch: int):
    from trl import SFTConfig

    # packing (best-fit decreasing): TRL's collator then puts each batch's sequences end to end in one row
    return SFTConfig(
        out, per_device_train_batch_size=batch, gradient_accumulation_steps=2, learning_rate=1e-2, max_grad_norm=0.5,
        logging_steps=1, max_steps=3, seed=7, report_to=[], use_cpu=True, disable_tqdm=True, max_length=32,
        save_strategy="no", gradient_checkpointing=False, activation_checkpointing=False, bf16=False, packing=True,
    )


def _packed_rank(path: str, directory: str, num_stages: int):
    from trl import SFTTrainer

    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer):
        pass

    data, tokenizer = _data(directory)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2,
                                                             num_stages=num_stages)
    out = os.path.join(directory, f"packed{os.environ['RANK']}")
    trainer = PipelineSFTTrainer(model=model, args=_packed_config(out, 2), train_dataset=data,
                                 processing_class=tokenizer)
    trainer.train()
    return _logs(trainer), {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_sft_trainer_with_packing_equals_sft_trainer(tmp_path, world):
    """TRL's padding-free batches (one row of sequences end to end) train as the same sequences in rows: one
    process's logged losses, gradient norms and parameters (integrations/padding_free.py), at pp=2 and pp=2 x dp=2
    (against one process with both replicas' rows). A batch run as one sequence (attention across the boundaries)
    or with the boundary labels scored moves the loss by ~1e-1."""
    from trl import SFTTrainer

    from hf_pipeline.integrations.padding_free import is_padding_free

    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    data, tokenizer = _data(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = SFTTrainer(model=model, args=_packed_config(str(tmp_path / "ref"), 2 * (world // 2)), train_dataset=data,
                     processing_class=tokenizer)
    assert is_padding_free(next(iter(ref.get_train_dataloader()))), "packing should make the batches padding-free"
    ref.train()
    want = _logs(ref)
    for rank, (logs, params) in enumerate(run_distributed(_packed_rank, world, path, str(tmp_path), 2)):
        assert len(logs) == len(want)
        for got, expected in zip(logs, want):
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), f"{world} ranks, rank {rank} {key}"
        _assert_params_equal(params, model.state_dict(), f"{world} ranks, rank {rank}")


def _peft_config(out: str):
    from trl import SFTConfig

    return SFTConfig(
        out, per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, max_steps=3,
        seed=7, report_to=[], use_cpu=True, disable_tqdm=True, max_length=16, save_strategy="steps", save_steps=3,
        gradient_checkpointing=False, activation_checkpointing=False, bf16=False,
    )


def _lora():
    import peft

    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)


def _peft_config_rank(path: str, directory: str):
    from trl import SFTTrainer

    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer):
        pass

    data, tokenizer = _data(directory)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2)
    torch.manual_seed(5)  # LoRA's initial values: one process's draws, on every rank (peft_inject.py)
    trainer = PipelineSFTTrainer(model=model, args=_peft_config(os.path.join(directory, "pipelined")),
                                 train_dataset=data, processing_class=tokenizer, peft_config=_lora())
    trainer.train()
    return _logs(trainer)


@pytest.mark.dist
def test_sft_trainer_with_its_peft_config_trains_and_saves_the_adapter_as_sft_trainer(tmp_path):
    """``peft_config=`` wraps the pipelined model inside TRL's constructor: the mixin then treats it as the PEFT
    model it is (its checkpoints are the adapter, in peft's format), equal to SFTTrainer on one process: the logged
    losses and the saved adapter's tensors. Before, the checkpoint was the whole model's and failed."""
    from safetensors.torch import load_file
    from trl import SFTTrainer

    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    data, tokenizer = _data(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(5)
    ref = SFTTrainer(model=model, args=_peft_config(str(tmp_path / "ref")), train_dataset=data,
                     processing_class=tokenizer, peft_config=_lora())
    ref.train()
    want = _logs(ref)
    for rank, logs in enumerate(run_distributed(_peft_config_rank, 2, path, str(tmp_path))):
        assert len(logs) == len(want)
        for got, expected in zip(logs, want):
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), f"rank {rank} {key}"
    saved, ref_saved = (load_file(tmp_path / d / "checkpoint-3" / "adapter_model.safetensors")
                        for d in ("pipelined", "ref"))
    assert sorted(saved) == sorted(ref_saved) and len(saved) == 16
    for name, tensor in ref_saved.items():
        assert torch.allclose(saved[name], tensor, rtol=0, atol=1e-6), name
