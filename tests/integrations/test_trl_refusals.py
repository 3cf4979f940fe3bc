"""What TRL's trainers do with a pipelined model, on one process (all stages local): refused at construction
with one line that says what to change, and the model usable afterwards.

* ``trl.SFTTrainer`` and ``trl.DPOTrainer`` as they come (no ``PipelineTrainerMixin``): their step would run the
  pipelined model as one module; refused naming the mixin (``refuse_plain_trainer``, read by transformers'
  ``Trainer.__init__``).
* ``class T(PipelineTrainerMixin, DPOTrainer)`` trains (tests/integrations/test_trl_dpo.py); what its pipelined
  loss cannot do as TRL does is refused naming the option (``check_dpo``): a loss type that is no per-pair
  function (``aot``), full fine-tuning with neither ``ref_model`` nor ``precompute_ref_log_probs`` (TRL would
  load an unsplit copy on every rank), an unpipelined ``ref_model``, ``use_weighting``.
* TRL's trainers with a loss of their own other than SFT's, DPO's, GRPO's, RLOO's, KTO's and the reward trainer's
  (distillation) are refused (``own_loss_class``), and so is SFTConfig's ``loss_type="dft"``; GRPO's and RLOO's
  ``use_vllm`` and ``beta`` with full fine-tuning, KTO's ``ref_model`` and its full fine-tuning without
  ``precompute_ref_log_probs`` (``check_own_step``). Other Trainer subclasses with their own
  ``compute_loss`` train (tests/integrations/test_trainer_own_loss.py), GRPO, RLOO, KTO and the reward trainer
  too (tests/integrations/test_trl_grpo.py, test_trl_rloo.py, test_trl_kto.py, test_trl_reward.py).
"""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers

import hf_pipeline
from hf_pipeline.errors import UsageError
from hf_pipeline.integrations.trainer import PipelineTrainerMixin
from hf_pipeline.tools.default_model import default_model_path

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.unit

MIXIN_NAMED = r"^a pipelined LlamaForCausalLM is trained by hf_pipeline.PipelineTrainer, or a Trainer subclass with " \
    r"hf_pipeline.integrations.trainer.PipelineTrainerMixin first"


@pytest.fixture(scope="module")
def bundled():
    path = str(default_model_path())
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False)
    return model, transformers.AutoTokenizer.from_pretrained(path)


def _sft(tmp_path, **overrides):
    args = dict(per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, save_strategy="no", max_length=16)
    data = datasets.Dataset.from_dict({"text": ["Return the value of the file."] * 4})
    return trl.SFTConfig(str(tmp_path / "sft"), **{**args, **overrides}), data


def _dpo(tmp_path, **overrides):
    args = dict(per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, save_strategy="no", max_length=16)
    data = datasets.Dataset.from_dict(
        {"prompt": ["Return the"] * 4, "chosen": [" value."] * 4, "rejected": [" file."] * 4}
    )
    return trl.DPOConfig(str(tmp_path / "dpo"), **{**args, **overrides}), data


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_trl_trainers_without_the_mixin_are_refused_naming_it(bundled, tmp_path):
    model, tok = bundled
    sft_args, sft_data = _sft(tmp_path)
    with pytest.raises(UsageError, match=MIXIN_NAMED) as e:
        trl.SFTTrainer(model=model, args=sft_args, train_dataset=sft_data, processing_class=tok)
    assert "PipelineSFTTrainer(PipelineTrainerMixin, trl.SFTTrainer)" in _one_line(e)
    dpo_args, dpo_data = _dpo(tmp_path)
    with pytest.raises(UsageError, match=MIXIN_NAMED) as e:
        trl.DPOTrainer(model=model, args=dpo_args, train_dataset=dpo_data, processing_class=tok)
    _one_line(e)


def test_what_the_mixin_cannot_train_as_trl_does_is_refused(bundled, tmp_path):
    model, tok = bundled

    class PipelineDPOTrainer(PipelineTrainerMixin, trl.DPOTrainer):
        pass

    refused = [
        ({"loss_type": "aot"}, {}, r"^loss_type='aot' is not supported by PipelineTrainerMixin with DPOTrainer: it "
         r"sorts the log-ratios over the whole batch"),
        ({}, {}, r"^ref_model=None is not supported by PipelineTrainerMixin with DPOTrainer; pass ref_model=<a second "
         r"pipelined model> or precompute_ref_log_probs=True"),
        ({}, {"ref_model": torch.nn.Linear(1, 1)}, r"^ref_model=Linear is not supported .*from_pretrained\(path, "
         r"pipeline=True\)"),
        ({"use_weighting": True, "precompute_ref_log_probs": True}, {}, r"^use_weighting=True is not supported"),
        ({"padding_free": True, "precompute_ref_log_probs": True}, {}, r"^padding_free=True is not supported"),
    ]
    for overrides, extra, message in refused:
        dpo_args, dpo_data = _dpo(tmp_path, **overrides)
        with pytest.raises(UsageError, match=message) as e:
            PipelineDPOTrainer(model=model, args=dpo_args, train_dataset=dpo_data, processing_class=tok, **extra)
        _one_line(e)

    args = transformers.TrainingArguments(str(tmp_path / "own"), report_to=[], use_cpu=True)
    for trainer_class in (trl.DistillationTrainer,):
        pipelined = type(f"Pipeline{trainer_class.__name__}", (PipelineTrainerMixin, trainer_class), {})
        with pytest.raises(UsageError, match=rf"^Pipeline{trainer_class.__name__} cannot train a pipelined model: "
                           rf"{trainer_class.__name__} is one of TRL's trainers not yet checked through the "
                           r"pipeline") as e:
            pipelined(model=model, args=args)
        _one_line(e)

    class PipelineGRPOTrainer(PipelineTrainerMixin, trl.GRPOTrainer):
        pass

    grpo = dict(per_device_train_batch_size=2, num_generations=2, max_steps=1, report_to=[], use_cpu=True,
                bf16=False, save_strategy="no")
    prompts = datasets.Dataset.from_dict({"prompt": ["Return the"] * 4})
    for overrides, message in (({"use_vllm": True}, r"^use_vllm=True is not supported with a pipelined model"),
                               ({"beta": 0.04}, r"^beta=0.04 with full fine-tuning is not supported with a pipelined "
                                r"model: GRPOTrainer would load an unsplit reference copy")):
        grpo_args = trl.GRPOConfig(str(tmp_path / "grpo"), **{**grpo, **overrides})
        with pytest.raises(UsageError, match=message) as e:
            PipelineGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                args=grpo_args, train_dataset=prompts, processing_class=tok)
        _one_line(e)

    class PipelineRLOOTrainer(PipelineTrainerMixin, trl.RLOOTrainer):
        pass

    with pytest.raises(UsageError, match=r"^beta=0.05 with full fine-tuning is not supported with a pipelined model: "
                       r"RLOOTrainer would load an unsplit reference copy") as e:  # RLOO's default beta
        PipelineRLOOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=trl.RLOOConfig(str(tmp_path / "rloo"), **grpo), train_dataset=prompts,
                            processing_class=tok)
    _one_line(e)

    class PipelineKTOTrainer(PipelineTrainerMixin, trl.KTOTrainer):
        pass

    kto_data = datasets.Dataset.from_dict({"prompt": ["Return the"] * 4, "completion": [" value"] * 4,
                                           "label": [True, False] * 2})
    for extra, message in (({}, r"^ref_model=None with full fine-tuning is not supported by PipelineTrainerMixin with "
                                r"KTOTrainer unless precompute_ref_log_probs=True"),
                           ({"ref_model": model}, r"^ref_model=PipelinedModel is not supported by PipelineTrainerMixin "
                                                  r"with KTOTrainer")):
        with pytest.raises(UsageError, match=message) as e:
            PipelineKTOTrainer(model=model, args=trl.KTOConfig(str(tmp_path / "kto"), report_to=[], use_cpu=True),
                               train_dataset=kto_data, processing_class=tok, **extra)
        _one_line(e)

    class PipelineSFTTrainer(PipelineTrainerMixin, trl.SFTTrainer):
        pass

    sft_args, sft_data = _sft(tmp_path, loss_type="dft")
    with pytest.raises(UsageError, match=r"^loss_type='dft' is not supported by PipelineTrainer"):
        PipelineSFTTrainer(model=model, args=sft_args, train_dataset=sft_data, processing_class=tok)
    # transformers' loss options train a plain Trainer's own step; on SFT's step (the model's loss) they are refused
    sft_args, sft_data = _sft(tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(UsageError, match=r"^label_smoothing_factor=0.1 is not supported by PipelineTrainerMixin "
                       r"with trl's SFTTrainer or DPOTrainer"):
        PipelineSFTTrainer(model=model, args=sft_args, train_dataset=sft_data, processing_class=tok)
    # nothing ran: the same model trains one SFT step through the mixin
    sft_args, sft_data = _sft(tmp_path)
    trainer = PipelineSFTTrainer(model=model, args=sft_args, train_dataset=sft_data, processing_class=tok)
    assert trainer.train().training_loss > 0
